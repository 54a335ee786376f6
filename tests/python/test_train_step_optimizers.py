"""RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta and Rprop in the pure step: 40 steps bit-exact with torch.optim's
single-tensor path (its default on CPU; foreach=False given explicitly too), and with schedulers, param groups,
a resumed optimizer and a saved .pt2."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

from helpers import eager_step, train_like_eager


OPTIMIZERS = {
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "rmsprop_centered_momentum_wd": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, alpha=0.9, momentum=0.8,
                                                                   centered=True, weight_decay=1e-3),
    "rmsprop_momentum_maximize": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, maximize=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=5e-2),
    "adagrad_decay_init_wd": lambda ps: torch.optim.Adagrad(ps, lr=5e-2, lr_decay=1e-2, weight_decay=1e-3,
                                                            initial_accumulator_value=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-2),
    "adamax_wd_maximize_single": lambda ps: torch.optim.Adamax(ps, lr=2e-2, betas=(0.8, 0.95), weight_decay=1e-2,
                                                               maximize=True, foreach=False),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "nadam_wd_md_single": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-2, momentum_decay=8e-3,
                                                       foreach=False),
    "nadam_decoupled_maximize": lambda ps: torch.optim.NAdam(ps, lr=1e-2, betas=(0.85, 0.99), weight_decay=0.1,
                                                             decoupled_weight_decay=True, maximize=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "radam_wd_single": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=1e-2, foreach=False),
    "radam_decoupled_maximize": lambda ps: torch.optim.RAdam(ps, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1,
                                                             decoupled_weight_decay=True, maximize=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "adadelta_wd_maximize_single": lambda ps: torch.optim.Adadelta(ps, lr=0.5, rho=0.8, eps=1e-5, weight_decay=1e-2,
                                                                   maximize=True, foreach=False),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "rprop_etas_sizes_maximize_single": lambda ps: torch.optim.Rprop(ps, lr=2e-3, etas=(0.4, 1.3),
                                                                     step_sizes=(1e-5, 0.02), maximize=True,
                                                                     foreach=False),
}


# 40 steps: RAdam's rectification starts at step 6, NAdam's mu_product and Rprop's step sizes compound over
# every step; 100 steps (as first written) cost ~5 min of the suite for no rounding that 40 do not show.
STEPS = 40


def model_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]
    return model, batches


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


@pytest.mark.parametrize("warm", [0, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bit_exact_many_steps(name, warm):
    model, batches = model_and_batches()
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    for b in batches[:warm]:  # resume from existing optimizer state
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, *b).backward()
            o.step()
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    state = train_like_eager(step, step.init_state(), ref, ref_opt, loss_fn, batches[warm:])
    names = {id(p): n for n, p in ref.named_parameters()}
    for p, st in ref_opt.state.items():
        for slot, v in st.items():
            assert torch.equal(state.opt[f"opt:model.{names[id(p)]}:{slot}"].to(v.dtype), v), slot
    # write_back hands the optimizer state back so eager continues identically.
    step.write_back(state)
    for p, st in opt.state.items():
        rp = dict(zip(map(id, model.parameters()), ref.parameters()))[id(p)]
        for slot, v in ref_opt.state[rp].items():
            assert torch.equal(st[slot], v), slot


def test_planned_arena_updates_in_place():
    model, batches = model_and_batches()
    step = torch_ext.make_train_step(model, OPTIMIZERS["rmsprop_centered_momentum_wd"](model.parameters()), loss_fn,
                                     batches[0])
    planned = step.compile(plan=True, donate=True)
    assert planned.inplace_updates == len(list(model.parameters()))
    s_ref, s = step.init_state(), step.init_state()
    for b in batches[:5]:
        l_ref, s_ref = step(s_ref, *b)
        loss, s = planned(s, *b)
        assert torch.equal(loss, l_ref)
    for name in step.state_names:
        assert torch.equal(s.lookup(name), s_ref.lookup(name)), name


def test_update_ops_opcheck():
    p, g = torch.randn(4, 3), torch.randn(4, 3)
    lr = torch.tensor(0.1, dtype=torch.float64)
    torch.library.opcheck(torch.ops.torch_ext.rmsprop_update.default,
                          (p, g, torch.rand(4, 3), torch.zeros(4, 3), torch.zeros(4, 3), torch.tensor(2.0), lr,
                           0.99, 1e-8, 0.0, 0.9, True, False))
    torch.library.opcheck(torch.ops.torch_ext.adagrad_update.default,
                          (p, g, torch.rand(4, 3), torch.tensor(2.0), lr, 0.01, 0.0, 1e-10, False))
    with pytest.raises(RuntimeError, match=r"sum has shape \[3\] but the parameter has shape \[4, 3\]"):
        torch.ops.torch_ext.adagrad_update(p, g, torch.rand(3), torch.tensor(2.0), lr, 0.0, 0.0, 1e-10, False)


FOREACH = {
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                                  foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "rmsprop_centered_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.8, centered=True,
                                                                foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=5e-2, lr_decay=1e-2, foreach=True),
    "adamax_wd": lambda ps: torch.optim.Adamax(ps, lr=2e-2, weight_decay=1e-2, foreach=True),
    "adamax_maximize": lambda ps: torch.optim.Adamax(ps, lr=2e-2, maximize=True, foreach=True),
    "adadelta_wd_maximize": lambda ps: torch.optim.Adadelta(ps, weight_decay=1e-2, maximize=True, foreach=True),
    "rprop_maximize": lambda ps: torch.optim.Rprop(ps, lr=1e-2, maximize=True, foreach=True),
}


@pytest.mark.parametrize("name", list(FOREACH))
def test_foreach_is_accepted_where_it_computes_the_same_numbers(name):
    """Eager's foreach path is bit-identical to the single-tensor one for these, so the step accepts it."""
    model, batches = model_and_batches()
    ref = copy.deepcopy(model)
    ref_opt = FOREACH[name](ref.parameters())
    step = torch_ext.make_train_step(model, FOREACH[name](model.parameters()), loss_fn, batches[0])
    train_like_eager(step, step.init_state(), ref, ref_opt, loss_fn, batches[:50])


