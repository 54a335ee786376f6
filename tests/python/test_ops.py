"""torch.ops.torch_ext optimizer ops: opcheck, and bit-exact parity with torch.optim's single-tensor loops."""
import math

import pytest
import torch

import torch_ext  # noqa: F401

ops = torch.ops.torch_ext


def _lr(v):
    return torch.tensor(v, dtype=torch.float64)


def _fresh(shape=(5, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


OPCHECK_CASES = [
    ("sgd_update", lambda p, g: (p, g, _lr(0.1), 0.01, False)),
    ("sgd_momentum_update", lambda p, g: (p, g, torch.randn_like(p), torch.tensor(3.0), _lr(0.1), 0.9, 0.1, 0.01, True, False)),
    ("adam_update", lambda p, g: (p, g, torch.randn_like(p), torch.rand_like(p), torch.tensor(2.0), _lr(1e-3), 0.9, 0.999, 1e-8, 0.01, True, False)),
    ("adam_amsgrad_update", lambda p, g: (p, g, torch.randn_like(p), torch.rand_like(p), torch.rand_like(p), torch.tensor(2.0), _lr(1e-3), 0.9, 0.999, 1e-8, 0.0, False, True)),
    ("muon_update", lambda p, g: (p, g, torch.randn_like(p), _lr(0.02), 0.1, 0.95, True, 3.4445, -4.7750, 2.0315, 5, 1e-7, 1.0)),
    ("rmsprop_update", lambda p, g: (p, g, torch.rand_like(p) + 1, torch.rand_like(p) * 0.1, torch.randn_like(p), torch.tensor(2.0), _lr(1e-2), 0.99, 1e-8, 0.01, 0.9, True, False)),
    # uncentered, no momentum: grad_avg and momentum_buffer are left alone (the functional op copies them)
    ("rmsprop_update", lambda p, g: (p, g, torch.rand_like(p), torch.randn_like(p), torch.randn_like(p), torch.tensor(2.0), _lr(1e-2), 0.99, 1e-8, 0.0, 0.0, False, True)),
    ("adagrad_update", lambda p, g: (p, g, torch.rand_like(p), torch.tensor(2.0), _lr(1e-2), 0.01, 0.01, 1e-10, False)),
    ("lion_update", lambda p, g: (p, g, torch.randn_like(p), _lr(1e-3), 0.9, 0.99, 0.1)),
]


def _fed(x):  # a scheduled scalar (momentum, beta1): a 1-element float64 tensor, as lr is
    return torch.tensor([x], dtype=torch.float64)


# The "scheduled" overloads (a scheduler that cycles momentum feeds it per step): same kernels.
SCHEDULED_CASES = [
    ("sgd_momentum_update", lambda p, g: (p, g, torch.randn_like(p), torch.tensor(3.0), _lr(0.1), _fed(0.9), 0.1, 0.01, True, False)),
    ("adam_update", lambda p, g: (p, g, torch.randn_like(p), torch.rand_like(p), torch.tensor(2.0), _lr(1e-3), _fed(0.9), 0.999, 1e-8, 0.01, True, False)),
    ("adam_amsgrad_update", lambda p, g: (p, g, torch.randn_like(p), torch.rand_like(p), torch.rand_like(p), torch.tensor(2.0), _lr(1e-3), _fed(0.9), 0.999, 1e-8, 0.0, False, True)),
    ("rmsprop_update", lambda p, g: (p, g, torch.rand_like(p) + 1, torch.rand_like(p) * 0.1, torch.randn_like(p), torch.tensor(2.0), _lr(1e-2), 0.99, 1e-8, 0.01, _fed(0.9), True, False)),
    ("lion_update", lambda p, g: (p, g, torch.randn_like(p), _lr(1e-3), _fed(0.9), 0.99, 0.1)),
    ("muon_update", lambda p, g: (p, g, torch.randn_like(p), _lr(0.02), 0.1, _fed(0.95), True, 3.4445, -4.7750, 2.0315, 5, 1e-7, 1.0)),
]


@pytest.mark.parametrize("name,make", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_functional_is_inplace_on_fresh_results(name, make):
    """The functional op writes fresh results (no input written, none aliased) that equal, bit for bit,
    the in-place op run on copies of the inputs."""
    p, g = _fresh()
    args = make(p, g)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = getattr(ops, name)(*args)
    out = out if isinstance(out, tuple) else (out,)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    written = [a for a in args if isinstance(a, torch.Tensor)]
    for o in out:
        assert all(o.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() for a in written)
    getattr(ops, name + "_")(*before)
    n_written = len(out)  # param, then the slots: the first tensors of args except grad
    targets = [before[0]] + [a for a in before[2:] if isinstance(a, torch.Tensor)][: n_written - 1]
    for o, t in zip(out, targets):
        assert torch.equal(o, t)


@pytest.mark.parametrize("name,make,overload", [(n, m, "default") for n, m in OPCHECK_CASES] +
                         [(n, m, "scheduled") for n, m in SCHEDULED_CASES],
                         ids=[c[0] for c in OPCHECK_CASES] + [c[0] + ".scheduled" for c in SCHEDULED_CASES])
@pytest.mark.parametrize("inplace", [False, True])
def test_opcheck(name, make, overload, inplace):
    p, g = _fresh()
    args = make(p, g)
    op = getattr(getattr(ops, name + ("_" if inplace else "")), overload)  # opcheck takes one overload
    torch.library.opcheck(op, args)


def _eager(opt_cls, p0, grads, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


GRADS = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(5)]
P0 = torch.randn(6, 4, generator=torch.Generator().manual_seed(99))


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.1, weight_decay=0.01, maximize=True)])
def test_sgd_bit_exact(kw):
    ref, _ = _eager(torch.optim.SGD, P0, GRADS, **kw)
    p = P0.clone()
    for g in GRADS:
        p = ops.sgd_update(p, g, _lr(kw["lr"]), kw.get("weight_decay", 0.0), kw.get("maximize", False))
    assert torch.equal(p, ref)


