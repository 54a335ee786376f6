"""The make_fx front end of ReactiveGraph (issue 10 item 5: build cost) against torch.export.

Every graph make_fx builds must give the same sweep results, bit for bit, as torch.export's; where
make_fx cannot vouch for its trace, front_end="auto" falls back to torch.export and says why, and
front_end="make_fx" refuses.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import torch_ext

from zoo import ZOO


def _both(model, inputs, front_end="make_fx", **kw):
    a = torch_ext.ReactiveGraph(model, inputs, front_end=front_end, **kw)
    b = torch_ext.ReactiveGraph(model, inputs, front_end="export", **kw)
    if front_end == "make_fx":
        assert a.build_stats["front_end"] == "make_fx" and a.stats["front_end"] == "make_fx"
    assert b.build_stats["front_end"] == "export"
    return a, b


def _assert_same_sweeps(a, b, metric, sites=None):
    """Same call nodes (names, targets, module paths), same outputs and the same sweep metrics, bit for bit."""
    calls = lambda rg: [(n.name, n.target, n.module_path) for n in rg.graph.nodes() if n.kind == "call"]  # noqa: E731
    assert calls(a) == calls(b)
    assert a.hook_names == b.hook_names
    ta, tb = torch.utils._pytree.tree_leaves(a.demand()), torch.utils._pytree.tree_leaves(b.demand())
    assert all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
    if sites is None:
        # Every float node, except where export's recorded type is not the value's (the lstm's
        # getitem_1: export records [2, 1, 3, 12] for a [2, 3, 12] value, so it cannot be patched).
        def declared(rg, n):
            t = rg.graph.node(n).type
            return t[0] == "tensor" and list(t[2]) == list(rg.value(n).shape)

        sites = [n for n in a._countable if isinstance(a.value(n), torch.Tensor) and a.value(n).is_floating_point()
                 and declared(a, n) and declared(b, n)]

    def patch(v, site):
        return v * 0.5 + 0.25

    ra = torch_ext.sweep(a, sites, patch, metric, progress=False)
    rb = torch_ext.sweep(b, sites, patch, metric, progress=False)
    assert ra.metrics == rb.metrics  # exact
    assert ra.measured_evaluations == rb.measured_evaluations


def _sum_metric(out):
    return sum(float(t.double().sum()) for t in torch.utils._pytree.tree_leaves(out) if t.is_floating_point())


INFERENCE_ZOO = [k for k, e in ZOO.items() if not e.joint and not e.mutates_buffers]


@pytest.mark.parametrize("name", INFERENCE_ZOO)
def test_zoo_make_fx_equals_export(name):
    model, inputs = ZOO[name].build()
    model.eval()
    a, b = _both(model, inputs, front_end="auto")
    # int_shape's scatter_ is in place: export functionalizes it, make_fx refuses.
    assert a.build_stats["front_end"] == ("export" if name == "int_shape" else "make_fx"), a.build_stats
    _assert_same_sweeps(a, b, _sum_metric)


def test_tiny_transformer_residual_sweep_bit_identical():
    from torch_ext.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=100, d_model=32, n_heads=4, n_layers=2, seq=8).eval()
    tokens = torch.randint(0, 100, (3, 8))
    a, b = _both(model, (tokens,))
    sites = [(n, p) for n in a.nodes("add*")[:4] for p in range(8)]

    def patch(v, site):
        v = v.clone()
        v[:, site[1]] = 0
        return v

    metric = lambda logits: logits[:, -1, 3] - logits[:, -1, 5]  # noqa: E731  (per example)
    ra = torch_ext.sweep(a, sites, patch, metric, progress=False)
    rb = torch_ext.sweep(b, sites, patch, metric, progress=False)
    assert ra.metrics.keys() == rb.metrics.keys()
    assert all(torch.equal(torch.as_tensor(ra.metrics[s]), torch.as_tensor(rb.metrics[s])) for s in sites)


def test_hugging_face_gpt2_make_fx_equals_export():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    tokens = torch.randint(0, 64, (2, 6))
    a, b = _both(model, (tokens,))
    assert model.config.use_cache  # restored after tracing
    sites = [h for h in a.hook_names if h.endswith(("hook_resid_pre", "hook_mlp_out", "hook_attn_out"))]
    assert len(sites) == 6
    _assert_same_sweeps(a, b, lambda out: float(out.logits[:, -1, 5].sum()), sites)


def test_transformer_bridge_make_fx_equals_export():
    tl = pytest.importorskip("transformer_lens", reason="transformer-lens is not installed")
    cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                     act_fn="gelu", normalization_type="LN", seed=0)
    bridge = tl.TransformerBridge.boot_native(cfg).eval()
    tokens = torch.randint(0, 50, (2, 6))
    a, b = _both(bridge, (tokens,), split_heads=True)
    sites = [h for h in a.hook_names if h.endswith(("hook_resid_pre", "hook_z", "hook_result", "hook_mlp_out"))]
    assert len(sites) >= 8
    _assert_same_sweeps(a, b, lambda logits: float(logits[:, -1, 3].sum() - logits[:, -1, 4].sum()), sites)
    plain = torch_ext.ReactiveGraph(bridge, (tokens,), front_end="make_fx")
    assert torch.equal(plain.demand(), bridge(tokens))


# ---- where make_fx cannot vouch for its trace: "auto" falls back, "make_fx" refuses
class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)  # export functionalizes this
        return torch.relu(y)


class _TensorAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # neither a parameter nor a buffer

    def forward(self, x):
        return self.lin(x) * self.scale


class _ItemBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > -1e9:  # data-dependent Python: the trace would bake in one branch
            return y + 1
        return y - 1


class _BoolOfTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("flag", torch.tensor(True))

    def forward(self, x):
        return self.lin(x) if bool(self.flag) else -self.lin(x)


class _ToList(nn.Module):
    def forward(self, x):
        k = int(x.abs().argmax().tolist())
        return x * k


@pytest.mark.parametrize("cls,reason", [(_InPlace, "in-place op"), (_TensorAttribute, "make_fx failed"),
                                        (_ItemBranch, "make_fx failed"), (_BoolOfTensor, "make_fx failed"),
                                        (_ToList, "make_fx failed")])
def test_unsound_traces_fall_back_or_refuse(cls, reason):
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="make_fx cannot trace this model soundly"):
        torch_ext.ReactiveGraph(model, (x,), front_end="make_fx")
    try:
        expected = torch_ext.ReactiveGraph(model, (x,), front_end="export")
    except Exception as e:  # noqa: BLE001  torch.export refuses it too: auto must refuse the same way
        with pytest.raises(type(e)):
            torch_ext.ReactiveGraph(model, (x,))
        return
    rg = torch_ext.ReactiveGraph(model, (x,))
    assert rg.build_stats["front_end"] == "export" and rg.stats["front_end"] == "export"
    assert reason in rg.build_stats["fallback_reason"]
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))
    assert torch.equal(rg.demand(), expected.demand())


def test_keyword_inputs_and_unknown_front_end():
    model = nn.Linear(4, 4).eval()
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="front_end must be one of"):
        torch_ext.ReactiveGraph(model, (x,), front_end="dynamo")
    rg = torch_ext.ReactiveGraph(model, (x,))
    assert rg.build_stats["front_end"] == "make_fx" and rg.build_stats["fallback_reason"] is None
    assert set(rg.build_stats) >= {"trace_s", "import_s", "bind_s", "first_run_s"}


def test_make_fx_leaves_the_model_untouched():
    """Fake tensors never reach the user's module, and its parameters stay its own."""
    from torch_ext.models import TinyTransformer

    model = TinyTransformer(vocab=50, d_model=16, n_heads=2, n_layers=1, seq=4).eval()
    before = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    rg = torch_ext.ReactiveGraph(model, (torch.randint(0, 50, (1, 4)),), front_end="make_fx")
    after = model.state_dict(keep_vars=True)
    for k, (obj, copy) in before.items():
        assert after[k] is obj and torch.equal(after[k], copy) and type(after[k].data) is torch.Tensor
    # The graph computes with the module's own parameters: a weight written in place shows at the next run.
    tokens = torch.randint(0, 50, (1, 4))
    with torch.no_grad():
        model.head.weight.mul_(2) if hasattr(model, "head") else next(model.parameters()).mul_(2)
        assert torch.equal(rg.run(tokens), model(tokens))


