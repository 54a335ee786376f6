"""The executor recycles the optimizer state it returned once the caller drops it (csrc/runtime/result_pool.h):
memory is reused, never while a state that holds it is alive, and results are unchanged."""
import gc

import torch
import torch.nn.functional as F

import torch_ext


def _step(opt_cls=torch.optim.AdamW, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = torch_ext.make_train_step(model, opt_cls(model.parameters(), lr=1e-2, **kw),
                                     lambda m, x, y: F.cross_entropy(m(x), y), (x, y))
    return step, (x, y)


def _snapshot(state):
    return {k: v.clone() for k, v in state.state_dict().items() if isinstance(v, torch.Tensor)}


def test_dropped_states_are_recycled_and_results_unchanged():
    step, batch = _step()
    kept = [step.init_state()]  # every state kept alive: nothing can be recycled
    for _ in range(4):
        kept.append(step(kept[-1], *batch)[1])
    assert step._executor.result_pool_stats()["reused_blocks"] == 0

    step2, _ = _step()
    state = step2.init_state()
    for _ in range(4):
        state = step2(state, *batch)[1]  # the old state is dropped: its update results come back
    stats = step2._executor.result_pool_stats()
    assert stats["reused_blocks"] > 0 and stats["cached_bytes"] > 0
    want, got = _snapshot(kept[-1]), _snapshot(state)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_live_state_is_never_overwritten():
    step, batch = _step(torch.optim.SGD, momentum=0.9)
    state = step.init_state()
    for _ in range(2):
        state = step(state, *batch)[1]
    held = state
    before = _snapshot(held)
    for _ in range(5):  # later calls recycle the states dropped along the way, never `held`'s memory
        state = step(state, *batch)[1]
    after = _snapshot(held)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_state_outlives_the_executor():
    step, batch = _step()
    state = step.init_state()
    for _ in range(3):
        state = step(state, *batch)[1]
    snap = _snapshot(state)
    del step
    gc.collect()
    for k, v in _snapshot(state).items():
        assert torch.equal(v, snap[k]), k
    del state  # its blocks go back to a closed pool: freed, not cached
    gc.collect()
