"""rg.gradient: d metric(outputs) / d value(node) on a ReactiveGraph (attribution patching), against eager
autograd's retain_grad() gradients, bit for bit (the cone re-runs the same ATen ops under autograd)."""
from __future__ import annotations

import copy

import pytest
import torch

import torch_ext


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4)).eval()
    return model, torch.randn(3, 8)


def _mlp_metric(out):
    return (out[:, 0] - out[:, 1]).sum()


def _eager_grads(model, run, metric, sites):
    """{name: .grad} of the outputs of the modules ``sites`` {name: (module, pre)} (pre: the module's first
    input), from one eager forward and backward; the hooks are removed again."""
    acts, handles = {}, []
    for name, (module, pre) in sites.items():
        def keep(t, name=name):
            t.retain_grad()
            acts[name] = t
        if pre:
            handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, keep=keep: keep(args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(lambda m, i, o, keep=keep: keep(o)))
    try:
        metric(run()).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return {name: t.grad for name, t in acts.items()}


def _retain(acts, name, then=None):
    """A forward hook keeping its module's output (retain_grad) under ``name``; ``then`` replaces it after."""
    def hook(module, inputs, out):
        out.retain_grad()
        acts[name] = out
        return then(out) if then is not None else None
    return hook


def _retained_block(acts, name, block):
    """``then`` for ``_retain``: eager's graft, ``block`` run on the output, its result kept (retain_grad) under
    ``name`` and returned in place of the output."""
    def run(out):
        y = block(out)
        y.retain_grad()
        acts[name] = y
        return y
    return run


def test_mlp_gradients_equal_eager_for_nodes_upstream_of_each_other():
    model, x = _mlp()
    rg = torch_ext.ReactiveGraph(model, (x,))
    stats, out = dict(rg.stats), rg.demand()
    got = rg.gradient(_mlp_metric, ["tanh", "linear_1", "gelu"])
    assert dict(rg.stats) == stats and rg.demand() is out  # a read: nothing evaluated, nothing replaced
    want = _eager_grads(model, lambda: model(x), _mlp_metric,
                        {"tanh": (model[1], False), "linear_1": (model[2], False), "gelu": (model[3], False)})
    for name in want:  # tanh's is the total derivative, through linear_1 and gelu, as eager's is
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(rg.gradient(_mlp_metric, "tanh"), want["tanh"])  # one name: the tensor itself


def test_a_standing_patch_is_a_constant_and_the_gradient_is_at_the_patched_values():
    model, x = _mlp()
    rg = torch_ext.ReactiveGraph(model, (x,))
    rg.patch("linear_1", lambda v: v * 0.5 + 1)
    patched = rg.value("linear_1")
    rg.reset_stats()
    got = rg.gradient(_mlp_metric, ["tanh", "linear_1", "gelu"])
    # Eager with a hook pinning linear_1's output to the patched tensor (a constant, as the patch is).
    leaf = patched.clone().requires_grad_(True)
    h = model[2].register_forward_hook(lambda m, i, o: leaf)
    acts = {}
    h2 = model[3].register_forward_hook(_retain(acts, "gelu"))
    try:
        _mlp_metric(model(x)).backward()
    finally:
        h.remove(), h2.remove()
    assert torch.equal(got["linear_1"], leaf.grad)
    assert torch.equal(got["gelu"], acts["gelu"].grad)
    assert torch.equal(got["tanh"], torch.zeros(3, 16))  # tanh reaches the output only through the patch
    assert rg.stats["evaluations"] == 0


def test_a_stale_graph_is_left_stale_and_its_counts_untouched():
    model, x = _mlp()
    rg = torch_ext.ReactiveGraph(model, (x,))
    value = rg.value("tanh") * 2
    rg.patch("tanh", value)  # not demanded: its cone is stale
    dirty, stats = rg._engine.num_dirty(), dict(rg.stats)
    got = rg.gradient(_mlp_metric, "gelu")
    assert rg._engine.num_dirty() == dirty and dict(rg.stats) == stats
    rg.demand()
    assert rg.stats["evaluations"] - stats["evaluations"] == len(rg.cone("tanh"))  # the cone, once, as before
    assert torch.equal(got, rg.gradient(_mlp_metric, "gelu"))