# ---- the per-process build cache (torch_ext._build_cache): a sound key, weights rebound
class _Scaled(nn.Module):
    def __init__(self, factor: float = 2.0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.factor = factor

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.factor


def _build(model, x, **kw):
    rg = torch_ext.ReactiveGraph(model, (x,), **kw)
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))
    return rg


def test_build_cache_rebinds_weights_and_misses_on_what_the_trace_depends_on():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    first = _build(_Scaled().eval(), x)
    assert first.build_stats["cache"] in ("miss", "hit")
    other = _Scaled().eval()  # same architecture, other weights
    rg = _build(other, x)
    assert rg.build_stats["cache"] == "hit"
    assert not torch.equal(rg.demand(), first.demand())
    # A weight written in place needs no rebuild, and changes the results: of a new graph, and of the
    # graph built before the write, which takes it as an edit of that input (engine invariant I15).
    before = rg.demand().clone()
    with torch.no_grad():
        other.lin.weight.mul_(-3)
    rg2 = _build(other, x)
    assert rg2.build_stats["cache"] == "hit" and not torch.equal(rg2.demand(), before)
    assert torch.equal(rg2.demand(), other(x)) and torch.equal(rg.demand(), other(x))
    # Shape, dtype, Python state, training mode and code all miss.
    assert _build(other, torch.randn(5, 4)).build_stats["cache"] == "miss"
    assert _build(other.double(), x.double()).build_stats["cache"] == "miss"
    other.float()
    assert _build(_Scaled(3.0).eval(), x).build_stats["cache"] == "miss"
    trained = _Scaled().train()
    assert _build(trained, x).build_stats["cache"] == "miss"

    class Shifted(_Scaled):
        def forward(self, x):
            return torch.relu(self.lin(x)) * self.factor + 1

    assert _build(Shifted().eval(), x).build_stats["cache"] == "miss"
    patched = _Scaled().eval()
    patched.forward = lambda x: torch.sigmoid(patched.lin(x))  # an instance-level forward
    assert _build(patched, x).build_stats["cache"] == "miss"
    hooked = _Scaled().eval()
    hooked.lin.register_forward_hook(lambda m, a, out: out * 0)
    assert _build(hooked, x).build_stats["cache"] == "miss"
    # Turned off.
    assert _build(_Scaled().eval(), x, cache=False).build_stats["cache"] == "off"


