"""TransformerLens-compatible activation patching on the reactive engine.

The functions mirror ``transformer_lens.patching`` (same names, signatures and returned tensors), so
a user swaps one import::

    from torch_ext import patching          # was: from transformer_lens import patching
    patching.get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric)

Each call runs the corrupted prompt once through a ``ReactiveGraph`` (built once per model and
input shape, then reused), and each patch recomputes only the patched node's downstream cone.
``model`` is a TransformerLens ``TransformerBridge`` (hook names come from its hook points), a
Hugging Face decoder (GPT-2 or Llama-style: hook names from ``_compat.hf_hook_points``), or a
``ReactiveGraph`` of either. ``clean_cache`` is TransformerLens's ``ActivationCache`` or the cache
of ``patching.run_with_cache`` / ``ReactiveGraph.run_with_cache``. TransformerLens's setters edit the corrupted activation in place;
here they are given a copy, never the engine's cached value.

``reduce`` ("scalar", "mean", "none"), a mapping of metrics and ``baseline=True`` behave as in
TransformerLens 4.3: the last three return TransformerLens's ``PatchingResult`` when it is installed
(else a record with the same fields).
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Callable, Mapping, Sequence

import torch

from . import _compat, _env_reads, _module_state
from .reactive import ReactiveGraph, _one_check_per_call, _weights_fingerprint, sweep

__all__ = [
    "generic_activation_patch", "get_act_patch_resid_pre", "get_act_patch_resid_mid", "get_act_patch_attn_out",
    "get_act_patch_mlp_out", "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_block_every", "layer_pos_patch_setter", "layer_pos_head_vector_patch_setter",
    "layer_head_vector_patch_setter", "act_name", "run_with_cache",
    "get_act_patch_attn_head_q_all_pos", "get_act_patch_attn_head_k_all_pos", "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_pattern_all_pos", "get_act_patch_attn_head_q_by_pos", "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos", "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_all_pos_every", "get_act_patch_attn_head_by_pos_every",
    "layer_head_pattern_patch_setter", "layer_head_pos_pattern_patch_setter",
    "get_act_patch_attn_head_pattern_dest_src_pos", "layer_head_dest_src_pos_pattern_patch_setter",
]

_BLOCK_HOOKS = {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"}
_ATTN_HOOKS = {"q", "k", "v", "z", "result", "pattern", "attn_scores"}
_MLP_HOOKS = {"pre", "post"}


def act_name(name: str, layer: int | None = None) -> str:
    """TransformerLens's hook name for an activation (``utils.get_act_name``): "resid_pre", 0 ->
    "blocks.0.hook_resid_pre"; "z", 1 -> "blocks.1.attn.hook_z"; full hook names pass through."""
    if "." in name or layer is None:
        return name
    if name in _BLOCK_HOOKS:
        return f"blocks.{layer}.hook_{name}"
    if name in _ATTN_HOOKS:
        return f"blocks.{layer}.attn.hook_{name}"
    if name in _MLP_HOOKS:
        return f"blocks.{layer}.mlp.hook_{name}"
    raise ValueError(f"unknown activation name {name!r} (expected one of "
                     f"{sorted(_BLOCK_HOOKS | _ATTN_HOOKS | _MLP_HOOKS)} or a full hook name)")


# ---- setters: TransformerLens's semantics, applied to a copy
def layer_pos_patch_setter(corrupted_activation, index, clean_activation):
    """index = (layer, pos): activations are [batch, pos, ...]."""
    layer, pos = index
    corrupted_activation[:, pos, ...] = clean_activation[:, pos, ...]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = (layer, pos, head): head vectors are [batch, pos, head, d_head]."""
    layer, pos, head = index
    corrupted_activation[:, pos, head] = clean_activation[:, pos, head]
    return corrupted_activation


def layer_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = (layer, head): every position of one head."""
    layer, head = index
    corrupted_activation[:, :, head] = clean_activation[:, :, head]
    return corrupted_activation


def layer_head_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = (layer, head): patterns are [batch, head, dest_pos, src_pos]."""
    layer, head = index
    corrupted_activation[:, head, :, :] = clean_activation[:, head, :, :]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = (layer, head, dest_pos)."""
    layer, head, dest_pos = index
    corrupted_activation[:, head, dest_pos, :] = clean_activation[:, head, dest_pos, :]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = (layer, head, dest_pos, src_pos): one entry of one head's pattern."""
    layer, head, dest_pos, src_pos = index
    corrupted_activation[:, head, dest_pos, src_pos] = clean_activation[:, head, dest_pos, src_pos]
    return corrupted_activation