def _assert_written_back_like(model, opt, ref, ref_opt):
    """After write_back: every parameter and every optimizer.state slot equal to the eager run's."""
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), rp.detach()), n
        assert set(opt.state[p]) == set(ref_opt.state[rp]), n
        for slot, v in ref_opt.state[rp].items():
            assert torch.equal(opt.state[p][slot], v), (n, slot)


def _eager(ref, ref_opt, b, sched=None):
    loss = eager_step(ref, ref_opt, loss_fn, *b)
    if sched is not None:
        sched.step()
    return loss.detach()


def _run_side_by_side(step, state, ref, ref_opt, batches, ref_sched=None):
    for i, b in enumerate(batches):
        loss, state = step(state, *b)
        assert torch.equal(loss, _eager(ref, ref_opt, b, ref_sched)), i
    return state


# OneCycleLR (cycle_momentum=True) cycles betas[0] of Adamax, NAdam and RAdam: fed per step like the lr.
SCHEDULED = {
    "adadelta_steplr": (lambda ps: torch.optim.Adadelta(ps, lr=0.5),
                        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), 5),
    "adamax_lambdalr": (lambda ps: torch.optim.Adamax(ps, lr=2e-2),
                        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1 / (1 + k)), 5),
    "adamax_onecycle": (lambda ps: torch.optim.Adamax(ps, lr=2e-2),
                        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10), 5),
    "nadam_onecycle": (lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-2),
                       lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10), 5),
    "radam_onecycle": (lambda ps: torch.optim.RAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
                       lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10), 8),
    "radam_steplr": (lambda ps: torch.optim.RAdam(ps, lr=1e-2),
                     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 8),
    # Rprop reads the lr only when it creates its state: a schedule changes nothing after, in eager as here.
    "rprop_steplr": (lambda ps: torch.optim.Rprop(ps, lr=1e-2),
                     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), 5),
}


@pytest.mark.parametrize("name", list(SCHEDULED))
def test_schedulers_bit_exact_and_written_back(name):
    make_opt, make_sched, steps = SCHEDULED[name]
    model, batches = model_and_batches()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    sched, ref_sched = make_sched(opt), make_sched(ref_opt)
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], scheduler=sched)
    state = step.init_state()
    assert ("opt:beta1:group0" in state.opt) == ("onecycle" in name)  # the cycled beta1: an input, fed per step
    state = _run_side_by_side(step, state, ref, ref_opt, batches[:steps], ref_sched)
    step.write_back(state)
    _assert_written_back_like(model, opt, ref, ref_opt)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert [g.get("betas") for g in opt.param_groups] == [g.get("betas") for g in ref_opt.param_groups]


GROUPED = {
    "adamax": lambda gs: torch.optim.Adamax(gs, lr=2e-2),
    "nadam": lambda gs: torch.optim.NAdam(gs, lr=1e-2),
    "radam": lambda gs: torch.optim.RAdam(gs, lr=1e-2),
    "adadelta": lambda gs: torch.optim.Adadelta(gs),
    "rprop": lambda gs: torch.optim.Rprop(gs, lr=1e-2),
}


