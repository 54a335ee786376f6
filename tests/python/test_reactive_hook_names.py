"""TransformerLens hook names on Hugging Face decoders, proven in the traced graph (torch_ext/_hook_proof.py):
each name is offered only where the graph shows what TransformerLens promises for it; every family
transformers ships that builds offline from a tiny config is checked here against those promises, value by
value, bit for bit."""
from __future__ import annotations

import pytest
import torch

import torch_ext

T = pytest.importorskip("transformers", reason="transformers is not installed")

_C = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, intermediate_size=64,
          max_position_embeddings=32, pad_token_id=0)
ALL = {"hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "attn.hook_z"}
STREAM = {"hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post"}


def _llama_like(config, model, **kw):
    return lambda: model(config(**{**_C, "num_key_value_heads": 2, **kw}))


# family -> (model factory, the names offered on every layer).
FAMILIES = {
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)),
             ALL),
    "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                                    rotary_dim=4)), ALL - {"hook_resid_mid"}),
    "codegen": (lambda: T.CodeGenForCausalLM(T.CodeGenConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                                             n_positions=32, rotary_dim=4)), ALL - {"hook_resid_mid"}),
    # hook_z wherever the output projection (c_proj, o_proj, dense, out_proj) reads the heads side by side.
    "falcon_parallel": (lambda: T.FalconForCausalLM(T.FalconConfig(num_hidden_layers=2, hidden_size=32,
                                                                   num_attention_heads=4, vocab_size=64,
                                                                   parallel_attn=True)), STREAM | {"attn.hook_z"}),
    "falcon_sequential": (lambda: T.FalconForCausalLM(T.FalconConfig(num_hidden_layers=2, hidden_size=32,
                                                                     num_attention_heads=4, vocab_size=64,
                                                                     parallel_attn=False)),
                          ALL),
    "falcon_new_architecture": (lambda: T.FalconForCausalLM(T.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, vocab_size=64,
        new_decoder_architecture=True)), STREAM | {"attn.hook_z"}),
    # GPT-NeoX (Pythia): the MLP's norm reads the layer's input when parallel: no resid_mid, as in TransformerLens.
    "neox_parallel": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_C, use_parallel_residual=True)),
                      STREAM | {"attn.hook_z"}),
    "neox_sequential": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_C, use_parallel_residual=False)),
                        ALL),
    "mpt": (lambda: T.MptForCausalLM(T.MptConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, max_seq_len=32)), ALL),
    # OPT runs its residual adds and MLP on [batch * pos, d]: only the layers' inputs and outputs are the stream.
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                 ffn_dim=64, vocab_size=64, word_embed_proj_dim=32,
                                                 max_position_embeddings=32)),
            {"hook_resid_pre", "hook_resid_post", "attn.hook_z"}),
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(**_C)), STREAM | {"attn.hook_z"}),
    "cohere": (_llama_like(T.CohereConfig, T.CohereForCausalLM), STREAM | {"attn.hook_z"}),
    "llama": (_llama_like(T.LlamaConfig, T.LlamaForCausalLM), ALL),
    "mistral": (_llama_like(T.MistralConfig, T.MistralForCausalLM), ALL),
    "qwen2": (_llama_like(T.Qwen2Config, T.Qwen2ForCausalLM), ALL),
    "gemma": (_llama_like(T.GemmaConfig, T.GemmaForCausalLM, head_dim=8), ALL),
    "gemma2": (_llama_like(T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=8, sliding_window=3), ALL),
    "gemma3": (_llama_like(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=8, sliding_window=3), ALL),
    "olmo": (_llama_like(T.OlmoConfig, T.OlmoForCausalLM), ALL),
    "olmo2": (_llama_like(T.Olmo2Config, T.Olmo2ForCausalLM), ALL - {"hook_resid_mid"}),
    "glm4": (_llama_like(T.Glm4Config, T.Glm4ForCausalLM, head_dim=8), ALL),
    "stablelm_sequential": (_llama_like(T.StableLmConfig, T.StableLmForCausalLM), ALL),
    "stablelm_parallel": (_llama_like(T.StableLmConfig, T.StableLmForCausalLM, use_parallel_residual=True),
                          ALL - {"hook_resid_mid"}),
    # Granite scales each branch before the residual add: what TransformerLens calls attn_out / mlp_out is the
    # scaled contribution, which no module outputs.
    "granite": (_llama_like(T.GraniteConfig, T.GraniteForCausalLM, residual_multiplier=0.5), ALL),
    # BLOOM's attention and MLP add the residual themselves: their outputs are resid_mid and resid_post.
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=64)), ALL),
}


