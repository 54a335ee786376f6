"""The torch-ext command line and scripts/install.sh, as a new user meets them.

Subprocess tests check what a shell sees (exit codes, stderr, pipes); in-process tests (cli.main) cover the rest
faster. Factories live in tests/python/factories.py or are written to tmp_path as files.
"""
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import factories
import torch_ext
from torch_ext import cli

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_cli(*args, cwd=HERE, timeout=300):
    return subprocess.run([sys.executable, "-m", "torch_ext", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def here(monkeypatch):
    monkeypatch.chdir(HERE)


def strict_json(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------- demo
def test_demo_runs_and_writes_pngs(tmp_path):
    r = run_cli("demo", "--steps", "20", "--out", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parity with eager torch.optim" in r.stdout and "rho =" in r.stdout
    for name in ("demo_memory_timeline.png", "demo_sweep_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 5000
    # Not a TTY: one status line per slow stage on stderr, none on stdout.
    assert re.search(r"torch-ext: building the pure step .* done in \d+\.\d s", r.stderr)
    assert "torch-ext:" not in r.stdout


def test_demo_fails_unless_its_parity_is_bit_exact_and_finite(tmp_path, monkeypatch, capsys):
    # The demo's exit status used rtol 1e-5 (and ignored a non-finite step): a 1e-7 drift exited 0. Now as `check`.
    real = torch_ext.testing.step_parity
    monkeypatch.setattr(torch_ext.testing, "step_parity", lambda *a, **kw: {**real(*a, **kw), "loss": 1e-7})
    assert cli.main(["demo", "--steps", "1", "--out", str(tmp_path), "--quiet", "--no-progress"]) == 1


def test_demo_steps_0_is_a_usage_error():
    r = run_cli("demo", "--steps", "0")
    assert r.returncode == 2
    assert "argument --steps: must be >= 1, got 0" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- arguments and exit codes
@pytest.mark.parametrize("argv,msg", [
    (["demo", "--steps", "-1"], "argument --steps: must be >= 1, got -1"),
    (["step", "factories:mlp", "--steps", "-3"], "argument --steps: must be >= 0, got -3"),
    (["step", "factories:mlp", "--unroll", "0"], "argument --unroll: must be >= 1, got 0"),
    (["check", "factories:mlp", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["check", "factories:mlp", "--steps", "two"], "argument --steps: expected an integer, got 'two'"),
    (["check", "factories:mlp", "--rtol", "-1"], "argument --rtol: must be a finite number >= 0, got -1"),
    (["check", "factories:mlp", "--rtol", "nan"], "argument --rtol: must be a finite number >= 0, got nan"),
    (["check", "factories:mlp", "--max-peak-bytes", "0"], "argument --max-peak-bytes: must be >= 1, got 0"),
    (["sweep", "factories:mlp", "--patch", "half"], "argument --patch: invalid choice: 'half'"),
])
def test_bad_option_values_exit_2_naming_the_option(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_help_documents_the_exit_codes(capsys):
    for argv in (["--help"], ["check", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        for line in ("0  ok", "1  a check failed", "2  usage or input error", "3  internal error"):
            assert line in out, (argv, out)
    readme = (ROOT / "README.md").read_text()
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |"):
        assert code in readme


def test_internal_errors_exit_3_and_input_errors_exit_2(here, monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(torch_ext, "make_train_step", broken)
    assert cli.main(["step", "factories:mlp", "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: an invariant broke" in err and "--debug" in err

    def refused(*a, **k):
        raise ValueError("loss_fn must return a scalar tensor, got (4,)")

    monkeypatch.setattr(torch_ext, "make_train_step", refused)
    assert cli.main(["step", "factories:mlp", "--quiet"]) == 2
    assert "ValueError: loss_fn must return a scalar tensor" in capsys.readouterr().err


def test_check_tells_a_broken_tool_from_a_failed_check(here, monkeypatch, capsys):
    assert cli.main(["check", "factories:nan_loss", "--steps", "2", "--quiet"]) == 1  # the model regressed

    def crash(*a, **k):
        raise RuntimeError("executor crashed")

    monkeypatch.setattr(torch_ext.testing, "step_parity", crash)
    assert cli.main(["check", "factories:mlp", "--steps", "2", "--quiet"]) == 3  # the tool broke
    assert "internal error" in capsys.readouterr().err


def test_unsupported_optimizer_is_an_input_error(tmp_path):
    (tmp_path / "own_opt.py").write_text(textwrap.dedent("""
        import torch

        class HomeMadeOptimizer(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, {"lr": 0.1})

            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.data.add_(p.grad, alpha=-group["lr"])

        def factory():
            model = torch.nn.Linear(3, 2)
            return model, HomeMadeOptimizer(model.parameters()), lambda m, x: m(x).sum(), (torch.randn(4, 3),)
    """))
    r = run_cli("check", f"{tmp_path / 'own_opt.py'}:factory", "--steps", "2")
    assert r.returncode == 2, r.stderr
    assert "HomeMadeOptimizer is not supported" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- MODEL
def test_model_as_a_file_path_from_another_folder(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "helper.py").write_text("import torch\nWIDTH = 5\n")
    (models / "tiny.py").write_text(textwrap.dedent("""
        import torch
        from helper import WIDTH  # a sibling module: importable as with `python models/tiny.py`

        def factory():
            torch.manual_seed(0)
            model = torch.nn.Linear(WIDTH, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            return model, opt, lambda m, x: m(x).pow(2).mean(), (torch.randn(3, WIDTH),)
    """))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_cli("step", "../models/tiny.py:factory", "--steps", "2", "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(strict_json(r.stdout)["losses"]) == 2


@pytest.mark.parametrize("model,msg", [
    ("factories", "must look like package.module:factory or path/to/file.py:factory"),
    ("no_such_module:f", "cannot import 'no_such_module'"),
    ("factories:missing", "'factories' has no attribute 'missing'"),
    ("/no/such/dir/tiny.py:factory", "MODEL file '/no/such/dir/tiny.py' does not exist"),
    ("factories:not_a_factory", "must return 4 or 5 items (model, optimizer, loss_fn, example_batch[, batches]), "
                                "got a single int"),
    ("factories:three_items", "returned 3 items (Sequential, SGD, function); expected 4 or 5: "
                              "(model, optimizer, loss_fn, example_batch[, batches])"),
    ("factories:raises", "the factory factories:raises raised RuntimeError: the factory broke"),
])
def test_bad_model_is_one_clear_line_and_exit_2(model, msg, here, capsys):
    assert cli.main(["step", model, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_factory_items_are_checked_by_position(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_items.py").write_text(textwrap.dedent("""
        import torch
        def opt_is_a_string():
            m = torch.nn.Linear(2, 2)
            return m, "sgd", lambda m, x: m(x).sum(), (torch.randn(1, 2),)
        def batch_is_a_tensor():
            m = torch.nn.Linear(2, 2)
            return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x: m(x).sum(), torch.randn(1, 2)
    """))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["step", "bad_items.py:opt_is_a_string", "--quiet"]) == 2
    assert "item 2 (optimizer) must be a torch.optim.Optimizer" in capsys.readouterr().err
    assert cli.main(["step", "bad_items:batch_is_a_tensor", "--quiet"]) == 2
    assert "item 4 (example_batch) must be a tuple of loss_fn's batch arguments, e.g. (x, y), got Tensor" in \
        capsys.readouterr().err


# ---------------------------------------------------------------- step
def test_step_prints_scalar_losses(here, capsys):
    assert cli.main(["step", "factories:mlp", "--steps", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"trained\s+3 steps, loss \d+\.\d{4} -> \d+\.\d{4}\n", out), out
    assert "[" not in out


def test_step_json_is_flat(here, capsys):
    assert cli.main(["step", "factories:mlp", "--steps", "2", "--unroll", "2", "--json", "--quiet"]) == 0
    d = strict_json(capsys.readouterr().out)
    assert len(d["losses"]) == 4 and all(isinstance(x, float) for x in d["losses"])  # 2 calls x 2 unrolled steps
    assert d["loss_first"] == d["losses"][0] and d["loss_last"] == d["losses"][-1]
    assert all(not isinstance(v, dict) for v in d.values())


def test_step_export_holds_the_trained_state(here, tmp_path, capsys):
    out = tmp_path / "step.pt2"
    assert cli.main(["step", "factories:mlp", "--steps", "3", "--export", str(out), "--json", "--quiet"]) == 0
    losses = strict_json(capsys.readouterr().out)["losses"]
    ep = torch.export.load(str(out))
    args, kwargs = ep.example_inputs
    exported_loss = float(ep.module()(*args, **kwargs)[0])  # one more step on the example batch
    # Reference: the same 3 steps in eager torch.optim, then the loss on the example batch.
    model, opt, loss_fn, example, batches = factories.mlp()
    for b in batches[:3]:
        opt.zero_grad()
        loss_fn(model, *b).backward()
        opt.step()
    with torch.no_grad():
        trained_loss = float(loss_fn(model, *example))
    assert exported_loss == pytest.approx(trained_loss, rel=1e-5)
    assert abs(exported_loss - losses[0]) > 1e-3  # losses[0] is the untrained loss on the same batch


def test_step_onnx_exports_a_step_that_trains_in_onnxruntime(here, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "step.onnx"
    assert cli.main(["step", "factories:mlp", "--onnx", str(out), "--quiet"]) == 0
    assert re.search(r"ONNX\s+.*step\.onnx", capsys.readouterr().out)
    from torch_ext.onnx import load_onnx_step

    onnx_step = load_onnx_step(str(out))
    model, opt, loss_fn, example, batches = factories.mlp()
    step = torch_ext.make_train_step(model, opt, loss_fn, example)
    state = step.init_state()
    ref_loss, ref_state = step(state, *batches[0])
    loss, new = onnx_step(state, *batches[0])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, t in ref_state.params.items():
        torch.testing.assert_close(new.params[name], t, rtol=1e-5, atol=1e-6)


def test_step_nproc_2_trains_data_parallel_through_torchrun(tmp_path):
    # The first loss is computed before any update: the mean over the ranks of the loss of each rank's
    # first batch (rank r takes batches r, r + 2, ...) at the initial parameters.
    r = run_cli("step", "factories:mlp", "--nproc", "2", "--steps", "2", "--shard-optimizer-state", "--json",
                "--quiet", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = strict_json(r.stdout[r.stdout.index("{"):])
    assert d["ranks"] == 2 and d["states_in_sync"] is True and d["shard_optimizer_state"] is True
    model, opt, loss_fn, example, batches = factories.mlp()
    with torch.no_grad():
        first = (loss_fn(model, *batches[0]) + loss_fn(model, *batches[1])).double() / 2
    assert d["loss_first"] == pytest.approx(float(first), rel=1e-6)
    # SGD momentum keeps one buffer per parameter: sharded, each rank holds half of it (+ padding).
    full = sum(p.numel() * 4 for p in model.parameters())
    assert d["optimizer_state_bytes_per_rank"] < 0.6 * full + 4 * 4 * len(list(model.parameters()))


def test_status_lines_without_a_tty(tmp_path):
    r = run_cli("step", "factories:mlp", "--steps", "2", "--export", str(tmp_path / "s.pt2"))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    for stage in ("building the pure step", "training on the C++ executor (2 iterations)",
                  f"exporting the pure step to {tmp_path / 's.pt2'}"):
        assert any(re.fullmatch(rf"torch-ext: {re.escape(stage)}.* \.\.\. done in \d+\.\d s", ln) for ln in lines), \
            (stage, lines)


def test_aoti_has_a_status_line_and_quiet_silences_it(here, tmp_path, monkeypatch, capsys):
    seen = []

    def fake_aoti(program, package_path, inductor_configs=None):  # the real compile takes minutes; test_deploy.py runs it
        assert "torch_ext.layout" in inductor_configs["aot_inductor.metadata"]
        seen.append(program)
        Path(package_path).write_bytes(b"package")
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_aoti)
    pkg = str(tmp_path / "step_aoti.pt2")
    assert cli.main(["step", "factories:mlp", "--aoti", pkg]) == 0
    captured = capsys.readouterr()
    assert re.search(rf"torch-ext: compiling with AOTInductor into {re.escape(pkg)}.* done in", captured.err)
    assert f"AOTInductor  {pkg}" in captured.out and len(seen) == 1
    assert cli.main(["step", "factories:mlp", "--aoti", pkg, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- plan
def test_plan_json_is_flat_and_plots(here, tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert cli.main(["plan", "factories:mlp", "--json", "--plot", str(png), "--quiet"]) == 0
    d = strict_json(capsys.readouterr().out)
    assert d["merged_planned"] > 0 and d["eager_peak"] > 0 and "ratios.planned/eager" in d
    assert all(not isinstance(v, dict) for v in d.values())
    assert png.stat().st_size > 5000


def test_memory_figure_is_labelled_with_the_legend_outside_the_data():
    model, opt, loss_fn, example, _ = factories.mlp()
    step = torch_ext.make_train_step(model, opt, loss_fn, example)
    fig = cli.memory_figure(torch_ext.memory_report(step, example), "eager vs planned")
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend is not None
    box, axes_box = legend.get_window_extent(), ax.get_window_extent()
    assert box.x0 >= axes_box.x1  # right of the axes: covers no curve
    texts = [t.get_text() for t in legend.get_texts()]
    assert any(t.startswith("eager step") for t in texts) and any(t.startswith("torch_ext planned") for t in texts)
    assert any("LB_graph: lower bound for any order" in t for t in texts)
    assert ax.get_xlabel() and ax.get_ylabel().startswith("live memory") and "eager vs planned" in ax.get_title()
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---------------------------------------------------------------- sweep
def test_sweep_list_shows_module_paths(here, capsys):
    assert cli.main(["sweep", "factories:seq", "--list", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["node", "module", "path", "op"]
    rows = {ln.split()[0]: ln.split()[1] for ln in out[1:]}
    assert rows["embedding"] == "emb" and rows["linear"] == "mlp.0" and rows["linear_1"] == "head"


def test_sweep_on_a_dict_output_names_the_outputs(here, capsys):
    assert cli.main(["sweep", "factories:seq_dict", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "logits [2, 5, 16], hidden [2, 5, 8]" in err and "--output KEY" in err
    assert cli.main(["sweep", "factories:seq_dict", "--output", "logits", "--json", "--quiet"]) == 0
    d = strict_json(capsys.readouterr().out)
    assert d["output"] == "logits" and d["sites"] == 5
    assert cli.main(["sweep", "factories:seq_dict", "--output", "nope", "--quiet"]) == 2
    assert "--output 'nope' is not an output of the model" in capsys.readouterr().err


def test_sweep_positions_make_a_layer_by_position_grid(here, tmp_path, capsys):
    png = tmp_path / "heat.png"
    assert cli.main(["sweep", "factories:seq", "--positions", "--metric", "logit:3", "--json", "--plot", str(png),
                     "--quiet"]) == 0
    d = strict_json(capsys.readouterr().out)
    assert d["sites"] == 25 and d["measured_evaluations"] == d["predicted_evaluations"]
    assert sorted({r["position"] for r in d["metrics"]}) == [0, 1, 2, 3, 4]
    # Logits at the last position depend only on that position's activations (no attention in this model).
    last = {r["node"]: r["metric"] for r in d["metrics"] if r["position"] == 4}
    others = [r["metric"] for r in d["metrics"] if r["position"] < 4]
    assert all(m == pytest.approx(d["unpatched_metric"]) for m in others)
    assert last["linear_1"] == 0.0  # the zeroed logits themselves
    assert png.stat().st_size > 5000


def test_sweep_figure_is_a_node_by_position_grid():
    metrics = {(node, p): float(i * 10 + p) for i, node in enumerate(["add", "add_1", "add_2"]) for p in range(4)}
    result = torch_ext.SweepResult(metrics, 12, 12, 36, 3, 0.01)
    fig = cli.sweep_figure(result, "patching compared", {"add": "add (blocks.0)"}, "token position", baseline=5.0)
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (3, 4)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["add (blocks.0)", "add_1", "add_2"]
    assert ax.get_xlabel() == "patched token position" and ax.get_ylabel() == "patched node (layer)"
    assert "patching compared" in ax.get_title()
    assert "unpatched run, 5" in fig.axes[1].get_ylabel()  # the colour bar says what white means
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_sweep_bad_metric_is_a_usage_error(here, capsys):
    assert cli.main(["sweep", "factories:mlp", "--metric", "logit:7", "--quiet"]) == 2
    assert "output 'output' has shape [4, 3], no index 7 in its last dimension" in capsys.readouterr().err
    assert cli.main(["sweep", "factories:mlp", "--metric", "max", "--quiet"]) == 2
    assert "--metric must be norm or logit:IDX, got 'max'" in capsys.readouterr().err


def test_sweep_json_and_plot(tmp_path):
    png = tmp_path / "sweep.png"
    r = run_cli("sweep", "factories:mlp", "--sites", "*", "--metric", "logit:0", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr[-3000:]
    d = strict_json(r.stdout)
    assert d["measured_evaluations"] == d["predicted_evaluations"] and d["rho"] > 1
    assert [r["module_path"] for r in d["metrics"]] == ["0", "1", "2"]
    assert png.stat().st_size > 3000


# ---------------------------------------------------------------- check
def test_check_passes_on_a_good_factory(here, capsys):
    assert cli.main(["check", "factories:mlp", "--steps", "5", "--json", "--quiet"]) == 0
    d = strict_json(capsys.readouterr().out)
    assert d["ok"] is True and d["failures"] == [] and all(not isinstance(v, dict) for v in d.values())
    assert d["rtol"] == 0.0 and d["loss_rel"] == 0.0 and d["state_rel"] == 0.0 and "bit-exact" in d["rtol_reason"]


def test_check_is_bit_exact_by_default_and_says_so(here, monkeypatch, capsys):
    # The pure step matches eager bit for bit: a drift of 1 ulp per step is a defect. The former default
    # rtol 1e-5 passed it silently; now the default is 0, stated with its reason, and --rtol loosens it.
    real_call = torch_ext.train_step.TrainStep.__call__

    def one_ulp_off(self, state, *batch, **kw):
        loss, new, *rest = real_call(self, state, *batch, **kw)
        new = new.replace({n: torch.nextafter(t, torch.full_like(t, math.inf)) for n, t in new.params.items()})
        return (loss, new, *rest)

    monkeypatch.setattr(torch_ext.train_step.TrainStep, "__call__", one_ulp_off)
    assert cli.main(["check", "factories:mlp", "--steps", "3", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "rtol" in out and "bit-exact expected: the pure step runs eager's kernels" in out
    assert cli.main(["check", "factories:mlp", "--steps", "3", "--rtol", "1e-5", "--quiet"]) == 0
    assert "1e-05 (given by --rtol)" in capsys.readouterr().out


def test_check_fails_on_nonfinite_loss_with_strict_json(here, capsys):
    assert cli.main(["check", "factories:nan_loss", "--steps", "3", "--json", "--quiet"]) == 1
    d = strict_json(capsys.readouterr().out)
    assert d["ok"] is False and "non-finite loss" in d["failures"][0] and d["nonfinite"] is True


def test_check_fails_on_weights_that_turned_nan_with_every_loss_finite(here, capsys):
    # One step at lr=nan: the loss is computed before the update, so it is finite, and eager's weights are NaN
    # exactly where the pure step's are: parity (NaN == NaN) and the loss check both passed; CI said OK.
    assert cli.main(["check", "factories:nan_weights", "--steps", "1", "--json", "--quiet"]) == 1
    d = strict_json(capsys.readouterr().out)
    assert d["ok"] is False and d["nonfinite"] is False and d["state_rel"] == 0.0
    assert d["nonfinite_state"] == "model.0.weight"
    assert d["failures"] == ["non-finite state after step 1: model.0.weight (finite before training; every loss "
                             "was finite)"]
    assert cli.main(["check", "factories:nan_weights", "--steps", "1", "--quiet"]) == 1
    assert "FAIL: non-finite state after step 1: model.0.weight" in capsys.readouterr().out
    with pytest.raises(torch_ext.testing.ParityError, match="model.0.weight holds non-finite values after 1 steps"):
        torch_ext.testing.assert_step_matches_eager(*factories.nan_weights()[:3], factories.nan_weights()[4][:1])
    # A state entry non-finite from the start (a -inf mask buffer) is no failure.
    assert cli.main(["check", "factories:causal_mask_buffer", "--steps", "2", "--json", "--quiet"]) == 0
    d = strict_json(capsys.readouterr().out)
    assert d["ok"] is True and d["nonfinite_state"] is None


def test_check_fails_when_the_budget_is_too_low(here, capsys):
    assert cli.main(["check", "factories:mlp", "--steps", "2", "--max-peak-bytes", "1000", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "check factories:mlp: FAILED" in out and "exceeds the budget of 1000 bytes" in out
    assert re.search(r"^  parity steps +2$", out, re.M)


def test_a_closed_pipe_is_silent_and_keeps_the_exit_code():
    # `torch-ext check ... --json | head -0`: the reader is gone before anything is written.
    proc = subprocess.Popen([sys.executable, "-m", "torch_ext", "check", "factories:mlp", "--steps", "2", "--json"],
                            cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0
    assert "BrokenPipe" not in err and "Exception ignored" not in err and "Traceback" not in err


# ---------------------------------------------------------------- install
FAKE_PYTHON = """#!/usr/bin/env bash
# python3, except that pip's record of torch is $FAKE_TORCH (unset: no torch).
if [ "$1" = -c ] && [[ "$2" == *'version("torch")'* ]]; then
  [ -n "${FAKE_TORCH:-}" ] || exit 1
  case "$2" in *'"torch=="'*) echo "torch==$FAKE_TORCH" ;; *) echo "$FAKE_TORCH" ;; esac
  exit 0
fi
exec python3 "$@"
"""


def install_dry_run(tmp_path, torch_version, *args, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("CI", "PIP_CONSTRAINT")}
    environ.update(PYTHON=str(fake), **env)
    if torch_version:
        environ["FAKE_TORCH"] = torch_version
    return subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--dry-run", *args], env=environ,
                          capture_output=True, text=True, timeout=120)


def pip_commands(out):
    return [ln for ln in out.splitlines() if ln.startswith("+ ") and " pip " in ln]


def test_install_keeps_an_installed_supported_torch(tmp_path):
    r = install_dry_run(tmp_path, "2.10.0")
    assert r.returncode == 0, r.stderr
    assert "torch 2.10.0 found: kept" in r.stdout and "holding torch at 2.10.0" in r.stdout
    cmds = pip_commands(r.stdout)
    assert len(cmds) == 2 and not any("torch>=" in c for c in cmds)  # requirements, then the build
    assert all(" -c " in c and " -q" not in c for c in cmds)  # pinned to the torch found, progress visible
    assert "-v --no-build-isolation --no-deps" in cmds[1] and cmds[1].endswith("-e .")
    steps = re.findall(r"^==> \[(\d)/4\] ([^(]+)", r.stdout, re.M)
    assert [s[0] for s in steps] == ["1", "2", "3", "4"]


def test_install_installs_torch_only_when_missing(tmp_path):
    r = install_dry_run(tmp_path, None)
    assert r.returncode == 0, r.stderr
    assert "no torch found" in r.stdout
    assert any(c.endswith("pip install --progress-bar on torch>=2.9") for c in pip_commands(r.stdout))


def test_install_refuses_an_old_torch_without_touching_it(tmp_path):
    r = install_dry_run(tmp_path, "2.8.0")
    assert r.returncode == 2
    assert "torch 2.8.0 is installed, torch_ext needs torch >= 2.9" in r.stderr
    assert pip_commands(r.stdout) == []


def test_install_adds_test_dependencies_in_ci_only(tmp_path):
    assert "requirements-test.txt" not in install_dry_run(tmp_path, "2.9.1").stdout
    r = install_dry_run(tmp_path, "2.9.1", CI="true")
    assert "-r requirements.txt -r requirements-test.txt" in pip_commands(r.stdout)[0]
    r = install_dry_run(tmp_path, "2.9.1", "--only-test-deps")
    cmds = pip_commands(r.stdout)
    assert len(cmds) == 1 and cmds[0].endswith("-r requirements-test.txt")
    assert install_dry_run(tmp_path, "2.9.1", "--bogus").returncode == 2


def test_requirements_leave_torch_to_the_user_and_pins_to_ci():
    def names(path):
        return [re.split(r"[<>=\[; ]", ln.strip())[0].lower() for ln in (ROOT / path).read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]

    assert "torch" not in names("requirements.txt")
    assert {"pytest", "transformers", "transformer-lens"} <= set(names("requirements-test.txt"))
    assert "torch==2.9.1" in (ROOT / ".ci" / "constraints.txt").read_text().split()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'PIP_CONSTRAINT="$PWD/.ci/constraints.txt"' in ci and "bash scripts/install.sh" in ci
    assert " -q" not in (ROOT / "scripts" / "install.sh").read_text()


def test_batched_sweep_matches_one_at_a_time_and_says_it_builds(here, capsys):
    assert cli.main(["sweep", "factories:seq", "--positions", "--json", "--quiet"]) == 0
    single = strict_json(capsys.readouterr().out)
    assert cli.main(["sweep", "factories:seq", "--positions", "--batched", "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    batched = strict_json(captured.out)
    assert [r["metric"] for r in batched["metrics"]] == pytest.approx([r["metric"] for r in single["metrics"]])
    assert batched["measured_evaluations"] < single["measured_evaluations"]
    assert re.search(r"torch-ext: reactive sweep over 25 sites \(batched: .*\) \.\.\. done in", captured.err)


def test_an_error_inside_a_loop_ends_its_status_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "ragged.py").write_text(textwrap.dedent("""
        import torch
        def factory():  # the second batch has another shape than the example batch
            model = torch.nn.Linear(3, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            return model, opt, lambda m, x: m(x).sum(), (torch.randn(4, 3),), [(torch.randn(4, 3),), (torch.randn(5, 3),)]
    """))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["step", "ragged.py:factory", "--steps", "3", "--no-progress"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"torch-ext: training on the C\+\+ executor \(3 iterations\) \.\.\. failed", lines[-3]), lines
    assert lines[-2].startswith("torch-ext step: error: ValueError: batch[0]: expected shape (4, 3)")


def test_demo_heatmap_rows_name_the_module_that_wrote_each_residual():
    from torch_ext.models import TinyTransformer

    model = TinyTransformer().eval()
    rg = torch_ext.ReactiveGraph(model, (torch.randint(0, model.vocab, (1, model.seq)),))
    labels = cli._residual_labels(rg, rg.nodes("add*"))
    assert list(labels.values()) == ["add (embeddings)", "add_1 (after blocks.0.attn.proj)",
                                     "add_2 (after blocks.0.mlp.2)", "add_3 (after blocks.1.attn.proj)",
                                     "add_4 (after blocks.1.mlp.2)"]


@pytest.mark.parametrize("extra", [["--list"], ["--positions"]])
def test_sweep_compares_the_weights_by_content_once_not_once_per_node(here, monkeypatch, capsys, extra):
    """`sweep` read every matching node with rg.value(n), up to three times per node, and each value() compared
    every weight byte by content (~20 ms on GPT-2 small): the command paid that per node. It reads them with
    one rg.values(), and the command is one call chain (its demands and the sweep share the build's digest)."""
    import torch_ext.reactive as reactive

    seen = []
    digest = reactive._contents_digest

    def counting(tensors):
        if any(isinstance(t, torch.nn.Parameter) for t in tensors):
            seen.append(len(tensors))
        return digest(tensors)

    monkeypatch.setattr(reactive, "_contents_digest", counting)
    assert cli.main(["sweep", "factories:seq", "--sites", "*", "--quiet", *extra]) == 0
    capsys.readouterr()
    assert len(seen) == 1, seen  # the build's run: the command is one call chain, nothing writes in between
