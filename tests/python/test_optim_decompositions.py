"""torch_ext.optim.aten_updates (each Registration's ``aten``): the ATen form of each update op (what AOTInductor fuses) against the
C++ kernel the executor runs, over several steps and every flag, to float32 rounding."""
from __future__ import annotations

import itertools

import pytest
import torch

import torch_ext  # noqa: F401 - registers the torch_ext ops
from torch_ext.optim import aten_updates as decompositions

ops = torch.ops.torch_ext


def tensors(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=g) for _ in range(n)]


def close(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def run(op, state, extra, steps=4):
    """Runs the op and its decomposition side by side for ``steps`` steps; ``state`` are the slot
    tensors the op returns updated (param first), ``extra`` the scalars after the lr."""
    fn = decompositions()[op]
    g = torch.Generator().manual_seed(1)
    mine, ref = list(state), list(state)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    for _ in range(steps):
        grad = torch.randn(mine[0].shape, generator=g)
        want = op(ref[0], grad, *ref[1:], lr, *extra)
        got = fn(mine[0], grad, *mine[1:], lr, *extra)
        want, got = (list(want) if isinstance(want, (tuple, list)) else [want]), \
            (list(got) if isinstance(got, (tuple, list)) else [got])
        got = [t for t in got if t is not None]
        close(got, want)
        ref, mine = want, got
    assert not torch.equal(mine[0], state[0])


@pytest.mark.parametrize("wd,decoupled,maximize", list(itertools.product([0.0, 0.1], [False, True], [False, True])))
def test_adam(wd, decoupled, maximize):
    p, m, v = tensors(3)
    m, v = m * 0.1, v.abs() * 0.1
    run(ops.adam_update.default, [p, m, v, torch.tensor(0.0)], [0.9, 0.999, 1e-8, wd, decoupled, maximize])


def test_adam_amsgrad():
    p, m, v = tensors(3)
    m, v = m * 0.1, v.abs() * 0.1
    run(ops.adam_amsgrad_update.default, [p, m, v, v.clone() * 2, torch.tensor(3.0)],
        [0.9, 0.99, 1e-8, 0.01, True, False])


@pytest.mark.parametrize("wd,maximize", [(0.0, False), (0.1, True)])
def test_sgd(wd, maximize):
    run(ops.sgd_update.default, tensors(1), [wd, maximize])


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (True, 0.0), (False, 0.3)])
def test_sgd_momentum(nesterov, dampening):
    p, buf = tensors(2)
    run(ops.sgd_momentum_update.default, [p, buf, torch.tensor(0.0)], [0.9, dampening, 0.01, nesterov, False])


@pytest.mark.parametrize("centered,momentum", [(False, 0.0), (True, 0.0), (True, 0.9), (False, 0.5)])
def test_rmsprop(centered, momentum):
    p, ga, buf = tensors(3)
    run(ops.rmsprop_update.default, [p, torch.rand(5, 7), ga * 0.01, buf * 0.1, torch.tensor(0.0)],
        [0.99, 1e-8, 0.01, momentum, centered, False])


@pytest.mark.parametrize("lr_decay,wd", [(0.0, 0.0), (0.01, 0.1)])
def test_adagrad(lr_decay, wd):
    p, = tensors(1)
    run(ops.adagrad_update.default, [p, torch.rand(5, 7), torch.tensor(2.0)], [lr_decay, wd, 1e-10, False])


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion(wd):
    p, m = tensors(2)
    run(ops.lion_update.default, [p, m * 0.1], [0.9, 0.99, wd])


def f64(v):
    return torch.tensor(v, dtype=torch.float64)


@pytest.mark.parametrize("wd,maximize,beta1", [(0.0, False, 0.9), (0.1, True, 0.9), (0.1, False, f64(0.85))])
def test_adamax(wd, maximize, beta1):
    p, m, u = tensors(3)
    op = ops.adamax_update.scheduled if isinstance(beta1, torch.Tensor) else ops.adamax_update.default
    run(op, [p, m * 0.1, u.abs() * 0.1, torch.tensor(2.0)], [beta1, 0.999, 1e-8, wd, maximize])


