"""Checkpoints: TrainState through torch.save / torch.load(weights_only=True), state_dict() /
load_state_dict(), and the program fingerprint that guards them, in this process and a fresh one."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

BUILD = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F, torch_ext
    def build(width=16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, width), nn.Dropout(0.1), nn.ReLU(), nn.Linear(width, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        batch = (torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0]))
        step = torch_ext.make_train_step(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), batch, scheduler=sched)
        return step, batch
""")
exec(BUILD)  # defines build()


def test_torch_save_and_weights_only_load_of_a_state(tmp_path):
    step, batch = build()  # noqa: F821
    state = step.init_state(seed=3)
    for _ in range(3):
        _, state = step(state, *batch)
    torch.save(state, tmp_path / "state.pt")
    torch.save(state.state_dict(), tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert isinstance(loaded, torch_ext.TrainState) and loaded.sched_epoch == 3
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    ref_loss, ref_state = step(state, *batch)
    for source in (loaded, sd):
        resumed = step.load_state_dict(source)
        loss, new = step(resumed, *batch)
        assert torch.equal(loss, ref_loss)
        assert new.lr == ref_state.lr and torch.equal(new.rng, ref_state.rng)
        for name in step.state_names:
            assert torch.equal(new.lookup(name), ref_state.lookup(name)), name


def test_fingerprint_is_stable_across_processes_and_guards_load(tmp_path):
    step, batch = build()  # noqa: F821
    state = step.init_state(seed=1)
    _, state = step(state, *batch)
    # A fresh process builds the same step, checks the fingerprint and continues from the saved state.
    torch.save(state.state_dict(), tmp_path / "sd.pt")
    script = BUILD + textwrap.dedent(f"""
        step, batch = build()
        print(step.fingerprint)
        state = step.load_state_dict(torch.load({str(tmp_path / 'sd.pt')!r}, weights_only=True))
        loss, _ = step(state, *batch)
        torch.save(loss, {str(tmp_path / 'loss.pt')!r})
        other, _ = build(width=8)
        try:
            other.load_state_dict(torch.load({str(tmp_path / 'sd.pt')!r}, weights_only=True))
        except ValueError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == step.fingerprint
    assert torch.equal(torch.load(tmp_path / "loss.pt"), step(state, *batch)[0])
    assert "refused: load_state_dict: the state was made by a different program" in out.stdout


def test_load_state_dict_refuses_bad_input_naming_the_entry():
    step, batch = build()  # noqa: F821
    sd = step.init_state(seed=0).state_dict()
    bad = dict(sd, params={**sd["params"], "model.0.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"params\['model.0.weight'\] should have shape \(16, 6\)"):
        step.load_state_dict(bad)
    missing = dict(sd, opt={k: v for k, v in sd["opt"].items() if not k.endswith(":exp_avg")})
    with pytest.raises(ValueError, match=r"opt entries differ: missing \['opt:model.0.bias:exp_avg'"):
        step.load_state_dict(missing)
    with pytest.raises(ValueError, match="missing key"):
        step.load_state_dict({"params": {}})
    with pytest.raises(TypeError, match="expects a dict"):
        step.load_state_dict([1])
    # A state from another (identical) step must go through load_state_dict.
    other, _ = build()  # noqa: F821
    with pytest.raises(ValueError, match=r"made by another TrainStep.*step.load_state_dict\(state\)"):
        other(step.init_state(), *batch)
    other(other.load_state_dict(step.init_state()), *batch)


def test_resume_with_a_restored_scheduler_keeps_the_schedule_in_place():
    # Resuming the PyTorch way (sched.load_state_dict(checkpoint) before building the step) counted
    # the state's 3 scheduler steps on top of the restored scheduler's 3: MultiStepLR decayed at step 7
    # instead of 10, silently. The state's sched_epoch is the scheduler's own epoch now.
    x, y = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2])

    def make():
        torch.manual_seed(0)
        model = nn.Linear(5, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.MultiStepLR(opt, [10, 20], 0.1)

    def loss_fn(m, a, b):
        return F.cross_entropy(m(a), b)

    model, opt, sched = make()
    step = torch_ext.make_train_step(model, opt, loss_fn, (x, y), scheduler=sched)
    state = step.init_state()
    for _ in range(3):
        _, state = step(state, x, y)
    step.write_back(state)
    checkpoint = {"state": state.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    # Either way of resuming: with the scheduler restored, or a fresh one (the state carries the epoch).
    for restore in (True, False):
        model, opt, sched = make()
        if restore:
            opt.load_state_dict(checkpoint["opt"])
            sched.load_state_dict(checkpoint["sched"])
        resumed = torch_ext.make_train_step(model, opt, loss_fn, (x, y), scheduler=sched)
        s = resumed.load_state_dict(checkpoint["state"])
        lrs = []
        for _ in range(10):
            _, s = resumed(s, x, y)
            lrs.append(float(s.lr[0]))
        assert s.sched_epoch == 13
        assert lrs == [0.1] * 6 + [0.1 * 0.1] * 4, (restore, lrs)  # eager: the decay after step 10
    # A scheduler restored past the state cannot be replayed back to it: refused.
    model, opt, sched = make()
    for _ in range(5):
        opt.step()
        sched.step()
    late = torch_ext.make_train_step(model, opt, loss_fn, (x, y), scheduler=sched)
    with pytest.raises(ValueError, match=r"at scheduler epoch 3, but this step's scheduler was at epoch 5"):
        late(late.load_state_dict(checkpoint["state"]), x, y)


def _mlp_step(n=2, width=8, dtype=torch.float32, weight_decay=1e-2, groups=1, optimizer="adamw", **kw):
    """An MLP step built on an example batch of n rows (n's own data), with one knob changed at a time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3)).to(dtype)
    params = [{"params": model[0].parameters()}, {"params": model[2].parameters()}] if groups == 2 \
        else model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=weight_decay) if optimizer == "adamw" \
        else torch.optim.SGD(params, lr=1e-2, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    g = torch.Generator().manual_seed(n)
    batch = (torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g))
    return torch_ext.make_train_step(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), batch,
                                     scheduler=sched, **kw), batch


def test_a_state_moves_between_steps_that_differ_only_in_batch_shapes():
    # The fingerprint hashed the batch shapes: a data-parallel state saved on rank 0 (example batch 2)
    # was refused on rank 1 (example batch 3) as "made by a different program", although parameters,
    # optimizer slots, lr, RNG and scheduler epoch do not depend on the batch shape.
    a, batch2 = _mlp_step(2)
    b, batch3 = _mlp_step(3)
    assert a.fingerprint == b.fingerprint
    _, state = a(a.init_state(), *batch2)
    moved = b.load_state_dict(state.state_dict())
    _, got = b(moved, *batch3)
    # The same two calls without moving the state: one step that builds a program per batch shape.
    both, _ = _mlp_step(3, batch_shapes="cache")
    want = both.init_state()
    for batch in (batch2, batch3):
        _, want = both(want, *batch)
    assert got.sched_epoch == want.sched_epoch == 2 and [float(v) for v in got.lr] == [float(v) for v in want.lr]
    for name in b.state_names:
        assert torch.equal(got.lookup(name), want.lookup(name)), name
    # A state of a really different program is still refused, also when all its shapes match.
    sd = state.state_dict()
    for knob in (dict(width=16), dict(dtype=torch.float64), dict(optimizer="sgd"), dict(groups=2),
                 dict(weight_decay=0.5)):
        other, _ = _mlp_step(3, **knob)
        assert other.fingerprint != a.fingerprint, knob
        with pytest.raises(ValueError, match="made by a different program"):
            other.load_state_dict(sd)