def _groups(m, cls):
    other = {"adamax": dict(betas=(0.8, 0.9), weight_decay=1e-2, maximize=True),
             "nadam": dict(betas=(0.8, 0.9), weight_decay=0.1, decoupled_weight_decay=True, momentum_decay=1e-2),
             "radam": dict(betas=(0.8, 0.9), weight_decay=0.1, decoupled_weight_decay=True),
             "adadelta": dict(lr=0.3, rho=0.7, weight_decay=1e-2),
             "rprop": dict(lr=3e-3, etas=(0.3, 1.1), step_sizes=(1e-4, 0.05), maximize=True)}[cls]
    return [{"params": m[0].parameters(), "lr": 3e-3} if cls != "adadelta" else {"params": m[0].parameters()},
            {"params": [*m[1].parameters(), *m[3].parameters()], **other}]


@pytest.mark.parametrize("name", list(GROUPED))
def test_param_groups_with_different_hyperparameters_and_a_resumed_optimizer(name):
    """Two groups with different options; the optimizer resumed by load_state_dict from an eager run of 3 steps,
    then 8 steps (RAdam crosses its rectification threshold), everything bit-exact after write_back."""
    model, batches = model_and_batches()
    ref = copy.deepcopy(model)
    opt, ref_opt = GROUPED[name](_groups(model, name)), GROUPED[name](_groups(ref, name))
    for b in batches[:3]:
        _eager(ref, ref_opt, b)
    model.load_state_dict(ref.state_dict())
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    state = _run_side_by_side(step, step.init_state(), ref, ref_opt, batches[3:11])
    step.write_back(state)
    _assert_written_back_like(model, opt, ref, ref_opt)
    # ... and eager training continues from the written-back state bit for bit.
    for b in batches[11:13]:
        assert torch.equal(_eager(model, opt, b), _eager(ref, ref_opt, b))
    _assert_written_back_like(model, opt, ref, ref_opt)


@pytest.mark.parametrize("name", ["adamax", "nadam", "radam", "adadelta", "rprop"])
def test_pt2_save_and_load_step_bit_exact(name, tmp_path):
    model, batches = model_and_batches()
    ref = copy.deepcopy(model)
    make = {"adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-2), "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
            "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2), "adadelta": lambda ps: torch.optim.Adadelta(ps),
            "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2)}[name]
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    path = tmp_path / "step.pt2"
    torch.export.save(step.program, str(path))
    loaded = torch_ext.load_step(path)
    state = _run_side_by_side(loaded, step.init_state(), ref, ref_opt, batches[:8])
    step.write_back(state)
    _assert_written_back_like(model, opt, ref, ref_opt)


REFUSED = {
    # torch.optim's foreach path of NAdam and RAdam rounds differently from the single-tensor one.
    "nadam_foreach": (lambda ps: torch.optim.NAdam(ps, foreach=True), ValueError, r"NAdam param group 0: .*foreach=True"),
    "radam_foreach": (lambda ps: torch.optim.RAdam(ps, foreach=True), ValueError, r"RAdam param group 0: .*foreach=True"),
    "adamax_capturable": (lambda ps: torch.optim.Adamax(ps, capturable=True), ValueError,
                          r"Adamax param group 0: .*capturable=True"),
    "adadelta_differentiable": (lambda ps: torch.optim.Adadelta(ps, differentiable=True), ValueError,
                                r"Adadelta param group 0: .*differentiable=True"),
    "nadam_tensor_betas": (lambda ps: torch.optim.NAdam(ps, betas=(torch.tensor(0.9), torch.tensor(0.999))),
                           ValueError, r"NAdam param group 0: tensor betas are not supported"),
    "radam_float32_lr": (lambda ps: torch.optim.RAdam(ps, lr=torch.tensor(0.01)), ValueError,
                         r"RAdam param group 0: lr is a torch.float32 tensor"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_options_are_refused_by_name_leaving_model_and_optimizer_unchanged(name):
    make, exc, match = REFUSED[name]
    model, batches = model_and_batches()
    opt = make(model.parameters())
    params, groups = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["param_groups"])
    with pytest.raises(exc, match=match):
        torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    assert all(torch.equal(a, b) for a, b in zip(params.values(), model.state_dict().values()))
    assert not opt.state and str(opt.state_dict()["param_groups"]) == str(groups)


def test_nadam_under_float64_default_dtype_is_refused():
    model, batches = model_and_batches()
    opt = torch.optim.NAdam(model.parameters())
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(ValueError, match=r"NAdam param group 0: its mu_product is .* float64"):
            torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    finally:
        torch.set_default_dtype(old)
    assert not opt.state


def test_radam_aten_form_branches_on_the_step_input():
    """The ATen form (what AOTInductor compiles), exported once at step 0, decides rectification per step from its
    step input: from step 6 on (default betas) it follows the kernel's rectified branch."""
    from torch_ext.optim import aten_updates

    fn = aten_updates()[torch.ops.torch_ext.radam_update.default]
    args = (0.9, 0.999, 1e-8, 0.0, False, False)

    class Update(nn.Module):
        def forward(self, p, g, m, v, step, lr):
            return fn(p, g, m, v, step, lr, *args)

    p, g, m, v = (torch.randn(3, 4) for _ in range(4))
    v = v.abs()
    lr = torch.tensor(1e-2, dtype=torch.float64)
    exported = torch.export.export(Update(), (p, g, m, v, torch.tensor(0.0), lr)).module()
    for s in (0.0, 4.0, 5.0, 6.0, 20.0):
        want = torch.ops.torch_ext.radam_update(p, g, m, v, torch.tensor(s), lr, *args)
        got = exported(p, g, m, v, torch.tensor(s), lr)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


# ---- Adafactor: a parameter of 2 or more dims keeps a factored second moment (row_var, col_var: shapes that
# are not the parameter's), a 1-d one a full variance; a conv weight (4-d) factors over its last two dims.
ADAFACTOR = {
    "default": lambda ps: torch.optim.Adafactor(ps),
    "wd_maximize_eps1_d_single": lambda ps: torch.optim.Adafactor(ps, lr=2e-2, beta2_decay=-0.5, eps=(1e-20, 1e-3),
                                                                  d=1.5, weight_decay=1e-2, maximize=True,
                                                                  foreach=False),
    "wd_eps1_none_f64_tensor_lr": lambda ps: torch.optim.Adafactor(ps, lr=torch.tensor(3e-2, dtype=torch.float64),
                                                                   weight_decay=0.1),
}


def conv_model_and_batches(steps=STEPS):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 5, 12),
                          nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 2, 4, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(steps)]
    return model, batches


