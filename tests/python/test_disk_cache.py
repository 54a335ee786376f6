"""The on-disk build cache (torch_ext._disk_cache): a fresh process reuses a stored graph without tracing,
computes bit-identically with the module's own (current) weights, and never reuses a graph whose trace
would differ. Every test points TORCH_EXT_CACHE_DIR at its own tmp_path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch
import torch.nn as nn

import torch_ext
from torch_ext import _build_cache, _disk_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TORCH_EXT_CACHE_DIR", str(folder))
    monkeypatch.delenv("TORCH_EXT_CACHE", raising=False)
    monkeypatch.delenv("TORCH_EXT_BUILD_CACHE", raising=False)
    _build_cache.clear()  # every build below looks on disk first
    yield folder
    _build_cache.clear()


def _entries(folder) -> list:
    sub = os.path.join(folder, f"graphs-v{_disk_cache.FORMAT}")
    return sorted(os.path.join(sub, n) for n in os.listdir(sub) if n.endswith(".json")) if os.path.isdir(sub) else []


class _Mlp(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.register_buffer("shift", torch.linspace(-1, 1, 3))
        self.scale = scale

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.training:
            h = h * 2
        return self.b(h) * self.scale + self.shift


def _build(model, x):
    """A graph built with the caches (in-process cleared: the disk decides), checked against eager."""
    _build_cache.clear()
    rg = torch_ext.ReactiveGraph(model, (x,))
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x)), rg.build_stats
    return rg


def test_disk_hit_rebinds_the_module_weights_and_misses_on_what_the_trace_depends_on(cache_dir):
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    first = _build(_Mlp().eval(), x)
    assert (first.build_stats["cache"], first.build_stats["disk_cache"]) == ("miss", "stored")
    assert len(_entries(cache_dir)) == 1
    other = _Mlp().eval()  # same architecture, other weights
    rg = _build(other, x)
    assert (rg.build_stats["cache"], rg.build_stats["disk_cache"]) == ("hit", "hit")
    assert not torch.equal(rg.demand(), first.demand())
    # Weights are read at use: written in place after the build, they show at the next run.
    with torch.no_grad():
        other.b.weight.mul_(-2)
        other.shift.add_(1)
        assert torch.equal(rg.run(x), other(x))
    # Shape, dtype, Python state and training mode each miss (and are then correct, checked by _build).
    assert _build(other, torch.randn(5, 6)).build_stats["disk_cache"] == "stored"
    assert _build(_Mlp().double().eval(), x.double()).build_stats["disk_cache"] == "stored"
    assert _build(_Mlp(3.0).eval(), x).build_stats["disk_cache"] == "stored"
    assert _build(_Mlp().train(), x).build_stats["disk_cache"] == "stored"
    assert _build(_Mlp().eval(), x).build_stats["disk_cache"] == "hit"
    # A class attribute read by forward is part of the code's state.
    assert _build(_Mlp().eval(), x).build_stats["cache"] == "hit"


class _ClassScale(nn.Module):
    factor = 2.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.factor


_OFFSET = 0.0


def _act(x):
    return torch.relu(x)


class _Globals(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _act(self.lin(x)) + _OFFSET


def test_disk_key_misses_when_code_a_global_or_a_class_attribute_changes(cache_dir, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = _Globals().eval()
    _build(model, x)
    assert _build(model, x).build_stats["disk_cache"] == "hit"
    monkeypatch.setitem(globals(), "_OFFSET", 1.5)
    assert _build(model, x).build_stats["disk_cache"] == "stored"
    monkeypatch.setitem(globals(), "_act", torch.sigmoid)
    assert _build(model, x).build_stats["disk_cache"] == "stored"
    monkeypatch.setattr(_Globals, "forward", lambda self, x: self.lin(x) * 2)
    assert _build(model, x).build_stats["disk_cache"] == "stored"
    scaled = _ClassScale().eval()
    _build(scaled, x)
    monkeypatch.setattr(_ClassScale, "factor", 5.0)
    assert _build(scaled, x).build_stats["disk_cache"] == "stored"


_config = types.ModuleType("_torch_ext_test_disk_config")  # a user module, read by attribute
_config.SCALE = 2.0


class _ReadsAModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * _config.SCALE


def test_disk_key_misses_when_an_attribute_of_a_user_module_it_reads_changes(cache_dir, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = _ReadsAModule().eval()
    _build(model, x)
    assert _build(model, x).build_stats["disk_cache"] == "hit"
    monkeypatch.setattr(_config, "SCALE", 3.0)
    rg = _build(model, x)
    assert rg.build_stats["disk_cache"] == "stored"
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))


class _MakesConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_programs_reading_tensors_other_than_the_module_state_are_not_stored(cache_dir):
    torch.manual_seed(0)
    rg = _build(_MakesConstant().eval(), torch.randn(2, 4))
    assert rg.build_stats["disk_cache"].startswith(("uncacheable", "not stored")), rg.build_stats
    assert _entries(cache_dir) == []


@pytest.mark.parametrize("damage", ["garbage", "truncated", "checksum", "bad graph", "unbindable", "empty"])
def test_a_corrupt_entry_is_rebuilt_never_fatal(cache_dir, damage):
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    _build(_Mlp().eval(), x)
    (path,) = _entries(cache_dir)
    text = open(path).read()
    if damage == "garbage":
        text = "\x00\xff not json"
    elif damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "checksum":
        text = text.replace("relu", "sigmoid")  # a flipped op, with the old checksum
    elif damage == "bad graph":  # a consistent entry whose graph does not parse
        doc = json.loads(text)
        doc["body"]["graph"] = "graph:\n  %x : f32[4 = oops\n"
        doc["checksum"] = _disk_cache._checksum(doc["body"])
        text = json.dumps(doc)
    elif damage == "unbindable":  # consistent, but names a parameter the module does not have
        doc = json.loads(text)
        doc["body"]["inputs"][0][1] = "no.such.weight"
        doc["checksum"] = _disk_cache._checksum(doc["body"])
        text = json.dumps(doc)
    else:
        text = ""
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
    before = _disk_cache.info()["corrupt"]
    rg = _build(_Mlp().eval(), x)
    assert rg.build_stats["disk_cache"] == "stored" and _disk_cache.info()["corrupt"] == before + 1
    assert _build(_Mlp().eval(), x).build_stats["disk_cache"] == "hit"  # rewritten whole


def test_disabled_by_environment(cache_dir, monkeypatch):
    x = torch.randn(4, 6)
    monkeypatch.setenv("TORCH_EXT_CACHE", "0")
    rg = _build(_Mlp().eval(), x)
    assert rg.build_stats["disk_cache"] == "off" and _entries(cache_dir) == []
    monkeypatch.setenv("TORCH_EXT_CACHE", "1")
    monkeypatch.setenv("TORCH_EXT_BUILD_CACHE", "0")  # every build cache off
    rg = _build(_Mlp().eval(), x)
    assert (rg.build_stats["cache"], rg.build_stats["disk_cache"]) == ("off", "off") and _entries(cache_dir) == []
    monkeypatch.delenv("TORCH_EXT_BUILD_CACHE")
    assert torch_ext.ReactiveGraph(_Mlp().eval(), (x,), cache=False).build_stats["disk_cache"] == "off"


def test_an_unwritable_cache_folder_only_means_not_stored(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TORCH_EXT_CACHE_DIR", str(blocker))
    rg = _build(_Mlp().eval(), torch.randn(4, 6))
    assert rg.build_stats["disk_cache"].startswith("not stored"), rg.build_stats


def test_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _disk_cache.directory().startswith(os.path.join(str(tmp_path), "torch_ext"))
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _disk_cache.directory().startswith(os.path.join(os.path.expanduser("~"), ".cache", "torch_ext"))


def test_concurrent_writers_and_readers_see_whole_entries(cache_dir):
    bodies = [{"graph": "x" * (20000 + i), "i": i} for i in range(4)]
    seen, errors = [], []

    def write(body):
        for _ in range(40):
            if not _disk_cache.store("k" * 64, body):
                errors.append("store failed")

    def read():
        for _ in range(200):
            got = _disk_cache.load("k" * 64)
            if got is not None:
                seen.append(got["i"])
                if got != bodies[got["i"]]:
                    errors.append("a torn entry")

    before = _disk_cache.info()["corrupt"]
    threads = [threading.Thread(target=write, args=(b,)) for b in bodies] + [threading.Thread(target=read)
                                                                            for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and _disk_cache.info()["corrupt"] == before
    assert [n for n in os.listdir(os.path.dirname(_entries(cache_dir)[0])) if n.endswith(".tmp")] == []


def test_program_of_a_disk_hit_is_traced_on_first_read(cache_dir):
    x = torch.randn(4, 6)
    _build(_Mlp().eval(), x)
    rg = _build(_Mlp().eval(), x)
    assert rg.build_stats["disk_cache"] == "hit" and rg._program is None
    ep = rg.program
    assert isinstance(ep, torch.export.ExportedProgram)
    assert [s.target for s in ep.graph_signature.input_specs if s.target] == \
        [n.state_name for n in rg.graph.nodes() if n.kind == "placeholder" and n.state_name]


# ---- fresh processes: what a new Python process sees
_MODEL = """
import torch, torch.nn as nn

