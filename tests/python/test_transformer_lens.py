"""torch_ext.patching against transformer_lens.patching on a TransformerBridge (issue 12).

Skipped when transformer-lens is not installed (CI installs it). Every function must return the
same tensor as TransformerLens's own, bit for bit, at batch 1 and batch 8.
"""
from __future__ import annotations

import pytest
import torch

tl = pytest.importorskip("transformer_lens", reason="transformer-lens is not installed")
import transformer_lens.patching as tl_patching  # noqa: E402

import torch_ext  # noqa: E402
from torch_ext import patching  # noqa: E402

FUNCTIONS = ["get_act_patch_resid_pre", "get_act_patch_resid_mid", "get_act_patch_attn_out", "get_act_patch_mlp_out",
             "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_out_by_pos", "get_act_patch_block_every",
             "get_act_patch_attn_head_q_all_pos", "get_act_patch_attn_head_k_by_pos", "get_act_patch_attn_head_v_all_pos",
             "get_act_patch_attn_head_pattern_all_pos", "get_act_patch_attn_head_pattern_by_pos",
             "get_act_patch_attn_head_all_pos_every", "get_act_patch_attn_head_by_pos_every",
             "get_act_patch_attn_head_pattern_dest_src_pos"]


@pytest.fixture(scope="module")
def bridge():
    cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                     act_fn="gelu", normalization_type="LN", seed=0)
    return tl.TransformerBridge.boot_native(cfg).eval()


def _prompts(batch):
    g = torch.Generator().manual_seed(batch)
    clean = torch.randint(0, 50, (batch, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 11) % 50
    return clean, corrupted


def _metric(logits):
    return logits[:, -1, 3].mean() - logits[:, -1, 4].mean()


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_patching_equals_transformer_lens(bridge, batch, name):
    clean, corrupted = _prompts(batch)
    _, clean_cache = bridge.run_with_cache(clean)
    expected = getattr(tl_patching, name)(bridge, corrupted, clean_cache, _metric)
    got = getattr(patching, name)(bridge, corrupted, clean_cache, _metric)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def test_reactive_graph_on_a_bridge_and_its_hook_names(bridge):
    clean, _ = _prompts(2)
    logits, tl_cache = bridge.run_with_cache(clean)
    rg = torch_ext.ReactiveGraph(bridge, (clean,))
    assert torch.equal(rg.demand(), logits)
    out, cache = rg.run_with_cache(clean)
    # Every hook TransformerLens caches is addressable, except the post-hoc attention scores (TL fires
    # them after the wrapped attention consumed its input, so they cannot be patched there either).
    missing = [k for k in tl_cache.keys() if k not in cache]
    assert all("attn_scores" in k for k in missing), missing
    for k in tl_cache.keys():
        if k in cache:
            assert torch.equal(cache[k], tl_cache[k]), k
    assert len(rg.nodes("blocks.*.hook_resid_pre")) == 2
    # Our own cache works as a clean cache too.
    _, corrupted = _prompts(2)
    a = patching.get_act_patch_resid_pre(bridge, corrupted, cache, _metric)
    b = tl_patching.get_act_patch_resid_pre(bridge, corrupted, tl_cache, _metric)
    assert torch.equal(a, b)


def test_patching_refuses_training_mode_and_unsupported_options(bridge):
    clean, corrupted = _prompts(1)
    _, clean_cache = bridge.run_with_cache(clean)
    with pytest.raises(ValueError, match="reduce"):
        patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric, reduce="median")
    with pytest.raises(ValueError, match=r"\[batch\] tensor"):  # per-example reduce needs a per-example metric
        patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric, reduce="mean")
    with pytest.raises(ValueError, match="scalar"):
        patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, lambda l: l[:, -1, 3], reduce="scalar")
    bridge.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    finally:
        bridge.eval()


