"""Variable batch size: batch_shapes='cache' builds one program per batch shape over one state."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

from helpers import train_like_eager


def model_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


def epoch(seed=1, n=10, sizes=(8, 8, 8, 5)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(sizes[i % len(sizes)], 16, generator=g), torch.randint(0, 4, (sizes[i % len(sizes)],),
                                                                                 generator=g)) for i in range(n)]


def test_partial_last_batch_bit_exact_with_eager():
    model, opt = model_opt()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = epoch()
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], batch_shapes="cache")
    state = step.init_state(seed=2)
    torch.manual_seed(2)
    train_like_eager(step, state, ref, ref_opt, loss_fn, batches)
    info = step.cache_info()
    assert info["programs"] == 2 and info["shapes"] == [((8, 16), (8,)), ((5, 16), (5,))]


def test_fixed_shapes_refuse_with_a_hint_and_cache_refuses_other_dtypes():
    model, opt = model_opt()
    batches = epoch()
    fixed = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    with pytest.raises(ValueError, match=r"got shape \(5, 16\).*batch_shapes='cache'"):
        fixed(fixed.init_state(), *batches[3])
    cached = torch_ext.make_train_step(model, opt, loss_fn, batches[0], batch_shapes="cache")
    x, y = batches[3]
    with pytest.raises(ValueError, match=r"batch\[1\]: expected dtype torch.int64 and rank 1.*got dtype torch.int32"):
        cached(cached.init_state(), x, y.int())
    assert cached.cache_info()["programs"] == 1  # nothing was built for the refused call
    with pytest.raises(ValueError, match="batch_shapes must be 'fixed' or 'cache', got 'dynamic'"):
        torch_ext.make_train_step(model, opt, loss_fn, batches[0], batch_shapes="dynamic")


@pytest.mark.parametrize("donate", [False, True], ids=["returning", "donating"])
def test_compiled_step_runs_a_partial_batch_under_cache(donate):
    # step.compile() refused the last, partial batch of an epoch ("got shape (5, 16)") that the step
    # itself runs under batch_shapes='cache'; it now plans the program built for those shapes once.
    model, opt = model_opt()
    batches = epoch()
    cached = torch_ext.make_train_step(model, opt, loss_fn, batches[0], batch_shapes="cache")
    planned = cached.compile(plan=True, donate=donate)
    state, want = cached.init_state(), cached.init_state()
    for b in batches + batches:
        loss, state = planned(state, *b)
        want_loss, want = cached(want, *b)
        assert torch.equal(loss, want_loss)
    assert all(torch.equal(state.lookup(n), want.lookup(n)) for n in want.params)
    assert all(torch.equal(state.lookup(n), want.lookup(n)) for n in want.opt)
    assert len(planned._variants) == cached.cache_info()["programs"] - 1 == 1


class _BranchOnBatchSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)

    def forward(self, x):
        out = self.l(x)
        if x.shape[0] > 5:  # only full batches use `extra`
            out = out + self.extra(x)
        return out


def test_a_parameter_used_at_one_batch_shape_only_is_refused_naming_it():
    # Was a RuntimeError worded as an internal invariant ("has a different state layout").
    torch.manual_seed(0)
    model = _BranchOnBatchSize()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = epoch()
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], batch_shapes="cache")
    state = step.init_state()
    with pytest.raises(ValueError, match=r"batch shapes \(\(5, 16\), \(5,\)\).*state entries differ.*"
                                         r"model\.extra\.weight"):
        step(state, *batches[3])
    assert step.cache_info()["programs"] == 1  # nothing kept for the refused call