def _graph(family):
    torch.manual_seed(0)
    model = FAMILIES[family][0]().eval()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, ids, torch_ext.ReactiveGraph(model, (ids,), cache=False)


def _sums(*xs):
    """x0 + x1 + ... in every order of adding (float addition is commutative, not associative)."""
    if len(xs) == 2:
        return [xs[0] + xs[1]]
    a, b, c = xs
    return [(a + b) + c, (a + c) + b, (b + c) + a]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_offered_hook_name_keeps_its_transformer_lens_promise(family):
    """resid_post(L) is resid_pre(L+1); resid_mid = resid_pre + attn_out; resid_post = resid_mid + mlp_out, or
    without a resid_mid (parallel attention and MLP, as TransformerLens defines them) resid_pre + attn_out +
    mlp_out: checked on the values, bit for bit. On main, BLOOM's hook_mlp_out was resid_post itself and
    Granite's attn_out / mlp_out the unscaled branch outputs, silently."""
    model, ids, rg = _graph(family)
    expected = FAMILIES[family][1]
    _, cache = rg.run_with_cache(ids)
    for layer in range(2):
        offered = {h.split(".", 2)[2] for h in rg.hook_names if h.startswith(f"blocks.{layer}.")}
        assert offered == expected, (family, layer, offered)
        v = {h: cache[f"blocks.{layer}.{h}"] for h in offered}
        if layer == 0:
            assert torch.equal(cache["blocks.0.hook_resid_post"], cache["blocks.1.hook_resid_pre"])
        if "hook_resid_mid" in v:
            if "hook_attn_out" in v:
                assert torch.equal(v["hook_resid_mid"], v["hook_resid_pre"] + v["hook_attn_out"])
            if "hook_mlp_out" in v:
                assert torch.equal(v["hook_resid_post"], v["hook_resid_mid"] + v["hook_mlp_out"])
        elif "hook_attn_out" in v and "hook_mlp_out" in v:
            sums = _sums(v["hook_resid_pre"], v["hook_attn_out"], v["hook_mlp_out"])
            assert any(torch.equal(v["hook_resid_post"], s) for s in sums), family
        if "attn.hook_z" in v:
            assert v["attn.hook_z"].dim() == 4 and v["attn.hook_z"].shape[2] == 4  # [batch, pos, head, d_head]
    with torch.no_grad():
        assert torch.equal(rg.demand().logits, model(ids, use_cache=False).logits)


def test_granite_and_bloom_branch_outputs_are_what_the_residual_adds_read():
    """On main, Granite's hook_attn_out / hook_mlp_out were the attention's and MLP's outputs, which Granite scales
    by residual_multiplier before the residual add, and BLOOM's hook_mlp_out was the MLP's output, which already
    holds the residual (resid_post itself): patching sweeps over them measured other tensors, silently. The names
    are now on the tensors the residual adds read, checked against eager module hooks."""
    seen, handles = {}, []

    def keep(key, scale=None):
        return lambda m, a, o: seen.__setitem__(key, (o[0] if isinstance(o, tuple) else o) * (scale or 1))

    for family in ("granite", "bloom"):
        model, ids, rg = _graph(family)
        for l, layer in enumerate(model.model.layers if family == "granite" else model.transformer.h):
            if family == "granite":
                scale = model.config.residual_multiplier
                handles += [layer.self_attn.register_forward_hook(keep(("attn", l), scale)),
                            layer.mlp.register_forward_hook(keep(("mlp", l), scale))]
            else:
                handles += [layer.self_attention.dense.register_forward_hook(keep(("attn", l))),
                            layer.mlp.dense_4h_to_h.register_forward_hook(keep(("mlp", l)))]
        with torch.no_grad():
            model(ids, use_cache=False)
        for h in handles:
            h.remove()
        handles.clear()
        _, cache = rg.run_with_cache(ids)
        for l in range(2):
            assert torch.equal(cache[f"blocks.{l}.hook_attn_out"], seen[("attn", l)]), (family, l)
            assert torch.equal(cache[f"blocks.{l}.hook_mlp_out"], seen[("mlp", l)]), (family, l)
        clean = rg.demand().logits.clone()
        rg.patch("blocks.1.hook_mlp_out", torch.zeros_like(cache["blocks.1.hook_mlp_out"]))
        patched = rg.demand().logits.clone()
        rg.restore()
        hook = (model.model.layers[1].mlp if family == "granite" else model.transformer.h[1].mlp.dense_4h_to_h
                ).register_forward_hook(lambda m, a, o: torch.zeros_like(o))
        with torch.no_grad():
            assert torch.equal(patched, model(ids, use_cache=False).logits), family
        hook.remove()
        assert torch.equal(rg.demand().logits, clean)