def _assert_opt_state_like(state, ref, ref_opt):
    names = {id(p): n for n, p in ref.named_parameters()}
    for p, st in ref_opt.state.items():
        for slot, v in st.items():
            got = state.opt[f"opt:model.{names[id(p)]}:{slot}"]
            assert got.shape == v.shape and torch.equal(got.to(v.dtype), v), (names[id(p)], slot)


@pytest.mark.parametrize("warm", [0, 3])
@pytest.mark.parametrize("name", list(ADAFACTOR))
def test_adafactor_bit_exact_many_steps_and_written_back(name, warm):
    model, batches = conv_model_and_batches()
    ref = copy.deepcopy(model)
    opt, ref_opt = ADAFACTOR[name](model.parameters()), ADAFACTOR[name](ref.parameters())
    for b in batches[:warm]:  # resume from existing optimizer state
        assert torch.equal(_eager(model, opt, b), _eager(ref, ref_opt, b))
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    shapes = {k: tuple(v.shape) for k, v in step.init_state().opt.items()}
    assert shapes["opt:model.0.weight:row_var"] == (3, 2, 3, 1) and shapes["opt:model.0.weight:col_var"] == (3, 2, 1, 3)
    assert shapes["opt:model.3.weight:row_var"] == (12, 1) and shapes["opt:model.3.weight:col_var"] == (1, 60)
    assert shapes["opt:model.0.bias:variance"] == (3,) and "opt:model.0.bias:row_var" not in shapes
    state = _run_side_by_side(step, step.init_state(), ref, ref_opt, batches[warm:])
    _assert_opt_state_like(state, ref, ref_opt)
    step.write_back(state)
    _assert_written_back_like(model, opt, ref, ref_opt)
    for b in batches[:2]:  # eager continues from the written-back state bit for bit
        assert torch.equal(_eager(model, opt, b), _eager(ref, ref_opt, b))
    _assert_written_back_like(model, opt, ref, ref_opt)


