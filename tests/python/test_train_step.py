"""Pure training step: parity with the eager torch.optim loop, purity, deployment, bad input."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.models import TinyTransformer

STEPS = 100
# The joint graph calls the same kernels as eager autograd and the update ops replay torch.optim's
# single-tensor op sequence, so parity is bit-exact.
RTOL, ATOL = 0.0, 0.0


# ---------------------------------------------------------------- models: (model, loss_fn, batch maker)
def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, lambda m, x, y: F.cross_entropy(m(x), y), lambda g: (
        torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))


def cnn_bn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 5)).train()
    return model, lambda m, x, y: F.cross_entropy(m(x), y), lambda g: (
        torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g))


def transformer():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, d_model=16, n_heads=2, n_layers=1, seq=8)

    def loss_fn(m, idx, tgt):
        return F.cross_entropy(m(idx).reshape(-1, 32), tgt.reshape(-1))
    return model, loss_fn, lambda g: (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))


MODELS = {"mlp": mlp, "cnn_bn": cnn_bn, "transformer": transformer}


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def adamw_two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}], lr=1e-3)


def muon_adamw(model):
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "tok" not in n and n != "pos"]
    rest = [p for n, p in model.named_parameters() if not any(p is h for h in hidden)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]


OPTIMIZERS = {"sgd_nesterov_wd": sgd, "adam": adam, "adamw_2groups": adamw_two_groups, "muon+adamw": muon_adamw}


def _as_list(opt):
    return opt if isinstance(opt, list) else [opt]


def eager_step(model, opts, loss_fn, batch, clip=None):
    for o in opts:
        o.zero_grad()
    loss = loss_fn(model, *batch)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for o in opts:
        o.step()
    return loss.detach()


def assert_state_matches(step, state, model, opts):
    for n, p in model.named_parameters():
        torch.testing.assert_close(state.params["model." + n], p.detach(), rtol=RTOL, atol=ATOL, msg=f"param {n}")
    for n, b in model.named_buffers():
        torch.testing.assert_close(state.buffers["model." + n], b, rtol=RTOL, atol=ATOL, msg=f"buffer {n}")
    names = {id(p): n for n, p in model.named_parameters()}
    for o in opts:
        for p, st in o.state.items():
            for slot, v in st.items():
                key = f"opt:model.{names[id(p)]}:{slot}"
                torch.testing.assert_close(state.opt[key].to(v.dtype), v, rtol=RTOL, atol=ATOL, msg=key)


def run_parity(model_name, opt_name, *, steps=STEPS, clip=None, unroll=1, warm=0):
    model, loss_fn, make_batch = MODELS[model_name]()
    ref = copy.deepcopy(model)
    opts, ref_opts = _as_list(OPTIMIZERS[opt_name](model)), _as_list(OPTIMIZERS[opt_name](ref))
    g = torch.Generator().manual_seed(1)
    for _ in range(warm):  # resume: both optimizers already hold state
        b = make_batch(g)
        eager_step(model, opts, loss_fn, b, clip)
        eager_step(ref, ref_opts, loss_fn, b, clip)
    example = make_batch(torch.Generator().manual_seed(123))
    step = torch_ext.make_train_step(model, opts if len(opts) > 1 else opts[0], loss_fn, example,
                                     clip_grad_norm=clip, unroll=unroll)
    state = step.init_state()
    for i in range(steps // unroll):
        batches = [make_batch(g) for _ in range(unroll)]
        flat = [t for b in batches for t in b]
        loss, new_state = step(state, *flat)
        ref_losses = torch.stack([eager_step(ref, ref_opts, loss_fn, b, clip) for b in batches])
        torch.testing.assert_close(loss.reshape(-1), ref_losses, rtol=RTOL, atol=ATOL, msg=f"loss at step {i}")
        state = new_state
    assert_state_matches(step, state, ref, ref_opts)
    return step, state, model, opts


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_parity_100_steps(model_name, opt_name):
    if opt_name == "muon+adamw" and model_name == "cnn_bn":
        pass  # Muon takes the 2D linear weight, AdamW the conv and BN parameters
    step, state, model, opts = run_parity(model_name, opt_name)
    torch_ext_program_is_pure(step)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_parity_clip_grad_norm(model_name):
    run_parity(model_name, "adamw_2groups", steps=40, clip=0.5)


@pytest.mark.parametrize("model_name", ["mlp", "cnn_bn"])
def test_parity_unroll_4(model_name):
    step, *_ = run_parity(model_name, "sgd_nesterov_wd", steps=40, unroll=4)
    assert step.graph.nodes()[-2].target == "aten::stack.default"


@pytest.mark.parametrize("opt_name", ["sgd_nesterov_wd", "adam", "muon+adamw"])
def test_parity_resume_from_existing_state(opt_name):
    run_parity("mlp", opt_name, steps=30, warm=3)


def torch_ext_program_is_pure(step):
    g = step.graph
    for n in g.nodes():
        if n.kind != "call" or n.target == "getitem":
            continue
        ns, rest = n.target.split("::")
        op = getattr(getattr(torch.ops, ns), rest.split(".")[0])._schemas[rest.split(".")[1] if rest.split(".")[1] != "default" else ""]
        assert not op.is_mutable, f"{n.name} mutates"
    assert len(g.nodes()) > 0


def test_program_is_a_pure_exported_program(tmp_path):
    model, loss_fn, make_batch = mlp()
    step = torch_ext.make_train_step(model, adam(model), loss_fn, make_batch(torch.Generator().manual_seed(0)))
    ep = step.program
    assert isinstance(ep, torch.export.ExportedProgram)
    for node in ep.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            assert not node.target._schema.is_mutable, f"{node} mutates"
    assert all(s.kind.name == "USER_INPUT" for s in ep.graph_signature.input_specs)
    # Save/load round trip and the loaded program computes the same step.
    path = tmp_path / "step.pt2"
    torch.export.save(ep, str(path))
    loaded = torch.export.load(str(path))
    state = step.init_state()
    batch = make_batch(torch.Generator().manual_seed(5))
    flat = step.flat_inputs(state, *batch)
    outs = loaded.module()(*flat)
    loss, new_state = step(state, *batch)
    assert torch.equal(outs[0], loss)
    for name, v in zip(step.state_names, outs[1:]):
        assert torch.equal(v, new_state.lookup(name)), name
    # No output aliases an input.
    in_ptrs = {t.data_ptr() for t in flat}
    assert not any(o.data_ptr() in in_ptrs for o in outs)


def test_step_is_pure_and_write_back_resumes_eager():
    model, loss_fn, make_batch = mlp()
    opt = adam(model)
    step = torch_ext.make_train_step(model, opt, loss_fn, make_batch(torch.Generator().manual_seed(0)))
    state = step.init_state()
    snapshot = {k: v.clone() for k, v in state.params.items()}
    g = torch.Generator().manual_seed(3)
    _, s1 = step(state, *make_batch(g))
    for k, v in state.params.items():
        assert torch.equal(v, snapshot[k]), "step mutated its input state"
    step.write_back(s1)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), s1.params["model." + n])
    # Eager continues from the written-back optimizer state exactly like the pure step would.
    b = make_batch(g)
    _, s2 = step(s1, *b)
    eager_step(model, [opt], loss_fn, b)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), s2.params["model." + n], rtol=RTOL, atol=ATOL)


def test_lr_is_an_input_so_schedules_need_no_reexport():
    model, loss_fn, make_batch = mlp()
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                                     make_batch(torch.Generator().manual_seed(0)))
    state = step.init_state()
    b = make_batch(torch.Generator().manual_seed(1))
    state.set_lr(0.0)
    _, same = step(state, *b)
    for k in state.params:
        assert torch.equal(same.params[k], state.params[k])
    state.set_lr(0.1)
    _, moved = step(state, *b)
    assert any(not torch.equal(moved.params[k], state.params[k]) for k in state.params)


# ---------------------------------------------------------------- bad input
def test_loss_not_scalar():
    model, _, make_batch = mlp()
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got \(8, 4\)"):
        torch_ext.make_train_step(model, adam(model), lambda m, x, y: m(x), make_batch(torch.Generator()))


def test_optimizer_params_not_the_models():
    model, loss_fn, make_batch = mlp()
    other = nn.Linear(3, 3)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"not a parameter of the model"):
        torch_ext.make_train_step(model, torch.optim.SGD(other.parameters(), lr=0.1), loss_fn, make_batch(torch.Generator()))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_unsupported_option_is_named():
    model, loss_fn, make_batch = mlp()
    with pytest.raises(ValueError, match=r"fused=True"):
        torch_ext.make_train_step(model, torch.optim.Adam(model.parameters(), fused=True), loss_fn,
                                  make_batch(torch.Generator()))
    with pytest.raises(TypeError, match=r"LBFGS is not supported"):
        torch_ext.make_train_step(model, torch.optim.LBFGS(model.parameters()), loss_fn, make_batch(torch.Generator()))


def test_batch_shape_or_dtype_differs_and_foreign_state():
    model, loss_fn, make_batch = mlp()
    step = torch_ext.make_train_step(model, adam(model), loss_fn, make_batch(torch.Generator()))
    state = step.init_state()
    x, y = make_batch(torch.Generator())
    with pytest.raises(ValueError, match=r"batch\[0\]: expected shape \(8, 16\) .* got shape \(9, 16\)"):
        step(state, torch.randn(9, 16), y)
    with pytest.raises(ValueError, match=r"batch\[1\]: expected shape \(8,\) and dtype torch.int64.*dtype torch.int32"):
        step(state, x, y.int())
    other = torch_ext.make_train_step(model, adam(model), loss_fn, make_batch(torch.Generator()))
    with pytest.raises(ValueError, match=r"made by another TrainStep"):
        other(state, x, y)


def test_nan_loss_propagates_by_default_and_can_be_skipped():
    model, loss_fn, make_batch = mlp()
    step = torch_ext.make_train_step(model, adam(model), loss_fn, make_batch(torch.Generator()))
    state = step.init_state()
    x, y = make_batch(torch.Generator())
    x_nan = x.clone()
    x_nan[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        loss, new = step(state, x_nan, y)
    assert torch.isnan(loss) and step.last_nonfinite
    assert any(torch.isnan(v).any() for v in new.params.values())
    with pytest.warns(RuntimeWarning, match="step skipped"):
        loss, kept = step(state, x_nan, y, skip_nonfinite=True)
    assert kept is state


def _frozen_first_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = torch_ext.make_train_step(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), (x, y),
                                     batch_shapes="cache")
    return model, opt, step, x, y


@pytest.mark.parametrize("change", ["unfreeze", "freeze", "momentum", "weight_decay", "add_param_group"])
def test_a_step_refuses_to_run_after_the_model_or_optimizer_it_baked_in_changed(change):
    # The program bakes in which parameters train and every group option but lr; eager training
    # follows such a change, and the step used to ignore it silently (a layer unfrozen after building
    # stayed frozen; a last partial batch, built later, followed it while the other batches did not).
    model, opt, step, x, y = _frozen_first_layer()
    state = step.init_state()
    loss, state = step(state, x, y)
    if change == "unfreeze":
        model[0].weight.requires_grad_(True)
        culprit = "0.weight"
    elif change == "freeze":
        model[2].bias.requires_grad_(False)
        culprit = "2.bias"
    elif change in ("momentum", "weight_decay"):
        opt.param_groups[0][change] = 0.5
        culprit = change
    else:
        extra = nn.Parameter(torch.zeros(3))
        model.register_parameter("extra", extra)
        opt.add_param_group({"params": [extra]})
        culprit = "param group"
    for call in (lambda: step(state, x, y), lambda: step(state, x[:3], y[:3]),
                 lambda: step.compile(plan=False, donate=False)(state, x, y)):
        with pytest.raises(ValueError, match=culprit):
            call()
    # Put back, the step runs again.
    if change == "unfreeze":
        model[0].weight.requires_grad_(False)
    elif change == "freeze":
        model[2].bias.requires_grad_(True)
    elif change in ("momentum", "weight_decay"):
        opt.param_groups[0][change] = 0.9 if change == "momentum" else 0
    else:
        opt.param_groups.pop()
        del model.extra
    step(state, x, y)


def test_an_option_mutated_in_place_after_build_is_refused_and_an_added_key_is_not():
    # betas given as a list and edited in place is still the same object: a snapshot that kept a
    # reference compared it equal to itself, and the step ran with the betas it was built with.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=[0.9, 0.999])
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = torch_ext.make_train_step(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), (x, y))
    state = step.init_state()
    opt.param_groups[0]["note"] = "added by a scheduler or a user; Adam never reads it"
    loss, state = step(state, x, y)
    opt.param_groups[0]["betas"][0] = 0.5
    with pytest.raises(ValueError, match=r"'betas' is \[0.5, 0.999\] now, \[0.9, 0.999\] when the step was built"):
        step(state, x, y)
    opt.param_groups[0]["betas"][0] = 0.9
    step(state, x, y)


def test_lr_set_on_the_optimizer_is_read_by_init_state_not_refused():
    model, opt, step, x, y = _frozen_first_layer()
    opt.param_groups[0]["lr"] = 0.25          # lr is state: init_state reads it, set_lr changes it
    state = step.init_state()
    assert float(state.lr[0]) == 0.25
    step(state, x, y)


def test_frozen_and_unused_parameters_are_left_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)            # frozen: no gradient, torch.optim skips it
    model.register_parameter("unused", nn.Parameter(torch.randn(4)))  # trainable but not in the loss
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(10)]
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    state = step.init_state()
    for b in batches:
        loss, state = step(state, *b)
        eager_step(ref, [ref_opt], loss_fn, b)
    assert_state_matches(step, state, ref, [ref_opt])
    assert torch.equal(state.params["model.0.weight"], model[0].weight)
    assert torch.equal(state.params["model.unused"], model.unused.detach())


class _ReadWithoutGradient(nn.Module):
    """Two trainable parameters the loss reads but has no gradient for: one through .detach(), one
    under torch.no_grad()."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.rand(8) + 0.5)
        self.shift = nn.Parameter(torch.randn(3) * 0.1)

    def forward(self, x):
        h = torch.tanh(self.l1(x)) * self.gain.detach()
        with torch.no_grad():
            offset = self.shift * 2
        return self.l2(h) + offset