@pytest.mark.parametrize("family, hook, found", [
    ("neox_parallel", "blocks.1.hook_resid_mid", "it is hook_resid_pre itself"),
    ("opt", "blocks.0.hook_attn_out", "hook_resid_post ('view"),
])
def test_a_hook_name_whose_promise_fails_is_refused_saying_why(family, hook, found):
    """A name the graph disproves is not offered: patching, reading or sweeping it says which name, on which
    architecture, and what the graph holds instead; nothing is pinned or changed."""
    model, ids, rg = _graph(family)
    before = rg.demand().logits.clone()
    arch = type(model).__name__
    for attempt in (lambda: rg.patch(hook, torch.zeros(2, 6, 32)), lambda: rg.value(hook),
                    lambda: torch_ext.sweep(rg, [hook], lambda v, s: v * 0, lambda o: o.logits.sum(),
                                            progress=False)):
        with pytest.raises(ValueError) as e:
            attempt()
        msg = str(e.value)
        assert f"hook '{hook}' is not offered on this {arch}" in msg and found in msg, msg
    assert not rg._engine.pinned()
    assert torch.equal(rg.demand().logits, before)
    assert hook not in rg.hook_names and rg.nodes(hook) == []


def test_a_stream_changed_between_layers_refuses_resid_post():
    """A decoder that scales the stream between layers (no family does today; the next one may): the layer's
    output is then not the next layer's resid_pre, so blocks.L.hook_resid_post is refused, naming both tensors;
    every other name still holds and is offered."""
    import torch.nn as nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(8), nn.LayerNorm(8)
            self.self_attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Decoder(nn.Module):
        config = T.PretrainedConfig(num_attention_heads=2)

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Layer(), Layer()])

        def generate(self):  # what marks a Hugging Face LM
            raise NotImplementedError

        def forward(self, x):
            for layer in self.model.layers:
                x = layer(x) * 2.0
            return x

    torch.manual_seed(0)
    model, x = Decoder().eval(), torch.randn(2, 3, 8)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    offered = set(rg.hook_names)
    assert {f"blocks.{l}.{h}" for l in range(2) for h in STREAM | {"hook_resid_mid"}} - offered == {
        "blocks.0.hook_resid_post"}
    with pytest.raises(ValueError, match=r"hook 'blocks.0.hook_resid_post' is not offered on this Decoder: .* the "
                                         r"layer's output is 'add.*' = add.* while blocks.1.hook_resid_pre is 'mul' = mul"):
        rg.value("blocks.0.hook_resid_post")
    _, cache = rg.run_with_cache(x)
    assert torch.equal(cache["blocks.1.hook_resid_post"], rg.demand() / 2.0)
    with torch.no_grad():
        assert torch.equal(cache["blocks.1.hook_resid_pre"], model.model.layers[0](x) * 2.0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_hook_z_patch_of_another_head_shape_is_refused_naming_the_hook_and_changes_nothing(family):
    # Before: [batch, pos, 2, 16] for 4 heads of 8 was merged back to [batch, pos, 32] by the reshape and taken as
    # the heads' values silently (a transposed or regrouped head axis), and a shape of other size was refused in
    # the node's merged layout, naming neither the hook nor the shape the function was handed.
    _, _, rg = _graph(family)
    clean = rg.demand().logits.clone()
    b, t = clean.shape[:2]
    for wrong in (lambda z: z.reshape(b, t, 2, 16).clone(), lambda z: z[:, :, :2].clone()):
        with pytest.raises(ValueError, match=r"hook 'blocks\.0\.attn\.hook_z' returned shape \[.*\]; the hook's value "
                                             rf"is \[batch, pos, head, d_head\] = \[{b}, {t}, 4, 8\]"):
            rg.patch("blocks.0.attn.hook_z", wrong)
        assert rg.patched() == [] and torch.equal(rg.demand().logits, clean)
        with pytest.raises(ValueError, match=r"hook 'blocks\.0\.attn\.hook_z' returned shape"):
            torch_ext.sweep(rg, [("blocks.0.attn.hook_z", 0)], lambda z, s, wrong=wrong: wrong(z), lambda o: 0.0,
                            progress=False)
        assert rg.patched() == [] and torch.equal(rg.demand().logits, clean)
    rg.patch("blocks.0.attn.hook_z", lambda z: torch.zeros_like(z))  # the hook's own shape is taken
    assert rg.patched() != []


def _eager_z(model, family, ids, replace=None):
    """(logits, {layer: z}) of the eager model, z the output projection's input reshaped here to [batch, pos,
    head, d_head]; ``replace`` ({layer: z in that layout}) is fed to the projection instead (merged back here)."""
    layers = model.transformer.h if family == "gpt2" else model.model.layers
    seen, handles = {}, []
    for l, layer in enumerate(layers):
        proj = layer.attn.c_proj if family == "gpt2" else layer.self_attn.o_proj

        def pre(m, args, l=l):
            x = args[0]
            seen[l] = x.reshape(x.shape[0], x.shape[1], 4, x.shape[2] // 4).clone()
            if replace is not None and l in replace:
                return (replace[l].reshape(x.shape),)
            return None
        handles.append(proj.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return logits, seen


def _zero_head(z, h):
    z = z.clone()
    z[:, :, h] = 0
    return z


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_read_and_write_by_hook_name_takes_hook_zs_head_layout(family):
    """On main, rg.value / values / baseline of blocks.<l>.attn.hook_z gave the node's merged [batch, pos, 32] while
    run_with_cache and patch functions gave TransformerLens's [batch, pos, head, d_head]: value(hook)[:, :, h] was a
    slice of the merged dim, not head h; patch(hook, tensor) refused the hook's own layout; graft(hook, block) handed
    the block the merged layout, so a block zeroing head 0 zeroed one feature. Every value here is compared to the
    eager model's (forward hooks on the output projection), at zero tolerance."""
    model, ids, rg = _graph(family)
    hook = "blocks.1.attn.hook_z"
    node = rg.hook_names[hook]
    logits, z = _eager_z(model, family, ids)
    b, t = ids.shape
    assert torch.equal(rg.value(hook), z[1]) and rg.value(hook).shape == (b, t, 4, 8)
    assert torch.equal(rg.value(hook)[:, :, 2], z[1][:, :, 2])  # head 2, as TransformerLens's cache indexes it
    got = rg.values([hook, "blocks.0.attn.hook_z", node])
    assert torch.equal(got[hook], z[1]) and torch.equal(got["blocks.0.attn.hook_z"], z[0])
    assert torch.equal(got[node], z[1].reshape(b, t, 32))  # a node name keeps the node's layout
    assert torch.equal(rg.baseline(hook), z[1])
    assert torch.equal(rg.run_with_cache(ids)[1][hook], z[1])

    # patch by hook name with a tensor in the hook's layout
    patched = _zero_head(z[1], 1)
    want, _ = _eager_z(model, family, ids, {1: patched})
    rg.patch(hook, patched)
    assert torch.equal(rg.demand().logits, want)
    assert torch.equal(rg.value(hook), patched) and torch.equal(rg.baseline(hook), z[1])
    rg.restore()
    # ... and with a function; by node name, the node's layout
    rg.patch(hook, lambda v: _zero_head(v, 1))
    assert torch.equal(rg.demand().logits, want)
    rg.restore()
    rg.patch(node, patched.reshape(b, t, 32))
    assert torch.equal(rg.demand().logits, want)
    rg.restore()
    # the node's merged layout given by hook name is refused, naming the hook and both shapes; nothing changes
    with pytest.raises(ValueError, match=rf"patch '{hook}': got shape \[{b}, {t}, 32\]; the hook's value is \[batch, "
                                         rf"pos, head, d_head\] = \[{b}, {t}, 4, 8\].*node '{node}' holds \[{b}, {t}, 32\]"):
        rg.patch(hook, patched.reshape(b, t, 32))
    assert rg.patched() == [] and torch.equal(rg.demand().logits, logits)

    # sweep's patch functions see the hook's layout, one head per site
    heads = [_eager_z(model, family, ids, {1: _zero_head(z[1], h)})[0][:, -1] for h in range(4)]
    for batch_sites in (False, True):
        res = torch_ext.sweep(rg, [(hook, h) for h in range(4)], lambda v, s: _zero_head(v, s[1]),
                              lambda o: {"last": o.logits[:, -1].clone()}, progress=False, batch_sites=batch_sites)
        for h in range(4):
            assert torch.equal(res.metrics[(hook, h)]["last"], heads[h]), (batch_sites, h)

    # reads= names outputs: a hook shown in another layout than its node's is refused by name
    rg.patch(hook, patched)
    with pytest.raises(ValueError, match=rf"reads: hook '{hook}' is shown as \[batch, pos, head, d_head\] = "
                                         rf"\[{b}, {t}, 4, 8\] where its node '{node}' holds \[{b}, {t}, 32\]"):
        rg.demand(reads={hook: (slice(None), -1)})
    assert torch.equal(rg.demand().logits, want)
    rg.restore()

    # graft by hook name: the block sees the heads; one of another shape is refused and changes nothing
    n = rg.num_nodes
    with pytest.raises(ValueError, match=rf"graft block after hook '{hook}' returned shape \[{b}, {t}, 2, 16\]; the "
                                         rf"hook's value is \[batch, pos, head, d_head\] = \[{b}, {t}, 4, 8\]"):
        rg.graft(hook, lambda v: v.reshape(b, t, 2, 16) * 1)
    assert rg.num_nodes == n and torch.equal(rg.demand().logits, logits)
    rg.graft(hook, lambda v: torch.cat([v[:, :, :1], v[:, :, 1:2] * 0, v[:, :, 2:]], dim=2))
    assert torch.equal(rg.demand().logits, want)


@pytest.mark.parametrize("reads", [None, {"logits": (slice(None), -1)}], ids=["all outputs", "reads="])
def test_the_key_value_cache_the_graph_does_not_compute_is_refused_by_name_when_read(reads):
    # GPT-2 with default kwargs: eager returns past_key_values (config.use_cache), the graph is traced with
    # use_cache=False and its output held None there, so a metric reading the cache failed with "'NoneType'
    # object is not iterable", naming nothing; the logits stay bit for bit eager's.
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)).eval()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(ids)
    assert eager.past_key_values is not None
    rg = torch_ext.ReactiveGraph(model, (ids,))
    out = rg.demand()
    assert torch.equal(out.logits, eager.logits) and list(out.keys()) == ["logits"]
    assert "not computed by the graph" in repr(out.past_key_values)
    why = r"past_key_values \(cache\): GPT2LMHeadModel's key/value cache is not computed by the graph, .*use_cache=False"
    with pytest.raises(ValueError, match=why):
        list(out.past_key_values)
    site = ("blocks.1.hook_resid_pre", 2)
    with pytest.raises(ValueError, match=why):
        torch_ext.sweep(rg, [site], lambda v, s: v * 2, lambda o: o.past_key_values[1][0].sum(), progress=False,
                        reads=reads)
    assert rg.patched() == []
    res = torch_ext.sweep(rg, [site], lambda v, s: v * 2, lambda o: o.logits[:, -1].clone(), progress=False,
                          reads=reads)
    assert res.metrics[site].shape == (2, 64)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_float64_patch_by_hook_name_is_refused_naming_the_hook_in_its_layout_and_changes_nothing(family):
    # Before: "patch %reshape_3: expected dtype torch.float32, got Double" (the node, which the user never wrote).
    _, _, rg = _graph(family)
    clean = rg.demand().logits.clone()
    b, t = clean.shape[:2]
    for hook, shown in (("blocks.0.attn.hook_z", rf"\[batch, pos, head, d_head\] = \[{b}, {t}, 4, 8\]"),
                        ("blocks.1.hook_resid_post", rf"\[{b}, {t}, 32\]")):
        for call in (lambda: rg.patch(hook, rg.value(hook).double()),
                     lambda: rg.patch(hook, lambda v: v.double()),
                     lambda: torch_ext.sweep(rg, [(hook, 0), (hook, 1)], lambda v, s: v.double(), lambda o: 0.0,
                                             progress=False, batch_sites=True),
                     lambda: rg.graft(hook, lambda v: v.double())):
            with pytest.raises(ValueError, match=rf"'{hook}'.* dtype torch\.float64; the hook's value is {shown} of "
                                                 r"dtype torch\.float32"):
                call()
            assert rg.patched() == [] and torch.equal(rg.demand().logits, clean)
