"""Bad input to make_train_step, to a step call and to compile (issue 16): each raises a clear error
naming the culprit, and leaves the model, the optimizer and the step as they were (the step then
gives the same result as a fresh one)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

from helpers import eager_step


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


X, Y = torch.randn(5, 4), torch.randint(0, 3, (5,))


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


class MySGD(torch.optim.SGD):
    def step(self, closure=None):  # a home-made update the pure step cannot see
        return super().step(closure)


def _assert_untouched(model, opt, before):
    for (n, p), q in zip(model.named_parameters(), before):
        assert torch.equal(p, q), n
    assert not opt.state  # no optimizer state was created


BUILD = {
    "model_not_a_module": (lambda m, o: torch_ext.make_train_step("model", o, _loss, (X, Y)), TypeError, "nn.Module"),
    "optimizer_not_an_optimizer": (lambda m, o: torch_ext.make_train_step(m, "adam", _loss, (X, Y)), TypeError,
                                   "torch.optim.Optimizer"),
    "optimizer_empty_list": (lambda m, o: torch_ext.make_train_step(m, [], _loss, (X, Y)), TypeError, "Optimizer"),
    "batch_not_a_tuple": (lambda m, o: torch_ext.make_train_step(m, o, _loss, X), TypeError, "example_batch"),
    "unroll_zero": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), unroll=0), ValueError, "unroll"),
    "unroll_negative": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), unroll=-2), ValueError, "unroll"),
    "unroll_float": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), unroll=2.5), TypeError, "unroll"),
    "unroll_string": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), unroll="2"), TypeError, "unroll"),
    "accumulate_zero": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), accumulate=0), ValueError,
                        "accumulate"),
    "clip_zero": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), clip_grad_norm=0), ValueError,
                  "clip_grad_norm"),
    "clip_negative": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), clip_grad_norm=-1.0), ValueError,
                      "clip_grad_norm"),
    "clip_string": (lambda m, o: torch_ext.make_train_step(m, o, _loss, (X, Y), clip_grad_norm="1.0"), TypeError,
                    "clip_grad_norm"),
    "loss_not_scalar": (lambda m, o: torch_ext.make_train_step(m, o, lambda m, x, y: m(x), (X, Y)), ValueError,
                        "scalar"),
    "loss_raises": (lambda m, o: torch_ext.make_train_step(m, o, lambda m, x, y: 1 / 0, (X, Y)), ZeroDivisionError,
                    "division"),
    "foreign_parameter": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), _loss, (X, Y)), ValueError, "not a parameter"),
    "parameter_in_two_groups": (lambda m, o: torch_ext.make_train_step(
        m, [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)], _loss, (X, Y)),
        ValueError, "more than one"),
    "unsupported_optimizer": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.LBFGS(m.parameters()), _loss, (X, Y)), TypeError, "LBFGS"),
    "subclass_overriding_step": (lambda m, o: torch_ext.make_train_step(
        m, MySGD(m.parameters(), lr=0.1), _loss, (X, Y)), TypeError, "MySGD"),
    "fused_option": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.Adam(m.parameters(), fused=True), _loss, (X, Y)), ValueError, "fused"),
    "capturable_option": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.Adam(m.parameters(), capturable=True), _loss, (X, Y)), ValueError, "capturable"),
    # A float32 tensor lr: eager Adam/AdamW/Adagrad(lr_decay) round their step size to float32 (1e-7 off
    # the float path after 5 steps); the step computed it in double and silently disagreed.
    "adam_float32_tensor_lr": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01)), _loss, (X, Y)), ValueError,
        r"Adam param group 0: lr is a torch.float32 tensor"),
    "adamw_float32_tensor_lr": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.01)), _loss, (X, Y)), ValueError,
        r"AdamW param group 0: lr is a torch.float32 tensor .*torch.float64 tensor"),
    "adagrad_lr_decay_float32_tensor_lr": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.Adagrad(m.parameters(), lr=torch.tensor(0.01), lr_decay=0.1), _loss, (X, Y)), ValueError,
        r"Adagrad param group 0: lr is a torch.float32 tensor"),
    # Muon keeps a 0-dim tensor lr a tensor too: lr * ratio and 1 - lr * weight_decay in float32 (fuzz_step 22:68).
    "muon_float32_tensor_lr": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.Muon([p for p in m.parameters() if p.dim() == 2], lr=torch.tensor(0.01)), _loss, (X, Y)),
        ValueError, r"Muon param group 0: lr is a torch.float32 tensor"),
    "nesterov_without_momentum": (lambda m, o: torch_ext.make_train_step(
        m, torch.optim.SGD(m.parameters(), lr=0.1, nesterov=True, momentum=0.0) if False else
        _nesterov_zero(m), _loss, (X, Y)), ValueError, "nesterov"),
}


def _nesterov_zero(m):
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opt.param_groups[0]["momentum"] = 0.0  # torch refuses this at construction; a script may set it later
    return opt


@pytest.mark.parametrize("case", BUILD.values(), ids=BUILD.keys())
def test_bad_build(case):
    fn, exc, pattern = case
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(exc, match=pattern):
        fn(model, opt)
    _assert_untouched(model, opt, before)
    # The model still builds a step that matches a fresh model's.
    fresh = _model()
    a = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _loss, (X, Y))
    b = torch_ext.make_train_step(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), _loss, (X, Y))
    assert torch.equal(a(a.init_state(), X, Y)[0], b(b.init_state(), X, Y)[0])


@pytest.fixture
def built():
    model = _model()
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _loss, (X, Y))
    return step


CALLS = {
    "state_not_a_trainstate": (lambda st, s: st({}, X, Y), TypeError, "TrainState"),
    "state_none": (lambda st, s: st(None, X, Y), TypeError, "TrainState"),
    "missing_batch": (lambda st, s: st(s, X), ValueError, "batch tensors"),
    "extra_batch": (lambda st, s: st(s, X, Y, Y), ValueError, "batch tensors"),
    "batch_wrong_shape": (lambda st, s: st(s, torch.randn(5, 7), Y), ValueError, r"batch\[0\]"),
    "batch_wrong_dtype": (lambda st, s: st(s, X.double(), Y), ValueError, r"batch\[0\]"),
    "batch_label_dtype": (lambda st, s: st(s, X, Y.float()), ValueError, r"batch\[1\]"),
    "batch_not_a_tensor": (lambda st, s: st(s, X, [0, 1, 2, 0, 1]), (TypeError, ValueError), r"batch|tensor"),
    "foreign_state": (lambda st, s: st(_other_state(), X, Y), ValueError, "another|TrainStep|fingerprint"),
    "set_lr_wrong_count": (lambda st, s: s.set_lr([0.1, 0.2, 0.3]), ValueError, "set_lr"),
    "write_back_foreign_state": (lambda st, s: st.write_back(_other_state()), ValueError, "another|TrainStep"),
}


def _other_state():
    m = nn.Sequential(nn.Linear(4, 3))
    return torch_ext.make_train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), _loss, (X, Y)).init_state()


@pytest.mark.parametrize("case", CALLS.values(), ids=CALLS.keys())
def test_bad_call(built, case):
    fn, exc, pattern = case
    state = built.init_state()
    snapshot = {k: v.clone() for k, v in state.params.items()}
    with pytest.raises(exc, match=pattern):
        fn(built, state)
    assert all(torch.equal(state.params[k], v) for k, v in snapshot.items())  # the state is untouched
    loss, _ = built(state, X, Y)[:2]
    fresh = built.init_state()
    assert torch.equal(loss, built(fresh, X, Y)[0])


COMPILE = {
    "plan_string": (lambda st: st.compile(plan="yes"), TypeError, "plan must be True or False"),
    "plan_none": (lambda st: st.compile(plan=None), TypeError, "plan must be True or False"),
    "donate_string": (lambda st: st.compile(donate="no"), TypeError, "donate must be True or False"),
    "donate_int": (lambda st: st.compile(donate=2), TypeError, "donate must be True or False"),
    "call_dict_state": (lambda st: st.compile()({}, X, Y), TypeError, "TrainState"),
    "call_none_state": (lambda st: st.compile()(None, X, Y), TypeError, "TrainState"),
    "call_missing_batch": (lambda st: st.compile()(st.init_state(), X), ValueError, "batch tensors"),
    "call_wrong_shape": (lambda st: st.compile()(st.init_state(), torch.randn(5, 7), Y), ValueError, r"batch\[0\]"),
    "call_wrong_dtype": (lambda st: st.compile()(st.init_state(), X.double(), Y), ValueError, r"batch\[0\]"),
    "call_foreign_state": (lambda st: st.compile()(_other_state(), X, Y), ValueError, "another|TrainStep|fingerprint"),
}


@pytest.mark.parametrize("case", COMPILE.values(), ids=COMPILE.keys())
def test_bad_compile(built, case):
    fn, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fn(built)
    planned = built.compile(plan=True, donate=False)
    state = built.init_state()
    assert torch.equal(planned(state, X, Y)[0], built(state, X, Y)[0])


def test_donated_state_is_refused_on_reuse(built):
    planned = built.compile(plan=True, donate=True)
    state = built.init_state()
    planned(state, X, Y)
    with pytest.raises(ValueError, match="donated"):
        planned(state, X, Y)
    with pytest.raises(ValueError, match="donated"):
        built(state, X, Y)
    fresh = built.init_state()
    loss, _ = planned(fresh, X, Y)[:2]
    assert torch.isfinite(loss)


def test_corpus_size():
    assert len(BUILD) + len(CALLS) + 1 >= 30
    assert len(COMPILE) + len(CALL_ONLY) + len(COMPILED_STATE) + 2 >= 30  # compile and compiled calls


CALL_ONLY = {k: v for k, v in CALLS.items() if not k.startswith(("set_lr", "write_back"))}


@pytest.mark.parametrize("case", CALL_ONLY.values(), ids=CALL_ONLY.keys())
def test_bad_call_of_a_compiled_step(built, case):
    """The same bad calls through the planned arena (donation on): refused before anything is donated."""
    fn, exc, pattern = case
    planned = built.compile(plan=True, donate=True)
    state = built.init_state()
    with pytest.raises(exc, match=pattern):
        fn(planned, state)
    loss = planned(state, X, Y)[0]  # the refused call consumed nothing
    assert torch.equal(loss, built(built.init_state(), X, Y)[0])


def _edit(fn):
    """A state from init_state() with one entry broken by ``fn(state)``."""
    def make(step):
        state = step.init_state()
        fn(state)
        return state
    return make


def _first(d):
    return next(iter(d))


# A broken state, batch or call of the compiled (donating) step: refused with the culprit named,
# before anything is donated.
COMPILED_STATE = {
    "param_missing": (_edit(lambda s: s.params.pop(_first(s.params))), ValueError, r"missing \['model.0.weight'\]"),
    "param_unknown": (_edit(lambda s: s.params.__setitem__("model.bogus", torch.zeros(1))), ValueError,
                      r"unknown \['model.bogus'\]"),
    "param_renamed": (_edit(lambda s: s.params.__setitem__("model.0.wieght", s.params.pop("model.0.weight"))),
                      ValueError, r"missing \['model.0.weight'\], unknown \['model.0.wieght'\]"),
    "opt_missing": (_edit(lambda s: s.opt.pop(_first(s.opt))), ValueError, "missing.*opt:model.0.weight"),
    "param_wrong_shape": (_edit(lambda s: s.params.__setitem__("model.0.weight", torch.zeros(3))), RuntimeError,
                          r"p_model_0_weight.*expected shape \[8, 4\], got \[3\]"),
    "param_wrong_dtype": (_edit(lambda s: s.params.__setitem__("model.0.weight", s.params["model.0.weight"].double())),
                          RuntimeError, "p_model_0_weight.*dtype"),
    "param_meta": (_edit(lambda s: s.params.__setitem__("model.0.weight", s.params["model.0.weight"].to("meta"))),
                   RuntimeError, "p_model_0_weight.*device"),
    "opt_wrong_shape": (_edit(lambda s: s.opt.__setitem__("opt:model.0.weight:exp_avg", torch.zeros(2))),
                        RuntimeError, r"exp_avg.*expected shape \[8, 4\]"),
    "lr_not_a_tensor": (_edit(lambda s: s.lr.__setitem__(0, 0.1)), RuntimeError, "lr_group0"),
    "donated_entries_share_storage": (_edit(lambda s: s.opt.__setitem__(
        "opt:model.0.weight:exp_avg_sq", s.opt["opt:model.0.weight:exp_avg"])), RuntimeError, "share storage"),
}

COMPILED_BATCH = {
    "batch_meta": (lambda st, s: st(s, X.to("meta"), Y), RuntimeError, "batch_0.*device"),
    "batch_numpy": (lambda st, s: st(s, X.numpy(), Y), TypeError, r"batch\[0\].*ndarray"),
    "batch_missing_dim": (lambda st, s: st(s, X[0], Y), ValueError, r"batch\[0\].*got shape \(4,\)"),
    "target_out_of_range": (lambda st, s: st(s, X, torch.full((5,), 7)), RuntimeError, "nll_loss.*out of bounds"),
    "compile_unknown_option": (lambda st, s: st.step.compile(plan=True, budget=3), TypeError, "budget"),
    "compile_plan_int": (lambda st, s: st.step.compile(plan=1), TypeError, "plan must be True or False"),
}
COMPILED_STATE.update({k: v for k, v in COMPILED_BATCH.items()})


@pytest.mark.parametrize("case", COMPILED_STATE.values(), ids=COMPILED_STATE.keys())
def test_bad_state_or_batch_of_a_compiled_step(built, case):
    fn, exc, pattern = case
    planned = built.compile(plan=True, donate=True)
    if callable(fn) and fn.__code__.co_argcount == 1:  # a broken state
        with pytest.raises(exc, match=pattern):
            planned(fn(built), X, Y)
    else:
        state = built.init_state()
        snapshot = {k: v.clone() for k, v in {**state.params, **state.opt}.items()}
        with pytest.raises(exc, match=pattern):
            fn(planned, state)
        assert state.consumed_by is None  # refused before anything was donated
        assert all(torch.equal(t, snapshot[k]) for k, t in {**state.params, **state.opt}.items())
    fresh = built.init_state()
    assert torch.equal(planned(fresh, X, Y)[0], built(built.init_state(), X, Y)[0])


def test_state_dict_of_a_donated_state_is_refused(built):
    planned = built.compile(plan=True, donate=True)
    state = built.init_state()
    planned(state, X, Y)
    with pytest.raises(ValueError, match=r"state_dict\(\).*donated"):
        state.state_dict()


def test_a_pytree_copy_of_a_donated_state_is_refused(built):
    # tree_map dropped consumed_by: the copy held the updated tensors with the old lr, epoch and RNG,
    # and a donating step accepted it as a fresh state.
    from torch.utils import _pytree as pytree

    planned = built.compile(plan=True, donate=True)
    state = built.init_state()
    pytree.tree_map(lambda t: t.clone(), state)  # before donation: fine
    planned(state, X, Y)
    with pytest.raises(ValueError, match=r"pytree.*donated"):
        pytree.tree_map(lambda t: t.clone(), state)


def test_failed_donating_call_that_wrote_in_place_consumes_the_state():
    """unroll=2: the first step's update lands in place before the second step's forward fails. The
    state must not look intact afterwards (it used to, silently holding half-updated weights)."""
    model = _model()
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _loss, (X, Y), unroll=2)
    planned = step.compile(plan=True, donate=True)
    state = step.init_state()
    with pytest.raises(RuntimeError, match=r"out of bounds(.|\n)*partly updated in place"):
        planned(state, X, Y, X, torch.full((5,), 9))
    assert state.consumed_by is not None and "failed call" in state.consumed_by
    with pytest.raises(ValueError, match="donated"):
        planned(state, X, Y, X, Y)
    # Without donation the same failure leaves the state as it was.
    state = step.init_state()
    snapshot = {k: v.clone() for k, v in state.params.items()}
    with pytest.raises(RuntimeError, match="out of bounds"):
        step.compile(plan=True, donate=False)(state, X, Y, X, torch.full((5,), 9))
    assert state.consumed_by is None and all(torch.equal(state.params[k], v) for k, v in snapshot.items())


def test_batchnorm_with_a_cumulative_average_is_refused_by_name():
    # BatchNorm(momentum=None) reads 1 / num_batches_tracked as a Python number: torch.export failed
    # with a data-dependent guard error that named neither the module nor the option.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 2))
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match=r"1: BatchNorm1d\(momentum=None\).*give it a momentum"):
        torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  lambda m, x, y: F.cross_entropy(m(x), y), batch)
    model[1].momentum = 0.1
    torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, x, y: F.cross_entropy(m(x), y), batch)


_TENSOR_LRS = {
    "Adam_float64": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.013, dtype=torch.float64), weight_decay=0.1),
    "AdamW_float64": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.013, dtype=torch.float64), weight_decay=0.1),
    "SGD_float32": lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.013), momentum=0.9, weight_decay=0.1),
    "RMSprop_float32": lambda ps: torch.optim.RMSprop(ps, lr=torch.tensor(0.013), centered=True, momentum=0.5),
    "Adagrad_float32_no_decay": lambda ps: torch.optim.Adagrad(ps, lr=torch.tensor(0.013)),
}


@pytest.mark.parametrize("make", _TENSOR_LRS.values(), ids=_TENSOR_LRS.keys())
def test_a_tensor_lr_the_step_accepts_matches_eager_bit_for_bit(make):
    # Accepted where eager's arithmetic with the tensor equals its arithmetic with the float (a float64
    # tensor; SGD and RMSprop pass lr to a Scalar argument; Adagrad without lr_decay divides by 1).
    model = _model()
    eager = copy.deepcopy(model)
    step = torch_ext.make_train_step(model, make(list(model.parameters())), _loss, (X, Y))
    opt = make(list(eager.parameters()))
    state = step.init_state()
    for _ in range(5):
        want = eager_step(eager, opt, _loss, X, Y)
        got, state = step(state, X, Y)
        assert torch.equal(got, want.detach())
    lr_before = step.optimizers[0].param_groups[0]["lr"]
    step.write_back(state)
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a, b), name
    # The user's lr stays their tensor (before, write_back replaced it with a Python float), as a
    # scheduler keeps it (LRScheduler fills a tensor lr in place).
    assert step.optimizers[0].param_groups[0]["lr"] is lr_before
    assert float(lr_before) == float(opt.param_groups[0]["lr"])


def test_a_failed_trace_leaves_no_global_module_hook_behind():
    # torch 2.9's non-strict export registers a global buffer-registration hook and removes it only when
    # the trace succeeds: the leaked hook kept the module alive and sat in the hook tables every later
    # build-cache key reads (a refused step made later ReactiveGraphs uncacheable on disk).
    from torch.nn.modules import module as nn_module

    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            raise RuntimeError("boom in forward")

    before = dict(nn_module._global_buffer_registration_hooks)
    model = Boom()
    with pytest.raises(RuntimeError, match="boom in forward"):
        torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  lambda m, x: m(x).sum(), (torch.randn(2, 3),))
    with pytest.raises(RuntimeError, match="boom in forward"):
        torch_ext.ReactiveGraph(model, (torch.randn(2, 3),))
    assert dict(nn_module._global_buffer_registration_hooks) == before


# fuzz_step 27:2668: with every parameter frozen (or none reaching the loss) the user got torch's raw "The output at
# index 0 was marked as the loss, but it does not require gradients" from the joint export.
def test_no_parameter_requiring_grad_is_refused_naming_the_groups():
    model = _model()
    for p in model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}], lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"the loss does not require grad, so there is nothing to train: no parameter "
                       r"of the optimizers requires grad \(SGD param group 0: '0\.weight', '0\.bias' "
                       r"\(requires_grad=False\); SGD param group 1: '2\.weight', '2\.bias' \(requires_grad=False\)\)"
                       r"\. Eager's loss\.backward\(\) raises too\. Unfreeze"):
        torch_ext.make_train_step(model, opt, _loss, (X, Y))
    _assert_untouched(model, opt, before)
    assert not any(p.requires_grad for p in model.parameters())


def test_a_loss_detached_from_every_parameter_is_refused_naming_them():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"the optimizers' parameters that require grad \('0\.weight', '0\.bias', "
                       r"'2\.weight', '2\.bias'\) do not reach the loss .* Let loss_fn's result depend on them"):
        torch_ext.make_train_step(model, opt, lambda m, x, y: _loss(m, x, y).detach(), (X, Y))
    _assert_untouched(model, opt, before)
    assert all(p.requires_grad for p in model.parameters())
