"""Memory round two (issue 17): the arena costs no time, rematerialization under a budget.

The arena writes through out= overloads found by schema that have a kernel of their own (no
functional-then-copy wrapper); nodes without one allocate their results, which the plan counts
(dynamic_bytes), so the planned peak stays the measured one.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.memory import measured_peak


def _cnn(batch=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    data = (torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,)))
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
                                     lambda m, x, y: F.cross_entropy(m(x), y), data)
    return step, data


def test_arena_uses_out_overloads_found_by_schema_and_skips_copying_wrappers():
    step, batch = _cnn()
    planned = step.compile(plan=True, donate=True)
    targets = {n["name"]: n["target"] for n in planned.graph.nodes() if n["kind"] == "call"}
    by_target = lambda t: [n for n, tt in targets.items() if tt == t]  # noqa: E731
    # threshold_backward's out= is named grad_input: found by schema, written into the arena.
    tb = by_target("aten::threshold_backward.default")
    assert tb and not set(tb) & set(planned.fallbacks), planned.fallbacks
    arena_nodes = {b[0] for b in planned.plan["buffers"]}
    assert set(tb) <= arena_nodes
    # convolution.out on CPU is the generated functional-then-copy wrapper: the kernel allocates.
    conv = by_target("aten::convolution.default")
    assert conv and set(conv) <= set(planned.fallbacks)
    assert set(conv) <= {d[0] for d in planned.plan["dynamic"]} and planned.plan["dynamic_bytes"] > 0
    assert planned.plan["peak_bytes"] == (planned.plan["persistent_bytes"] + planned.plan["escaping_bytes"]
                                          + planned.plan["arena_bytes"] + planned.plan["dynamic_bytes"])


def test_measured_peak_is_below_the_unplanned_executor_and_results_are_bit_exact():
    step, batch = _cnn()
    planned = step.compile(plan=True, donate=True)
    unplanned = step.compile(plan=False, donate=False)
    s_ref, s_arena = step.init_state(), step.init_state()
    for _ in range(2):
        loss_ref, s_ref = step(s_ref, *batch)
        peak, s_arena = measured_peak(planned, s_arena, batch)
    # Measured the same way; kernels' own scratch (convolution's) is in both and in neither plan.
    plain_peak, _ = measured_peak(unplanned, step.init_state(), batch)
    assert planned.plan["persistent_bytes"] + planned.plan["arena_bytes"] <= peak <= plain_peak, (peak, plain_peak)
    for name in step.state_names:
        assert torch.equal(s_ref.lookup(name), s_arena.lookup(name)), name