OFFSET = {offset}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 50)

    def forward(self, tokens):
        h = self.emb(tokens)
        for blk in self.blocks:
            h = h + blk(h){extra}
        return self.head(h) + OFFSET
"""

_CHILD = """
import hashlib, json, sys, torch
sys.path.insert(0, sys.argv[1])
import torch_ext
from usermodel import Net

torch.manual_seed(int(sys.argv[2]))
model = Net().eval()
tokens = torch.randint(0, 50, (2, int(sys.argv[3])))
rg = torch_ext.ReactiveGraph(model, (tokens,))
with torch.no_grad():
    out = rg.demand()
    eager = model(tokens)
    sites = [(n, p) for n in rg.nodes("blocks.*")[-1:] for p in range(tokens.shape[1])]
    sweep = torch_ext.sweep(rg, sites, lambda v, site: v.index_fill(1, torch.tensor([site[1]]), 0.0),
                            lambda o: o[:, -1].sum(), progress=False)
print(json.dumps({"cache": rg.build_stats["cache"], "disk": rg.build_stats["disk_cache"],
                  "equal_eager": bool(torch.equal(out, eager)),
                  "out": hashlib.sha256(out.numpy().tobytes()).hexdigest(),
                  "sweep": [sweep.metrics[s] for s in sites],
                  "dynamo": "torch._dynamo" in sys.modules, "trace_s": rg.build_stats["trace_s"]}))