def test_a_grafted_block_is_differentiated_through():
    model, x = _mlp()
    rg = torch_ext.ReactiveGraph(model, (x,))
    rg.graft("tanh", lambda t: 2 * torch.sin(t))
    got = rg.gradient(_mlp_metric, ["linear", "tanh"])
    acts = {}
    h1 = model[0].register_forward_hook(_retain(acts, "linear"))
    h2 = model[1].register_forward_hook(_retain(acts, "tanh", then=lambda o: 2 * torch.sin(o)))
    try:
        _mlp_metric(model(x)).backward()
    finally:
        h1.remove(), h2.remove()
    assert torch.equal(got["linear"], acts["linear"].grad)
    assert torch.equal(got["tanh"], acts["tanh"].grad)


def test_train_mode_batch_norm_gradients_equal_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4)).train()
    x = torch.randn(5, 8)
    rg = torch_ext.ReactiveGraph(model, (x,))
    got = rg.gradient(_mlp_metric, ["linear", "tanh"])
    running = model[1].running_mean.clone()
    want = _eager_grads(model, lambda: model(x), _mlp_metric, {"linear": (model[0], False), "tanh": (model[2], False)})
    model[1].running_mean.copy_(running)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("masked", [False, True])
def test_gpt2_resid_pre_and_hook_z_equal_eager(masked):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)).eval()
    tokens = torch.randint(0, 64, (2, 6))
    kwargs = {}
    if masked:
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, :2] = 0  # left padding
        kwargs = {"attention_mask": mask}
    rg = torch_ext.ReactiveGraph(model, (tokens,), example_kwargs=kwargs)

    def metric(out):
        return (out.logits[:, -1, 3] - out.logits[:, -1, 4]).sum()

    names = [f"blocks.{l}.{h}" for l in range(2) for h in ("hook_resid_pre", "attn.hook_z")]
    got = rg.gradient(metric, names)
    sites = {}
    for l in range(2):
        sites[f"blocks.{l}.hook_resid_pre"] = (model.transformer.h[l], True)
        sites[f"blocks.{l}.attn.hook_z"] = (model.transformer.h[l].attn.c_proj, True)
    want = _eager_grads(model, lambda: model(tokens, use_cache=False, **kwargs), metric, sites)
    for name in names:
        w = want[name].view(2, 6, 4, 8) if name.endswith("hook_z") else want[name]  # the hook's layout
        assert got[name].shape == w.shape and torch.equal(got[name], w), name
    node = rg.hook_names["blocks.1.attn.hook_z"]  # by node name: the node's own layout
    assert torch.equal(rg.gradient(metric, node), want["blocks.1.attn.hook_z"])


_GQA_CONFIGS = {"llama": ("LlamaForCausalLM", "LlamaConfig", {}), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
                "mistral": ("MistralForCausalLM", "MistralConfig", {}),
                "gemma": ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 8})}


@pytest.mark.parametrize("mask", [None, "pad"])
@pytest.mark.parametrize("arch", list(_GQA_CONFIGS))
def test_grouped_query_attention_values_and_gradients_equal_eager(arch, mask):
    """Grouped-query attention (4 query heads, 2 key/value heads, sdpa) with no padding mask: eager passes no mask,
    so SDPA runs is_causal and shares the key/value heads inside its kernel (enable_gqa). The graph was traced
    with the mask materialised and the heads repeated (transformers' packed-sequence check always keeps a mask
    while tracing) and block 0's hook_resid_pre gradient was 6e-8 off eager (1.8e-8 relative on Llama); now the
    graph takes eager's decision for its shapes. With left padding eager repeats the heads too."""
    T = pytest.importorskip("transformers")
    model_cls, config_cls, extra = _GQA_CONFIGS[arch]
    torch.manual_seed(0)
    config = getattr(T, config_cls)(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=64, vocab_size=100, max_position_embeddings=64,
                                    attn_implementation="sdpa", **extra)
    model = getattr(T, model_cls)(config).eval()
    tokens = torch.randint(0, 100, (2, 6))
    kwargs = {}
    if mask == "pad":
        kwargs = {"attention_mask": torch.ones(2, 6, dtype=torch.long)}
        kwargs["attention_mask"][1, :2] = 0
    rg = torch_ext.ReactiveGraph(model, (tokens,), example_kwargs=kwargs)

    def metric(out):
        return (out.logits[:, -1, 3] - out.logits[:, -1, 4]).sum()

    names = [f"blocks.{l}.{h}" for l in range(2) for h in ("hook_resid_pre", "attn.hook_z")]
    got = rg.gradient(metric, names)
    values = {name: rg.value(name) for name in names}
    sites = {}
    for l, layer in enumerate(model.model.layers):
        sites[f"blocks.{l}.hook_resid_pre"] = (layer, True)
        sites[f"blocks.{l}.attn.hook_z"] = (layer.self_attn.o_proj, True)
    acts = {}
    handles = [mod.register_forward_pre_hook(
        lambda m, args, kw, name=name: acts.__setitem__(name, (args[0] if args else kw["hidden_states"]).detach()),
        with_kwargs=True) for name, (mod, _) in sites.items()]
    try:
        with torch.no_grad():
            eager_logits = model(tokens, use_cache=False, **kwargs).logits
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(rg.demand().logits, eager_logits)
    want = _eager_grads(model, lambda: model(tokens, use_cache=False, **kwargs), metric, sites)
    for name in names:
        w, a = want[name], acts[name]
        if name.endswith("hook_z"):  # the hook's layout
            w, a = w.view(2, 6, 4, 8), a.view(2, 6, 4, 8)
        assert torch.equal(values[name], a), name
        assert got[name].shape == w.shape and torch.equal(got[name], w), name


