"""torch_ext.load_step: a saved pure step (.pt2 ExportedProgram, AOTInductor package, .onnx) back as a
callable over TrainStates, driven by the layout written into the artifact's metadata."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.deploy import LAYOUT_KEY

from helpers import TransposedWeight

ROOT = Path(__file__).resolve().parents[2]


class DropoutMLP(nn.Module):
    def __init__(self, p=0.2):
        super().__init__()
        self.l1, self.drop, self.l2 = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 3)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x):
        return self.l2(self.drop(torch.tanh(self.l1(x)))) * self.scale


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def batches(n=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def make(p=0.2, **kw):
    torch.manual_seed(0)
    model = DropoutMLP(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return torch_ext.make_train_step(model, opt, ce, batches(1)[0], **kw)


def run(fn, state, bs):
    losses = []
    for b in bs:
        loss, state = fn(state, *b)[:2]
        losses.append(loss)
    return torch.stack(losses), state


def assert_states_equal(a, b, atol=0.0):
    for part in ("params", "buffers", "opt"):
        da, db = getattr(a, part), getattr(b, part)
        assert set(da) == set(db), part
        for k in da:
            if atol == 0.0:
                assert torch.equal(da[k], db[k]), k
            else:
                torch.testing.assert_close(da[k], db[k], rtol=atol, atol=atol, msg=k)


def test_layout_is_in_the_exported_program_and_names_every_input():
    step = make()
    layout = json.loads(step.program.graph_module.meta["custom"][LAYOUT_KEY])
    placeholders = [n for n in step.program.graph.nodes if n.op == "placeholder"]
    assert len(layout["inputs"]) == len(placeholders)
    assert layout["inputs"][-2:] == ["batch:0", "batch:1"]
    assert "rng" in layout["inputs"] and "opt:lr:group0" in layout["inputs"]
    assert layout["outputs"] == ["loss", *step.state_names]
    assert layout["fingerprint"] == step.fingerprint
    assert layout["state"]["model.l1.weight"] == {"shape": [16, 8], "dtype": "torch.float32"}


def test_pt2_save_load_10_more_steps_bit_exact(tmp_path):
    step = make()
    bs = batches(20)
    _, state = run(step, step.init_state(seed=5), bs[:10])  # trained a while, then saved
    path = tmp_path / "step.pt2"
    torch.export.save(step.program, str(path))
    loaded = torch_ext.load_step(path)
    assert loaded.kind == "exported_program" and isinstance(loaded.runner, torch_ext.Executor)
    want_losses, want = run(step, state, bs[10:])
    got_losses, got = run(loaded, state, bs[10:])
    assert torch.equal(got_losses, want_losses)
    assert_states_equal(got, want)
    assert torch.equal(got.rng, want.rng)  # the random stream is state, not the global generator
    # The loaded step's states stay states of the same program: the live step takes them back.
    assert torch.equal(step(got, *bs[0])[0], loaded(got, *bs[0])[0])


def test_pt2_load_in_a_fresh_process_with_a_saved_state(tmp_path):
    step = make()
    bs = batches(10)
    state = step.init_state(seed=7)
    torch.export.save(step.program, str(tmp_path / "step.pt2"))
    torch.save(state, tmp_path / "state.pt")
    torch.save(bs, tmp_path / "batches.pt")
    want_losses, want = run(step, state, bs)
    script = textwrap.dedent(f"""
        import torch, torch_ext
        loaded = torch_ext.load_step({str(tmp_path / 'step.pt2')!r})
        state = torch.load({str(tmp_path / 'state.pt')!r}, weights_only=True)
        losses = []
        for b in torch.load({str(tmp_path / 'batches.pt')!r}, weights_only=True):
            loss, state = loaded(state, *b)
            losses.append(loss)
        torch.save((torch.stack(losses), state.state_dict()), {str(tmp_path / 'out.pt')!r})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got_losses, got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(got_losses, want_losses)
    for part in ("params", "buffers", "opt"):
        for k, v in getattr(want, part).items():
            assert torch.equal(got[part][k], v), k
    assert torch.equal(got["rng"], want.rng)


def test_aoti_package_loads_and_trains(tmp_path):
    # AOTInductor draws its own random stream (the issue only asks it to stay pure) and fuses
    # kernels, so: bit-exact with its own package driven by hand, within float32 rounding of the
    # executor without dropout, and pure with dropout.
    step = make(p=0.0)
    bs = batches(10)
    pkg = step.to_aoti(str(tmp_path / "step_aoti.pt2"))
    loaded = torch_ext.load_step(pkg)
    assert loaded.kind == "aoti"
    assert json.loads(loaded.runner.get_metadata()[LAYOUT_KEY])["fingerprint"] == step.fingerprint
    state = step.init_state()
    got_losses, got = run(loaded, state, bs)
    # by hand, with the flat layout of the live step
    raw = torch._inductor.aoti_load_package(pkg)
    flat = step.flat_inputs(state, *bs[0])
    n = len(step.state_names)
    hand = []
    for b in bs:
        flat = step.flat_inputs(state, *b)
        outs = raw(*flat)
        hand.append(outs[0])
        state = state.replace(dict(zip(step.state_names, outs[1:1 + n])))
    assert torch.equal(got_losses, torch.stack(hand))
    assert_states_equal(got, state)
    want_losses, want = run(step, step.init_state(), bs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)
    # AOTInductor indexes inputs with the contiguous strides it was compiled for, unchecked: a
    # transposed entry or batch (same values) trained something else (loss 1.088 for 1.103). A state
    # entry is copied into the compiled strides; a batch in another dense layout is refused, as by the
    # live step (eager's matmul on a transposed input rounds otherwise: train_step.in_layout_of).
    state = step.init_state()
    w = state.lookup("model.l1.weight")
    transposed = state.replace({"model.l1.weight": w.t().contiguous().t()})
    x, y = bs[0]
    loss, new = loaded(transposed, x, y)
    want_loss, want_new = loaded(state, x, y)
    assert torch.equal(loss, want_loss)
    assert_states_equal(new, want_new)
    with pytest.raises(ValueError, match=r"batch\[0\]: strides \(1, 4\) \(shape \(4, 8\)\), a memory layout other"):
        loaded(state, x.t().contiguous().t(), y)