def test_adafactor_scheduler_and_two_param_groups_bit_exact():
    """Two groups (eps1=None and a float, weight decay, maximize in one) under a LambdaLR, 40 steps, then write_back."""
    model, batches = conv_model_and_batches()
    ref = copy.deepcopy(model)

    def make(m):
        opt = torch.optim.Adafactor([{"params": m[0].parameters()},
                                     {"params": [*m[3].parameters(), *m[4].parameters(), *m[6].parameters()],
                                      "lr": 5e-3, "eps": (1e-25, 2e-3), "weight_decay": 1e-2, "maximize": True,
                                      "d": 2.0}], lr=3e-2)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + 0.1 * k))

    (opt, sched), (ref_opt, ref_sched) = make(model), make(ref)
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], scheduler=sched)
    state = _run_side_by_side(step, step.init_state(), ref, ref_opt, batches, ref_sched)
    _assert_opt_state_like(state, ref, ref_opt)
    step.write_back(state)
    _assert_written_back_like(model, opt, ref, ref_opt)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]


def test_adafactor_pt2_save_load_step_and_planned_arena(tmp_path):
    model, batches = conv_model_and_batches(10)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.Adafactor(model.parameters(), weight_decay=1e-2), \
        torch.optim.Adafactor(ref.parameters(), weight_decay=1e-2)
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    path = tmp_path / "step.pt2"
    torch.export.save(step.program, str(path))
    loaded = torch_ext.load_step(path)
    state = _run_side_by_side(loaded, step.init_state(), ref, ref_opt, batches[:5])
    # a saved TrainState comes back with its factored slots; one shaped like its parameter is refused by name
    torch.save(state.state_dict(), tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt")
    state = step.load_state_dict(saved)
    saved["opt"]["opt:model.3.weight:row_var"] = torch.zeros(12, 60)
    with pytest.raises(ValueError, match=r"opt\['opt:model.3.weight:row_var'\] should have shape \(12, 1\)"):
        step.load_state_dict(saved)
    # the planned arena, donating, updates the factored slots in place and goes on bit for bit
    planned = step.compile(plan=True, donate=True)
    assert planned.inplace_updates == len(list(model.parameters()))
    state = _run_side_by_side(planned, state, ref, ref_opt, batches[5:])
    _assert_opt_state_like(state, ref, ref_opt)
    step.write_back(state)
    _assert_written_back_like(model, opt, ref, ref_opt)


def test_adafactor_foreach_is_refused_as_it_rounds_differently():
    """Eager's foreach path adds the scaled update with a separate multiply (the single-tensor path: add with
    alpha), so its bits differ; the step refuses foreach=True by name."""
    model, batches = conv_model_and_batches(5)
    single, multi = copy.deepcopy(model), copy.deepcopy(model)
    o1, o2 = torch.optim.Adafactor(single.parameters(), foreach=False), torch.optim.Adafactor(multi.parameters(),
                                                                                           foreach=True)
    for b in batches:
        _eager(single, o1, b), _eager(multi, o2, b)
    assert not all(torch.equal(a, b) for a, b in zip(single.parameters(), multi.parameters()))
    opt = torch.optim.Adafactor(model.parameters(), foreach=True)
    with pytest.raises(ValueError, match=r"Adafactor param group 0: .*foreach=True"):
        torch_ext.make_train_step(model, opt, loss_fn, batches[0])


ADAFACTOR_REFUSED = {
    "foreach": (lambda ps: torch.optim.Adafactor(ps, foreach=True), r"Adafactor param group 0: .*foreach=True"),
    # eager computes rho, the update's scale and the decay factor in float32 tensor arithmetic then
    "float32_lr": (lambda ps: torch.optim.Adafactor(ps, lr=torch.tensor(0.01)),
                   r"Adafactor param group 0: lr is a torch.float32 tensor"),
    "tensor_d": (lambda ps: torch.optim.Adafactor(ps, d=torch.tensor(2.0)),
                 r"Adafactor param group 0: a tensor d is not supported"),
    "eps1_none_mixed_dtypes": (lambda ps: torch.optim.Adafactor(ps), r"Adafactor param group 0: eps=\(None, \.\.\.\) .*"
                               r"mixes dtypes \(torch.float32, torch.float64\)"),
}


@pytest.mark.parametrize("name", list(ADAFACTOR_REFUSED))
def test_adafactor_unsupported_options_are_refused_by_name_leaving_model_and_optimizer_unchanged(name):
    make, match = ADAFACTOR_REFUSED[name]
    model, batches = conv_model_and_batches(1)
    if name == "eps1_none_mixed_dtypes":  # the head in float64
        model[5] = _Cast(torch.float64)
        model[6].double()
        model.append(_Cast(torch.float32))
    opt = make(model.parameters())
    params, groups = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["param_groups"])
    with pytest.raises(ValueError, match=match):
        torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    assert all(torch.equal(a, b) for a, b in zip(params.values(), model.state_dict().values()))
    assert not opt.state and str(opt.state_dict()["param_groups"]) == str(groups)


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)

