"""The torch-ext command line: every subcommand on the built-in default and on tests/python/factories.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "torch_ext", *args], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_runs_and_writes_pngs(tmp_path):
    r = cli("demo", "--steps", "20", "--out", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parity with eager torch.optim" in r.stdout and "rho =" in r.stdout
    for name in ("demo_memory_timeline.png", "demo_sweep_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 5000


def test_step_trains_exports_and_reports_json(tmp_path):
    out = tmp_path / "step.pt2"
    r = cli("step", "factories:mlp", "--steps", "3", "--export", str(out), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    assert len(d["losses"]) == 3 and d["state_entries"] > 0 and out.stat().st_size > 0


def test_plan_json_and_plot(tmp_path):
    png = tmp_path / "timeline.png"
    r = cli("plan", "factories:mlp", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    assert d["merged_planned"] > 0 and d["eager_peak"] > 0
    assert png.stat().st_size > 5000


def test_sweep_json_and_plot(tmp_path):
    png = tmp_path / "sweep.png"
    r = cli("sweep", "factories:mlp", "--sites", "*", "--metric", "logit:0", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    assert d["measured_evaluations"] == d["predicted_evaluations"] and d["rho"] > 1
    assert png.stat().st_size > 3000


def test_check_passes_on_a_good_factory():
    r = cli("check", "factories:mlp", "--steps", "5", "--json")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert json.loads(r.stdout)["ok"] is True


def test_check_fails_on_nonfinite_loss():
    r = cli("check", "factories:nan_loss", "--steps", "3", "--json")
    assert r.returncode == 1
    d = json.loads(r.stdout)
    assert d["ok"] is False and "non-finite loss" in d["failures"][0]


def test_check_fails_when_the_budget_is_too_low():
    r = cli("check", "factories:mlp", "--steps", "2", "--max-peak-bytes", "1000")
    assert r.returncode == 1
    assert "exceeds the budget of 1000 bytes" in r.stdout


@pytest.mark.parametrize("model,msg", [("factories", "must look like package.module:factory"),
                                       ("no_such_module:f", "cannot import 'no_such_module'"),
                                       ("factories:not_a_factory", "must return (model, optimizer")])
def test_bad_model_is_one_clear_line(model, msg):
    r = cli("step", model)
    assert r.returncode == 2
    assert msg in r.stderr and "Traceback" not in r.stderr
