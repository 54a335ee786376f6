"""A parameter read inside a reentrant activation checkpoint and also outside it (or in two blocks), trained
with gradient accumulation: eager's reentrant backward adds the block's gradient into .grad on its own, so the
step adds each micro-batch's block and outside gradients one at a time, in eager's order (fuzz_step 29:10)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_ext


def ckpt(fn, *args):
    return checkpoint(fn, *args, use_reentrant=True)


class Shared(nn.Module):
    """fc is read inside the reentrant block and, depending on `shape`, elsewhere too."""

    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape
        self.front, self.fc, self.fc2, self.head = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        s, fc = self.shape, self.fc
        h = self.front(x)
        if s == "before":  # the weight read before the block
            h = torch.tanh(fc(h))
        if s == "nested":  # the outer block reads fc after an inner block that reads it too
            h = h + ckpt(lambda u: fc(torch.sigmoid(ckpt(lambda v: torch.tanh(fc(v)), self.fc2(u)))), h)
        elif s == "intermediate":  # an outer block that reads no parameter itself
            h = h + ckpt(lambda u: ckpt(lambda v: torch.tanh(fc(v)), u) * 2, h)
        else:
            h = h + ckpt(lambda u: self.fc2(torch.sigmoid(fc(u))), h)
        if s == "two":  # a second reentrant block reading the same weight
            h = h + ckpt(lambda u: torch.sin(fc(u)), h)
        if s in ("after", "two", "intermediate"):  # and after the blocks
            h = torch.tanh(fc(h))
        return self.head(h)


def loss_of(l2):
    def loss_fn(m, x, y):
        loss = F.mse_loss(m(x), y)
        return loss + 1e-3 * sum(p.pow(2).sum() for p in m.parameters()) if l2 else loss
    return loss_fn


def run_both(model, opt_cls, loss_fn, acc, dtype, steps=3, **opt_kw):
    torch.manual_seed(0)
    m = model.to(dtype)
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(1)
    mbs = [[(torch.randn(4, 5, generator=g, dtype=dtype), torch.randn(4, 3, generator=g, dtype=dtype))
            for _ in range(acc)] for _ in range(steps + 1)]
    opt, ropt = opt_cls(m.parameters(), lr=0.1, **opt_kw), opt_cls(ref.parameters(), lr=0.1, **opt_kw)
    step = torch_ext.make_train_step(m, opt, loss_fn, mbs[0][0], accumulate=acc)
    state = step.init_state(seed=0)
    for i in range(steps):
        _, state = step(state, *[t for mb in mbs[1 + i] for t in mb])[:2]
        ropt.zero_grad()
        for mb in mbs[1 + i]:
            (loss_fn(ref, *mb) / acc).backward()
        ropt.step()
    step.write_back(state)
    return {k: (v - ref.state_dict()[k]).abs().max().item() for k, v in m.state_dict().items()
            if not torch.equal(v, ref.state_dict()[k])}


SHAPES = [("inside", True), ("before", False), ("after", False), ("two", False), ("two", True),
          ("nested", False), ("nested", True), ("intermediate", True)]


@pytest.mark.parametrize("shape,l2", SHAPES)
@pytest.mark.parametrize("acc,opt_cls,dtype", [(2, torch.optim.SGD, torch.float64), (3, torch.optim.Adam, torch.float32),
                                               (1, torch.optim.SGD, torch.float64)])
def test_shared_parameter_of_a_reentrant_block_trains_bit_exact(shape, l2, acc, opt_cls, dtype):
    torch.manual_seed(0)
    assert run_both(Shared(shape), opt_cls, loss_of(l2), acc, dtype) == {}


class Tied(Shared):
    """out.weight is fc.weight (one Parameter under two names): read inside the block and after it."""

    def __init__(self):
        super().__init__("inside")
        self.out = nn.Linear(8, 8)
        self.out.weight = self.fc.weight

    def forward(self, x):
        return super().forward(x) + self.head(torch.tanh(self.out(self.front(x))))


def test_weight_tied_across_a_reentrant_block_with_momentum():
    torch.manual_seed(0)
    assert run_both(Tied(), torch.optim.SGD, loss_of(True), 2, torch.float64, momentum=0.9) == {}


class Given(nn.Module):
    """The block reads its activation argument twice and a weight passed as an argument twice; both are read
    outside it too. Eager's inner backward sums the block's reads of each argument (the detached copy's .grad)
    and returns one gradient to the outer backward; the inlined block added each read on its own, 1 ulp off
    eager at accumulate=1 already."""

    def __init__(self):
        super().__init__()
        self.front, self.fc, self.head = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.front(x)
        h = h + ckpt(lambda u, w: torch.tanh(u @ w.t() + u @ w), h, self.fc.weight)
        return self.head(torch.tanh(self.fc(h)))


@pytest.mark.parametrize("acc", [1, 2, 3])
def test_arguments_of_a_reentrant_block_read_twice_inside_bit_exact(acc):
    torch.manual_seed(0)
    assert run_both(Given(), torch.optim.SGD, loss_of(False), acc, torch.float64) == {}


def test_the_step_gradient_adds_the_blocks_events_in_eagers_order():
    # The joint gradient of fc.weight (read by the block and the L2 penalty after it) is the penalty's
    # gradient, then the block's: eager's outer backward adds the penalty's first, the block's inner one after
    torch.manual_seed(0)
    m = Shared("inside").double()
    step = torch_ext.make_train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), loss_of(True),
                                     (torch.randn(4, 5).double(), torch.randn(4, 3).double()), accumulate=2)
    folds = [n for n in step.joint_graph.nodes() if n.name.startswith("reentrant_grad_fold")]
    assert {n.name for n in folds} == {f"reentrant_grad_fold_model_{n}_1" for n in ("fc_weight", "fc_bias", "fc2_weight",
                                                                                 "fc2_bias")}
    # no marker is left in the programs
    assert not any("torch_ext_ckpt" in str(getattr(n, "target", "")) for n in step.joint_graph.nodes())
    assert not any("torch_ext_ckpt" in str(n.target) for n in step._forward_program.graph.nodes)