_OFFSET = 0.0


def _activation(x):
    return torch.relu(x)


class _ReadsGlobals(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _activation(self.lin(x)) + _OFFSET


def test_build_cache_misses_when_code_or_the_globals_it_reads_change(monkeypatch):
    """A forward's module-level constant or helper reassigned, or a method replaced on the class, between
    two builds: the second build must not reuse the first graph (it would compute the old code)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = _ReadsGlobals().eval()
    _build(model, x)
    assert _build(model, x).build_stats["cache"] == "hit"
    monkeypatch.setitem(globals(), "_OFFSET", 1.5)
    assert _build(model, x).build_stats["cache"] == "miss"  # _build checks the graph against model(x)
    monkeypatch.setitem(globals(), "_activation", torch.sigmoid)
    assert _build(model, x).build_stats["cache"] == "miss"
    monkeypatch.setattr(_ReadsGlobals, "forward", lambda self, x: self.lin(x) * 2)
    assert _build(model, x).build_stats["cache"] == "miss"
    monkeypatch.setattr(_Scaled, "forward", lambda self, x: self.lin(x) - self.factor)
    assert _build(_Scaled().eval(), x).build_stats["cache"] == "miss"


# A user module read by attribute (``import config`` then ``config.SCALE``): not in site-packages, so its
# attributes are the user's state. Made here, as a module object with no file, like a script's own module.
_config = types.ModuleType("_torch_ext_test_config")
_config.SCALE = 2.0
_config.settings = types.SimpleNamespace(shift=0.0)
_config.sub = types.ModuleType("_torch_ext_test_config.sub")
_config.sub.GAIN = 1.0


class _ReadsAModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * _config.SCALE * _config.sub.GAIN + _config.settings.shift


def test_build_cache_misses_when_an_attribute_of_a_user_module_it_reads_changes(monkeypatch):
    """``config.SCALE = 3.0`` between two builds: the module object is the same, so a key holding it by
    identity reused the first graph, which multiplies by 2.0 (_build compares with model(x))."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = _ReadsAModule().eval()
    _build(model, x)
    assert _build(model, x).build_stats["cache"] == "hit"
    monkeypatch.setattr(_config, "SCALE", 3.0)
    assert _build(model, x).build_stats["cache"] == "miss"
    monkeypatch.setattr(_config.settings, "shift", 0.5)
    assert _build(model, x).build_stats["cache"] == "miss"
    monkeypatch.setattr(_config.sub, "GAIN", -1.0)
    assert _build(model, x).build_stats["cache"] == "miss"
    assert _build(model, x).build_stats["cache"] == "hit"


def test_build_cache_off_by_environment(monkeypatch):
    monkeypatch.setenv("TORCH_EXT_BUILD_CACHE", "0")
    assert _build(_Scaled().eval(), torch.randn(3, 4)).build_stats["cache"] == "off"


def test_build_cache_refuses_what_it_cannot_describe():
    torch.manual_seed(0)
    model = _TensorAttribute().eval()
    x = torch.randn(3, 4)
    rg = _build(model, x)
    # The tensor attribute is in the key by content, but export lifts it as a constant of the program,
    # which the cache does not keep.
    assert rg.build_stats["cache"].startswith("uncacheable")
    model.scale = model.scale * 2
    assert _build(model, x).build_stats["cache"].startswith("uncacheable")


def test_build_cache_on_a_transformer_bridge():
    tl = pytest.importorskip("transformer_lens", reason="transformer-lens is not installed")
    import copy

    cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                     act_fn="gelu", normalization_type="LN", seed=0)
    bridge = tl.TransformerBridge.boot_native(cfg).eval()
    tokens = torch.randint(0, 50, (2, 6))
    torch_ext.ReactiveGraph(bridge, (tokens,), cache=False)
    first = torch_ext.ReactiveGraph(bridge, (tokens,))
    twin = copy.deepcopy(bridge)
    with torch.no_grad():
        for p in torch.nn.Module.parameters(twin):
            p.add_(0.01)
    rg = torch_ext.ReactiveGraph(twin, (tokens,))
    assert rg.build_stats["cache"] == "hit", rg.build_stats
    assert rg.hook_names == first.hook_names
    with torch.no_grad():
        assert torch.equal(rg.demand(), twin(tokens))
        assert not torch.equal(rg.demand(), first.demand())