def test_bridge_gradients_equal_transformer_lens_gradient_cache():
    tl = pytest.importorskip("transformer_lens")
    ap = pytest.importorskip("transformer_lens.tools.analysis.attribution_patching")
    cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                     act_fn="gelu", normalization_type="LN", seed=0)
    bridge = tl.TransformerBridge.boot_native(cfg).eval()
    tokens = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))

    def metric(logits):
        return logits[:, -1, 3].mean() - logits[:, -1, 4].mean()

    rg = torch_ext.ReactiveGraph(bridge, (tokens,))
    # Every hook TransformerLens lets one register without switching a flag on. Its eager gradients move in the
    # last bit with the set of hooks registered (its backward hooks change where autograd sums the branches of
    # the residual stream): with only resid_pre, hook_z and mlp_out of both layers, 5 of those 6 differ from
    # these by up to 1.5e-7, while these 76 all equal rg.gradient's bit for bit.
    names = [h for h in rg.hook_names if h.startswith("blocks.") and not any(
        flag in h for flag in ("mlp_in", "attn_in", "_input"))]
    cache = ap.cache_activation_and_gradient(bridge, tokens, metric, names_filter=names)
    want = {h: g for h, g in cache.gradients.items() if g is not None}
    assert len(want) > 60 and {"blocks.0.hook_resid_pre", "blocks.1.attn.hook_z"} <= set(want)
    got = rg.gradient(metric, list(want))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_refusals_name_the_culprit_and_change_nothing():
    model, x = _mlp()
    rg = torch_ext.ReactiveGraph(model, (x,))
    stats = dict(rg.stats)
    with pytest.raises(TypeError, match=r"metric <lambda> returned float"):
        rg.gradient(lambda out: float(out.sum()), "tanh")
    with pytest.raises(TypeError, match=r"returned a torch.float32 tensor of shape \[3\]"):
        rg.gradient(lambda out: out[:, 0], "tanh")
    with pytest.raises(RuntimeError, match="depends on none of the requested nodes"):
        rg.gradient(lambda out: out.detach().sum(), "tanh")
    with pytest.raises(RuntimeError, match="unknown node 'nope'"):
        rg.gradient(_mlp_metric, "nope")
    with pytest.raises(TypeError, match="expected node or hook names"):
        rg.gradient(_mlp_metric, [3])
    assert dict(rg.stats) == stats and not rg.patched()

    idx = torch.tensor([[1, 2, 3]])
    emb = torch_ext.ReactiveGraph(torch.nn.Embedding(8, 4).eval(), (idx,))
    token_node = [n.name for n in emb.graph.nodes() if n.kind == "placeholder" and n.role == "input"][0]
    with pytest.raises(ValueError, match=rf"node '{token_node}' holds a i64 tensor"):
        emb.gradient(lambda out: out.sum(), token_node)


