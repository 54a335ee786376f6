"""torch.prod in a trained model: the pure step's joint graph computes eager autograd's first-order prod_backward
(``grad * (result / input)`` when the input holds no zero, ``prod_safe_zeros_backward`` when it does, zeros for a
full prod with two zeros or more, picked by where), so the step trains bit-exact with an eager torch.optim loop.
Traced, ATen always took prod_safe_zeros_backward (its path for tensor subclasses), and the gradients were ~3e-8
off eager's."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import PositiveFactors, assert_adamw_steps_bit_exact, joint_of_summed
from torch_ext import _compat


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


class Prod(PositiveFactors):
    """``x.prod(dim)`` over slices of 4 factors and a full ``x.prod()`` of a few factors, scaling the logits.
    ``zeros``: the factors pass through a ReLU, so some slices (and the full product) hold zeros; else they are
    in (0.5, 1.5) and eager divides by the input."""

    def forward(self, x):
        factors = self.factors(x)
        per_slice = factors.view(-1, 2, 4).prod(self.dim)  # (n, 2) or (n, 4)
        full = factors[:, :3].prod()
        return self.head(torch.cat([per_slice, factors], 1)[:, :8] * (1 + full))


@pytest.mark.parametrize("run", ["executor", "planned"])
@pytest.mark.parametrize("dim,zeros", [(-1, False), (1, False), (-1, True), (1, True)],
                         ids=["last-dim", "middle-dim", "last-dim-zeros", "middle-dim-zeros"])
def test_prod_steps_bit_exact_with_eager(dim, zeros, run):
    torch.manual_seed(0)
    model = Prod(dim, zeros)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    if zeros:  # eager's zero-handling formulas: slices with one zero or more, a full product with several
        with torch.no_grad():
            h = model.fc(x)
        factor_zeros = (F.relu(h) + (h > 0.4).float() * 0.5) == 0
        assert factor_zeros.view(-1, 2, 4).sum(dim).max() >= 1, factor_zeros
        assert factor_zeros[:, :3].sum() >= 2, factor_zeros
    assert_adamw_steps_bit_exact(model, _loss, (x, y), run)


def _with_zeros(shape, zeros, dtype, g):
    x = torch.randn(*shape, generator=g, dtype=dtype)
    if zeros:
        x.view(-1)[torch.randperm(x.numel(), generator=g)[:zeros]] = 0
    if zeros == 5:  # a slice along every dim with two zeros or more
        x[1, 2, :] = x[1, 4, :] = 0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("zeros", [0, 1, 5])
def test_first_order_prod_backward_is_eagers(dtype, zeros):
    """The formula the joint graph traces, run eagerly, against eager autograd's gradient: with no zero, one zero,
    and several zeros, over every dim (with and without keepdim) and over the whole input."""
    g = torch.Generator().manual_seed(zeros)
    for dim in (0, 1, -1, None):
        for keepdim in (False, True):
            x = _with_zeros((5, 7, 3), zeros, dtype, g).requires_grad_(True)
            out = x.prod() if dim is None else x.prod(dim, keepdim=keepdim)
            grad = torch.randn(out.shape, generator=g, dtype=dtype)
            expected, = torch.autograd.grad(out, x, grad)
            got = _compat._prod_backward_first_order(grad, x.detach(), out.detach(), dim, keepdim)
            assert torch.equal(got, expected), (dim, keepdim, (got - expected).abs().max())


def test_first_order_prod_backward_differs_from_safe_zeros():
    """Without zeros eager divides by the input: that rounds differently from prod_safe_zeros_backward (which a
    traced ATen took), so the formula's choice is seen."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 16, generator=g) + 0.5
    out, grad = x.prod(1), torch.randn(64, generator=g)
    first_order = _compat._prod_backward_first_order(grad, x, out, 1)
    assert not torch.equal(first_order, _compat._prod_safe_zeros_backward(grad.unsqueeze(1), x, 1))


@pytest.mark.parametrize("zeros", [0, 1, 5])
def test_prod_in_the_block_differentiates_as_eager(zeros):
    """Under the block (with the Python dispatcher) torch.prod's first and second derivatives are eager's."""
    from torch._dispatch.python import enable_python_dispatcher

    g = torch.Generator().manual_seed(zeros)
    for dim in (1, None):
        x = _with_zeros((5, 7, 3), zeros, torch.float64, g)
        grad = torch.randn(() if dim is None else (5, 3), generator=g, dtype=torch.float64)

        def grads(create_graph):
            leaf = x.clone().requires_grad_(True)
            out = leaf.prod() if dim is None else leaf.prod(dim)
            first, = torch.autograd.grad(out, leaf, grad, create_graph=create_graph)
            if not create_graph:
                return first, None
            second, = torch.autograd.grad(first.sin().sum(), leaf)
            return first, second

        def forward():
            return x.prod() if dim is None else x.prod(dim)

        expected = grads(False)[0], grads(True)[1]
        expected_out = forward()
        with _compat.eager_prod_backward(), enable_python_dispatcher():
            got = grads(False)[0], grads(True)[1]
            with torch.no_grad():  # no autograd: the op as ATen's
                assert torch.equal(forward(), expected_out)
        assert torch.equal(got[0], expected[0]), (dim, zeros)
        assert torch.equal(got[1], expected[1]), (dim, zeros)


def test_prod_kernel_put_back():
    """The Python kernels live in aten.prod's overloads only during the joint export."""
    ops = (torch.ops.aten.prod.default, torch.ops.aten.prod.dim_int)
    before = [dict(op.py_kernels) for op in ops]

    joint = joint_of_summed(Prod(), torch.randn(4, 8))
    assert [dict(op.py_kernels) for op in ops] == before
    # eager's no-zero formula divides by the input; prod_safe_zeros_backward (ATen's traced path) never does
    assert torch.ops.aten.div.Tensor in {n.target for n in joint.graph.nodes}
