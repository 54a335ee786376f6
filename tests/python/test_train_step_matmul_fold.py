"""``linear`` and ``matmul`` on a 3-D input trace as eager runs them: one folded ``mm`` or a ``bmm``.

ATen's ``matmul`` folds the batch of a 3-D input into one ``mm`` when the weight requires grad or when each batch
dim's stride is the next one's times its size (size-1 dims included); otherwise it runs ``bmm``, which rounds
differently. The trace runs torch._decomp's Python ``matmul``, whose check differed (it asked for a contiguous input,
skipping size-1 dims): fuzz_step ``--case 24:257`` trained 1 ulp off eager (_compat.eager_matmul_fold)."""
from __future__ import annotations

import collections
import contextlib
import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torch_ext

from helpers import eager_step

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.mv.default)


def _seq_loss(m, x, y):
    return F.cross_entropy(m(x).flatten(0, 1), y.flatten())


class _Counted(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        if func in _MATMULS:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _steps_differences(model, x, y, steps=3, lr=0.5):
    """(what differs between ``steps`` SGD steps of the pure step and of eager PyTorch from the same model, the
    losses and the final state compared bit for bit; the mm / bmm / addmm / mv nodes of the step's program; the
    kernels of those eager's first step ran, forward and backward)."""
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    eager_opt = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=lr)
    step = torch_ext.make_train_step(model, opt, _seq_loss, (x, y))
    traced = collections.Counter(n.target.__name__ for n in step.program.graph.nodes if n.target in _MATMULS)
    counted = _Counted()
    state = step.init_state()
    bad = []
    for i in range(steps):
        loss, state = step(state, x, y)
        with counted if i == 0 else contextlib.nullcontext():
            eager_loss = eager_step(eager, eager_opt, _seq_loss, x, y)
        if not torch.equal(loss, eager_loss):
            bad.append(f"loss of step {i}")
    step.write_back(state)
    bad += [name for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values())
            if not torch.equal(a, b)]
    return bad, traced, counted.ops


class _AttentionFrozenHead(nn.Module):
    """fuzz_step 24:257, minimised: MultiheadAttention(batch_first=True)'s output at batch 1 is [1, 6, 4] with
    strides (4, 4, 1), into a bias-free head whose weight is frozen: eager's matmul runs bmm there."""

    def __init__(self):
        super().__init__()
        self.front = nn.Embedding(11, 4)
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 11, bias=False)

    def forward(self, x):
        h = self.front(x)
        o, _ = self.mha(h, h, h, need_weights=False)
        return self.head(o)


def test_frozen_bias_free_head_after_batch_first_attention_at_batch_one_trains_bit_exact():
    # Found by scripts/fuzz_step.py (seed 24, case 257). The trace folded the head into one mm where eager runs
    # bmm: the logits differed in the last bit and mha.in_proj_bias / out_proj ended 1 ulp off eager's.
    torch.manual_seed(0)
    model = _AttentionFrozenHead()
    model.head.weight.requires_grad_(False)
    x, y = torch.randint(0, 11, (1, 6)), torch.randint(0, 11, (1, 6))
    bad, traced, eager = _steps_differences(model, x, y, lr=0.1)
    assert bad == [] and traced == eager and eager["bmm.default"] > 0, (bad, traced, eager)


class _Head(nn.Module):
    """A Linear front, a layout of its [T, B, 8] output as [B, T, 8] (``contiguous``; ``transposed``: strides
    (8, 8B, 1), at batch 1 a size-1 dim whose stride is not the contiguous one; ``sliced``: every other feature of a
    contiguous [B, T, 16], which folds without being contiguous), then the head: ``linear`` (F.linear), ``matmul``
    (h @ W.t() + b) or ``left`` (W @ h.mT, a 2-D @ 3-D product)."""

    def __init__(self, layout, call, bias):
        super().__init__()
        self.front = nn.Linear(8, 16 if layout == "sliced" else 8)
        self.head = nn.Linear(8, 5, bias=bias)
        self.layout, self.call = layout, call

    def forward(self, x):
        h = self.front(x).transpose(0, 1)
        if self.layout == "contiguous":
            h = h.clone(memory_format=torch.contiguous_format)
        elif self.layout == "sliced":
            h = h.clone(memory_format=torch.contiguous_format)[..., ::2]
        if self.call == "linear":
            return self.head(h)
        w, b = self.head.weight, self.head.bias
        out = h @ w.t() if self.call == "matmul" else (w @ h.mT).mT
        return out if b is None else out + b