def _checked_once(fn):
    """The weights are compared by content once per call of ``fn`` (the graph lookup, its run and the sweep
    share it): reactive._one_check_per_call."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_check_per_call():
            return fn(*args, **kwargs)
    return wrapper


# ---- graphs, one per model and input shape
_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _graph_for(model, tokens: torch.Tensor) -> ReactiveGraph:
    if isinstance(model, ReactiveGraph):
        rg = model
    else:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a TransformerLens model, an nn.Module or a ReactiveGraph, "
                            f"got {type(model).__name__}")
        if model.training:
            raise ValueError("activation patching needs the model in eval mode (dropout would add noise); "
                             "call model.eval() first")
        per_shape = _GRAPHS.setdefault(model, {})
        key = (tuple(tokens.shape), tokens.dtype, tokens.device)
        # A graph is a snapshot of the weights (TransformerLens models are even exported from a copy):
        # any weight replaced or written in place since (load_state_dict, fine-tuning) rebuilds it.
        rg, built_for = per_shape.get(key, (None, None))
        if rg is not None:
            rg._take_untracked_writes()  # a weight written through .data moves its version: rebuilt below
        fingerprint = _weights_fingerprint(model)
        # An attribute the trace read (a LayerNorm eps) changed since: the graph holds the old value, built again.
        if rg is None or built_for != fingerprint or _module_state.changed(getattr(rg, "_attributes", ())) \
                or _module_state.changed(getattr(rg, "_global_reads", ())) or _env_reads.changed(rg._env):
            rg = ReactiveGraph(model, (tokens,))
            per_shape[key] = (rg, fingerprint)
            return rg
    # The same tensor object is not enough: tokens edited in place since the last run (a new corruption
    # written into the same buffer) must be run again, or every site patches the old corrupted run. Keyword
    # inputs the graph was run with (a padding attention_mask in example_kwargs) stay: run without them,
    # it exported a graph without the mask.
    kwargs = rg._last_inputs[1] if rg._last_inputs is not None else {}
    if not rg._ran_on(tokens, **kwargs):
        rg.run(tokens, **kwargs)
    return rg


def _layers_and_heads(model, rg: ReactiveGraph) -> tuple[int, int]:
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_layers"):
        return int(cfg.n_layers), int(getattr(cfg, "n_heads", 0))
    found = _compat._hf_decoder(model) if model is not None else None
    if found is not None:
        return len(found[0]), found[1]
    layers = {int(h.split(".")[1]) for h in rg.hook_names if h.startswith("blocks.")}
    return (max(layers) + 1 if layers else 0), 0


@_checked_once
def run_with_cache(model, tokens: torch.Tensor):
    """(outputs, cache) of ``model`` on ``tokens``, the cache keyed by hook name (and node name):
    a clean cache for the functions here, for any model they accept (Hugging Face decoders too). A
    ReactiveGraph run with keyword inputs (a padding ``attention_mask`` in example_kwargs) runs ``tokens``
    with them, as the patching functions run the corrupted tokens: without them it moved to a mask-free
    graph, and the clean cache (and every later patching call on the graph) silently dropped the mask."""
    rg = _graph_for(model, tokens)
    kwargs = rg._last_inputs[1] if rg._last_inputs is not None else {}
    return rg.run_with_cache(tokens, **kwargs)


def _logits(out):
    return getattr(out, "logits", out)


@_checked_once
def generic_activation_patch(model, corrupted_tokens: torch.Tensor, clean_cache, patching_metric: Callable,
                             patch_setter: Callable, activation_name: str,
                             index_axis_names: Sequence[str] | None = None, index_df=None,
                             return_index_df: bool = False, *, reduce: str = "scalar", baseline: bool = False,
                             batch_sites: bool = False):
    """Patches ``activation_name`` at every index and returns the metric for each, as
    ``transformer_lens.patching.generic_activation_patch`` does: shaped by ``index_axis_names``
    (each axis's full range), or one value per row of ``index_df``."""
    if reduce not in _REDUCE_MODES:
        raise ValueError(f"reduce must be one of {_REDUCE_MODES}, got {reduce!r}")
    if isinstance(patching_metric, Mapping):
        metrics = dict(patching_metric)
        if not metrics:
            raise ValueError("patching_metric mapping must contain at least one metric")
    else:
        metrics = {"metric": patching_metric}
    has_metric_axis = isinstance(patching_metric, Mapping)
    want_result = has_metric_axis or reduce == "none" or baseline
    if want_result and return_index_df:
        raise ValueError("return_index_df only applies to the tensor return; a PatchingResult carries index_df")
    if (index_axis_names is None) == (index_df is None):
        raise ValueError("give exactly one of index_axis_names and index_df")
    rg = _graph_for(model, corrupted_tokens)
    n_layers, n_heads = _layers_and_heads(model if not isinstance(model, ReactiveGraph) else rg._module, rg)
    seq = corrupted_tokens.shape[-1]
    if index_df is not None:
        columns = list(index_df.columns)
        rows = [tuple(int(v) for v in r) for r in index_df.itertuples(index=False)]
    else:
        kv_heads = getattr(getattr(model, "cfg", None), "n_key_value_heads", None)
        if activation_name in ("k", "v") and kv_heads:  # grouped-query attention: fewer key/value heads
            n_heads = int(kv_heads)
        sizes = {"layer": n_layers, "pos": seq, "head_index": n_heads, "head": n_heads, "src_pos": seq,
                 "dest_pos": seq}
        unknown = [a for a in index_axis_names if a not in sizes]
        if unknown:
            raise ValueError(f"unknown index axis {unknown[0]!r} (expected {sorted(sizes)})")
        columns = list(index_axis_names)
        rows = list(itertools.product(*[range(sizes[a]) for a in columns]))
    if "layer" not in columns:
        raise ValueError(f"the index needs a 'layer' axis to name the hook (got {columns})")
    if columns[0] != "layer":
        # TransformerLens takes the first column as the layer and its patch setters unpack the index in
        # column order, layer first: another order would patch another site than the one named.
        raise ValueError(f"the index's first axis must be 'layer', as TransformerLens reads it (got {columns}); "
                         "reorder the columns (index_df[['layer', ...]])")
    layer_at = 0
    sites = []
    for row in rows:
        hook = act_name(activation_name, row[layer_at])
        if rg.resolve(hook) == hook and hook not in rg.hook_names:
            raise ValueError(f"hook {hook!r} is not a patchable site of this model "
                             f"(known: {sorted(rg.hook_names)[:6]}...)")
        sites.append((hook, row))

    def patch(value, site):
        return patch_setter(value.clone(), site[1], clean_cache[site[0]])

    batch_size = int(corrupted_tokens.shape[0])
    per_example = reduce != "scalar"

    def evaluate(out) -> torch.Tensor:
        """Every metric on one output, as [metric] or [metric, batch] (TransformerLens's checks)."""
        rows = []
        for name, fn in metrics.items():
            value = torch.as_tensor(fn(_logits(out)))
            if per_example and (value.ndim != 1 or value.shape[0] != batch_size):
                raise ValueError(f"patching_metric {name!r} must return a [batch] tensor of length {batch_size} "
                                 f"under reduce={reduce!r}, got shape {tuple(value.shape)}")
            if not per_example and value.ndim != 0:
                raise ValueError(f"patching_metric {name!r} must return a scalar under reduce='scalar', got shape "
                                 f"{tuple(value.shape)}; return a [batch] tensor and pass reduce='mean' or "
                                 "reduce='none' to keep per-example values")
            rows.append(value.detach().to(torch.float32))
        return torch.stack(rows)

    # positions=False: TransformerLens parity is bit for bit, and a linear run on rows [p, T) alone
    # rounds differently from one run on all T rows (token-granular cones agree up to rounding, README).
    # skip_identical: a site whose patched value is bit-identical to the corrupted run's (positions
    # before the first corrupted token, where the prompts share their prefix) takes the corrupted
    # outputs unevaluated; TransformerLens's forward with that value computes them, the same bits.
    result = sweep(rg, sites, patch, evaluate, progress=False, batch_sites=batch_sites, positions=False,
                   skip_identical=True)
    cell = (len(metrics),) + ((batch_size,) if per_example else ())  # a 1-element metric comes back a float
    store = torch.stack([torch.as_tensor(result.metrics[s], dtype=torch.float32).reshape(cell) for s in sites],
                        dim=1)  # [metric, site, batch?]
    if index_df is None:
        store = store.reshape([len(metrics)] + [sizes[a] for a in columns] + list(store.shape[2:]))
    baseline_values = evaluate(rg.demand()) if baseline else None  # the unpatched corrupted run
    if reduce == "mean":
        store = store.mean(dim=-1)
        baseline_values = baseline_values.mean(dim=-1) if baseline_values is not None else None
    store = store.to(corrupted_tokens.device)
    if not want_result:
        if return_index_df:
            import pandas as pd

            return store[0], pd.DataFrame(rows, columns=columns)
        return store[0]
    import pandas as pd

    return _patching_result(
        values=store if has_metric_axis else store[0], axis_names=[] if index_df is not None else columns,
        index_df=index_df if index_df is not None else pd.DataFrame(rows, columns=columns),
        metric_names=list(metrics), reduced=reduce != "none",
        baseline=None if baseline_values is None else (baseline_values if has_metric_axis else baseline_values[0]),
        has_metric_axis=has_metric_axis)


_REDUCE_MODES = ("scalar", "mean", "none")


def _patching_result(**fields):
    """TransformerLens's PatchingResult (statistics included) when it is installed, else a plain record."""
    try:
        from transformer_lens.patching import PatchingResult
    except ImportError:
        import types

        return types.SimpleNamespace(**fields)
    return PatchingResult(**fields)


# TransformerLens's one-activation sweeps: suffix -> (patch setter, activation, index axes, docstring).
_ACT_PATCHES = {
    "resid_pre": (layer_pos_patch_setter, "resid_pre", ("layer", "pos"),
                  "[n_layers, pos]: the residual stream at the start of each block, one position at a time."),
    "resid_mid": (layer_pos_patch_setter, "resid_mid", ("layer", "pos"),
                  "[n_layers, pos]: the residual stream between attention and MLP."),
    "attn_out": (layer_pos_patch_setter, "attn_out", ("layer", "pos"),
                 "[n_layers, pos]: the output of each attention layer."),
    "mlp_out": (layer_pos_patch_setter, "mlp_out", ("layer", "pos"), "[n_layers, pos]: the output of each MLP layer."),
    "attn_head_out_all_pos": (layer_head_vector_patch_setter, "z", ("layer", "head"),
                              "[n_layers, n_heads]: each head's output (z), every position at once."),
    "attn_head_out_by_pos": (layer_pos_head_vector_patch_setter, "z", ("layer", "pos", "head"),
                             "[n_layers, pos, n_heads]: each head's output (z) at each position."),
    "attn_head_pattern_all_pos": (layer_head_pattern_patch_setter, "pattern", ("layer", "head_index"),
                                  "[n_layers, n_heads]: each head's attention pattern, every destination position "
                                  "at once."),
    "attn_head_pattern_by_pos": (layer_head_pos_pattern_patch_setter, "pattern", ("layer", "head_index", "dest_pos"),
                                 "[n_layers, n_heads, dest_pos]: each head's attention pattern at each destination "
                                 "position."),
    "attn_head_pattern_dest_src_pos": (layer_head_dest_src_pos_pattern_patch_setter, "pattern",
                                       ("layer", "head_index", "dest_pos", "src_pos"),
                                       "[n_layers, n_heads, dest_pos, src_pos]: each entry of each head's attention "
                                       "pattern."),
}


def _act_patch(suffix: str, setter=None, act: str = "", axes: tuple = (), doc: str = ""):
    """``get_act_patch_<suffix>``: generic_activation_patch with one setter, activation and index axes
    (from ``_ACT_PATCHES`` unless given)."""
    if setter is None:
        setter, act, axes, doc = _ACT_PATCHES[suffix]

    def f(model, corrupted_tokens, clean_cache, patching_metric, **kwargs):
        return generic_activation_patch(model, corrupted_tokens, clean_cache, patching_metric, setter, act, axes,
                                        **kwargs)

    f.__name__ = f.__qualname__ = f"get_act_patch_{suffix}"
    f.__doc__ = doc
    return f


get_act_patch_resid_pre = _act_patch("resid_pre")
get_act_patch_resid_mid = _act_patch("resid_mid")
get_act_patch_attn_out = _act_patch("attn_out")
get_act_patch_mlp_out = _act_patch("mlp_out")
get_act_patch_attn_head_out_all_pos = _act_patch("attn_head_out_all_pos")
get_act_patch_attn_head_out_by_pos = _act_patch("attn_head_out_by_pos")
get_act_patch_attn_head_pattern_all_pos = _act_patch("attn_head_pattern_all_pos")
get_act_patch_attn_head_pattern_by_pos = _act_patch("attn_head_pattern_by_pos")
get_act_patch_attn_head_pattern_dest_src_pos = _act_patch("attn_head_pattern_dest_src_pos")


def get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric, **kwargs):
    """[3, n_layers, pos]: resid_pre, attn_out and mlp_out, stacked."""
    return _every((get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out), (("layer", "pos"),) * 3,
                  model, corrupted_tokens, clean_cache, metric, kwargs, axis_order=("layer", "pos"), n_heads=0,
                  type_names=("resid_pre", "attn_out", "mlp_out"), block=True)