def test_refused_inside_a_sweep_metric_and_on_a_joint_graph():
    model, x = _mlp()
    rg = torch_ext.ReactiveGraph(model, (x,))

    def metric(out):
        rg.gradient(_mlp_metric, "tanh")
        return float(out.sum())

    with pytest.raises(RuntimeError, match=r"gradient\(\) from a sweep's metric|gradient\(\) is not allowed"):
        torch_ext.sweep(rg, [("tanh", 0)], lambda v, s: v * 0, metric)

    from helpers import joint_of_summed

    model, x = _mlp()
    joint = torch_ext.ReactiveGraph(joint_of_summed(model, x))
    joint.run(x)
    with pytest.raises(ValueError, match="joint forward\\+backward program"):
        joint.gradient(lambda out: out[0], "tanh")


class _RMS(torch.nn.Module):
    def forward(self, x):  # reads x twice: two consumers of its input
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Residual(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.lin = _RMS(), torch.nn.Linear(d, d)

    def forward(self, x):  # a third consumer: the residual add, after the norm's two
        return x + self.lin(self.norm(x))


class _ResidualModel(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.emb, self.layer, self.head = torch.nn.Linear(d, d), _Residual(d), torch.nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.layer(self.emb(x)))


@pytest.mark.parametrize("seed", range(4))
def test_an_edge_graft_keeps_eager_accumulation_order_of_a_multi_reader_gradient(seed):
    """graft(src, dst, block) on the residual add's edge is, in eager, a forward pre-hook on the reader's module
    (``layer``) running the block, with its norm given the value back: eager creates the block before the norm's
    two readers, so its gradient is added to theirs last. The cone ran it where the engine splices it (right
    before the add, after the norm's readers) and added it first: 6e-8 off eager on a Llama (fuzz_sweep's
    gradient_after_an_edge_graft_on_a_llama), 1.5e-8 to 3e-8 here (seeds 0-3), silently. Bit for bit now."""
    torch.manual_seed(seed)
    model, x = _ResidualModel().eval(), torch.randn(3, 5, 16)
    blk = torch.nn.Linear(16, 16)
    ref_model, ref_blk = copy.deepcopy(model), copy.deepcopy(blk)
    rg = torch_ext.ReactiveGraph(model, (x,))
    src = next(n for n in rg.nodes() if rg._module_paths.get(n) == "emb")
    from torch_ext.reactive import _node_inputs
    readers = [n.name for n in rg.graph.nodes() if src in _node_inputs(n)]
    dst = next(n for n in readers if rg._module_paths.get(n) == "layer")
    assert len(readers) == 3, readers  # pow and mul in the norm, the residual add
    rg.graft(src, dst, blk)
    metric = lambda out: (out[..., 0] * out[..., 1]).sum()  # noqa: E731
    got = rg.gradient(metric, [src])[src]

    state, acts = {}, {}

    def block_in(mod, args):
        acts["src"] = args[0]
        args[0].retain_grad()
        state["x"] = args[0]
        return (ref_blk(args[0]),)
    hs = [ref_model.layer.register_forward_pre_hook(block_in),
          ref_model.layer.norm.register_forward_pre_hook(lambda mod, args: (state["x"],))]
    try:
        out = ref_model(x)
        metric(out).backward()
    finally:
        for h in hs:
            h.remove()
    want = acts["src"].grad
    assert torch.equal(rg.demand(), out.detach())  # the graft is eager's pre-hooks: the same values
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("seed", range(2))
def test_a_node_graft_before_three_readers_keeps_eager_accumulation_order(seed):
    """The node form, graft(src, block), is eager's forward hook on src's module: the block runs right after src,
    where the engine splices it, so its output's three readers (the norm's two, the residual add) are created in
    eager's order and its gradient sums them as eager's does, bit for bit."""
    torch.manual_seed(seed)
    model, x = _ResidualModel().eval(), torch.randn(3, 5, 16)
    blk = torch.nn.Linear(16, 16)
    ref_model, ref_blk = copy.deepcopy(model), copy.deepcopy(blk)
    rg = torch_ext.ReactiveGraph(model, (x,))
    src = next(n for n in rg.nodes() if rg._module_paths.get(n) == "emb")
    names = rg.graft(src, blk)
    metric = lambda out: (out[..., 0] * out[..., 1]).sum()  # noqa: E731
    got = rg.gradient(metric, [src, names[-1]])

    acts = {}

    after = _retain(acts, "src", then=_retained_block(acts, "blk", ref_blk))
    h = ref_model.emb.register_forward_hook(after)
    try:
        out = ref_model(x)
        metric(out).backward()
    finally:
        h.remove()
    assert torch.equal(rg.demand(), out.detach())
    assert torch.equal(got[names[-1]], acts["blk"].grad), (got[names[-1]] - acts["blk"].grad).abs().max()
    assert torch.equal(got[src], acts["src"].grad), (got[src] - acts["src"].grad).abs().max()


class _CamelNorm(torch.nn.Module):
    """A Hugging Face BERT's naming: a LayerNorm attribute spelled ``LayerNorm`` (parameters p_LayerNorm_weight)."""

    def __init__(self):
        super().__init__()
        self.dense, self.LayerNorm, self.out = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.LayerNorm(torch.tanh(self.dense(x))))