def test_an_index_whose_first_axis_is_not_the_layer_is_refused(bridge):
    # TransformerLens names the hook by the first column and its setters unpack (layer, pos) in column
    # order; the 'layer' column found by name while a setter read the row as (layer, pos) patched
    # position <layer> of layer <pos>'s hook, silently.
    import pandas as pd

    clean, corrupted = _prompts(1)
    _, clean_cache = bridge.run_with_cache(clean)
    setter = tl_patching.layer_pos_patch_setter
    df = pd.DataFrame([(p, layer) for layer in range(2) for p in range(6)], columns=["pos", "layer"])
    with pytest.raises(ValueError, match=r"first axis must be 'layer'.*\['pos', 'layer'\]"):
        patching.generic_activation_patch(bridge, corrupted, clean_cache, _metric, setter, "resid_pre", index_df=df)
    with pytest.raises(ValueError, match=r"first axis must be 'layer'"):
        patching.generic_activation_patch(bridge, corrupted, clean_cache, _metric, setter, "resid_pre",
                                          ["pos", "layer"])
    ours = patching.generic_activation_patch(bridge, corrupted, clean_cache, _metric, setter, "resid_pre",
                                             index_df=df[["layer", "pos"]])
    theirs = tl_patching.generic_activation_patch(bridge, corrupted, clean_cache, _metric, setter, "resid_pre",
                                                  index_df=df[["layer", "pos"]])
    assert torch.equal(ours, theirs)


def test_patching_sees_weights_changed_after_the_first_call(bridge):
    """The graph is exported from a copy of the bridge: a weight written afterwards must rebuild it."""
    clean, corrupted = _prompts(1)
    _, clean_cache = bridge.run_with_cache(clean)
    first = patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    w = next(p for n, p in torch.nn.Module.named_parameters(bridge) if n.endswith("weight") and p.dim() == 2)
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(1.5)
        _, clean_cache = bridge.run_with_cache(clean)
        expected = tl_patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
        got = patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
        assert torch.equal(got, expected)
        assert not torch.equal(got, first)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_patching_sees_weights_written_through_data(bridge):
    """``w.data.mul_(1.5)`` (or ``w.data[i] = 0``) does not move ``w``'s version counter (``.data`` has one of its
    own): the second call reused the graph and its cached runs, answering with the old weights (0.35 off
    TransformerLens on a resid_pre sweep). Weights are compared by content at each call."""
    clean, corrupted = _prompts(1)
    _, clean_cache = bridge.run_with_cache(clean)
    first = patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    w = next(p for n, p in torch.nn.Module.named_parameters(bridge) if n.endswith("weight") and p.dim() == 2)
    saved = w.detach().clone()
    try:
        w.data.mul_(1.5)
        _, clean_cache = bridge.run_with_cache(clean)
        expected = tl_patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
        got = patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
        assert not torch.equal(expected, first)
        assert torch.equal(got, expected)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_patching_sees_corrupted_tokens_edited_in_place(bridge):
    """The graph kept the corrupted run of the same tensor object: tokens edited in place since (a new
    corruption written into the same buffer) were ignored, every site patched onto the old corrupted run
    (0.17 off TransformerLens here). The second call must run the edited tokens."""
    clean, corrupted = _prompts(1)
    _, clean_cache = bridge.run_with_cache(clean)
    patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    corrupted[:, 4] = (corrupted[:, 4] + 7) % 50  # the same tensor object, new values
    expected = tl_patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    got = patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    assert torch.equal(got, expected)
    # A ReactiveGraph handed in is run again too, so its run_with_cache / demand agree with the tokens.
    rg = torch_ext.ReactiveGraph(bridge, (corrupted,))
    corrupted[:, 1] = (corrupted[:, 1] + 3) % 50
    expected = tl_patching.get_act_patch_attn_out(bridge, corrupted, clean_cache, _metric)
    assert torch.equal(patching.get_act_patch_attn_out(rg, corrupted, clean_cache, _metric), expected)


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_patching_sees_corrupted_tokens_written_through_data_or_numpy(bridge, how):
    """Written through ``.data`` or ``.numpy()``, the tokens keep their version counter: the second call took
    them for the ones already run and patched onto the old corrupted run (0.15 off TransformerLens)."""
    clean, corrupted = _prompts(1)
    _, clean_cache = bridge.run_with_cache(clean)
    patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    view = corrupted.data if how == "data" else torch.from_numpy(corrupted.numpy())
    view[:, 4] = (view[:, 4] + 7) % 50
    expected = tl_patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric)
    assert torch.equal(patching.get_act_patch_resid_pre(bridge, corrupted, clean_cache, _metric), expected)