@pytest.mark.parametrize("wd,decoupled,maximize,beta1", [(0.0, False, False, 0.9), (0.1, False, True, 0.9),
                                                         (0.1, True, False, 0.9), (0.1, True, True, f64(0.85))])
def test_nadam(wd, decoupled, maximize, beta1):
    p, m, v = tensors(3)
    op = ops.nadam_update.scheduled if isinstance(beta1, torch.Tensor) else ops.nadam_update.default
    run(op, [p, m * 0.1, v.abs() * 0.1, torch.tensor(0.8), torch.tensor(2.0)],
        [beta1, 0.999, 1e-8, wd, 4e-3, decoupled, maximize])


@pytest.mark.parametrize("start", [0.0, 3.0, 10.0])  # steps 1-4 unrectified, 4-7 across the threshold, rectified
@pytest.mark.parametrize("wd,decoupled,maximize,beta1", [(0.0, False, False, 0.9), (0.1, False, True, 0.9),
                                                         (0.1, True, False, f64(0.85))])
def test_radam(start, wd, decoupled, maximize, beta1):
    p, m, v = tensors(3)
    op = ops.radam_update.scheduled if isinstance(beta1, torch.Tensor) else ops.radam_update.default
    run(op, [p, m * 0.1, v.abs() * 0.1, torch.tensor(start)], [beta1, 0.999, 1e-8, wd, decoupled, maximize])


@pytest.mark.parametrize("maximize", [False, True])
def test_rprop(maximize):
    p, prev = tensors(2)
    prev[0, :3] = 0  # sign 0: factor 1
    run(ops.rprop_update.default, [p, prev, torch.full((5, 7), 1e-2), torch.tensor(0.0)],
        [0.5, 1.2, 1e-6, 50.0, maximize])


@pytest.mark.parametrize("wd,maximize", [(0.0, False), (0.1, True)])
def test_adadelta(wd, maximize):
    p, = tensors(1)
    run(ops.adadelta_update.default, [p, torch.rand(5, 7), torch.rand(5, 7) * 0.1, torch.tensor(0.0)],
        [0.9, 1e-6, wd, maximize])


@pytest.mark.parametrize("nesterov,dampening,momentum", [(False, 0.0, 0.9), (True, 0.0, 0.85), (False, 0.3, 0.9),
                                                         (True, 0.0, 0.0)])
def test_sgd_momentum_scheduled(nesterov, dampening, momentum):
    # The "scheduled" overload: momentum is a float64 tensor input (0: torch.optim's plain SGD step).
    p, buf = tensors(2)
    run(ops.sgd_momentum_update.scheduled, [p, buf, torch.tensor(1.0)], [f64(momentum), dampening, 0.01, nesterov,
                                                                           False])


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_scheduled(amsgrad):
    p, m, v = tensors(3)
    m, v = m * 0.1, v.abs() * 0.1
    if amsgrad:
        run(ops.adam_amsgrad_update.scheduled, [p, m, v, v.clone() * 2, torch.tensor(3.0)],
            [f64(0.87), 0.99, 1e-8, 0.01, True, False])
    else:
        run(ops.adam_update.scheduled, [p, m, v, torch.tensor(2.0)], [f64(0.87), 0.999, 1e-8, 0.1, True, False])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rmsprop_scheduled(momentum):
    p, ga, buf = tensors(3)
    run(ops.rmsprop_update.scheduled, [p, torch.rand(5, 7), ga * 0.01, buf * 0.1, torch.tensor(0.0)],
        [0.99, 1e-8, 0.01, f64(momentum), True, False])


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_scheduled(wd):
    p, m = tensors(2)
    run(ops.lion_update.scheduled, [p, m * 0.1], [f64(0.9), 0.99, wd])