@pytest.mark.parametrize("front_end", ["make_fx", "export"])
def test_tracing_leaves_no_fake_tensor_on_the_module(front_end):
    """nn.LSTM caches its parameters in _flat_weights; tracing used to leave FakeTensors there."""
    model, inputs = ZOO["lstm"].build()
    model.eval()
    torch_ext.ReactiveGraph(model, inputs, front_end=front_end)
    for m in model.modules():
        for v in vars(m).values():
            for t in (v if isinstance(v, list) else [v]):
                assert not isinstance(t, torch._subclasses.FakeTensor)
    with torch.no_grad():
        model(*inputs)


def test_build_cache_key_tells_apart_equal_comparing_values():
    """1, 1.0 and True compare equal in Python, as do 0.0 and -0.0; a trace may depend on the difference."""
    from torch_ext import _build_cache

    x = torch.randn(3, 4)
    keys = []
    for factor in (1, 1.0, True, 0.0, -0.0):
        m = _Scaled(factor).eval()
        m.cfg = {"flag": factor}
        keys.append(_build_cache.fingerprint(m, (x,), {}, ()))
    assert len(set(keys)) == len(keys)
    assert _build_cache.fingerprint(_Scaled(2.0).eval(), (x,), {}, ()) == _build_cache.fingerprint(
        _Scaled(2.0).eval(), (x,), {}, ())


def test_build_cache_key_tells_apart_autocast_per_device_and_dtype():
    """A trace under torch.autocast("cpu") records casts a plain trace has not: the key must differ.
    ``torch.is_autocast_enabled()`` without a device reads CUDA's only, which keyed them alike."""
    from torch_ext import _build_cache

    x = torch.randn(3, 4)

    def key():
        return _build_cache.fingerprint(_Scaled(2.0).eval(), (x,), {}, ())

    plain = key()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu_bf16 = key()
    with torch.autocast("cpu", dtype=torch.float16):
        cpu_f16 = key()
    assert len({plain, cpu_bf16, cpu_f16}) == 3
    assert key() == plain


class _GradModeBlocks(nn.Module):
    """A forward with a torch.no_grad() block and a reentrant checkpoint (torch 2.9's default checkpoint),
    which torch.export records as grad-mode regions (wrap_with_set_grad_enabled)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, 4)

    def forward(self, x):
        from torch.utils import checkpoint

        h = self.a(x)
        with torch.no_grad():
            g = self.b(h) * 2
        return self.head(h + g + checkpoint.checkpoint(self.b, h, use_reentrant=True))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("front_end", ["auto", "export"])
def test_grad_mode_regions_in_forward_are_inlined(front_end):
    # Were refused: "higher-order operator 'wrap_with_set_grad_enabled' is not supported by torch_ext yet".
    # torch_ext runs every graph without autograd, so a region's grad mode changes no value.
    torch.manual_seed(0)
    model = _GradModeBlocks().eval()
    x = torch.randn(2, 5, 8)
    rg = torch_ext.ReactiveGraph(model, (x,), front_end=front_end)
    assert not any("wrap_with_set_grad_enabled" in n.target for n in rg.graph.nodes() if n.kind == "call")
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))
    node = rg.nodes("linear")[0]  # self.a's output, read by the region and by the checkpoint
    rg.patch(node, lambda v: v * -1)
    with torch.no_grad():
        h = -model.a(x)
        want = model.head(h + model.b(h) * 2 + model.b(h))
    assert torch.equal(rg.demand(), want)
    rg.restore()