def test_reactive_graph_of_a_bridge_computes_with_its_live_weights(bridge):
    """The graph is traced from a copy of the bridge, but binds the bridge's own parameters: a weight
    written afterwards shows at the next run (never a stale copy)."""
    clean, _ = _prompts(1)
    rg = torch_ext.ReactiveGraph(bridge, (clean,))
    before = rg.run(clean).clone()
    w = next(p for n, p in torch.nn.Module.named_parameters(bridge) if n.endswith("weight") and p.dim() == 2)
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(2.0)
            after = rg.run(clean)
            assert torch.equal(after, bridge(clean)) and not torch.equal(after, before)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_patching_leaves_no_trace_on_the_model_or_on_the_model_it_was_copied_from():
    """Export runs the bridge under fake tensors. TransformerLens 4's blocks store the pre-LN residual on
    an attention module through hook closures, which a deep copy shares with its original: patching a
    copy used to leave export-time FakeTensors on the ORIGINAL model (it could no longer be deep-copied,
    and it kept the traced graph alive)."""
    import copy

    cfg = tl.TransformerBridgeConfig(n_layers=1, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                     act_fn="gelu", normalization_type="LN", seed=0)
    original = tl.TransformerBridge.boot_native(cfg).eval()
    clean, corrupted = _prompts(1)
    _, clean_cache = original.run_with_cache(clean)
    copied = copy.deepcopy(original)
    before = {id(m): dict(vars(m)) for m in torch.nn.Module.modules(original)}
    patching.get_act_patch_resid_pre(copied, corrupted, clean_cache, _metric)
    for m in torch.nn.Module.modules(original):
        for k, v in vars(m).items():
            assert before[id(m)].get(k) is v, f"{type(m).__name__}.{k} was written by the sweep"
    copy.deepcopy(original)
    copy.deepcopy(copied)


def _per_example(logits):
    return logits[:, -1, 3] - logits[:, -1, 4]


@pytest.mark.parametrize("kwargs,metric", [
    ({"reduce": "mean"}, _per_example), ({"reduce": "none"}, _per_example), ({"baseline": True}, _metric),
    ({}, {"diff": _metric, "logit7": lambda l: l[:, -1, 7].mean()}),
    ({"reduce": "none", "baseline": True}, {"diff": _per_example})],
    ids=["mean", "none", "baseline", "metric_mapping", "none_baseline_mapping"])
@pytest.mark.parametrize("name", ["get_act_patch_attn_head_out_by_pos", "get_act_patch_attn_head_all_pos_every",
                                  "get_act_patch_block_every"])
def test_reduce_baseline_and_metric_mappings_equal_transformer_lens(bridge, kwargs, metric, name):
    clean, corrupted = _prompts(3)
    _, clean_cache = bridge.run_with_cache(clean)
    expected = getattr(tl_patching, name)(bridge, corrupted, clean_cache, metric, **kwargs)
    got = getattr(patching, name)(bridge, corrupted, clean_cache, metric, **kwargs)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
        return
    assert type(got) is type(expected)
    assert torch.equal(got.values, expected.values)
    assert (got.baseline is None) == (expected.baseline is None)
    if expected.baseline is not None:
        assert torch.equal(got.baseline, expected.baseline)
    assert got.axis_names == expected.axis_names and got.metric_names == expected.metric_names
    assert got.index_df.equals(expected.index_df) and got.reduced == expected.reduced


@pytest.mark.parametrize("batch", [1, 8])
def test_split_heads_gives_hook_result_sites_equal_to_head_output_patching(bridge, batch):
    """ReactiveGraph(split_heads=True) splits each attention output projection into per-head results
    (TransformerLens hook_result, [batch, pos, head, d_model]) plus a sum. Patching a head's result
    is patching its z through W_O: the sweep equals TransformerLens's z patching within 1e-6 (the
    sum over heads adds in another order than one linear). TransformerLens 4's own bridge cannot give
    hook_result for this model (set_use_attn_result refuses AttentionBridge)."""
    clean, corrupted = _prompts(batch)
    _, tl_cache = bridge.run_with_cache(clean)
    rg = torch_ext.ReactiveGraph(bridge, (clean,), split_heads=True)
    out, cache = rg.run_with_cache(clean)
    assert torch.allclose(out, bridge(clean).detach(), rtol=1e-5, atol=1e-5)
    result = cache["blocks.0.attn.hook_result"]
    assert result.shape == (batch, 6, 4, 32)
    w_o = bridge.blocks[0].attn.o.weight.detach()  # [d_model, n_heads * d_head]
    z = tl_cache["blocks.0.attn.hook_z"]  # [batch, pos, head, d_head]
    expected = torch.einsum("bphd,Dhd->bphD", z, w_o.view(32, 4, 8))
    assert torch.allclose(result, expected, rtol=1e-5, atol=1e-6)
    rg.run(corrupted)
    for setter, axes, tl_fn in [
            (patching.layer_head_vector_patch_setter, ("layer", "head"), tl_patching.get_act_patch_attn_head_out_all_pos),
            (patching.layer_pos_head_vector_patch_setter, ("layer", "pos", "head"),
             tl_patching.get_act_patch_attn_head_out_by_pos)]:
        ours = patching.generic_activation_patch(rg, corrupted, cache, _metric, setter, "result", axes)
        ref = tl_fn(bridge, corrupted, tl_cache, _metric)
        assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6), float((ours - ref).abs().max())


