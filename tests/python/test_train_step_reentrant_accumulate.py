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


class Closure(nn.Module):
    """The reentrant block reads, by closure, a view of fc.weight made before it (eager's inner backward takes its
    gradient through the view's backward in the outer graph into the block's own addition to .grad), or reads fc
    inside a torch.cond branch (lifted to an operand of the cond). Before: the view's gradient was added with the
    reads outside the block, ~3e-17 off eager (float64, accumulate=2 or 3, even at 1 with the weight also read in
    the block); the cond's parameters lost the branch's gradient altogether (1e-2 off at accumulate=1)."""

    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape
        self.front, self.fc, self.head = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        s, fc = self.shape, self.fc
        h = self.front(x)
        wt = fc.weight.t()
        if s == "view_then_weight":  # the view only in the block, the weight itself after it
            h = h + ckpt(lambda u: torch.tanh(u @ wt), h)
            h = torch.tanh(fc(h))
        elif s == "view_both":  # the view in the block and after it
            h = h + ckpt(lambda u: torch.tanh(u @ wt), h)
            h = torch.tanh(h @ wt)
        elif s == "view_and_weight":  # the view and the weight in the block, the view after it
            h = h + ckpt(lambda u: torch.tanh(u @ wt) + fc(u), h)
            h = torch.tanh(h @ wt)
        elif s == "view_chain":  # a view of a view (transposed, then sliced), in a nested block
            w4 = wt[:, :4]
            h = h + ckpt(lambda u: torch.sigmoid(ckpt(lambda v: torch.tanh(v @ w4), u)).sum(1, keepdim=True), h)
            h = torch.tanh(fc(h))
        elif s in ("views", "views_reversed"):  # three views and the weight: four additions in the block's event
            w4, wd = fc.weight[:4], fc.weight.diagonal()  # (the replayed views first, as eager made them first)
            parts = [lambda u: torch.tanh(u @ wt), lambda u: fc(torch.cos(u)), lambda u: u[:, :1] * wd,
                     lambda u: (torch.sin(u) @ w4.t()).sum(1, keepdim=True)]
            parts = parts[::-1] if s == "views_reversed" else parts
            h = h + ckpt(lambda u: parts[0](u) + parts[1](u) + parts[2](u) + parts[3](u), h)
            h = torch.tanh(h @ wt) + wd
        elif s in ("cond", "cond_after"):
            blk = lambda u: torch.cond(u.sum() > 0, lambda v: torch.tanh(fc(v)), lambda v: torch.sin(fc(v)), (u,))
            h = h + ckpt(blk, h)
            if s == "cond_after":
                h = torch.tanh(fc(h))
        return self.head(h)


CLOSURES = [("view_then_weight", False), ("view_then_weight", True), ("view_both", True), ("view_and_weight", False),
            ("view_chain", True), ("views", False), ("views_reversed", True), ("cond", False), ("cond", True),
            ("cond_after", True)]


@pytest.mark.parametrize("shape,l2", CLOSURES)
@pytest.mark.parametrize("acc,opt_cls", [(2, torch.optim.SGD), (3, torch.optim.AdamW), (1, torch.optim.SGD)])
def test_closure_view_and_cond_parameter_of_a_reentrant_block_bit_exact(shape, l2, acc, opt_cls):
    torch.manual_seed(0)
    assert run_both(Closure(shape), opt_cls, loss_of(l2), acc, torch.float64) == {}


class ClosureTensor(nn.Module):
    """The block reads, by closure, a tensor that requires grad and is no view of a parameter: g.exp() made
    before it. Eager's inner backward runs exp's backward with the block's gradient alone and adds it into g.grad
    on its own: the step's gradient is eager's only where nothing else reads g (or the tensor, or its history)."""

    def __init__(self, also: str | None):
        super().__init__()
        self.also = also
        self.front, self.fc, self.head = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.g = nn.Parameter(torch.linspace(-0.3, 0.3, 8))

    def forward(self, x):
        h = self.front(x)
        scale = self.g.exp()
        if self.also == "argument":  # the way out: the tensor passed to the block
            h = h + ckpt(lambda u, s: self.fc(u) * s, h, scale)
        else:
            h = h + ckpt(lambda u: self.fc(u) * scale, h)
        if self.also == "after":
            h = h * self.g
        return self.head(h)


@pytest.mark.parametrize("also", [None, "argument"])
@pytest.mark.parametrize("acc", [1, 2, 3])
def test_closure_tensor_read_only_by_the_block_or_passed_as_argument_bit_exact(also, acc):
    torch.manual_seed(0)
    assert run_both(ClosureTensor(also), torch.optim.SGD, loss_of(False), acc, torch.float64) == {}


@pytest.mark.parametrize("also,l2", [("after", False), (None, True)])
def test_closure_tensor_whose_parameter_is_read_elsewhere_is_refused(also, l2):
    # Before: built and trained ~7e-18 off eager (g, accumulate=2 or 3)
    torch.manual_seed(0)
    m = ClosureTensor(also).double()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(NotImplementedError) as e:
        torch_ext.make_train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), loss_of(l2),
                                  (torch.randn(4, 5).double(), torch.randn(4, 3).double()), accumulate=2)
    msg = str(e.value)
    assert "ClosureTensor.forward.<locals>.<lambda>" in msg and "(8,) torch.float64 made before it by ExpBackward0" in msg
    assert "as an argument" in msg and "use_reentrant=False" in msg
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_closure_view_read_in_a_cond_branch_of_a_reentrant_block_is_refused():
    class M(Closure):
        def forward(self, x):
            h, wt = self.front(x), self.fc.weight.t()
            h = h + ckpt(lambda u: torch.cond(u.sum() > 0, lambda v: torch.tanh(v @ wt), lambda v: torch.sin(v @ wt),
                                              (u,)), h)
            return self.head(torch.tanh(self.fc(h)))

    torch.manual_seed(0)
    m = M("cond").double()
    with pytest.raises(NotImplementedError, match=r"reads by closure \(an operand of cond\) a tensor \(8, 8\) "
                                                  r"torch.float64 made before it by TBackward0"):
        torch_ext.make_train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), loss_of(False),
                                  (torch.randn(4, 5).double(), torch.randn(4, 3).double()), accumulate=2)