"""


def _child(folder, cache, seed=0, seq=5, env=None):
    p = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(seed), str(seq)], capture_output=True,
                       text=True, check=False, cwd=ROOT,
                       env={**os.environ, "TORCH_EXT_CACHE_DIR": str(cache), "PYTHONPATH": ROOT, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_fresh_process_hit_is_bit_identical_and_never_traces(tmp_path):
    """One model file, run in fresh processes: a cold build stores, the next process hits (without
    importing torch._dynamo) and equals a build with the disk cache off bit for bit; new weights hit
    and are used; an edited model file, an edited global and a new shape miss and are correct."""
    code, cache = tmp_path / "code", tmp_path / "cache"
    code.mkdir()
    (code / "usermodel.py").write_text(textwrap.dedent(_MODEL.format(offset=0.0, extra="")))
    cold = _child(code, cache)
    assert (cold["cache"], cold["disk"], cold["equal_eager"]) == ("miss", "stored", True)
    off = _child(code, cache, env={"TORCH_EXT_CACHE": "0"})
    assert off["disk"] == "off"
    hit = _child(code, cache)
    assert (hit["cache"], hit["disk"], hit["equal_eager"], hit["dynamo"]) == ("hit", "hit", True, False), hit
    assert hit["out"] == cold["out"] == off["out"] and hit["sweep"] == cold["sweep"] == off["sweep"]
    weights = _child(code, cache, seed=1)
    assert (weights["disk"], weights["equal_eager"]) == ("hit", True) and weights["out"] != cold["out"]
    assert _child(code, cache, seq=7)["disk"] == "stored"
    (code / "usermodel.py").write_text(textwrap.dedent(_MODEL.format(offset=0.0, extra=" * 0.5")))
    changed = _child(code, cache)
    assert (changed["disk"], changed["equal_eager"]) == ("stored", True) and changed["out"] != cold["out"]
    (code / "usermodel.py").write_text(textwrap.dedent(_MODEL.format(offset=0.25, extra="")))
    shifted = _child(code, cache)
    assert (shifted["disk"], shifted["equal_eager"]) == ("stored", True) and shifted["out"] != cold["out"]


def _real_models():
    from torch_ext.models import TinyTransformer

    torch.manual_seed(0)
    yield "tiny", TinyTransformer(vocab=50, d_model=32, n_heads=4, n_layers=2, seq=6).eval()
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    yield "gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50,
                                                                       n_positions=16)).eval()
    tl = pytest.importorskip("transformer_lens", reason="transformer-lens is not installed")
    cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                     act_fn="gelu", normalization_type="LN", seed=0)
    yield "bridge", tl.TransformerBridge.boot_native(cfg).eval()


def test_portable_keys_of_real_models_hold_values_only():
    """The walker's portable form names or digests every object: no type, function or code object (whose
    repr would differ per process, or say nothing about its contents) is left in the key."""
    tokens = torch.randint(0, 50, (2, 6))
    for name, model in _real_models():
        key = _build_cache.describe(model, (tokens,), {}, ("auto", "False"), portable=True)
        _build_cache._check_portable(key)
        assert _build_cache.fingerprint(model, (tokens,), {}, ("auto", "False"), portable=True) == \
            _build_cache.fingerprint(model, (tokens,), {}, ("auto", "False"), portable=True), name
        with pytest.raises(_build_cache.Uncacheable):
            _build_cache._check_portable(_build_cache.describe(model, (tokens,), {}, ("auto", "False")))


_BRIDGE_KEY = """
import sys, torch, transformer_lens as tl
from torch_ext import _build_cache
cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                 act_fn="gelu", normalization_type="LN", seed=0)
bridge = tl.TransformerBridge.boot_native(cfg).eval()
tokens = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
bridge.run_with_cache(tokens)  # leaves per-tensor state keyed by id() on the attention conversions
print(_build_cache.fingerprint(bridge, (tokens,), {}, ("auto", "False"), portable=True))
"""


def test_portable_key_of_a_bridge_after_run_with_cache_is_the_same_in_every_process():
    pytest.importorskip("transformer_lens", reason="transformer-lens is not installed")
    keys = set()
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _BRIDGE_KEY], capture_output=True, text=True, check=False, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT})
        assert p.returncode == 0, p.stderr[-3000:]
        keys.add(p.stdout.strip().splitlines()[-1])
    assert len(keys) == 1


def test_portable_key_bytes_refuse_any_object_and_ignore_sharing():
    """A portable key is digested from its values alone: an object the walker let through is refused
    even when its repr looks like a value (the old check only caught default reprs, " at 0x"), and
    whether equal strings are one object or two does not change the bytes (no pickle memo)."""

    class Leaked:
        def __repr__(self):
            return "'looks like a string'"

    with pytest.raises(_build_cache.Uncacheable, match="Leaked"):
        _build_cache._portable_bytes(("a", (1, Leaked())))
    with pytest.raises(_build_cache.Uncacheable):
        _build_cache._portable_bytes(("a", [torch.float32]))
    shared = "x" * 40
    one = (shared, shared)
    two = ("x" * 40, "".join(["x"] * 40))
    assert one[0] is one[1] and two[0] is not two[1]
    assert _build_cache._portable_bytes(one) == _build_cache._portable_bytes(two)
    assert _build_cache._portable_bytes((1, "1")) != _build_cache._portable_bytes(("1", 1))
    assert _build_cache._portable_bytes((-0.0,)) != _build_cache._portable_bytes((0.0,))


class _EnvScale(nn.Module):
    """A forward that reads environment variables (os.environ.get, os.getenv): the trace bakes their values in."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x) * float(os.environ.get("TORCH_EXT_TEST_SCALE", "1.0"))
        return torch.tanh(y) if os.getenv("TORCH_EXT_TEST_TANH") == "1" else y


