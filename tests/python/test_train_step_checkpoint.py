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