def test_split_heads_refusals(bridge):
    clean, _ = _prompts(1)
    with pytest.raises(ValueError, match="split_heads must be True, False or a positive int"):
        torch_ext.ReactiveGraph(bridge, (clean,), split_heads=0)
    with pytest.raises(RuntimeError, match=r"is not divisible by heads=5"):
        torch_ext.ReactiveGraph(bridge, (clean,), split_heads=5)
    with pytest.raises(ValueError, match="no blocks.<l>.attn.hook_z sites"):
        torch_ext.ReactiveGraph(torch.nn.Linear(3, 3), (torch.randn(2, 3),), split_heads=2)


def test_split_heads_carries_to_batched_sites(bridge):
    """The K-times batched graph of batched sites gets the same split: hook_result sweeps agree with the
    one-at-a-time sweep (within 1e-6: a batched GEMM may round differently)."""
    clean, corrupted = _prompts(2)
    rg = torch_ext.ReactiveGraph(bridge, (clean,), split_heads=True)
    _, cache = rg.run_with_cache(clean)
    rg.run(corrupted)
    args = (rg, corrupted, cache, _metric, patching.layer_head_vector_patch_setter, "result", ("layer", "head"))
    one = patching.generic_activation_patch(*args)
    batched = patching.generic_activation_patch(*args, batch_sites=True)
    assert torch.allclose(one, batched, rtol=1e-6, atol=1e-6), float((one - batched).abs().max())


@pytest.mark.parametrize("name,hook", [("get_act_patch_resid_pre", "hook_resid_pre"),
                                       ("get_act_patch_attn_head_out_by_pos", "attn.hook_z")])
def test_patching_skips_sites_whose_patch_changes_nothing(bridge, name, hook):
    """A site whose clean activation is bit-identical to the corrupted run's (every position before the
    first corrupted token, by causal attention; for resid_pre of layer 0, every uncorrupted token)
    costs no evaluations, the others their cones (sweep(skip_identical=True)), and the result still
    equals TransformerLens's bit for bit. Which sites are identical comes from TransformerLens's caches."""
    clean, corrupted = _prompts(8)
    _, clean_cache = bridge.run_with_cache(clean)
    _, corrupted_cache = bridge.run_with_cache(corrupted)
    expected = getattr(tl_patching, name)(bridge, corrupted, clean_cache, _metric)
    getattr(patching, name)(bridge, corrupted, clean_cache, _metric)  # builds (and caches) the graph
    rg = patching._graph_for(bridge, corrupted)
    before = rg.stats["evaluations"]
    got = getattr(patching, name)(bridge, corrupted, clean_cache, _metric)
    assert torch.equal(got, expected)
    want, skipped = 0, 0
    for layer in range(2):
        a, b = clean_cache[f"blocks.{layer}.{hook}"], corrupted_cache[f"blocks.{layer}.{hook}"]
        cone = len(rg.cone(rg.resolve(f"blocks.{layer}.{hook}")))
        for pos in range(6):
            for head in (range(4) if "head" in name else [None]):
                idx = (slice(None), pos) if head is None else (slice(None), pos, head)
                same = torch.equal(a[idx].view(torch.int32), b[idx].view(torch.int32))
                skipped += same
                want += 0 if same else cone
    assert skipped >= 2 * (4 if "head" in name else 1) * 2  # at least positions 0 and 1 of both layers
    assert rg.stats["evaluations"] - before == want