@pytest.mark.parametrize("disk", [True, False])
def test_environment_variables_the_forward_reads_are_part_of_the_graph(cache_dir, monkeypatch, disk):
    """A changed environment variable reused the graph traced with the old value, silently: from the in-process
    and the on-disk build caches (neither key held it), and at demand() of a built graph. The variables the
    forward reads are recorded during the trace: a cached graph traced with other values is traced again, and
    a built graph refuses to compute once one of them changed."""
    if not disk:
        monkeypatch.setenv("TORCH_EXT_CACHE", "0")
    monkeypatch.setenv("TORCH_EXT_TEST_SCALE", "2.0")
    monkeypatch.delenv("TORCH_EXT_TEST_TANH", raising=False)
    model, x = _EnvScale().eval(), torch.randn(3, 4)
    first = torch_ext.ReactiveGraph(model, (x,))
    assert first._env == {"TORCH_EXT_TEST_SCALE": "2.0", "TORCH_EXT_TEST_TANH": None}
    for name, value in (("TORCH_EXT_TEST_SCALE", "3.0"), ("TORCH_EXT_TEST_TANH", "1")):
        monkeypatch.setenv("TORCH_EXT_TEST_SCALE", "2.0")
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=rf"environment variable {name} the forward read is '{value}' now"):
            first.demand()
        if disk:
            rg = _build(model, x)  # the in-process cache cleared: the disk entry is the one traced before
        else:
            rg = torch_ext.ReactiveGraph(model, (x,))
            with torch.no_grad():
                assert torch.equal(rg.demand(), model(x))
        assert rg.build_stats["cache"] == "miss"
    monkeypatch.setenv("TORCH_EXT_TEST_SCALE", "2.0")
    monkeypatch.delenv("TORCH_EXT_TEST_TANH")
    with torch.no_grad():
        assert torch.equal(first.demand(), model(x))  # changed back: as traced