def test_parameters_read_without_a_gradient_are_skipped_as_eager_skips_them():
    # Before, the joint export raised a raw "AssertionError: Found a parameter that did not receive a
    # gradient" from torch internals. Eager gives them grad None, and torch.optim skips them (no
    # update, no weight decay, no state): the step now does the same, bit for bit.
    torch.manual_seed(0)
    model = _ReadWithoutGradient()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(5)]
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    assert model.gain.requires_grad and model.shift.requires_grad  # left as the user had them
    state = step.init_state()
    for b in batches:
        loss, state = step(state, *b)
        assert torch.equal(loss, loss_fn(ref, *b).detach())
        eager_step(ref, [ref_opt], loss_fn, b)
    assert ref.gain.grad is None and ref.shift.grad is None
    assert_state_matches(step, state, ref, [ref_opt])
    assert torch.equal(state.params["model.gain"], model.gain.detach())
    assert torch.equal(state.params["model.shift"], model.shift.detach())


def test_clip_grad_norm_with_a_trainable_parameter_outside_every_optimizer_is_refused():
    # Eager clip_grad_norm_(model.parameters(), c) counts the gradient of a parameter that requires grad
    # but no optimizer holds; the step clipped over the optimizers' parameters only, so its norm was
    # smaller and the head trained differently (loss 0.97610 vs eager 0.97624 at step 3), silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.5)
    batch = (torch.randn(6, 5), torch.randint(0, 3, (6,)))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    with pytest.raises(ValueError, match=r"clip_grad_norm=0\.05: parameter '0\.weight' requires grad but is in no "
                                         r"optimizer.*requires_grad_\(False\)"):
        torch_ext.make_train_step(model, opt, loss_fn, batch, clip_grad_norm=0.05)
    torch_ext.make_train_step(model, opt, loss_fn, batch)  # without clipping the set of gradients does not matter
    model[0].requires_grad_(False)  # frozen: eager has no gradient for it either
    torch_ext.make_train_step(model, opt, loss_fn, batch, clip_grad_norm=0.05)