@pytest.mark.parametrize("kw", [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-2),
                                dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3, maximize=True)])
def test_sgd_momentum_bit_exact(kw):
    ref, state = _eager(torch.optim.SGD, P0, GRADS, **kw)
    p, buf, step = P0.clone(), torch.zeros_like(P0), torch.tensor(0.0)
    for g in GRADS:
        p, buf, step = ops.sgd_momentum_update(p, g, buf, step, _lr(kw["lr"]), kw["momentum"], kw.get("dampening", 0.0),
                                               kw.get("weight_decay", 0.0), kw.get("nesterov", False), kw.get("maximize", False))
    assert torch.equal(p, ref) and torch.equal(buf, state["momentum_buffer"])
    # The in-place variant is the same computation.
    p2, buf2, step2 = P0.clone(), torch.zeros_like(P0), torch.tensor(0.0)
    for g in GRADS:
        ops.sgd_momentum_update_(p2, g, buf2, step2, _lr(kw["lr"]), kw["momentum"], kw.get("dampening", 0.0),
                                 kw.get("weight_decay", 0.0), kw.get("nesterov", False), kw.get("maximize", False))
    assert torch.equal(p2, ref) and step2.item() == len(GRADS)


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)),
    (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
])
def test_adam_bit_exact(cls, kw):
    ref, state = _eager(cls, P0, GRADS, **kw)
    d = cls([torch.nn.Parameter(P0.clone())], **kw).defaults
    beta1, beta2 = d["betas"]
    decoupled = cls is torch.optim.AdamW
    p, m, v, vmax, step = P0.clone(), torch.zeros_like(P0), torch.zeros_like(P0), torch.zeros_like(P0), torch.tensor(0.0)
    for g in GRADS:
        if d["amsgrad"]:
            p, m, v, vmax, step = ops.adam_amsgrad_update(p, g, m, v, vmax, step, _lr(d["lr"]), beta1, beta2, d["eps"],
                                                          d["weight_decay"], decoupled, d["maximize"])
        else:
            p, m, v, step = ops.adam_update(p, g, m, v, step, _lr(d["lr"]), beta1, beta2, d["eps"], d["weight_decay"],
                                            decoupled, d["maximize"])
    assert torch.equal(p, ref)
    assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"]) and torch.equal(step, state["step"])
    if d["amsgrad"]:
        assert torch.equal(vmax, state["max_exp_avg_sq"])


@pytest.mark.parametrize("shape,kw", [((6, 4), {}), ((4, 6), dict(nesterov=False, adjust_lr_fn="match_rms_adamw")),
                                      ((6, 4), dict(weight_decay=0.0, momentum=0.9))])
def test_muon_bit_exact(shape, kw):
    grads = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    ref, state = _eager(torch.optim.Muon, p0, grads, lr=0.02, **kw)
    d = torch.optim.Muon([torch.nn.Parameter(p0.clone())], lr=0.02, **kw).defaults
    a_dim, b_dim = shape
    fn = d["adjust_lr_fn"]
    ratio = math.sqrt(max(1, a_dim / b_dim)) if fn in (None, "original") else 0.2 * math.sqrt(max(a_dim, b_dim))
    p, buf = p0.clone(), torch.zeros_like(p0)
    a, b, c = d["ns_coefficients"]
    for g in grads:
        p, buf = ops.muon_update(p, g, buf, _lr(0.02), d["weight_decay"], d["momentum"], d["nesterov"], a, b, c,
                                 d["ns_steps"], d["eps"], ratio)
    assert torch.equal(p, ref) and torch.equal(buf, state["momentum_buffer"])


def test_bad_arguments_name_the_argument():
    p, g = _fresh()
    with pytest.raises(RuntimeError, match=r"exp_avg has shape \[2\] but the parameter has shape \[5, 3\]"):
        ops.adam_update(p, g, torch.zeros(2), torch.zeros_like(p), torch.tensor(0.0), _lr(0.1), 0.9, 0.99, 1e-8, 0.0, False, False)
    # A mixed dtype failed inside lerp ("expected dtype float for `end`"), naming no argument.
    with pytest.raises(RuntimeError, match=r"grad has dtype Double but the parameter has dtype Float"):
        ops.adam_update(p, g.double(), torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0), _lr(0.1), 0.9, 0.99,
                        1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"exp_avg_sq has dtype Half but the parameter has dtype Float"):
        ops.adam_update(p, g, torch.zeros_like(p), torch.zeros_like(p).half(), torch.tensor(0.0), _lr(0.1), 0.9, 0.99,
                        1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"lr must be a 1-element tensor, got shape \[2\]"):
        ops.sgd_update(p, g, torch.zeros(2), 0.0, False)
