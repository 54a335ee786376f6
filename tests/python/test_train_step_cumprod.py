"""torch.cumprod in a trained model: the pure step's joint graph computes eager autograd's first-order
cumprod_backward (reversed cumsum over the input when it holds no zero, the masked O(n) formula when it does), so
the step trains bit-exact with an eager torch.optim loop. Traced, ATen's kernel took its O(n^2) double-backward
form (products of slices), and the gradients were 1.5e-8 off eager's."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import PositiveFactors, assert_adamw_steps_bit_exact, joint_of_summed
from torch_ext import _compat


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


class CumProd(PositiveFactors):
    """``zeros``: the factors pass through a ReLU, so some slices hold zeros (one, two, or more) and eager takes
    its masked formula; else they are in (0.5, 1.5) and eager divides by the input."""

    def forward(self, x):
        factors = self.factors(x)
        return self.head(torch.cumprod(factors.view(-1, 2, 4), dim=self.dim).flatten(1))


@pytest.mark.parametrize("run", ["executor", "planned"])
@pytest.mark.parametrize("dim,zeros", [(-1, False), (1, False), (-1, True), (1, True)],
                         ids=["last-dim", "middle-dim", "last-dim-zeros", "middle-dim-zeros"])
def test_cumprod_steps_bit_exact_with_eager(dim, zeros, run):
    torch.manual_seed(0)
    model = CumProd(dim, zeros)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    if zeros:  # eager's masked formula, with slices holding two zeros or more (the part after the second zero)
        with torch.no_grad():
            h = model.fc(x)
        zeros_per_slice = ((F.relu(h) + (h > 0.4).float() * 0.5) == 0).view(-1, 2, 4).sum(dim)
        assert zeros_per_slice.max() >= 2, zeros_per_slice
    assert_adamw_steps_bit_exact(model, _loss, (x, y), run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("zeros", [0, 1, 5])
def test_first_order_cumprod_backward_is_eagers(dtype, zeros):
    """The formula the joint graph traces, run eagerly, against eager autograd's gradient: with no zero, one zero,
    and slices with two or more zeros, along every dim."""
    g = torch.Generator().manual_seed(zeros)
    for dim in (0, 1, -1):
        x = torch.randn(5, 7, 3, generator=g, dtype=dtype)
        if zeros:
            x.view(-1)[torch.randperm(x.numel(), generator=g)[:zeros]] = 0
        if zeros == 5:
            x[1, 2, :] = x[1, 4, :] = 0
        x.requires_grad_(True)
        out = torch.cumprod(x, dim)
        grad = torch.randn(out.shape, generator=g, dtype=dtype)
        expected, = torch.autograd.grad(out, x, grad)
        got = _compat._cumprod_backward_first_order(grad, x.detach(), dim, out.detach())
        assert torch.equal(got, expected), (dim, (got - expected).abs().max())


def test_cumprod_backward_kernel_put_back():
    """The traced kernel lives in aten.cumprod_backward's Python kernels only during the joint export."""
    op = torch.ops.aten.cumprod_backward.default
    before = dict(op.py_kernels)

    joint = joint_of_summed(CumProd(), torch.randn(4, 8))
    assert op.py_kernels == before
    # eager's first-order formula: no product of slices (aten.prod) as in ATen's double-backward form
    assert torch.ops.aten.prod.dim_int not in {n.target for n in joint.graph.nodes}


def test_cumprod_backward_under_grad_mode_stays_atens():
    """A gradient of the gradient (grad mode on) keeps ATen's kernel, whose O(n^2) form is differentiable; without
    grad mode the traced kernel is eager's first-order formula. The two differ on this input, which holds a zero."""
    from torch._dispatch.python import enable_python_dispatcher

    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    x[0, 2] = 0
    out = torch.cumprod(x, 1)
    op = torch.ops.aten.cumprod_backward.default
    aten = op(grad, x, 1, out)
    first_order = _compat._cumprod_backward_first_order(grad, x, 1, out)
    assert not torch.equal(aten, first_order)
    with _compat.eager_cumprod_backward(), enable_python_dispatcher():
        assert torch.equal(op(grad, x, 1, out), aten)
        with torch.no_grad():
            assert torch.equal(op(grad, x, 1, out), first_order)
