"""Gradient accumulation: ``make_train_step(..., accumulate=N)`` against the eager loop

    for mb in micro_batches: (loss_fn(model, *mb) / N).backward()
    clip (optional); opt.step()

bit for bit: the backward seed is ones / N as DivBackward gives, and gradients are summed in
micro-batch order as AccumulateGrad does.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

N = 4


def mlp_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)).train()


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


def micro_batches(seed, n=N):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)]


def eager_accumulate(model, opt, mbs, clip=None):
    opt.zero_grad()
    losses = []
    for mb in mbs:
        loss = loss_fn(model, *mb)
        (loss / len(mbs)).backward()
        losses.append(loss.detach())
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return torch.stack(losses)


@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("n", [3, N])
def test_accumulate_is_bit_exact_with_the_eager_loop(n, clip):
    model = mlp_bn()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    step = torch_ext.make_train_step(model, opt, loss_fn, micro_batches(0, 1)[0], accumulate=n, clip_grad_norm=clip)
    state = step.init_state(seed=5)
    torch.manual_seed(5)
    for i in range(20):
        mbs = micro_batches(100 + i, n)
        losses, state = step(state, *[t for mb in mbs for t in mb])
        ref_losses = eager_accumulate(ref, ref_opt, mbs, clip)
        assert losses.shape == (n,)
        assert torch.equal(losses, ref_losses), (i, losses, ref_losses)
    for k, p in ref.named_parameters():
        assert torch.equal(state.params["model." + k], p.detach()), k
    for k, b in ref.named_buffers():  # BatchNorm statistics run through every micro-batch
        assert torch.equal(state.buffers["model." + k], b), k
    for name, v in ref_opt.state[ref[0].weight].items():
        assert torch.equal(state.opt[f"opt:model.0.weight:{name}"].to(v.dtype), v), name


def test_accumulate_one_update_per_call_and_planned():
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = torch_ext.make_train_step(model, opt, loss_fn, micro_batches(0, 1)[0], accumulate=N)
    updates = [n for n in step.graph.nodes() if (n.target or "").startswith("torch_ext::sgd_momentum_update")]
    assert len(updates) == len(list(model.parameters()))  # one update per parameter, not per micro-batch
    flat = [t for mb in micro_batches(1) for t in mb]
    s = step.init_state(seed=1)
    ref_loss, ref_state = step(s, *flat)
    loss, new = step.compile(plan=True, donate=True)(step.init_state(seed=1), *flat)
    assert torch.equal(loss, ref_loss)
    for name in step.state_names:
        assert torch.equal(new.lookup(name), ref_state.lookup(name)), name


def test_accumulate_bad_input():
    model = mlp_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mb = micro_batches(0, 1)[0]
    with pytest.raises(ValueError, match="accumulate must be >= 1, got 0"):
        torch_ext.make_train_step(model, opt, loss_fn, mb, accumulate=0)
    with pytest.raises(TypeError, match="accumulate must be an int, got float 2.5"):
        torch_ext.make_train_step(model, opt, loss_fn, mb, accumulate=2.5)
    with pytest.raises(TypeError, match="unroll must be an int, got float 2.5"):
        torch_ext.make_train_step(model, opt, loss_fn, mb, unroll=2.5)
    with pytest.raises(ValueError, match=r"unroll \(2\) and accumulate \(2\) cannot be combined"):
        torch_ext.make_train_step(model, opt, loss_fn, mb, unroll=2, accumulate=2)
    with pytest.raises(TypeError, match="clip_grad_norm must be a number or None, got str '1.0'"):
        torch_ext.make_train_step(model, opt, loss_fn, mb, clip_grad_norm="1.0")
    step = torch_ext.make_train_step(model, opt, loss_fn, mb, accumulate=2)
    with pytest.raises(ValueError, match=r"expected 4 batch tensors \(2 micro-batches\), got 2"):
        step(step.init_state(), *mb)


@pytest.mark.parametrize("loss", ["binary_cross_entropy", "huber_loss", "soft_margin_loss", "mse_loss"])
def test_planned_arena_runs_losses_whose_out_kernels_use_scratch(loss):
    # These losses' out= kernels resize `out` to the input's shape as scratch before reducing into it.
    # With accumulate=2 each micro-batch loss is an arena buffer, and the planned step failed with
    # "Trying to resize storage that is not resizable" (binary_cross_entropy here; mse_loss under
    # process_group). They now run functionally, bit-exact with the executor.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    x, y = torch.randn(4, 5), torch.rand(4, 8).round()

    def loss_fn(m, x, y):
        out = m(x)
        if loss == "binary_cross_entropy":
            return F.binary_cross_entropy(torch.sigmoid(out), y)
        if loss == "soft_margin_loss":
            return F.soft_margin_loss(out, y * 2 - 1)
        return getattr(F, loss)(out, y)

    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, (x, y),
                                     accumulate=2)
    planned = step.compile(plan=True)
    ours, theirs = step.init_state(), step.init_state()
    for _ in range(2):
        want, ours = step(ours, x, y, x, y)
        got, theirs = planned(theirs, x, y, x, y)
        assert torch.equal(got, want)
    for name in ours.params:
        assert torch.equal(theirs.params[name], ours.params[name]), name