def test_aoti_donating_package_updates_the_state_in_place(tmp_path):
    # to_aoti(donate=True): the package stores the new state into the state passed in (no state-sized
    # outputs per call), the same training as the plain package, and the old state is consumed.
    step = make(p=0.0)
    bs = batches(6)
    plain = torch_ext.load_step(step.to_aoti(str(tmp_path / "plain.pt2")))
    donating = torch_ext.load_step(step.to_aoti(str(tmp_path / "donating.pt2"), donate=True))
    layout = donating.layout
    assert sorted(layout["donated"]) == sorted(step.state_names) and layout["outputs"] == ["loss"]
    want_losses, want = run(plain, step.init_state(), bs)
    state = step.init_state()
    ptrs = {n: state.lookup(n).data_ptr() for n in step.state_names}
    before = state.lookup("model.l1.weight").clone()
    loss, new = donating(state, *bs[0])
    assert {n: new.lookup(n).data_ptr() for n in step.state_names} == ptrs  # written in place
    assert not torch.equal(new.lookup("model.l1.weight"), before)
    with pytest.raises(ValueError, match=r"was donated to load_step\(.*donating\.pt2'\) \(call 1\)"):
        donating(state, *bs[1])
    got_losses, got = run(donating, new, bs[1:])
    assert torch.equal(torch.cat([loss.reshape(1), got_losses]), want_losses)
    assert_states_equal(got, want)
    shared = step.init_state()
    shared.opt = dict(shared.opt)
    a, b = sorted(n for n in shared.opt if n.endswith(":exp_avg"))[:2]
    if shared.opt[a].shape == shared.opt[b].shape:
        shared.opt[b] = shared.opt[a]
    else:  # the same storage, another view: still refused
        shared.opt[b] = shared.opt[a].new_zeros(0).set_(shared.opt[a].untyped_storage(), 0, shared.opt[b].shape)
    with pytest.raises(ValueError, match="share memory") as refused:
        donating(shared, *bs[0])
    assert f"'{a}'" in str(refused.value) and f"'{b}'" in str(refused.value)
    assert shared.consumed_by is None
    # The package writes into an entry with the strides it was compiled for: a transposed one is
    # copied into those first, the copy updated and kept by the new state, the same training.
    transposed = step.init_state()
    w = transposed.lookup("model.l1.weight")
    transposed = transposed.replace({"model.l1.weight": w.t().contiguous().t()})
    loss_t, new_t = donating(transposed, *bs[0])
    assert transposed.consumed_by is not None and donating.converted_entries == 1
    assert new_t.lookup("model.l1.weight").is_contiguous()
    assert torch.equal(loss_t, want_losses[0])
    got_losses, got = run(donating, new_t, bs[1:])
    assert torch.equal(got_losses, want_losses[1:]) and donating.converted_entries == 1
    assert_states_equal(got, want)


def test_aoti_calls_reuse_the_memory_of_the_last_call(tmp_path):
    # LoadedStep runs a package in a CallPool (csrc/runtime/call_pool.h): from the second call on,
    # its allocations come from the blocks the last call freed, while every output the caller still
    # holds keeps its values; the result is the package's own, driven without the pool.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10))
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ce, (x, y))
    pkg = step.to_aoti(str(tmp_path / "pooled.pt2"))
    loaded = torch_ext.load_step(pkg)
    state = step.init_state()
    for k in range(5):  # training: the caller drops each old state
        loss, state = loaded(state, x, y)
        if k == 1:  # the first state returned is alive during the second call
            fresh = loaded.memory_stats()["fresh_blocks"]
    stats = loaded.memory_stats()
    assert stats["fresh_blocks"] == fresh  # nothing newly allocated from the third call on
    assert stats["reused_blocks"] > 0 and stats["cached_bytes"] > 0
    state = step.init_state()
    kept = []  # every loss and state, alive across later calls: fresh blocks for them
    for _ in range(4):
        loss, state = loaded(state, x, y)
        kept.append((loss, state))
    assert loaded.memory_stats()["fresh_blocks"] > fresh
    fresh = loaded.memory_stats()["fresh_blocks"]
    raw = torch._inductor.aoti_load_package(pkg)  # no pool
    state = step.init_state()
    n = len(step.state_names)
    for loss, got in kept:
        outs = raw(*step.flat_inputs(state, x, y))
        state = state.replace(dict(zip(step.state_names, outs[1:1 + n])))
        assert torch.equal(loss, outs[0])
        assert_states_equal(got, state)
    torch.empty(1 << 20)  # outside a call: not the pool's
    assert loaded.memory_stats()["fresh_blocks"] == fresh
    loaded.release_memory()
    assert loaded.memory_stats()["cached_bytes"] == 0
    loss, _ = loaded(kept[-1][1], x, y)
    assert torch.equal(loss, raw(*step.flat_inputs(kept[-1][1], x, y))[0])
    assert torch_ext.load_step(str(tmp_path / "pooled.pt2")).memory_stats()["cached_bytes"] == 0


def test_aoti_max_pool_backward_is_atens_and_the_lowering_is_put_back(tmp_path):
    # to_aoti compiles max_pool2d's backward as a call of ATen's kernel (Inductor's own lowering is a
    # scalar gather, 13-22x slower on ResNet-18's first pool), and only inside to_aoti.
    from torch._inductor import lowering

    op = torch.ops.aten.max_pool2d_with_indices_backward.default
    before = lowering.lowerings[op]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 5))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, (x, y))
    seen = []
    real = torch._inductor.aoti_compile_and_package

    def spy(program, **kw):
        seen.append(lowering.lowerings[op])
        return real(program, **kw)

    torch._inductor.aoti_compile_and_package = spy
    try:
        loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "pool.pt2")))
    finally:
        torch._inductor.aoti_compile_and_package = real
    assert len(seen) == 1 and seen[0] is not before
    assert lowering.lowerings[op] is before
    import zipfile

    with zipfile.ZipFile(tmp_path / "pool.pt2") as z:
        code = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".cpp"))
    assert "aoti_torch_cpu_max_pool2d_with_indices_backward(" in code
    got_losses, got = run(loaded, step.init_state(), [(x, y)] * 4)
    want_losses, want = run(step, step.init_state(), [(x, y)] * 4)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)

    def failing(program, **kw):
        raise RuntimeError("compile failed")

    torch._inductor.aoti_compile_and_package = failing
    try:
        with pytest.raises(RuntimeError, match="compile failed"):
            step.to_aoti(str(tmp_path / "never.pt2"))
    finally:
        torch._inductor.aoti_compile_and_package = real
    assert lowering.lowerings[op] is before


class DropoutProbe(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.l1, self.drop = nn.Linear(16, 256), nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.l1(x))


