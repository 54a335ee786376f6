"""to_aoti's cross-entropy rewrite (torch_ext/_aoti.py fuse_cross_entropy): the joint graph's
log-softmax / nll_loss forward and backward become pointwise math over the logits and their
logsumexp, which Inductor fuses; the values stay ATen's to float32 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import torch_ext
from torch_ext._aoti import aoti_decompositions, fuse_cross_entropy, fuse_cross_entropy_program

CE_OPS = {"aten._log_softmax.default", "aten.nll_loss_backward.default", "aten._log_softmax_backward_data.default"}


def targets(graph):
    return {str(n.target) for n in graph.nodes if n.op == "call_function"}


def joint(loss_of, x, *rest):
    def f(x, *rest):
        x = x.detach().requires_grad_(True)
        loss = loss_of(x * 2, *rest)
        (g,) = torch.autograd.grad(loss * 3, x)  # an upstream gradient other than 1
        return loss, g

    return make_fx(f, tracing_mode="fake")(x, *rest)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("dim", [1, -1])
def test_rewrite_matches_aten(reduction, ignored, dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 11, generator=g) * 4
    t = torch.randint(0, 11, (7,), generator=g)
    if ignored == "some":
        t[2] = t[5] = -100
    elif ignored == "all":
        t[:] = -100  # total weight 0: mean is nan, and ATen's gradient is 0, not 0 * inf

    def loss_of(x, t):
        return F.nll_loss(F.log_softmax(x, dim=dim), t, ignore_index=-100, reduction=reduction)

    gm = joint(loss_of, x, t)
    want = gm(x, t)
    assert fuse_cross_entropy(gm) == 1
    assert not CE_OPS & targets(gm.graph), sorted(targets(gm.graph))
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    got = gm(x, t)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6, equal_nan=True)
    # float32 rounding of exp(x - lse) for exp(log_softmax(x)) near p = 1: a few ulps of the scale c
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6 * float(want[1].abs().max().clamp(min=1)))
    assert not got[1].isnan().any()


def test_forward_only_and_other_ignore_index():
    x, t = torch.randn(5, 9), torch.tensor([0, 3, 8, 1, 3])
    gm = make_fx(lambda x, t: F.cross_entropy(x, t, ignore_index=3), tracing_mode="fake")(x, t)
    want = gm(x, t)
    assert fuse_cross_entropy(gm) == 1
    assert "aten._log_softmax.default" not in targets(gm.graph)
    torch.testing.assert_close(gm(x, t), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["weight", "lsm_used_elsewhere", "three_d", "float64"])
def test_left_alone(case):
    x, t = torch.randn(6, 10), torch.randint(0, 10, (6,))
    if case == "weight":
        w = torch.rand(10)
        gm = joint(lambda x, t, w: F.cross_entropy(x, t, weight=w), x, t, w)
        args = (x, t, w)
    elif case == "lsm_used_elsewhere":
        gm = joint(lambda x, t: (lambda l: F.nll_loss(l, t) + l.mean())(F.log_softmax(x, 1)), x, t)
        args = (x, t)
    elif case == "three_d":
        x3, t3 = torch.randn(2, 10, 3), torch.randint(0, 10, (2, 3))
        gm = joint(lambda x, t: F.cross_entropy(x, t), x3, t3)
        args = (x3, t3)
    else:
        x = x.double()
        gm = joint(lambda x, t: F.cross_entropy(x, t), x, t)
        args = (x, t)
    before = gm.code
    assert fuse_cross_entropy(gm) == 0
    assert gm.code == before
    gm(*args)


def test_the_step_program_handed_to_aoti_has_no_log_softmax():
    # The pattern as export writes the pure step's joint graph (the saved log-softmax read through
    # detach nodes), after to_aoti's decompositions.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    batch = (torch.randn(4, 8), torch.tensor([0, 4, -100, 2]))
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     lambda m, x, y: F.cross_entropy(m(x), y), batch)
    program = step.program.run_decompositions(aoti_decompositions())
    assert CE_OPS <= targets(program.graph)
    fused = fuse_cross_entropy_program(program)
    assert not CE_OPS & targets(fused.graph), sorted(targets(fused.graph))
    state = step.init_state()
    flat = step.flat_inputs(state, *batch)
    want, got = program.module()(*flat), fused.module()(*flat)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