def test_a_cone_reading_a_camel_case_parameter_equals_eager():
    """fuzz_sweep seed 62 on BERT: rg.gradient at any node upstream of a LayerNorm attribute named ``LayerNorm``
    raised "unknown node 'p_..._layer_norm_weight'" (FX snake-cases a placeholder's name; the engine knows
    p_..._LayerNorm_weight). Now the gradients, at an activation and at the parameter itself, are eager's."""
    torch.manual_seed(0)
    model, x = _CamelNorm().eval(), torch.randn(2, 5, 8)
    rg = torch_ext.ReactiveGraph(model, (x,))
    metric = lambda out: (out[..., 0] * out[..., 1]).sum()  # noqa: E731
    stats = dict(rg.stats)
    got = rg.gradient(metric, ["tanh", "p_LayerNorm_weight"])
    assert dict(rg.stats) == stats
    tanh_out = []  # eager: the LayerNorm's input (tanh's output), kept by a pre-hook
    h = model.LayerNorm.register_forward_pre_hook(lambda m, args: tanh_out.append(args[0]))
    try:
        out = model(x)
    finally:
        h.remove()
    want_tanh, want_w = torch.autograd.grad(metric(out), [tanh_out[0], model.LayerNorm.weight])
    assert torch.equal(got["tanh"], want_tanh), (got["tanh"] - want_tanh).abs().max()
    assert torch.equal(got["p_LayerNorm_weight"], want_w), (got["p_LayerNorm_weight"] - want_w).abs().max()


class _KeptLayout(torch.nn.Module):
    """fuzz_sweep's linear_kept block: its result written into a fresh tensor of the input's layout (copy_)."""

    def __init__(self, inner, broadcast=False):
        super().__init__()
        self.inner, self.broadcast = inner, broadcast

    def forward(self, t):
        y = self.inner(t)
        return torch.empty_like(t).copy_(y.mean(-1, keepdim=True) if self.broadcast else y)


@pytest.mark.parametrize("broadcast", [False, True])
def test_a_grafted_block_ending_in_copy_is_differentiated_as_eager(broadcast):
    """fuzz_sweep seed 62 (15 of 229 cases' gradient calls): a grafted block ending in
    ``torch.empty_like(t).copy_(f(t))`` is traced as the functional aten.copy, which has no autograd formula, so
    rg.gradient raised torch's "derivative for aten::copy is not implemented"; eager differentiates copy_ (the
    identity into the source, summed over a broadcast; zero into the overwritten tensor). Bit for bit now."""
    model, x = _mlp()
    torch.manual_seed(1)
    blk = _KeptLayout(torch.nn.Linear(16, 16), broadcast)
    ref_blk = copy.deepcopy(blk)
    rg = torch_ext.ReactiveGraph(model, (x,))
    names = rg.graft("tanh", blk)
    got = rg.gradient(_mlp_metric, ["linear", "tanh", names[-1]])
    acts = {}

    after = _retain(acts, "tanh", then=_retained_block(acts, "blk", ref_blk))
    h1 = model[0].register_forward_hook(_retain(acts, "linear"))
    h2 = model[1].register_forward_hook(after)
    try:
        out = model(x)
        _mlp_metric(out).backward()
    finally:
        h1.remove(), h2.remove()
    assert torch.equal(rg.demand(), out.detach())
    for name, want in (("linear", acts["linear"].grad), ("tanh", acts["tanh"].grad), (names[-1], acts["blk"].grad)):
        assert torch.equal(got[name], want), (name, (got[name] - want).abs().max())