def test_aoti_dropout_is_fused_pure_and_draws_from_the_state(tmp_path, monkeypatch):
    # to_aoti hands Inductor each dropout as a seed drawn from the explicit state (torch_ext::rng_seed)
    # and a counter-based hash stream, fused with the mask and the scale (torch_ext/_aoti.py). The C++
    # native_dropout_rng was an opaque kernel there (about 10% of the GPT-2 benchmark step).
    torch.manual_seed(0)
    p = 0.25
    model = DropoutProbe(p)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))

    def loss_fn(m, x):
        out = m(x)
        return out.square().mean(), out.detach()

    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, (x,))
    programs = []
    real = torch._inductor.aoti_compile_and_package

    def spy(program, **kw):
        programs.append(program)
        return real(program, **kw)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", spy)
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "drop.pt2")))
    targets = {str(n.target) for n in programs[0].graph.nodes if n.op == "call_function"}
    assert "torch_ext.native_dropout_rng.default" not in targets, sorted(targets)
    assert "torch_ext.rng_seed.default" in targets, sorted(targets)
    state = step.init_state(seed=5)
    before = torch.get_rng_state()
    loss1, new1, out1 = loaded(state, x)
    loss2, new2, out2 = loaded(state, x)
    assert torch.equal(torch.get_rng_state(), before), "the package read the global generator"
    assert torch.equal(loss1, loss2) and torch.equal(out1, out2) and torch.equal(new1.rng, new2.rng)
    assert not torch.equal(new1.rng, state.rng), "the RNG state did not advance"
    kept = out1 != 0
    assert abs(float(1 - kept.float().mean()) - p) < 0.02  # 16384 draws: sd 0.0034
    w, b = state.lookup("model.l1.weight"), state.lookup("model.l1.bias")
    torch.testing.assert_close(out1[kept], (F.linear(x, w, b) / (1 - p))[kept], rtol=1e-5, atol=1e-6)
    _, _, out3 = loaded(step.init_state(seed=6), x)  # another state, another mask
    _, _, out4 = loaded(new1, x)  # the next step's mask differs from this one's
    assert not torch.equal(out3 != 0, kept) and not torch.equal(out4 != 0, kept)