_GRID = list(itertools.product(["linear", "matmul", "left"], ["contiguous", "transposed", "sliced"],
                               [False, True], [False, True], [1, 4]))


@pytest.mark.parametrize("call, layout, bias, frozen, batch", _GRID,
                         ids=[f"{c}-{lay}-{'bias' if b else 'nobias'}-{'frozen' if f else 'trained'}-batch{n}"
                              for c, lay, b, f, n in _GRID])
def test_linear_and_matmul_fold_as_eager_and_train_bit_exact(call, layout, bias, frozen, batch):
    # Frozen, bias-free (or matmul + bias) at batch 1 on the transposed layout: eager bmm, traced mm; sliced at
    # batch 4: eager mm, traced bmm. Each trained off eager before _compat.eager_matmul_fold.
    torch.manual_seed(0)
    model = _Head(layout, call, bias)
    model.head.weight.requires_grad_(not frozen)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, batch, 8, generator=g), torch.randint(0, 5, (batch, 6), generator=g)
    bad, traced, eager = _steps_differences(model, x, y)
    assert bad == [] and traced == eager, (bad, traced, eager)



class _Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        self.ops.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _strided(rng, sizes, requires_grad):
    """A tensor of ``sizes`` laid out at random: contiguous, every other element of a larger one in some dims,
    and/or two dims transposed (size-1 dims included)."""
    steps = [rng.choice([1, 1, 2]) for _ in sizes]
    t = torch.randn(*[s * k for s, k in zip(sizes, steps)])[tuple(slice(None, None, k) for k in steps)]
    if len(sizes) >= 2 and rng.random() < 0.4:
        i, j = rng.sample(range(len(sizes)), 2)
        t = t.transpose(i, j).contiguous().transpose(i, j)
    return t.requires_grad_(requires_grad)


def test_matmul_decomposition_folds_where_eager_folds_on_random_layouts():
    # The Python decomposition the trace runs (torch._decomp's matmul) against eager's C++ one, on 3-D to 5-D
    # operands laid out at random, with and without requires_grad: the same kernels (mm / mv where ATen folds,
    # bmm where it does not). torch's own should_fold disagreed with eager on 12% of such cases.
    import random

    from torch._decomp import decompositions

    from torch_ext import _trace_patches

    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        big, small = rng.choice([3, 4, 5]), rng.choice([1, 2])
        sizes = [rng.choice([1, 1, 2, 3]) for _ in range(big)]
        a = _strided(rng, sizes, rng.random() < 0.5)
        k = sizes[-1]
        b = _strided(rng, [k, rng.choice([1, 3])][:small], rng.random() < 0.5)
        if rng.random() < 0.5:  # the small operand on the left: (b^T) @ a^T
            a, b = (b.t() if small == 2 else b), a.mT
        eager, traced = _Kernels(), _Kernels()
        with eager:
            expected = torch.matmul(a, b)
        with _trace_patches.patched("eager_matmul_fold"), traced:
            got = decompositions.matmul(a, b)
        assert ("bmm" in eager.ops) == ("bmm" in traced.ops), (a.shape, a.stride(), a.requires_grad, b.shape,
                                                                b.stride(), b.requires_grad, eager.ops, traced.ops)
        assert torch.equal(got, expected)
        checked += "bmm" in eager.ops
    assert checked > 50  # both branches were exercised
