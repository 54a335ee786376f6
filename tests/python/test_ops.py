"""torch.ops.torch_ext ops: opcheck, bit-exact parity of the optimizer ops with torch.optim's single-tensor loops, and of
the oneDNN LSTM layer ops with ATen's."""
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


def _lstm_layer_args(dtype, batch_first=False, seed=0):
    # One LSTM layer's (input, w_ih, w_hh, b_ih, b_hh, hx, cx) as aten.mkldnn_rnn_layer takes them: T=5, B=3, I=4, H=6.
    g = torch.Generator().manual_seed(seed)
    shape = (3, 5, 4) if batch_first else (5, 3, 4)
    x = torch.randn(shape, generator=g)
    ws = [torch.randn(s, generator=g) * 0.3 for s in ((24, 4), (24, 6), (24,), (24,))]
    hx, cx = torch.randn(1, 3, 6, generator=g), torch.randn(1, 3, 6, generator=g)
    return [t.to(dtype) for t in (x, *ws, hx, cx)]


def _onednn_dtypes():
    from torch_ext import _compat

    return [d for d in (torch.float32, torch.bfloat16) if d in _compat._onednn_lstm_dtypes()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_mkldnn_rnn_layer_ops_are_atens_kernels(dtype, reverse):
    # torch_ext::mkldnn_rnn_layer(_backward): ATen's oneDNN LSTM layer and its backward with batch_sizes=[] (what
    # to_aoti hands AOTInductor, whose proxy executor passed aten's empty batch_sizes as None), the forward run with
    # grad mode on when training: ATen's returns the backward's workspace only then, and AOTInductor runs with it off.
    if dtype not in _onednn_dtypes():
        pytest.skip("oneDNN's LSTM does not take this dtype on this CPU")
    x, w0, w1, b0, b1, hx, cx = _lstm_layer_args(dtype)
    want = torch.ops.aten.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, reverse, [], 2, 6, 1, True, False, False, True)
    with torch.no_grad():
        assert torch.ops.aten.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, reverse, [], 2, 6, 1, True, False, False,
                                               True)[3] is None  # (why the op exists)
        got = ops.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, reverse, 2, 6, 1, True, False, False, True)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    # (the workspace's bytes are oneDNN's scratch, some never written: its size, and the gradients below)
    assert got[3].dtype == torch.uint8 and got[3].shape == want[3].shape
    y, hy, cy, work = got
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    gh = torch.randn(hy.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    args = (x, w0, w1, b0, b1, hx, cx, y, hy, cy, gy, gh, None, reverse, 2, 6, 1, True, True, False)
    want = torch.ops.aten.mkldnn_rnn_layer_backward(*args, [], False, work.clone())  # (ATen writes into it)
    with torch.no_grad():
        got = ops.mkldnn_rnn_layer_backward(*args, False, work)
    assert len(got) == 7
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the two bias gradients: equal, not one tensor (no two outputs of an op alias)
    assert got[3].untyped_storage().data_ptr() != got[4].untyped_storage().data_ptr()
    # ATen's kernel writes into its workspace; the op's input is left as it was
    before = work.clone()
    ops.mkldnn_rnn_layer_backward(*args, False, work)
    assert torch.equal(work, before)
    # not training: ATen's inference output (oneDNN's inference primitive: the training one's bits on the machines of
    # earlier stops, not on an AVX2 AMD EPYC), and an empty workspace (ATen's is None)
    inference = ops.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, reverse, 2, 6, 1, True, False, False, False)
    with torch.no_grad():
        want = torch.ops.aten.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, reverse, [], 2, 6, 1, True, False, False,
                                               False)
    assert torch.equal(inference[0], want[0]) and torch.equal(inference[1], want[1])
    assert inference[3].numel() == 0 and inference[3].dtype == torch.uint8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_opcheck_mkldnn_rnn_layer_ops(dtype):
    if dtype not in _onednn_dtypes():
        pytest.skip("oneDNN's LSTM does not take this dtype on this CPU")
    x, w0, w1, b0, b1, hx, cx = _lstm_layer_args(dtype)
    for train in (True, False):
        # Training, the workspace holds scratch bytes oneDNN never writes, which differ from run to run: AOTDispatch's
        # test compares two runs' outputs, so it runs on the inference call only.
        utils = ("test_schema", "test_autograd_registration", "test_faketensor") + (() if train else
                                                                                   ("test_aot_dispatch_dynamic",))
        torch.library.opcheck(ops.mkldnn_rnn_layer.default, (x, w0, w1, b0, b1, hx, cx, False, 2, 6, 1, True, False,
                                                             False, train), test_utils=utils)
    y, hy, cy, work = ops.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, False, 2, 6, 1, True, False, False, True)
    torch.library.opcheck(ops.mkldnn_rnn_layer_backward.default,
                          (x, w0, w1, b0, b1, hx, cx, y, hy, cy, torch.ones_like(y), None, None, False, 2, 6, 1, True,
                           True, False, False, work))


def test_mkldnn_rnn_layer_backward_names_a_missing_workspace():
    x, w0, w1, b0, b1, hx, cx = _lstm_layer_args(torch.float32)
    y, hy, cy, _ = ops.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, False, 2, 6, 1, True, False, False, False)
    # the inference forward's (empty) workspace: refused by name, where ATen's kernel would read past it
    with pytest.raises(RuntimeError, match=r"workspace is empty \(input \[5, 3, 4\], hidden_size 6\)"):
        ops.mkldnn_rnn_layer_backward(x, w0, w1, b0, b1, hx, cx, y, hy, cy, torch.ones_like(y), None, None, False, 2,
                                      6, 1, True, True, False, False, _)