class EmptyCacheAttention(nn.Module):
    """Hugging Face's attention without a past: cat([empty cache, k]) before q @ k^T."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        k = torch.cat([k.new_zeros(b, 2, 0, 8), k], dim=-2)
        att = (q @ k.transpose(-1, -2) * 0.35).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(b, s, 16)


def test_aoti_lowers_a_view_after_an_empty_cache_cat(tmp_path):
    # torch 2.9's Inductor turns cat([empty, k]) into k.clone() with k's strides, and the view export
    # recorded after it failed to lower (the HF GPT-2 benchmark step did); to_aoti hands it reshapes.
    torch.manual_seed(0)
    model = EmptyCacheAttention()
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(2, 8, 16, generator=g),) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch_ext.make_train_step(model, opt, lambda m, x: m(x).pow(2).mean(), xs[0])
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "attn.pt2")))
    got_losses, got = run(loaded, step.init_state(), xs)
    want_losses, want = run(step, step.init_state(), xs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out.mean(1)) + c.sum(0).mean(-1, keepdim=True)


def test_aoti_lstm_step_runs_and_agrees_with_the_step(tmp_path):
    # The step traces eager's CPU LSTM (aten.mkldnn_rnn_layer and its backward, _compat.eager_onednn_lstm). The
    # package failed at run time: torch 2.9's AOTInductor proxy executor passed the backward's empty batch_sizes as
    # None ("Expected IntList but got None"), and ATen's forward, run with grad mode off there, returned no
    # workspace for it. to_aoti calls torch_ext's ops of the same kernels (csrc/ops/onednn_rnn.h) instead.
    torch.manual_seed(0)
    model = LSTMClassifier()
    g = torch.Generator().manual_seed(3)
    bs = [(torch.randn(4, 5, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, bs[0])
    assert {n.target for n in step.program.graph.nodes} >= {torch.ops.aten.mkldnn_rnn_layer.default,
                                                           torch.ops.aten.mkldnn_rnn_layer_backward.default}
    package = step.to_aoti(str(tmp_path / "lstm.pt2"))
    loaded = torch_ext.load_step(package)
    got_losses, got = run(loaded, step.init_state(), bs)
    want_losses, want = run(step, step.init_state(), bs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)
    # the C++ runner (no Python) runs it too: it links torch_ext_core, which defines the ops
    runner = Path(os.environ.get("TORCH_EXT_BUILD_DIR", ROOT / "build")) / "aoti_train"
    if runner.exists():
        torch.save(step.init_state().state_dict(), tmp_path / "state.pt")
        torch.save([list(b) for b in bs], tmp_path / "batches.pt")
        cpp = subprocess.run([str(runner), package, str(tmp_path / "state.pt"), str(tmp_path / "batches.pt")],
                             capture_output=True, text=True, timeout=300)
        assert cpp.returncode == 0, cpp.stderr[-3000:]
        torch.testing.assert_close(torch.tensor([float(v) for v in cpp.stdout.split()]), want_losses, rtol=1e-5,
                                   atol=1e-6)
    # the executor's program keeps ATen's ops (bit-exact with eager)
    assert torch.ops.torch_ext.mkldnn_rnn_layer.default not in {n.target for n in step.program.graph.nodes}


class SmallCNN(nn.Module):
    # 3x3 and 1x1 convolutions (a 1x1 weight is channels-last and contiguous at once, in two spellings)
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.c3 = nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.Conv2d(16, 16, 1, bias=False)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 3, 2, 1)
        x = self.c3(F.relu(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def test_aoti_channels_last_package_converts_a_contiguous_state_once(tmp_path):
    # to_aoti(channels_last=True): conv weights and their AdamW moments are compiled channels-last.
    # AOTInductor indexes inputs with the compiled strides, unchecked: the package driven by hand on
    # the contiguous state trains something else, so load_step copies such a state into the compiled
    # strides on its first call (bit-identical to a state converted beforehand), and the new state
    # keeps them (no copy on later calls); torch.save and the executor see the same values.
    torch.manual_seed(0)
    model = SmallCNN()
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(4)]
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, bs[0])
    pkg = step.to_aoti(str(tmp_path / "cl.pt2"), channels_last=True)
    loaded = torch_ext.load_step(pkg)
    layout = loaded.layout
    strides = dict(zip(layout["inputs"], map(tuple, layout["input_strides"])))
    weights = ["model.c1.weight", "model.c2.weight", "model.c3.weight"]
    chosen = weights + [f"opt:{w}:{s}" for w in weights for s in ("exp_avg", "exp_avg_sq")]
    state = step.init_state()
    for name in layout["inputs"]:
        if name.startswith("batch:"):
            continue
        want = torch.empty_like(state.lookup(name), memory_format=torch.channels_last if name in chosen
                                else torch.contiguous_format).stride()
        assert strides[name] == want, name
    assert all(not state.lookup(n).is_contiguous(memory_format=torch.channels_last) for n in chosen[:2])

    def in_compiled_strides(s):
        return s.replace({n: torch.empty_strided(s.lookup(n).shape, strides[n]).copy_(s.lookup(n)) for n in chosen})

    x, y = bs[0]
    want_loss, want_new = torch_ext.load_step(pkg)(in_compiled_strides(state), x, y)
    loss, new = loaded(state, x, y)
    assert loaded.converted_entries == len(chosen)
    assert torch.equal(loss, want_loss)
    assert_states_equal(new, want_new)
    assert all(new.lookup(n).stride() == strides[n] for n in chosen)
    # the conversion is what makes it right: the raw package on the contiguous state
    raw = torch._inductor.aoti_load_package(pkg)
    raw_new = dict(zip(step.state_names, raw(*step.flat_inputs(state, x, y))[1:]))
    assert not all(torch.equal(raw_new[n], new.lookup(n)) for n in chosen)
    got_losses, got = run(loaded, new, bs[1:])
    assert loaded.converted_entries == len(chosen)  # the package's own state: no copy
    want_losses, want = run(step, step.init_state(), bs)
    torch.testing.assert_close(torch.cat([loss.reshape(1), got_losses]), want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)
    # a channels-last state saves and loads with the same values, and trains on bit-identically
    torch.save(got.state_dict(), tmp_path / "state.pt")
    back = step.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert_states_equal(back, got)
    assert torch.equal(loaded(back, x, y)[0], loaded(got, x, y)[0])
    # The executor takes a state in the strides the program was traced with (a copy), as it takes a
    # batch: bit-identical to the contiguous state eager's contiguous model holds.
    flat = back.replace({n: back.lookup(n).contiguous() for n in chosen})
    l1, s1 = step(back, x, y)
    l2, s2 = step(flat, x, y)
    assert torch.equal(l1, l2)
    assert_states_equal(s1, s2)
    # donating: the first call's copies receive the update and become the new state
    donating = torch_ext.load_step(step.to_aoti(str(tmp_path / "cl_don.pt2"), donate=True, channels_last=True))
    state = step.init_state()
    d_losses, d_state = run(donating, state, bs)
    assert donating.converted_entries == len(chosen)
    assert state.lookup("model.c1.weight").is_contiguous()  # the caller's tensor was not written
    torch.testing.assert_close(d_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(d_state, want, atol=1e-5)
    with pytest.raises(TypeError, match="channels_last must be a bool or 'auto', got str 'yes'"):
        step.to_aoti(str(tmp_path / "never.pt2"), channels_last="yes")


class ConvFlatten(nn.Module):
    # a convolution on 8x8 (channels-last under "auto"), then a flatten: a view the executor runs
    def __init__(self):
        super().__init__()
        self.c, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(F.relu(self.c(x)).flatten(1))


def test_the_state_of_a_default_channels_last_package_runs_on_the_executor(tmp_path):
    # The package's state holds the conv weight and its momentum channels-last. The executor, the
    # loaded .pt2 and the planned step failed on it ("view size is not compatible"); now each takes it
    # in the traced strides and trains bit-exact with the same values held contiguous.
    torch.manual_seed(0)
    model = ConvFlatten()
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ce, bs[0])
    aoti = torch_ext.load_step(step.to_aoti(str(tmp_path / "cl.pt2")))
    _, cl_state = aoti(step.init_state(), *bs[0])
    assert not cl_state.params["model.c.weight"].is_contiguous()
    assert not cl_state.opt["opt:model.c.weight:momentum_buffer"].is_contiguous()
    moved = ("model.c.weight", "opt:model.c.weight:momentum_buffer")
    dense = cl_state.replace({n: cl_state.lookup(n).contiguous() for n in moved})
    want_losses, want = run(step, dense, bs[1:])
    torch.export.save(step.program, str(tmp_path / "step.pt2"))
    loaded = torch_ext.load_step(str(tmp_path / "step.pt2"))
    for fn in (step, loaded, step.compile(plan=True, donate=False), step.compile(plan=True, donate=True)):
        given = cl_state.replace({n: cl_state.lookup(n).clone() for n in moved})  # (a donating call consumes it)
        assert not given.params["model.c.weight"].is_contiguous()
        losses, got = run(fn, given, bs[1:])
        assert torch.equal(losses, want_losses)
        assert_states_equal(got, want)


def test_aoti_channels_last_auto_keeps_small_convolutions_contiguous(tmp_path):
    # channels_last="auto" (the default): a weight is stored channels-last only where its
    # convolution's input has >= 64 positions (c1 on 16x16, c2 on 8x8), not c3 on 4x4, whose input
    # (channels-last from c2) is read through one contiguous copy by the convolution and its backward,
    # so ATen runs c3 contiguous. The package trains as the contiguous package and the executor do.
    from torch_ext._aoti import CHANNELS_LAST_MIN_POSITIONS, conv_weight_entries, with_input_layout

    torch.manual_seed(0)
    model = SmallCNN()
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(4)]
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, bs[0])
    inputs = json.loads(step.program.graph_module.meta["custom"][LAYOUT_KEY])["inputs"]
    chosen = conv_weight_entries(step.program, inputs, CHANNELS_LAST_MIN_POSITIONS)
    weights = ["model.c1.weight", "model.c2.weight"]
    assert sorted(chosen) == sorted(weights + [f"opt:{w}:{s}" for w in weights for s in ("exp_avg", "exp_avg_sq")])
    assert set(conv_weight_entries(step.program, inputs)) > set(chosen)  # True: c3 too
    program, _ = with_input_layout(step.program, inputs, set(chosen))
    nodes = list(program.graph_module.graph.nodes)
    convs = [n for n in nodes if n.target in (torch.ops.aten.convolution.default,
                                              torch.ops.aten.convolution_backward.default)]
    c3 = [n for n in convs if n.args[1 if n.target is torch.ops.aten.convolution.default else 2].meta["val"].shape
          == (16, 16, 1, 1)]
    assert len(c3) == 2
    x3 = {n.args[0] if n.target is torch.ops.aten.convolution.default else n.args[1] for n in c3}
    assert len(x3) == 1
    (copy,) = x3
    assert copy.target is torch.ops.aten.clone.default and copy.meta["val"].is_contiguous()
    assert not copy.args[0].meta["val"].is_contiguous()  # what c2 and the ReLU leave: channels-last
    assert all(n.meta["val"].is_contiguous() for n in c3 if n.target is torch.ops.aten.convolution.default)
    assert sum(n.target is torch.ops.aten.clone.default for n in nodes) == 1 + sum(
        n.target is torch.ops.aten.clone.default for n in step.program.graph_module.graph.nodes)

    auto = torch_ext.load_step(step.to_aoti(str(tmp_path / "auto.pt2")))
    strides = dict(zip(auto.layout["inputs"], map(tuple, auto.layout["input_strides"])))
    state = step.init_state()
    for name in inputs:
        if not name.startswith("batch:"):
            fmt = torch.channels_last if name in chosen else torch.contiguous_format
            assert strides[name] == torch.empty_like(state.lookup(name), memory_format=fmt).stride(), name
    assert strides["model.c3.weight"] == (16, 1, 1, 1)
    got_losses, got = run(auto, state, bs)
    assert auto.converted_entries == len(chosen)
    plain = torch_ext.load_step(step.to_aoti(str(tmp_path / "plain.pt2"), channels_last=False))
    assert "input_strides" not in plain.layout
    plain_losses, plain_state = run(plain, step.init_state(), bs)
    want_losses, want = run(step, step.init_state(), bs)
    for losses, new in ((got_losses, got), (plain_losses, plain_state)):
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
        assert_states_equal(new, want, atol=1e-5)
    assert_states_equal(got, plain_state, atol=1e-5)
    with pytest.raises(TypeError, match="channels_last must be a bool or 'auto', got str 'Auto'"):
        step.to_aoti(str(tmp_path / "never.pt2"), channels_last="Auto")


def test_aoti_channels_last_auto_leaves_a_step_with_subgraph_calls_contiguous(tmp_path):
    # channels_last="auto" is the default, and its stride re-inference cannot look inside torch.cond's
    # subgraphs: a convolution model that branches compiles contiguous (it raised KeyError 'val'), and
    # channels_last=True is refused by name.
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 5)

        def forward(self, x):
            h = torch.relu(self.c1(x))
            h = torch.cond(h.sum() > 0, lambda h: self.c2(h), lambda h: h * 2, (h,))
            return self.head(h.mean((2, 3)))

    torch.manual_seed(0)
    model = Branching()
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 5, (2,), generator=g)) for _ in range(2)]
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, bs[0])
    with pytest.raises(NotImplementedError, match=r"channels_last=True\): the step calls subgraphs"):
        step.to_aoti(str(tmp_path / "never.pt2"), channels_last=True)
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "auto.pt2")))
    assert "input_strides" not in loaded.layout
    got_losses, got = run(loaded, step.init_state(), bs)
    want_losses, want = run(step, step.init_state(), bs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)


def test_aoti_hands_cond_branches_operands_in_their_traced_strides(tmp_path):
    # A branch operand Inductor computes itself (here .contiguous() of a transposed view) was laid out
    # as Inductor chose, while the branch was compiled for the traced strides: the package read the
    # wrong elements, silently (_compat.exact_subgraph_strides). The false branch keeps half the mean:
    # with all of it subtracted, the head reads the sequence mean of a centred tensor, exactly zero, so
    # proj and head.weight get only rounding noise as gradient and AdamW's first step scales that noise
    # to +-lr (eager float32 and float64 then differ by 0.7% in loss): no compiler could match eager.
    class HeadsThenBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 5)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.proj(x).view(b, s, 4, 4).transpose(1, 2).contiguous()  # (b, heads, s, 4)
            mixed = torch.cond(x.sum() > 0, lambda h: (h * h.flip(-2)).transpose(1, 2),
                               lambda h: (h - 0.5 * h.mean(-2, keepdim=True)).transpose(1, 2), (h,))
            return self.head(mixed.reshape(b, s, 16).mean(1))

    torch.manual_seed(0)
    model = HeadsThenBranch()
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(2, 6, 16, generator=g) + (1.0 if i % 2 else -1.0), torch.randint(0, 5, (2,), generator=g))
          for i in range(4)]
    assert {bool(x.sum() > 0) for x, _ in bs} == {True, False}
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, bs[0])
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "cond.pt2")))
    got_losses, got = run(loaded, step.init_state(), bs)
    want_losses, want = run(step, step.init_state(), bs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)


def test_onnx_loads_through_load_step_within_1e5(tmp_path):
    pytest.importorskip("onnxruntime", reason="needs onnxruntime")
    pytest.importorskip("onnxscript", reason="needs onnxscript")
    step = make(p=0.0)  # ONNX has no counterpart of the explicit RNG state (to_onnx refuses dropout)
    bs = batches(10)
    path = step.to_onnx(str(tmp_path / "step.onnx"))
    loaded = torch_ext.load_step(path)
    assert loaded.session.get_inputs()
    state = step.init_state()
    got_losses, got = run(loaded, state, bs)
    want_losses, want = run(step, state, bs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)
    other = make(p=0.0, clip_grad_norm=1.0)
    with pytest.raises(ValueError, match="made by a different program .* than this ONNX step"):
        loaded(other.init_state(), *bs[0])


def test_errors_name_the_path_the_extension_and_the_state(tmp_path):
    with pytest.raises(ValueError, match=r"step\.pt' has extension '\.pt'; expected \.pt2"):
        torch_ext.load_step(tmp_path / "step.pt")
    with pytest.raises(FileNotFoundError, match="no such file .*missing.pt2"):
        torch_ext.load_step(tmp_path / "missing.pt2")
    with pytest.raises(TypeError, match="expects a path, got int"):
        torch_ext.load_step(3)
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.pt2 is not a .pt2 archive"):
        torch_ext.load_step(tmp_path / "junk.pt2")
    plain = torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),))
    torch.export.save(plain, str(tmp_path / "plain.pt2"))
    with pytest.raises(ValueError, match=r"plain.pt2 has no torch_ext.layout metadata.*torch.export.save\(step.prog"):
        torch_ext.load_step(tmp_path / "plain.pt2")

    step = make()
    torch.export.save(step.program, str(tmp_path / "step.pt2"))
    loaded = torch_ext.load_step(tmp_path / "step.pt2")
    b = batches(1)[0]
    foreign = make(clip_grad_norm=1.0)  # same shapes, another program
    state = foreign.init_state(seed=0)
    with pytest.raises(ValueError, match=r"made by a different program \(fingerprint '[0-9a-f]+'\) than .*step.pt2"):
        loaded(state, *b)
    with pytest.raises(TypeError, match=r"takes a TrainState, got the dict of state\.state_dict\(\).*"
                                        r"torch_ext\.TrainState\(\*\*d\)"):
        loaded(step.init_state(seed=0).state_dict(), *b)
    with pytest.raises(TypeError, match="takes a TrainState, got list"):
        loaded([step.init_state(seed=0)], *b)
    wrapped = torch_ext.TrainState(**step.init_state(seed=0).state_dict())  # what the message says to do
    assert torch.equal(loaded(wrapped, *b)[0], loaded(step.init_state(seed=0), *b)[0])
    with pytest.raises(ValueError, match=r"batch\[0\]: .*expects shape \(4, 8\) and dtype torch.float32, got shape "
                                         r"\(5, 8\)"):
        loaded(step.init_state(seed=0), torch.randn(5, 8), b[1])
    with pytest.raises(ValueError, match="takes 2 batch tensors, got 1"):
        loaded(step.init_state(seed=0), b[0])
    bad = step.init_state(seed=0)
    bad.params["model.l1.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"entry 'model.l1.weight' has shape \(3, 3\)"):
        loaded(bad, *b)
    donated = step.init_state(seed=0)
    step.compile(plan=True, donate=True)(donated, *b)
    with pytest.raises(ValueError, match="was donated to"):
        loaded(donated, *b)


def test_example_state_is_the_state_the_program_was_saved_with(tmp_path):
    # As `torch-ext step MODEL --steps N --export step.pt2` does: the trained state rides as the
    # program's example inputs, so a deployment needs neither the model nor a state file.
    step = make()
    bs = batches(6)
    _, trained = run(step, step.init_state(seed=2), bs[:3])
    program = step.program
    program.example_inputs = (tuple(step.flat_inputs(trained, *bs[0])), {})
    torch.export.save(program, str(tmp_path / "trained.pt2"))
    loaded = torch_ext.load_step(tmp_path / "trained.pt2")
    state = loaded.example_state()
    assert_states_equal(state, trained)
    assert [float(v) for v in state.lr] == [float(v) for v in trained.lr] and torch.equal(state.rng, trained.rng)
    got_losses, _ = run(loaded, state, bs[3:])
    want_losses, _ = run(step, trained, bs[3:])
    assert torch.equal(got_losses, want_losses)


@pytest.mark.parametrize("kw", [{"accumulate": 2}, {"unroll": 2}], ids=["accumulate", "unroll"])
def test_pt2_of_an_unrolled_or_accumulating_step_reads_every_batch(tmp_path, kw):
    # step.program is exported from example inputs that repeat the example batch n times: export
    # reads one tensor passed twice as one input, and every micro-batch would read the last one.
    step = make(**kw)
    bs = batches(6)
    calls = [tuple(x for b in bs[k:k + 2] for x in b) for k in (0, 2, 4)]
    placeholders = [n for n in step.program.graph.nodes if n.op == "placeholder"]
    assert all(n.users for n in placeholders[-4:]), [(n.name, len(n.users)) for n in placeholders[-4:]]
    path = tmp_path / "step.pt2"
    torch.export.save(step.program, str(path))
    loaded = torch_ext.load_step(path)
    want_losses, want = run(step, step.init_state(seed=3), calls)
    got_losses, got = run(loaded, step.init_state(seed=3), calls)
    assert torch.equal(got_losses, want_losses)
    assert_states_equal(got, want)
    flat = step.flat_inputs(step.init_state(seed=3), *calls[0])
    assert torch.equal(step.program.module()(*flat)[0], step(step.init_state(seed=3), *calls[0])[0])


def test_example_state_keeps_a_constant_the_loss_function_captured(tmp_path):
    # Class weights captured by the loss function are lifted as "lifted_tensor_0" (no "model."
    # prefix): example_state() kept only "model." entries as buffers and lost it.
    class_weights = torch.tensor([0.5, 1.0, 2.0])
    torch.manual_seed(0)
    model = DropoutMLP(0.0)
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     lambda m, x, y: F.cross_entropy(m(x), y, weight=class_weights), batches(1)[0])
    torch.export.save(step.program, str(tmp_path / "step.pt2"))
    loaded = torch_ext.load_step(tmp_path / "step.pt2")
    state = loaded.example_state()
    assert torch.equal(state.lookup("lifted_tensor_0"), class_weights)
    bs = batches(3)
    got_losses, _ = run(loaded, state, bs)
    want_losses, _ = run(step, step.init_state(), bs)
    assert torch.equal(got_losses, want_losses)


# ---------------------------------------------------------------- a step built with scheduler=
def _scheduled(p=0.2):
    torch.manual_seed(0)
    model = DropoutMLP(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, torch_ext.make_train_step(model, opt, ce, batches(1)[0], scheduler=sched)


def _fresh_scheduler(model):
    # What a deployment script rebuilds: the same optimizer and scheduler, fresh.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def test_a_scheduled_step_loaded_without_its_scheduler_is_refused(tmp_path):
    # The program takes the lr as an input and does not advance it. Before, the loaded step trained
    # every call at the lr of the state it was given (1e-2), where the step it came from halved it
    # every 2 steps: after 6 calls the parameters differed, silently.
    model, step = _scheduled()
    path = str(tmp_path / "sched.pt2")
    torch.export.save(step.program, path)
    with pytest.raises(ValueError, match=r"built with scheduler=.*load_step\(path, scheduler=sched\).*manual_lr=True"):
        torch_ext.load_step(path)
    plain = make()
    torch.export.save(plain.program, str(tmp_path / "plain.pt2"))
    with pytest.raises(ValueError, match="built without one"):
        torch_ext.load_step(str(tmp_path / "plain.pt2"), scheduler=_fresh_scheduler(model))
    with pytest.raises(ValueError, match="not both"):
        torch_ext.load_step(path, scheduler=_fresh_scheduler(model), manual_lr=True)
    other = nn.Sequential(nn.Linear(8, 3), nn.Linear(3, 3))
    opt2 = torch.optim.SGD([{"params": other[0].parameters()}, {"params": other[1].parameters()}], lr=0.1)
    with pytest.raises(ValueError, match="2 param groups.*takes 1 lr"):
        torch_ext.load_step(path, scheduler=torch.optim.lr_scheduler.StepLR(opt2, step_size=2))


def test_a_scheduled_step_loaded_with_its_scheduler_follows_it_as_the_step_does(tmp_path):
    # The AOTInductor package and the .onnx file go through the same schedule (deploy.loaded_schedule).
    model, step = _scheduled()
    path = str(tmp_path / "sched.pt2")
    torch.export.save(step.program, path)
    loaded = torch_ext.load_step(path, scheduler=_fresh_scheduler(copy_model(model)))
    bs = batches(6)
    state = step.init_state(seed=2)
    live, saved = state, state
    for b in bs:
        live_loss, live = step(live, *b)
        saved_loss, saved = loaded(saved, *b)
        assert saved.sched_epoch == live.sched_epoch
        assert [float(v) for v in saved.lr] == [float(v) for v in live.lr]
        assert torch.equal(saved_loss, live_loss)
    assert [float(v) for v in saved.lr] == [1e-2 * 0.5 ** 3]
    assert_states_equal(saved, live)
    # A hand-set lr is refused as the live step refuses it; manual_lr=True trains at it.
    with pytest.raises(ValueError, match=r"has lr \[0\.5\].*scheduler \(StepLR\) gives"):
        loaded(_with_lr(saved, 0.5), *bs[0])
    manual = torch_ext.load_step(path, manual_lr=True)
    _, after = manual(_with_lr(saved, 0.5), *bs[0])
    assert [float(v) for v in after.lr] == [0.5]


def test_example_state_keeps_the_scheduler_epoch_of_the_example_inputs(tmp_path):
    # example_state() gave scheduler epoch 0 whatever the example inputs were: with StepLR(10) the
    # lr of epoch 3 is epoch 0's, so the state was accepted and the loaded step decayed the lr 3
    # calls late, silently (a state whose epoch disagrees with its lr).
    def build(epochs_before=0):
        torch.manual_seed(0)
        model = DropoutMLP(0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        for _ in range(epochs_before):  # a scheduler restored past epoch 0
            opt.step()
            sched.step()
        return model, torch_ext.make_train_step(model, opt, ce, batches(1)[0], scheduler=sched)

    def fresh_scheduler(model):
        return torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=10, gamma=0.5)

    bs = batches(11)
    model, step = build()
    _, trained = run(step, step.init_state(), bs[:3])
    program = step.program
    program.example_inputs = (tuple(step.flat_inputs(trained, *bs[0])), {})  # set by hand: a trained state
    torch.export.save(program, str(tmp_path / "trained.pt2"))
    _, restored = build(epochs_before=3)
    torch.export.save(restored.program, str(tmp_path / "restored.pt2"))  # example inputs at epoch 3
    for name, live, hand_set in (("trained.pt2", trained, True), ("restored.pt2", restored.init_state(), False)):
        loaded = torch_ext.load_step(tmp_path / name, scheduler=fresh_scheduler(copy_model(model)))
        if hand_set:
            with pytest.raises(ValueError, match=r"not the ones step\.program was exported with.*"
                                                 r"example_state\(sched_epoch=state\.sched_epoch\)"):
                loaded.example_state()
            state = loaded.example_state(sched_epoch=trained.sched_epoch)
        else:
            state = loaded.example_state()
        assert state.sched_epoch == live.sched_epoch == 3, name
        owner = step if hand_set else restored
        got_lrs, want_lrs = [], []
        for b in bs[3:]:
            _, state = loaded(state, *b)
            _, live = owner(live, *b)
            got_lrs.append(float(state.lr[0]))
            want_lrs.append(float(live.lr[0]))
        assert want_lrs == [0.1] * 6 + [0.05] * 2 and got_lrs == want_lrs, name
        assert_states_equal(state, live)
    with pytest.raises(ValueError, match=r"sched_epoch must be an int >= 0, got -1"):
        loaded.example_state(sched_epoch=-1)


def copy_model(model):
    import copy

    return copy.deepcopy(model)


def _with_lr(state, lr):
    out = state.replace({})
    out.set_lr(lr)
    return out


def test_aoti_package_of_a_channels_last_model_reads_its_state_in_its_strides(tmp_path):
    # model.to(memory_format=torch.channels_last), a common habit for CNNs: the state's convolution
    # weights (and Adam's moments, zeros_like them) are channels-last, and AOTInductor compiles for
    # those strides. With no convolution that to_aoti itself makes channels-last (4x4 inputs: "auto"
    # keeps them contiguous) the package recorded no input_strides, so load_step copied the state to
    # contiguous and the package read it as channels-last: the second loss was 0.8% off, silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(8, 3)).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(2, 3, 4, 4, generator=g), torch.randint(0, 3, (2,), generator=g)) for _ in range(3)]
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, bs[0])
    assert not step.init_state().params["model.0.weight"].is_contiguous()
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "step.pt2")))
    got_losses, got = run(loaded, step.init_state(), bs)
    want_losses, want = run(step, step.init_state(), bs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)


def test_aoti_package_of_an_expanded_example_batch_reads_every_row(tmp_path):
    # An example batch made by expand (stride 0: one row repeated) was compiled for stride 0, so the
    # package read every later batch as copies of its first row: 3% off the executor's loss, silently.
    # (With its strides recorded it would be refused instead: a batch cannot be copied into stride 0.)
    class ShiftThenLinear(nn.Module):  # an Inductor kernel reads x first, not an extern GEMM
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            return self.lin(torch.tanh(x * 1.5 + 0.1))

    torch.manual_seed(0)
    model = ShiftThenLinear()
    g = torch.Generator().manual_seed(1)
    example = (torch.randn(1, 6, generator=g).expand(4, 6), torch.randint(0, 3, (4,), generator=g))
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), ce, example)
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "step.pt2")))
    bs = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)] + [example]
    got_losses, got = run(loaded, step.init_state(), bs)
    want_losses, want = run(step, step.init_state(), bs)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_states_equal(got, want, atol=1e-5)


@pytest.mark.parametrize("restore_optimizer", [False, True])
def test_resuming_with_only_the_scheduler_restored_names_the_optimizer(restore_optimizer):
    # A checkpoint resumed with sched.load_state_dict but not opt.load_state_dict: the fresh optimizer's lr
    # is the initial one, so the replay disagrees with the saved state's lr. It was refused as a hand-set lr
    # (state.set_lr), which the user never called; the message now names the optimizer not restored.
    import copy
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
    loss = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(5)]
    m1 = copy.deepcopy(base)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    s1 = sched(o1)
    step = torch_ext.make_train_step(m1, o1, loss, bs[0], scheduler=s1)
    state = step.init_state()
    for b in bs[:3]:
        _, state = step(state, *b)
    saved = state.state_dict()
    step.write_back(state)
    m2 = copy.deepcopy(base)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    s2 = sched(o2)
    if restore_optimizer:
        o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    s2.load_state_dict(copy.deepcopy(s1.state_dict()))
    resumed = torch_ext.make_train_step(m2, o2, loss, bs[0], scheduler=s2)
    state2 = resumed.load_state_dict(saved)
    if not restore_optimizer:
        with pytest.raises(ValueError, match=r"StepLR was restored at epoch 3 .*but its optimizer was not "
                                             r"\(its lr is \[0\.1\]\).*opt\.load_state_dict") as e:
            resumed(state2, *bs[3])
        assert "set_lr" not in str(e.value)
        return
    want = step(state, *bs[3])[0]
    got = resumed(state2, *bs[3])[0]
    assert torch.equal(got, want)


def _two_scheduled_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    body, head = (torch.optim.AdamW(model[i].parameters(), lr=1e-2) for i in (0, 2))
    # both start at lr 1e-2: a state at epoch 0 cannot tell the two schedules apart
    return model, [body, head], [torch.optim.lr_scheduler.StepLR(body, step_size=1, gamma=0.5),
                                 torch.optim.lr_scheduler.LambdaLR(head, lambda i: 1.0)]


def test_schedulers_given_in_another_order_than_the_steps_optimizers_follow_their_own(tmp_path):
    # The step maps each scheduler to its optimizer whatever the list's order; load_step took the
    # list's order for the optimizers' (the order of the lr inputs), so [head's, body's] fed the body's
    # halving lr to the head and the constant one to the body: 0.02 off the live step in 4 calls, silently.
    model, opts, scheds = _two_scheduled_optimizers()
    step = torch_ext.make_train_step(model, opts, ce, batches(1)[0], scheduler=scheds)
    path = str(tmp_path / "two.pt2")
    torch.export.save(step.program, path)
    _, _, fresh = _two_scheduled_optimizers()
    loaded = torch_ext.load_step(path, scheduler=fresh[::-1])
    live = saved = step.init_state()
    for b in batches(4):
        live_loss, live = step(live, *b)
        saved_loss, saved = loaded(saved, *b)
        assert torch.equal(saved_loss, live_loss)
    assert [float(v) for v in saved.lr] == [float(v) for v in live.lr] == [1e-2 * 0.5 ** 4, 1e-2]
    assert_states_equal(saved, live)
    # schedulers of optimizers unlike the step's (other parameter shapes) are refused, naming both
    other = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 3))
    wrong = [torch.optim.lr_scheduler.StepLR(torch.optim.AdamW(other[i].parameters(), lr=1e-2), step_size=1)
             for i in (0, 1)]
    with pytest.raises(ValueError, match=r"optimizer 0 is AdamW with param groups of shapes \[\[\[16, 8\], \[16\]\]\]"
                                         r".*no scheduler given drives one like it.*\[\[\[4, 8\], \[4\]\]\]"):
        torch_ext.load_step(path, scheduler=wrong)
    with pytest.raises(ValueError, match=r"2 optimizers \(AdamW, AdamW\), the schedulers given drive 1"):
        torch_ext.load_step(path, scheduler=[torch.optim.lr_scheduler.StepLR(
            torch.optim.SGD([{"params": other[0].parameters()}, {"params": other[1].parameters()}], lr=0.1), 1)])


class AlphaAddMLP(nn.Module):
    """A forward that adds a bias to a matmul with an alpha, as the coupled weight decay of the update adds the
    weight to its gradient (``grad.add(param, alpha=weight_decay)``, an mm's transpose)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.w = nn.Parameter(torch.randn(3, 3) / 3)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        return torch.add(self.l2(h) @ self.w, self.l2.bias, alpha=0.5)


def test_aoti_keeps_the_alpha_of_an_add_to_a_matmul(tmp_path):
    """torch 2.9's Inductor fuses ``add(mm(a, b), c, alpha=k)`` into ``addmm(c, a, b)`` and drops k, so every
    coupled weight decay (SGD, Adam, Adamax, NAdam, RAdam, Adadelta, RMSprop, Adagrad: ``grad + wd * param``,
    the gradient a matmul's) trained as ``grad + param`` in the package: 0.04 off eager's Linear weight after one
    SGD/Adam step at lr 2e-2, weight_decay 1e-2, and 0.21 off after 8 Adamax steps
    (scripts/check_deploy_optimizers.py). The package now agrees with eager to float32 rounding, the
    forward's own alpha add included."""
    torch.manual_seed(0)
    model = AlphaAddMLP()
    ref = AlphaAddMLP()
    ref.load_state_dict(model.state_dict())
    make = lambda m: [torch.optim.SGD([m.l1.weight, m.l1.bias], lr=2e-2, momentum=0.9, weight_decay=1e-2),  # noqa: E731
                      torch.optim.Adamax([m.l2.weight, m.l2.bias, m.w], lr=2e-2, weight_decay=1e-2)]
    opts, ref_opts = make(model), make(ref)
    bs = batches(3)
    step = torch_ext.make_train_step(model, opts, ce, bs[0])
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "step.pt2")))
    state = step.init_state()
    for b in bs:
        loss, state = loaded(state, *b)
        for o in ref_opts:
            o.zero_grad()
        want = ce(ref, *b)
        want.backward()
        for o in ref_opts:
            o.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state.params["model." + n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_aoti_package_of_a_transposed_parameter_reads_it_in_its_strides(tmp_path):
    # A transposed parameter, its gradient and its Adam moments are traced in strides (1, 8): the package is
    # compiled for those, which it reads unchecked, so load_step must feed them in those strides (a
    # contiguous copy read as (1, 8) would be the parameter permuted). The executor is bit-exact with eager
    # torch.optim; the package agrees with it to float32 rounding only, as for a contiguous parameter
    # (scripts/probe_aoti_transposed_param.py: 3 AdamW steps, 6.0e-8 off on w either way, the first loss
    # 2.4e-7 off; eager's transposed and contiguous runs also differ in w's last bits).
    model = TransposedWeight()
    ref = TransposedWeight()
    assert model.w.stride() == (1, 8) and ref.w.stride() == (1, 8)
    bs = batches(3)
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), ce,
                                     bs[0])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    want_losses, want = run(step, step.init_state(), bs)
    for x, y in bs:
        ref_opt.zero_grad()
        ce(ref, x, y).backward()
        ref_opt.step()
    names = {id(p): n for n, p in ref.named_parameters()}
    for n, p in ref.named_parameters():
        assert torch.equal(want.params["model." + n], p.detach()), n
    for p, slots in ref_opt.state.items():
        for slot, v in slots.items():
            assert torch.equal(want.opt[f"opt:model.{names[id(p)]}:{slot}"], v), (names[id(p)], slot)
    loaded = torch_ext.load_step(step.to_aoti(str(tmp_path / "step.pt2")))
    strides = dict(zip(loaded.layout["inputs"], loaded.layout["input_strides"]))
    assert [strides[k] for k in ("model.w", "opt:model.w:exp_avg", "opt:model.w:exp_avg_sq")] == [[1, 8]] * 3
    got_losses, got = run(loaded, step.init_state(), bs)
    assert got.params["model.w"].stride() == (1, 8)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-6, atol=1e-6)
    assert_states_equal(got, want, atol=1e-6)
    # The same state made contiguous (a state saved by other code, or .contiguous()'d) is copied into the
    # compiled strides: the same training, bit for bit.
    s = step.init_state()
    contiguous = s.replace({k: v.contiguous() for part in (s.params, s.opt) for k, v in part.items()})
    assert contiguous.params["model.w"].is_contiguous()
    again_losses, again = run(loaded, contiguous, bs)
    assert torch.equal(again_losses, got_losses)
    assert_states_equal(again, got)