def test_a_fresh_gqa_bridge_builds_and_patches_heads_as_transformer_lens():
    """A native RMS bridge never run before (Llama-style: rotary, gated MLP, 4 query heads over 2 key/value
    heads) failed to build with "ReferenceError: weakly-referenced object no longer exists": its blocks wire
    their capture hooks at their first forward, which was the make_fx attempt of front_end="auto", where each
    block is a tracer's stand-in (weakref.proxy to it, dead after that trace); the export that followed kept
    those hooks. The attempt's hooks and attribute writes are now undone before the export. Per-head q, k, v
    and pattern patches at one position then equal TransformerLens's run_with_hooks bit for bit."""
    cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16, d_vocab=50,
                                     act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
                                     gated_mlp=True, n_key_value_heads=2, seed=0)
    model = tl.TransformerBridge.boot_native(cfg).eval()
    clean, _ = _prompts(2)
    rg = torch_ext.ReactiveGraph(model, (clean,), cache=False)
    assert rg.build_stats["front_end"] == "export"  # make_fx refused it first: the case
    assert torch.equal(rg.demand(), model(clean))
    assert rg.value("blocks.0.attn.hook_k").shape == (2, 6, 2, 8)  # two key/value heads

    def one_head(a):
        a = a.clone()
        a[:, 2, 1] = 0.5  # [batch, pos, head, d_head]: head 1 at position 2
        return a

    def one_row(a):
        a = a.clone()
        a[:, 1, 3] = a[:, 1, 3].flip(-1)  # [batch, head, query, key]: head 1, query 3
        return a

    for hook, fn in [("hook_q", one_head), ("hook_k", one_head), ("hook_v", one_head), ("hook_pattern", one_row)]:
        name = f"blocks.1.attn.{hook}"
        want = model.run_with_hooks(clean, fwd_hooks=[(name, lambda act, hook, fn=fn: fn(act))])
        rg.patch(name, fn)
        assert torch.equal(rg.demand(), want), name
        rg.restore()


@pytest.fixture(scope="module")
def rms_bridge():
    cfg = tl.TransformerBridgeConfig(n_layers=2, d_model=16, n_heads=4, d_head=4, d_mlp=24, n_ctx=16, d_vocab=31,
                                     act_fn="silu", normalization_type="RMS", seed=2)
    return tl.TransformerBridge.boot_native(cfg).eval()


@pytest.mark.parametrize("name", ["get_act_patch_resid_pre", "get_act_patch_attn_head_q_by_pos",
                                  "get_act_patch_block_every"])
def test_rms_norm_bridge_equals_transformer_lens(rms_bridge, name):
    """An RMSNorm bridge runs HF's norm (x * rsqrt) only while its hook_scale / hook_normalized hand back the
    very tensor they got; the trace's hook markers are new tensors, so the graph took the bridge's edit path
    (x / sqrt) and every sweep differed from TransformerLens in the last bits. Those two observation hooks are
    no longer markers (not patchable sites); the graph computes what eager computes."""
    clean = torch.randint(0, 31, (3, 7), generator=torch.Generator().manual_seed(0))
    corrupted = clean.clone()
    corrupted[:, 0] = (corrupted[:, 0] + 5) % 31
    _, clean_cache = rms_bridge.run_with_cache(clean)
    expected = getattr(tl_patching, name)(rms_bridge, corrupted, clean_cache, _metric)
    got = getattr(patching, name)(rms_bridge, corrupted, clean_cache, _metric)
    assert torch.equal(got, expected)
    rg = torch_ext.ReactiveGraph(rms_bridge, (corrupted,))
    with torch.no_grad():
        assert torch.equal(rg.demand(), rms_bridge(corrupted))
    assert "blocks.0.ln1.hook_normalized" not in rg.hook_names