def _head_vector(name, by_pos):
    setter = layer_pos_head_vector_patch_setter if by_pos else layer_head_vector_patch_setter
    axes = ("layer", "pos", "head") if by_pos else ("layer", "head")
    return _act_patch(f"attn_head_{name}_{'by_pos' if by_pos else 'all_pos'}", setter, name, axes,
                      f"[n_layers, {'pos, ' if by_pos else ''}n_heads]: each head's {name} "
                      f"({'at each position' if by_pos else 'every position at once'}).")


get_act_patch_attn_head_q_all_pos = _head_vector("q", by_pos=False)
get_act_patch_attn_head_k_all_pos = _head_vector("k", by_pos=False)
get_act_patch_attn_head_v_all_pos = _head_vector("v", by_pos=False)
get_act_patch_attn_head_q_by_pos = _head_vector("q", by_pos=True)
get_act_patch_attn_head_k_by_pos = _head_vector("k", by_pos=True)
get_act_patch_attn_head_v_by_pos = _head_vector("v", by_pos=True)


@_checked_once
def _every(fns, axes, model, corrupted_tokens, clean_cache, metric, kwargs, *, axis_order, n_heads, type_names,
           pattern_to_pos_head=False, block=False):
    """Several sweeps stacked on a leading patch-type axis, as TransformerLens's *_every helpers do
    (a baseline is computed once, by the first sweep; PatchingResults are stacked by TransformerLens)."""
    kwargs = dict(kwargs)
    baseline = bool(kwargs.pop("baseline", False))
    results = [f(model, corrupted_tokens, clean_cache, metric, baseline=baseline and i == 0, **kwargs)
               for i, f in enumerate(fns)]
    if all(isinstance(r, torch.Tensor) for r in results) and not baseline:
        if block:
            return torch.stack(results, dim=0)
        heads = results[0].size(-1)
        for i in (2, 3):  # k and v have n_key_value_heads heads: padded as TransformerLens does
            results[i] = torch.nn.functional.pad(results[i], (0, heads - results[i].size(-1)))
        if pattern_to_pos_head:
            results[4] = results[4].permute(0, 2, 1)  # [layer, head, dest_pos] -> [layer, pos, head]
        return torch.stack(results, dim=0)
    try:
        from transformer_lens import patching as tl_patching
    except ImportError:
        raise ValueError("stacking PatchingResults (reduce='none', baseline=True or a mapping of metrics) in a "
                         "*_every helper needs transformer_lens installed; call the single sweeps instead") from None
    results = [tl_patching._wrap_tensor_result(r, a) if isinstance(r, torch.Tensor) else r
               for r, a in zip(results, axes)]
    return tl_patching._stack_patch_types(results, axis_order=axis_order, n_heads=n_heads, type_names=type_names)