def test_a_scheduled_scalar_computes_as_the_same_constant_bit_for_bit():
    # The C++ kernel reads the tensor's double: the same update as the constant overload, bit for bit.
    for op, state, extra, at in [
            (ops.sgd_momentum_update, tensors(2) + [torch.tensor(1.0)], [0.9, 0.1, 0.01, True, False], 0),
            (ops.adam_update, tensors(3, seed=1)[:1] + [t.abs() * 0.1 for t in tensors(2, seed=2)] + [torch.tensor(4.0)],
             [0.87, 0.999, 1e-8, 0.1, True, False], 0),
            (ops.rmsprop_update, tensors(1) + [torch.rand(5, 7), torch.zeros(5, 7), torch.zeros(5, 7), torch.tensor(0.0)],
             [0.99, 1e-8, 0.01, 0.9, False, False], 3),
            (ops.lion_update, tensors(2), [0.9, 0.99, 0.1], 0),
            (ops.muon_update, tensors(2), [0.1, 0.95, True, 3.4445, -4.7750, 2.0315, 5, 1e-7, 1.0], 1)]:
        grad = tensors(1, seed=5)[0]
        lr = f64(1e-2)
        want = op.default(state[0], grad, *state[1:], lr, *extra)
        scheduled = list(extra)
        scheduled[at] = f64(extra[at])
        got = op.scheduled(state[0], grad, *state[1:], lr, *scheduled)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_each_registration_carries_its_aten_forms():
    """The ATen forms live in the optimizer's own registration (one Python module per optimizer);
    every kind but Muon's has one, so AOTInductor fuses it."""
    from torch_ext.optim import descriptor, registrations

    table = decompositions()
    kinds = {kind for reg in registrations() for kind in reg.aten}
    overloads = {getattr(ops, descriptor(k)["op"]).default for k in kinds}
    overloads |= {getattr(ops, descriptor(k)["op"]).scheduled for k in kinds if descriptor(k)["schedulable"]}
    assert overloads == set(table)
    assert kinds == {"adam", "adam_amsgrad", "sgd", "sgd_momentum", "rmsprop", "adagrad", "lion", "adamax", "nadam",
                     "radam", "adadelta", "rprop", "adafactor", "adafactor_vector"}


def test_an_aten_form_for_an_unknown_kind_is_refused():
    from torch_ext.optim import Registration, register

    class Mine(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="unknown update kind 'sgdd'"):
        register(Registration(Mine, lambda *a: {}, aten={"sgdd": lambda *a: None}))



@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_bias_corrections_are_computed_once_per_call_not_per_vector(decoupled):
    """Inductor inlines 0-d arithmetic into its consumer's loop: the bias corrections (two double pow
    of the step count) were recomputed for every 16 elements of the AdamW update (13% of the update at
    ResNet-18 size, one thread). The ATen form computes them as values of their own, before the loop."""
    from torch._inductor.utils import run_and_get_code

    op = ops.adam_update.default
    n = 4096  # elements of the update: its loop's bound
    p, m, v = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.1
    args = [p, torch.randn(n), m, v, torch.tensor(3.0), torch.tensor(1e-2, dtype=torch.float64),
            0.9, 0.999, 1e-8, 0.01, decoupled, False]
    torch._dynamo.reset()
    got, (code,) = run_and_get_code(torch.compile(decompositions()[op], fullgraph=True), *args)
    close(got, op(*args))
    assert code.count("std::pow") >= 2, code  # (beta1^s, beta2^s)
    for kernel in code.split('extern "C"')[1:]:
        loop = kernel.find(f"<static_cast<int64_t>({n}L)")
        assert loop > 0, kernel
        assert "std::pow" not in kernel[loop:], kernel[loop:]


def test_once_refuses_a_tensor_that_is_not_0d():
    from torch_ext.optim import once

    assert torch.equal(once(torch.tensor(2.5, dtype=torch.float64)), torch.tensor(2.5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"0-d tensor, got shape \(2,\)"):
        once(torch.ones(2))


@pytest.mark.parametrize("wd,maximize,eps1", [(0.0, False, 1e-30), (0.1, True, float(torch.finfo(torch.float32).eps))])
def test_adafactor(wd, maximize, eps1):
    """Both kinds: a matrix with its factored row_var [5, 1] and col_var [1, 7], a vector with its variance."""
    (p,) = tensors(1)
    extra = [-0.8, eps1, 1e-3, 1.0, wd, maximize]
    run(ops.adafactor_update.default, [p, torch.zeros(5, 1), torch.zeros(1, 7), torch.tensor(0.0)], extra)
    run(ops.adafactor_vector_update.default, [p[0].clone(), torch.zeros(7), torch.tensor(0.0)], extra)