def test_split_heads_on_a_bridge_over_hugging_face_gpt2(tmp_path):
    """A TransformerBridge over Hugging Face GPT-2 keeps GPT-2's Conv1D c_proj (view -> addmm(b, x2d, W[in, out])
    -> view): split_heads splits it. hook_result is z through W's rows per head; head-result patching equals
    TransformerLens's z patching within 1e-6 (the sum over heads adds in another order than the addmm)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16,
                                  architectures=["GPT2LMHeadModel"])
    model = transformers.GPT2LMHeadModel(cfg).eval()
    cfg.save_pretrained(tmp_path)  # a local config: no hub access
    gpt2 = tl.TransformerBridge.boot_transformers(str(tmp_path), hf_model=model, load_weights=False).eval()
    clean, corrupted = _prompts(2)
    _, tl_cache = gpt2.run_with_cache(clean)
    rg = torch_ext.ReactiveGraph(gpt2, (clean,), split_heads=True)
    out, cache = rg.run_with_cache(clean)
    assert torch.allclose(out, gpt2(clean).detach(), rtol=1e-5, atol=1e-6)
    for l in range(2):
        w = model.transformer.h[l].attn.c_proj.weight.detach()  # Conv1D: [head * d_head, d_model]
        expected = torch.einsum("bphd,hdD->bphD", tl_cache[f"blocks.{l}.attn.hook_z"], w.view(4, 8, 32))
        assert torch.allclose(cache[f"blocks.{l}.attn.hook_result"], expected, rtol=1e-5, atol=1e-6)
    rg.run(corrupted)
    ours = patching.generic_activation_patch(rg, corrupted, cache, _metric, patching.layer_head_vector_patch_setter,
                                             "result", ("layer", "head"))
    ref = tl_patching.get_act_patch_attn_head_out_all_pos(gpt2, corrupted, tl_cache, _metric)
    assert ours.shape == ref.shape == (2, 4)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6), float((ours - ref).abs().max())


@pytest.mark.parametrize("kind", ["list", "dict", "counter"])
def test_a_hook_added_through_add_hook_leaves_the_users_state_as_found(bridge, kind):
    # TransformerLens registers the user's hook inside its own wrapper (add_hook's full_hook), which the check of
    # hooks that store activations did not look into. Before: the build was accepted and left a FakeTensor of the
    # trace in the user's list or dict (no run of the graph ever stores one), and a counter counting a call that
    # never ran.
    acts, store, count = [], {}, {"n": 0}
    hooks = {"list": lambda act, hook: acts.append(act), "dict": lambda act, hook: store.__setitem__(hook.name, act),
             "counter": lambda act, hook: count.__setitem__("n", count["n"] + 1)}
    clean = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    bridge.add_hook("blocks.0.hook_resid_pre", hooks[kind])
    try:
        if kind == "counter":
            torch_ext.ReactiveGraph(bridge, (clean,), cache=False)
        else:
            with pytest.raises(ValueError, match=r"stored a tensor of the trace in '(acts|store)'"):
                torch_ext.ReactiveGraph(bridge, (clean,), cache=False)
    finally:
        bridge.reset_hooks()
    assert acts == [] and store == {} and count == {"n": 0}


class _Scale:
    def __init__(self, k: float):
        self.k = k

    def __call__(self, act, hook):
        return act * self.k


@pytest.mark.parametrize("kind", ["closure", "object"])
def test_a_steering_hook_added_through_add_hook_refuses_its_knob_changed_after_build(bridge, kind):
    # The graph holds the values a traced hook read. A hook added through add_hook sits inside TransformerLens's
    # own wrapper (full_hook), which the check of what hooks read did not look into. Before: after the user
    # turned the knob, run() answered with the traced value (0.66 off eager on this bridge), silently.
    scale, obj = [2.0], _Scale(2.0)
    hook = (lambda act, hook: act * scale[0]) if kind == "closure" else obj
    clean = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(5))
    bridge.add_hook("blocks.0.hook_resid_pre", hook)
    try:
        rg = torch_ext.ReactiveGraph(bridge, (clean,), cache=False)
        before = rg.run(clean).clone()
        scale[0], obj.k = 3.0, 3.0
        with torch.no_grad():
            assert not torch.equal(bridge(clean), before)  # eager follows the change
        with pytest.raises(ValueError, match=r"run: forward hook (<lambda>|_Scale) on module 'blocks.0.hook_in' \(HookPoint\): "
                           r"'(scale|k)' is \[?3.0\]? now, \[?2.0\]? when this ReactiveGraph"):
            rg.run(clean)
        scale[0], obj.k = 2.0, 2.0  # changed back: the graph is right again
        assert torch.equal(rg.run(clean), before)
    finally:
        bridge.reset_hooks()


def _tiny_gemma2(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
                                    sliding_window=3, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0, architectures=["Gemma2ForCausalLM"])
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    cfg.save_pretrained(tmp_path)  # a local config: no hub access
    import copy
    bridge = tl.TransformerBridge.boot_transformers(str(tmp_path), hf_model=copy.deepcopy(model), load_weights=False)
    return model, bridge.eval()


GEMMA2_FUNCTIONS = ["get_act_patch_resid_mid", "get_act_patch_attn_out", "get_act_patch_mlp_out",
                    "get_act_patch_attn_head_q_all_pos", "get_act_patch_attn_head_k_by_pos"]


def test_a_bridge_over_hugging_face_gemma2_keeps_transformer_lenss_hook_names(tmp_path):
    """A bridge forwards `config` and `model.layers` to the Hugging Face model it wraps, so it was taken for a
    Hugging Face decoder: Llama-style markers named blocks.<l>.hook_resid_mid / hook_attn_out / hook_mlp_out
    took those names from TransformerLens's own hooks. On Gemma 2 (sandwich norms) they are other tensors:
    resid_mid patching was 0.047 off TransformerLens, mlp_out 0.013, attn_out 4e-4, silently; q/k head
    patching raised an expand error (the markers' [pos, d] views against GQA's heads)."""
    _, bridge = _tiny_gemma2(tmp_path)
    clean, corrupted = _prompts(2)
    _, clean_cache = bridge.run_with_cache(clean)
    for name in GEMMA2_FUNCTIONS:
        expected = getattr(tl_patching, name)(bridge, corrupted, clean_cache, _metric)
        got = getattr(patching, name)(bridge, corrupted, clean_cache, _metric)
        assert torch.equal(got, expected), (name, float((got - expected).abs().max()))


def test_hugging_face_gemma2_hook_names_are_the_residual_streams(tmp_path):
    """Gemma 2's post_attention_layernorm normalizes the attention's output before the residual add (the
    norm before the MLP is pre_feedforward_layernorm): blocks.<l>.hook_resid_mid named the raw attention
    output, and hook_attn_out / hook_mlp_out what comes before the post-norms, so resid_mid patching on the
    Hugging Face model measured attention-output patching. Each name is now what TransformerLens's bridge
    over the same weights gives, and each patching function returns the bridge's tensor, bit for bit."""
    model, bridge = _tiny_gemma2(tmp_path)
    clean, corrupted = _prompts(2)
    _, tl_cache = bridge.run_with_cache(clean)
    _, cache = patching.run_with_cache(model, clean)
    for layer in range(2):
        for hook in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
            name = f"blocks.{layer}.{hook}"
            assert torch.equal(cache[name], tl_cache[name]), name
    for name in ["get_act_patch_resid_mid", "get_act_patch_attn_out", "get_act_patch_mlp_out"]:
        expected = getattr(tl_patching, name)(bridge, corrupted, tl_cache, _metric)
        got = getattr(patching, name)(model, corrupted, cache, _metric)
        assert torch.equal(got, expected), (name, float((got - expected).abs().max()))


