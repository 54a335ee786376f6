"""Deployment: the pure step compiled with AOTInductor and run for 10 steps from C++ with no Python."""
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

from helpers import TransposedWeight

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(os.environ.get("TORCH_EXT_BUILD_DIR", ROOT / "build")) / "aoti_train"


@pytest.fixture(autouse=True)
def runner_threads_like_this_process(monkeypatch):
    """The C++ runner (libtorch reads OMP_NUM_THREADS at start) runs with this process's intra-op thread count: the
    package's kernels reduce in an order that depends on it, so the runner's losses equal load_step's bit for bit
    only at the same count. Another test file in the same worker (pytest-xdist) may have set it to 1: the runner,
    on every core, then differed from load_step in the last bits of a loss (1.26656473 against 1.26656461)."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))


def assert_same_state(got, want):
    """Every entry of two TrainStates bit for bit, and what a state carries besides (scheduler epoch,
    fingerprint, unstepped)."""
    for part in ("params", "buffers", "opt"):
        g, w = getattr(got, part), getattr(want, part)
        assert list(g) == list(w), part
        for k in w:
            assert torch.equal(g[k], w[k]) and g[k].dtype == w[k].dtype, f"{part}[{k!r}]: {g[k]} != {w[k]}"
    assert len(got.lr) == len(want.lr) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got.lr, want.lr))
    assert (got.rng is None) == (want.rng is None) and (got.rng is None or torch.equal(got.rng, want.rng))
    assert (got.sched_epoch, got.fingerprint, tuple(got.unstepped)) == (want.sched_epoch, want.fingerprint,
                                                                       tuple(want.unstepped))


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
@pytest.mark.parametrize("donate", [False, True], ids=["returning", "donating"])
def test_aoti_package_runs_10_steps_from_cpp(tmp_path, donate):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(10)]
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    # The flat layout rides in the package's metadata; a donating package returns only the loss and
    # writes the new state into the state's tensors, which the runner must carry to the next call.
    package = step.to_aoti(str(tmp_path / "step.pt2"), donate=donate)

    state = step.init_state()
    torch.save(state.state_dict(), tmp_path / "state.pt")  # the checkpoint format, nothing else
    torch.save([list(b) for b in batches], tmp_path / "batches.pt")

    py_losses = []
    for b in batches:
        loss, state = step(state, *b)
        py_losses.append(loss.item())
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt"),
                          "--save-state", str(tmp_path / "trained.pt")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    cpp_losses = [float(line) for line in run.stdout.split()]
    assert len(cpp_losses) == 10
    # --save-state: the state after the last update (AdamW's moments and step counts included) is what
    # load_step leaves after the same 10 calls of the same package, bit for bit.
    loaded = torch_ext.load_step(package)
    s = loaded.load_state(tmp_path / "state.pt")
    for b in batches:
        s = loaded(s, *b)[1]
    trained = loaded.load_state(tmp_path / "trained.pt")
    assert_same_state(trained, s)
    assert float(trained.opt["opt:model.0.weight:step"]) == 10
    # Resumed from a state saved after 4 calls, 6 more calls continue exactly: the same losses and state.
    torch.save([list(b) for b in batches[:4]], tmp_path / "first.pt")
    torch.save([list(b) for b in batches[4:]], tmp_path / "rest.pt")
    first = subprocess.run([str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "first.pt"),
                            "--save-state", str(tmp_path / "mid.pt")], capture_output=True, text=True, timeout=300)
    rest = subprocess.run([str(RUNNER), package, str(tmp_path / "mid.pt"), str(tmp_path / "rest.pt"),
                           "--save-state", str(tmp_path / "resumed.pt")], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and rest.returncode == 0, first.stderr[-2000:] + rest.stderr[-2000:]
    assert [float(v) for v in (first.stdout + rest.stdout).split()] == cpp_losses
    assert_same_state(loaded.load_state(tmp_path / "resumed.pt"), trained)
    s = loaded.load_state(tmp_path / "mid.pt")  # and in Python from the C++ runner's state
    for b in batches[4:]:
        s = loaded(s, *b)[1]
    assert_same_state(s, trained)
    # Inductor fuses the forward/backward kernels, so agreement is to float32 rounding, not bitwise.
    torch.testing.assert_close(torch.tensor(cpp_losses), torch.tensor(py_losses), rtol=1e-5, atol=1e-6)
    assert cpp_losses[-1] < cpp_losses[0]
    # torch.save keeps a transposed tensor transposed; the package's kernels assume contiguous inputs.
    transposed = step.init_state().state_dict()
    w = transposed["params"]["model.0.weight"]
    transposed["params"]["model.0.weight"] = w.t().contiguous().t()
    torch.save(transposed, tmp_path / "transposed.pt")
    torch.save([[b[0].t().contiguous().t(), b[1]] for b in batches], tmp_path / "transposed_batches.pt")
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "transposed.pt"), str(tmp_path / "transposed_batches.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [float(line) for line in run.stdout.split()] == cpp_losses
    if donate:
        # Two donated entries sharing memory would overwrite each other's new values: refused.
        shared = step.init_state().state_dict()
        shared["opt"]["opt:model.0.weight:exp_avg_sq"] = shared["opt"]["opt:model.0.weight:exp_avg"]
        torch.save(shared, tmp_path / "shared.pt")
        run = subprocess.run([str(RUNNER), package, str(tmp_path / "shared.pt"), str(tmp_path / "batches.pt")],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and "share memory" in run.stderr, run.stderr


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
@pytest.mark.parametrize("donate", [False, True], ids=["returning", "donating"])
def test_cpp_runner_feeds_a_transposed_parameter_in_its_compiled_strides(tmp_path, donate):
    # A transposed nn.Parameter (strides (1, 8)) and its Adam moments are compiled in those strides and
    # recorded in the metadata; a checkpoint holding them contiguous is copied into them by the runner, as
    # by load_step: the same losses and trained state, bit for bit (fed as they are, the package would read
    # the weight permuted: with load_step's copy disabled, test_load_step's transposed case was 0.27 off).
    model = TransposedWeight()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = torch_ext.make_train_step(model, torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn, batches[0])
    package = step.to_aoti(str(tmp_path / "step.pt2"), donate=donate)
    meta = torch._inductor.aoti_load_package(package).get_metadata()
    assert meta["torch_ext.input_strides"].split("\n").count("2:1,8") == 3, meta["torch_ext.input_strides"]
    s = step.init_state()
    contiguous = s.replace({k: v.contiguous() for part in (s.params, s.opt) for k, v in part.items()})
    torch.save(contiguous.state_dict(), tmp_path / "state.pt")
    torch.save([list(b) for b in batches], tmp_path / "batches.pt")
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt"),
                          "--save-state", str(tmp_path / "trained.pt")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = torch_ext.load_step(package)
    state, losses = step.init_state(), []
    for b in batches:
        loss, state = loaded(state, *b)
        losses.append(loss.item())
    assert [float(line) for line in run.stdout.split()] == [float(f"{x:.9g}") for x in losses]
    assert_same_state(loaded.load_state(tmp_path / "trained.pt"), state)


def _runner_trains_as_load_step(tmp_path, model, batches, expected_stride_line, **to_aoti):
    """Compiles ``model``'s step with ``to_aoti(**to_aoti)``, checks the package records
    ``expected_stride_line`` among its input strides, and trains it from one contiguous checkpoint with
    load_step and with the C++ runner: the same losses, bit for bit."""
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, batches[0])
    package = step.to_aoti(str(tmp_path / "strided.pt2"), **to_aoti)
    meta = torch._inductor.aoti_load_package(package).get_metadata()
    assert expected_stride_line in meta["torch_ext.input_strides"].split("\n"), meta["torch_ext.input_strides"]
    state = step.init_state()
    torch.save(state.state_dict(), tmp_path / "state.pt")
    torch.save([list(b) for b in batches], tmp_path / "batches.pt")
    loaded = torch_ext.load_step(package)
    py_losses = []
    for b in batches:
        loss, state = loaded(state, *b)
        py_losses.append(loss.item())
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [float(line) for line in run.stdout.split()] == [float(f"{x:.9g}") for x in py_losses]


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
@pytest.mark.parametrize("donate", [False, True], ids=["returning", "donating"])
def test_cpp_runner_feeds_a_channels_last_package_its_compiled_strides(tmp_path, donate):
    # to_aoti(channels_last=True) records each input's strides in the package metadata; the runner
    # copies the checkpoint's contiguous entries into them (the package's kernels would index them
    # unchecked) and trains as load_step does on the same package: the same losses, bit for bit.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(5)]
    # the 8x3x3x3 weight, channels-last
    _runner_trains_as_load_step(tmp_path, model, batches, "4:27,1,9,3", donate=donate, channels_last=True)


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
@pytest.mark.parametrize("donate", [False, True], ids=["returning", "donating"])
def test_cpp_runner_feeds_a_tap_major_package_its_compiled_strides(tmp_path, donate):
    # A convolution on a 2x2 input (fewer positions than its 9 taps) is compiled as tap GEMMs with its
    # weight and AdamW moments held tap-major (torch_ext/_conv_taps.py); the runner copies the contiguous
    # checkpoint into those strides as load_step does.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, stride=4), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(5)]
    # the 8x8x3x3 weight of the 2x2 convolution, tap-major: W[:, :, a, b] one contiguous 8x8 block
    _runner_trains_as_load_step(tmp_path, model, batches, "4:8,1,192,64", donate=donate)


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_cpp_runner_refuses_a_batch_of_another_dtype_or_shape(tmp_path):
    # The package's kernels read each batch tensor with its compiled dtype and shape, unchecked: a
    # float64 batch was read as float32 bits, and a last partial batch (a slice of a full one, whose
    # whole storage torch.save keeps) as the full batch, both training on silently (exit 0).
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 3))  # an Inductor kernel reads x first, not an extern GEMM
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     lambda m, x, y: F.cross_entropy(m(x), y), (torch.randn(5, 6), torch.zeros(5).long()))
    package = step.to_aoti(str(tmp_path / "step.pt2"))
    torch.save(step.init_state().state_dict(), tmp_path / "state.pt")
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    cases = {"ok": [x, y], "double": [x.double(), y], "partial": [x[:3], y[:3]], "extra": [x, y, y]}
    runs = {}
    for name, batch in cases.items():
        torch.save([batch], tmp_path / f"{name}.pt")
        runs[name] = subprocess.run([str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / f"{name}.pt")],
                                    capture_output=True, text=True, timeout=300)
    assert runs["ok"].returncode == 0, runs["ok"].stderr[-3000:]
    assert runs["double"].returncode == 2, runs["double"].stdout
    assert "batch tensor 0 has dtype:shape Double:5,6" in runs["double"].stderr
    assert "compiled for Float:5,6" in runs["double"].stderr
    assert runs["partial"].returncode == 2, runs["partial"].stdout
    assert "batch tensor 0 has dtype:shape Float:3,6" in runs["partial"].stderr
    assert runs["extra"].returncode == 2 and "batch has 3 tensors" in runs["extra"].stderr, runs["extra"].stderr


class _ShiftThenConv(nn.Module):
    """An Inductor kernel reads the image first (an extern convolution would take any strides)."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x):
        x = torch.tanh(x * 1.5 + torch.arange(6.0))  # the shift differs along W: a permuted read shows
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_a_channels_last_example_batch_is_fed_in_its_compiled_strides(tmp_path):
    # AOTInductor compiles a batch input for the example batch's strides (here channels-last images)
    # and reads it so, unchecked. load_step and the C++ runner fed it contiguous: both trained on
    # permuted pixels, silently (losses 1e-3 off the executor's). The package now records them.
    torch.manual_seed(0)
    model = _ShiftThenConv()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last),
                torch.randint(0, 3, (2,), generator=g)) for _ in range(3)]
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     lambda m, x, y: F.cross_entropy(m(x), y), batches[0])
    package = step.to_aoti(str(tmp_path / "step.pt2"), channels_last=False)  # no channels-last weights
    loaded = torch_ext.load_step(package)
    want, got = [], []
    state = loaded_state = step.init_state()
    torch.save(state.state_dict(), tmp_path / "state.pt")
    for x, y in batches:
        loss, state = step(state, x, y)
        want.append(loss.item())
        loss, loaded_state = loaded(loaded_state, x, y)
        got.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    torch.save([list(b) for b in batches], tmp_path / "batches.pt")
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [float(line) for line in run.stdout.split()] == [float(f"{x:.9g}") for x in got]


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_cpp_runner_refuses_a_state_of_another_program(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(3, 4), torch.randint(0, 2, (3,)))
    step = torch_ext.make_train_step(model, opt, loss_fn, batch)
    package = step.to_aoti(str(tmp_path / "step.pt2"))
    other = torch_ext.make_train_step(model, opt, loss_fn, batch, clip_grad_norm=1.0)
    torch.save(other.init_state().state_dict(), tmp_path / "other.pt")
    torch.save([list(batch)], tmp_path / "batches.pt")
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "other.pt"), str(tmp_path / "batches.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "was made by a different program" in run.stderr, run.stderr


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_cpp_runner_refuses_a_scheduled_package_unless_told_the_lr_stays_constant(tmp_path):
    # The package takes the lr as an input and does not advance it (the scheduler is Python). Before,
    # the runner trained every call at the state's lr where the step followed the schedule, silently.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batch = (torch.randn(3, 4), torch.randint(0, 2, (3,)))
    step = torch_ext.make_train_step(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), batch, scheduler=sched)
    package = step.to_aoti(str(tmp_path / "step.pt2"))
    torch.save(step.init_state().state_dict(), tmp_path / "state.pt")
    torch.save([list(batch)] * 2, tmp_path / "batches.pt")
    args = [str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "built with scheduler=" in run.stderr and "--constant-lr" in run.stderr, run.stderr
    run = subprocess.run(args + ["--constant-lr"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.stdout.split()) == 2


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_cpp_runner_follows_a_schedule_given_as_per_call_lrs(tmp_path):
    # --lrs feeds each call the lr the step's scheduler gives (step.lr_schedule): the runner's losses
    # are those of the same package loaded in Python with the scheduler, call for call.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batches = [(torch.randn(3, 4), torch.randint(0, 2, (3,))) for _ in range(4)]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], scheduler=sched)
    package = step.to_aoti(str(tmp_path / "step.pt2"))
    state = step.init_state()
    lrs = step.lr_schedule(state, len(batches))
    assert lrs == [[0.5], [0.25], [0.125], [0.0625]]
    torch.save(state.state_dict(), tmp_path / "state.pt")
    torch.save([list(b) for b in batches], tmp_path / "batches.pt")
    torch.save(lrs, tmp_path / "lrs.pt")
    args = [str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt")]
    run = subprocess.run(args + ["--lrs", str(tmp_path / "lrs.pt")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    fresh = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.5), step_size=1,
                                            gamma=0.5)
    loaded = torch_ext.load_step(package, scheduler=fresh)
    s, want = state, []
    for b in batches:
        loss, s = loaded(s, *b)[:2]
        want.append(float(loss))
    assert [float(v) for v in run.stdout.split()] == pytest.approx(want, rel=1e-6, abs=0)
    # --save-state: the state holds the schedule's epoch and the lr of the next call, as load_step's does,
    # so it resumes under the scheduler (a state with the last call's lr at epoch 4 is refused there).
    torch.save(step.lr_schedule(state, len(batches) + 1), tmp_path / "lrs5.pt")
    saved = subprocess.run(args + ["--lrs", str(tmp_path / "lrs5.pt"), "--save-state", str(tmp_path / "out.pt")],
                           capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0 and saved.stdout == run.stdout, saved.stderr[-3000:]
    trained = loaded.load_state(tmp_path / "out.pt")
    assert trained.sched_epoch == 4 and [float(t) for t in trained.lr] == [0.03125]
    assert_same_state(trained, s)
    assert torch.equal(loaded(trained, *batches[0])[0], loaded(s, *batches[0])[0])
    no_next = subprocess.run(args + ["--lrs", str(tmp_path / "lrs.pt"), "--save-state", str(tmp_path / "no.pt")],
                             capture_output=True, text=True, timeout=300)
    assert no_next.returncode == 2 and "step.input_schedule(state, 5)" in no_next.stderr, no_next.stderr
    assert not (tmp_path / "no.pt").exists()
    kept = subprocess.run(args + ["--constant-lr", "--save-state", str(tmp_path / "kept.pt")], capture_output=True,
                          text=True, timeout=300)  # manual_lr=True's state: the epoch and lr as given
    assert kept.returncode == 0, kept.stderr[-3000:]
    kept = loaded.load_state(tmp_path / "kept.pt")
    assert kept.sched_epoch == 0 and [float(t) for t in kept.lr] == [0.5]
    constant = subprocess.run(args + ["--constant-lr"], capture_output=True, text=True, timeout=300)
    assert [float(v) for v in constant.stdout.split()] != [float(v) for v in run.stdout.split()]
    torch.save(lrs[:2], tmp_path / "short.pt")
    short = subprocess.run(args + ["--lrs", str(tmp_path / "short.pt")], capture_output=True, text=True, timeout=300)
    assert short.returncode == 2 and "has lrs for 2 calls" in short.stderr, short.stderr


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
                                      lambda ps: torch.optim.AdamW(ps, lr=1e-2)], ids=["sgd_nesterov", "adamw"])
def test_cpp_runner_follows_a_schedule_that_cycles_momentum(tmp_path, make_opt):
    # OneCycleLR with its default cycle_momentum=True: the package takes the momentum (beta1) as an
    # input, like the lr; step.input_schedule gives both per call, and the runner's losses are those of
    # the package loaded in Python with a fresh scheduler, which follows the executor's step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fresh_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def sched_of(o):
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=12)

    opt = make_opt(model.parameters())
    batches = [(torch.randn(3, 4), torch.randint(0, 2, (3,))) for _ in range(8)]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], scheduler=sched_of(opt))
    package = step.to_aoti(str(tmp_path / "step.pt2"))
    state = step.init_state()
    fed = "opt:beta1:group0" if isinstance(opt, torch.optim.AdamW) else "opt:momentum:group0"
    schedule = step.input_schedule(state, len(batches))
    assert set(schedule[0]) == {"opt:lr:group0", fed}
    assert len({row[fed] for row in schedule}) == len(batches)  # the momentum changes every call
    torch.save(state.state_dict(), tmp_path / "state.pt")
    torch.save([list(b) for b in batches], tmp_path / "batches.pt")
    torch.save(schedule, tmp_path / "inputs.pt")
    args = [str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt")]
    run = subprocess.run(args + ["--lrs", str(tmp_path / "inputs.pt")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = torch_ext.load_step(package, scheduler=sched_of(make_opt(fresh_model.parameters())))
    s, live, want, exact = state, state, [], []
    for b in batches:
        loss, s = loaded(s, *b)[:2]
        live_loss, live = step(live, *b)
        want.append(float(loss))
        exact.append(float(live_loss))
    assert float(s.opt[fed]) == float(live.opt[fed])
    assert [float(v) for v in run.stdout.split()] == pytest.approx(want, rel=1e-6, abs=0)
    # --save-state holds the scheduled momentum of the next call too, as load_step's state does.
    torch.save(step.input_schedule(state, len(batches) + 1), tmp_path / "inputs9.pt")
    saved = subprocess.run(args + ["--lrs", str(tmp_path / "inputs9.pt"), "--save-state", str(tmp_path / "out.pt")],
                           capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert_same_state(loaded.load_state(tmp_path / "out.pt"), s)
    assert want == pytest.approx(exact, rel=1e-5, abs=0)
    # A list of lrs alone gives no momentum: refused, naming the input.
    torch.save(step.lr_schedule(state, len(batches)), tmp_path / "lrs.pt")
    short = subprocess.run(args + ["--lrs", str(tmp_path / "lrs.pt")], capture_output=True, text=True, timeout=300)
    assert short.returncode != 0 and f"gives no value for '{fed}'" in short.stderr, short.stderr


class _Keyed(nn.Module):
    """Two batch tensors of one shape and dtype, told apart only by their keys."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 7)

    def forward(self, tokens, targets):
        return F.cross_entropy(self.head(self.emb(tokens)).flatten(0, 1), targets.flatten())


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_cpp_runner_matches_dict_batches_by_key(tmp_path):
    # The runner fed a call's tensors by position: a loader whose dicts list "targets" before "tokens"
    # (same shape and dtype) trained on swapped inputs, silently. It now matches them by the key paths
    # the package records (torch_ext.batch_paths), and refuses a flat list for a keyed batch.
    torch.manual_seed(0)
    model = _Keyed()
    g = torch.Generator().manual_seed(1)
    batches = [{"tokens": torch.randint(0, 7, (3, 5), generator=g), "targets": torch.randint(0, 7, (3, 5), generator=g)}
               for _ in range(3)]
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), lambda m, b: m(**b),
                                     (batches[0],))
    package = step.to_aoti(str(tmp_path / "step.pt2"))
    loaded = torch_ext.load_step(package)
    state = step.init_state()
    torch.save(state.state_dict(), tmp_path / "state.pt")
    want = []
    for b in batches:
        loss, state = loaded(state, b)
        want.append(loss.item())
    reordered = [{"targets": b["targets"], "tokens": b["tokens"]} for b in batches]
    args = [str(RUNNER), package, str(tmp_path / "state.pt")]
    for name, value in {"dicts": reordered, "lists_of_dicts": [[b] for b in reordered]}.items():
        torch.save(value, tmp_path / f"{name}.pt")
        run = subprocess.run(args + [str(tmp_path / f"{name}.pt")], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert [float(line) for line in run.stdout.split()] == [float(f"{x:.9g}") for x in want], name
    refused = {"flat_list": ([list(b.values()) for b in reordered], "missing [0]['tokens'], [0]['targets']"),
               "other_key": ([{"tokens": b["tokens"], "labels": b["targets"]} for b in batches],
                             "missing [0]['targets']; not in the example: [0]['labels']")}
    for name, (value, message) in refused.items():
        torch.save(value, tmp_path / f"{name}.pt")
        run = subprocess.run(args + [str(tmp_path / f"{name}.pt")], capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and message in run.stderr and run.stdout == "", (name, run.stderr)


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_cpp_runner_refuses_a_state_entry_of_another_dtype_or_shape(tmp_path):
    # The package's kernels read state entries unchecked: a float32 lr (written by hand into a state
    # dict) was read as float64 and the runner trained at a garbage lr, exit 0. The package records
    # every state input's dtype and shape (torch_ext.state) and the runner refuses, naming the entry.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     lambda m, x, y: F.cross_entropy(m(x), y), (x, y))
    package = step.to_aoti(str(tmp_path / "step.pt2"))
    torch.save([[x, y]] * 2, tmp_path / "batches.pt")
    good = step.init_state().state_dict()
    bad = {"lr_float32": ("lr", None, [torch.tensor(0.1, dtype=torch.float32)], "'opt:lr:group0' has dtype:shape Float:"),
           "weight_reshaped": ("params", "model.0.weight", good["params"]["model.0.weight"].reshape(8, 16),
                               "'model.0.weight' has dtype:shape Float:8,16, "),
           "moment_half": ("opt", "opt:model.0.weight:momentum_buffer", torch.zeros(16, 8, dtype=torch.float16),
                           "'opt:model.0.weight:momentum_buffer' has dtype:shape Half:16,8")}
    for name, (part, key, value, message) in bad.items():
        d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in good.items()}
        if key is None:
            d[part] = value
        else:
            d[part][key] = value
        torch.save(d, tmp_path / f"{name}.pt")
        run = subprocess.run([str(RUNNER), package, str(tmp_path / f"{name}.pt"), str(tmp_path / "batches.pt")],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and message in run.stderr and run.stdout == "", (name, run.stderr)
    torch.save(good, tmp_path / "good.pt")
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "good.pt"), str(tmp_path / "batches.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and len(run.stdout.split()) == 2, run.stderr


@pytest.mark.skipif(not RUNNER.exists(), reason=f"C++ runner not built at {RUNNER}")
def test_cpp_runner_prints_every_loss_of_an_accumulating_package(tmp_path):
    # An accumulate=2 step returns one loss per micro-batch: the runner printed loss.item() and exited 2 on
    # the first call ("a Tensor with 2 elements cannot be converted to Scalar").
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(6)]
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     lambda m, x, y: F.cross_entropy(m(x), y), batches[0], accumulate=2)
    package = step.to_aoti(str(tmp_path / "acc.pt2"))
    state = step.init_state()
    torch.save(state.state_dict(), tmp_path / "state.pt")
    calls = [list(batches[i]) + list(batches[i + 1]) for i in range(0, 6, 2)]
    torch.save(calls, tmp_path / "batches.pt")
    loaded = torch_ext.load_step(package)
    py_losses = []
    for c in calls:
        loss, state = loaded(state, *c)
        py_losses.extend(loss.tolist())
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [float(line) for line in run.stdout.split()] == [float(f"{x:.9g}") for x in py_losses]
    # torch.save(state) (a pickled Python TrainState) is not the runner's format: named, no C++ stack trace.
    torch.save(step.init_state(), tmp_path / "pickled.pt")
    run = subprocess.run([str(RUNNER), package, str(tmp_path / "pickled.pt"), str(tmp_path / "batches.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "pickled Python TrainState" in run.stderr and "state_dict()" in run.stderr, \
        run.stderr[-2000:]
    assert "frame #" not in run.stderr, run.stderr[-2000:]