def get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric, **kwargs):
    """[5, n_layers, n_heads]: head output (z), q, k, v and pattern, every position at once."""
    return _every((get_act_patch_attn_head_out_all_pos, get_act_patch_attn_head_q_all_pos,
                   get_act_patch_attn_head_k_all_pos, get_act_patch_attn_head_v_all_pos,
                   get_act_patch_attn_head_pattern_all_pos), (("layer", "head"),) * 4 + (("layer", "head_index"),),
                  model, corrupted_tokens, clean_cache, metric, kwargs, axis_order=("layer", "head"),
                  n_heads=_compat.attention_heads(model) or 0, type_names=("out", "q", "k", "v", "pattern"))


def get_act_patch_attn_head_by_pos_every(model, corrupted_tokens, clean_cache, metric, **kwargs):
    """[5, n_layers, pos, n_heads]: head output (z), q, k, v and pattern at each position."""
    return _every((get_act_patch_attn_head_out_by_pos, get_act_patch_attn_head_q_by_pos,
                   get_act_patch_attn_head_k_by_pos, get_act_patch_attn_head_v_by_pos,
                   get_act_patch_attn_head_pattern_by_pos),
                  (("layer", "pos", "head"),) * 4 + (("layer", "head_index", "dest_pos"),),
                  model, corrupted_tokens, clean_cache, metric, kwargs, axis_order=("layer", "pos", "head"),
                  n_heads=_compat.attention_heads(model) or 0, type_names=("out", "q", "k", "v", "pattern"), pattern_to_pos_head=True)