def test_run_with_cache_on_a_rotary_bridge_gives_its_unread_hooks(tmp_path):
    """A rotary bridge's rotary_emb.hook_in is read by nothing: its alias node is dropped from the graph as dead
    code, and run_with_cache (so patching.run_with_cache too) raised "unknown node 'alias_default_1'"."""
    _, bridge = _tiny_gemma2(tmp_path)
    clean, _ = _prompts(2)
    logits, tl_cache = bridge.run_with_cache(clean)
    rg = torch_ext.ReactiveGraph(bridge, (clean,))
    out, cache = rg.run_with_cache(clean)
    assert torch.equal(out, logits)
    assert "rotary_emb.hook_in" in cache
    # Every hook both caches hold is the same tensor (hook_scale / hook_normalized of a norm are not markers).
    shared = [name for name in tl_cache.keys() if name in cache]
    assert "rotary_emb.hook_in" in shared and "blocks.1.hook_resid_mid" in shared
    for name in shared:
        assert torch.equal(cache[name], tl_cache[name]), name
    assert torch.equal(patching.run_with_cache(bridge, clean)[1]["rotary_emb.hook_in"], tl_cache["rotary_emb.hook_in"])


def test_patching_a_hook_nothing_reads_says_so(tmp_path):
    """rg.patch("rotary_emb.hook_in", v) on a rotary bridge raised "unknown node 'alias_default_N'", naming neither
    the hook nor why: nothing reads that hook point (its alias node was dropped as dead code), so a patch there
    changes nothing. The refusal names the hook and its source; reading it gives the source's value; nothing is
    pinned."""
    _, bridge = _tiny_gemma2(tmp_path)
    clean, _ = _prompts(2)
    _, tl_cache = bridge.run_with_cache(clean)
    rg = torch_ext.ReactiveGraph(bridge, (clean,))
    before = rg.demand().clone()
    source = next(n.args[0].name for n in rg.program.graph.nodes if n.name == rg.hook_names["rotary_emb.hook_in"])
    value = torch.zeros_like(tl_cache["rotary_emb.hook_in"])
    for attempt in (lambda: rg.patch("rotary_emb.hook_in", value),
                    lambda: torch_ext.sweep(rg, ["rotary_emb.hook_in"], lambda v, s: v * 0, lambda o: o.sum(),
                                            progress=False)):
        with pytest.raises(ValueError, match=r"hook 'rotary_emb.hook_in' addresses nothing in the graph: nothing "
                                             rf"reads its value .* patch or read that") as e:
            attempt()
        assert f"node '{source}'" in str(e.value)
    assert not rg._engine.pinned()
    assert torch.equal(rg.demand(), before)
    assert torch.equal(rg.value("rotary_emb.hook_in"), tl_cache["rotary_emb.hook_in"])


def test_reads_and_writes_by_hook_name_on_a_bridge_take_transformer_lenss_layout(bridge):
    """A bridge's hook_z, hook_q, hook_k, hook_v are nodes of [batch, pos, head * d_head] that TransformerLens shows
    as [batch, pos, head, d_head] (its hook conversions). On main rg.value / values / baseline gave the merged node
    while run_with_cache gave TransformerLens's layout, and patch(hook, tensor) refused TransformerLens's layout.
    Compared to the bridge's own run_with_cache and run_with_hooks, at zero tolerance."""
    clean, _ = _prompts(2)
    logits, tl_cache = bridge.run_with_cache(clean)
    rg = torch_ext.ReactiveGraph(bridge, (clean,))
    for l in range(2):
        for h in ("hook_z", "hook_q", "hook_k", "hook_v"):
            name = f"blocks.{l}.attn.{h}"
            assert tl_cache[name].shape == (2, 6, 4, 8)
            assert torch.equal(rg.value(name), tl_cache[name]), name
            assert torch.equal(rg.baseline(name), tl_cache[name]), name
            assert torch.equal(rg.values([name])[name], tl_cache[name]), name
    node = rg.hook_names["blocks.1.attn.hook_z"]
    assert torch.equal(rg.value(node), tl_cache["blocks.1.attn.hook_z"].reshape(2, 6, 32))  # the node's own layout
    z = tl_cache["blocks.1.attn.hook_z"].clone()
    z[:, :, 2] = 0
    want = bridge.run_with_hooks(clean, fwd_hooks=[("blocks.1.attn.hook_z", lambda act, hook: z)])
    rg.patch("blocks.1.attn.hook_z", z)
    assert torch.equal(rg.demand(), want)
    assert torch.equal(rg.value("blocks.1.attn.hook_z"), z)
    rg.restore()
    with pytest.raises(ValueError, match=r"patch 'blocks\.1\.attn\.hook_z': got shape \[2, 6, 32\]; the hook's value is "
                                         r"\[batch, pos, head, d_head\] = \[2, 6, 4, 8\]"):
        rg.patch("blocks.1.attn.hook_z", z.reshape(2, 6, 32))
    assert rg.patched() == [] and torch.equal(rg.demand(), logits)
    # a patch function of another head shape: TransformerLens's revert passed it through, unmerged
    with pytest.raises(ValueError, match=r"hook 'blocks\.1\.attn\.hook_z' returned shape \[2, 6, 2, 16\]"):
        rg.patch("blocks.1.attn.hook_z", lambda v: v.reshape(2, 6, 2, 16) * 1)
    assert rg.patched() == [] and torch.equal(rg.demand(), logits)
    # a block grafted by hook name sees the heads, as a TransformerLens hook does
    rg.graft("blocks.1.attn.hook_z", lambda v: torch.cat([v[:, :, :2], v[:, :, 2:3] * 0, v[:, :, 3:]], dim=2))
    assert torch.equal(rg.demand(), want)
