#!/usr/bin/env python
"""Differential fuzzer for the reactive engine: ReactiveGraph mutations and torch_ext.sweep against eager PyTorch.

Each case is a seeded random spec (JSON): a small model built from an embedding / Linear / Conv1d front, blocks
of LayerNorm + MLP (GELU/ReLU/tanh), torch_ext.models' causal attention Block, nn.MultiheadAttention and
nn.TransformerEncoderLayer (batch_first or [seq, batch, d], causal or padding masks), Conv1d (same or causal
padding), eval-mode BatchNorm1d and residual adds, with TransformerLens HookPoints between them (the sites);
batch 1..3, float32 or float64. Then a sequence of operations on a ReactiveGraph: patch (tensor, function),
restore() / restore(hook), graft(hook, block), run(new inputs, same or other length), weight edits (``W.add_``
under no_grad, ``W.data.mul_`` found by content, a grafted block's weight too), ``with rg.batch():`` blocks (an
exception raised inside and caught, sometimes), set_cutoff, reads (value, values, demand, demand(reads=)) and
sweeps (one at a time, batch_sites=True / K, reads=, positions on/off, skip_identical on/off; zero / noise /
mean / corrupted-run patches; over standing patches and grafts).

Real-model families too: a Hugging Face GPT-2 (tied embedding/unembedding, 2 layers, d 32/64, vocab <= 100, with
no, an all-ones or a left-padding attention_mask, batch 1-3) addressed by TransformerLens 4 bridge hook names
(resid_pre, attn.hook_z, attn_out, resid_mid = ln_2's input, mlp_out, resid_post), and a TransformerBridge through
torch_ext.patching against transformer_lens.patching (bit for bit, README "Coming from TransformerLens"). Other
mutations: buffer and in-place input edits, baseline() reads, ReactiveGraph(cutoff=, positions=), a Linear graft
block that keeps its input's layout. From seed 60 (GRADIENT_SEED): rg.gradient (eager autograd.grad through the
same hooks, bit for bit), edge-form grafts graft(src, dst, block) where forward pre-hooks on dst's module express
them (the graph shows that module reads src through that one edge), one-row patch functions under positions=True,
and batch sizes equal to the sequence length or d_model. Not generated: distributed sweeps.

The reference is eager PyTorch on a deep copy of the model, forward hooks on the HookPoints, no torch_ext code,
following README's documented semantics: a standing patch's function runs once, at patch(), on the hook's
baseline value (no patch active, grafts and weight edits included: ReactiveGraph.patch's docstring), and the node then keeps that value (frozen) through later weight edits, grafts and sweep sites;
after a node-form graft ``graft(hook, block)`` the hook's name addresses the value before the block (a patch
there is applied before the block), and a second node-form graft there runs before the first block (spliced
right after the node; two eager forward hooks would run in the other order); a refused call leaves everything as it was; an exception leaving
``rg.batch()`` puts the patches back as they were when it began, grafts made in it stand.

Comparison: bit for bit (torch.equal) where README promises it; where it documents a tolerance (token-granular
rows: ``positions`` on, sites at one position; demand(reads=); a batched sweep, ``batch_sites``, which stacks K
copies in one GEMM), within 1e-6 relative (of the metric's scale) or, on a float32 model, within FLOOR (16) times
eager float32's own error: eager against the same forward in float64, through the metric's scale functional
(README: GEMMs on other row counts round otherwise, and an ill-conditioned model carries that past any bound
relative to the output). Comparisons passed only by the second are counted in the report.

    python scripts/fuzz_sweep.py --seconds 600 --seed 1      # bounded run
    python scripts/fuzz_sweep.py --case 1:17                 # replay case 17 of seed 1, with details
    python scripts/fuzz_sweep.py --spec '{"model": ...}'     # replay a (hand-minimised) spec
    python scripts/fuzz_sweep.py --case 1:17 --minimize      # drop ops and blocks while it stays a finding

Cases run in a worker subprocess, so a crash is caught and the run continues with the next case. A refusal by
name (an exception of the project's own kinds, no internal assert) ends only that operation; refusals are
counted by message. A case that raises anything else is run again eagerly alone, as far as it got (the ops the
graph refused left out), and counted apart as "eager failed" where eager fails too at the build, or raises the same
at run time (scripts/_fuzz_driver.py's classify, as fuzz_step does).
"""
from __future__ import annotations

import contextlib
import copy
import json
import random
import re
import sys

import _fuzz_driver
from _fuzz_driver import env_set_during, one_intra_op_thread
ACTS = ("gelu", "relu", "tanh")
BLOCKS = ("mlp", "tiny", "mha", "enc", "conv", "bn", "act")
TOL = 1e-6
# Where TOL is exceeded on a float32 model, a toleranced comparison may still pass within FLOOR times eager float32's
# own error (eager against the same forward in float64, through the metric's scale functional): the row path's
# GEMMs round otherwise, and an ill-conditioned model (a weight edit giving the residual stream a large common mode,
# which LayerNorm divides out) carries that past any fixed bound relative to the output. Measured over 1e4 GPT-2
# sites with and without weight edits: the row path's distance from eager <= 7.5 times eager's own error, while
# relative to the output it reached 5e-5 (README, token-granular cones).
FLOOR = 16.0


class Mismatch(Exception):
    pass


class _Stop(Exception):
    """Ends a case's operations: the graph accepted what it must refuse (a difference is recorded)."""


class Boom(Exception):
    """The user's own exception, raised inside ``with rg.batch():``."""


# ------------------------------------------------------------------------------------------ generator
def gen_model(rng: random.Random) -> dict:
    if rng.random() < 0.35:  # a Hugging Face GPT-2 (tied embedding / unembedding), built from a config
        return {"family": "gpt2", "seed": rng.randrange(1000), "d": rng.choice((32, 64)),
                "vocab": rng.choice((50, 64, 100)), "T": rng.choice((4, 5, 6, 8)), "B": rng.choice((1, 2, 3)),
                "mask": rng.choice((None, None, "left", "ones")),
                "dtype": "float64" if rng.random() < 0.15 else "float32", "blocks": [{"kind": "gpt2"}] * 2}
    blocks = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(BLOCKS)
        b = {"kind": kind}
        if kind in ("mlp", "act"):
            b["act"] = rng.choice(ACTS)
        if kind in ("mha", "enc"):
            b["batch_first"] = rng.random() < 0.5
            b["mask"] = rng.choice((None, "causal", "pad"))
            b["inner_hook"] = rng.random() < 0.3  # a hook on the [seq, batch, d] stream when not batch_first
        if kind == "conv":
            b["causal"] = rng.random() < 0.5
        blocks.append(b)
    return {"seed": rng.randrange(1000), "front": rng.choice(("embed", "embed", "linear", "conv")),
            "d": rng.choice((8, 12)), "T": rng.choice((4, 5, 6, 8)), "B": rng.choice((1, 2, 3)),
            "dtype": "float64" if rng.random() < 0.2 else "float32", "blocks": blocks}


GPT2_HOOKS = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")


def hooks_of(model_spec: dict) -> dict:
    """{hook name: seq dim} of the spec's model, in forward order."""
    if model_spec.get("family") == "gpt2":
        return {f"blocks.{i}.{h}": 1 for i in range(len(model_spec["blocks"])) for h in GPT2_HOOKS}
    if model_spec.get("family") == "tl":
        return {}
    if model_spec.get("family") == "hf":
        return {f"blocks.{i}.{h}": 1 for i in range(len(model_spec["blocks"])) for h in HF_HOOKS[model_spec["arch"]]}
    hooks = {"hook_embed": 1}
    for i, b in enumerate(model_spec["blocks"]):
        if b["kind"] in ("mlp", "tiny", "mha", "enc", "conv"):
            hooks[f"blocks.{i}.hook_mid"] = 1
        if b["kind"] in ("mha", "enc") and b.get("inner_hook") and not b["batch_first"]:
            hooks[f"blocks.{i}.hook_tbd"] = 0
        hooks[f"blocks.{i}.hook_out"] = 1
    return hooks


def gen_ops(rng: random.Random, m: dict) -> list:
    hooks = list(hooks_of(m))
    ops = []
    patched, grafted = set(), set()
    n_graft = 0

    def patch_op():
        h = rng.choice(hooks)
        if rng.random() < 0.4:
            return {"op": "patch_t", "hook": h, "seed": rng.randrange(1000)}
        return {"op": "patch_f", "hook": h, "fn": rng.choice(("zero", "scale", "noise", "pos")),
                "p": rng.randrange(m["T"]), "seed": rng.randrange(1000)}

    for _ in range(rng.randint(2, 8)):
        r = rng.random()
        if r < 0.18:
            o = patch_op()
            patched.add(o["hook"])
        elif r < 0.25:
            o = {"op": "restore"} if rng.random() < 0.5 or not patched else \
                {"op": "restore1", "hook": rng.choice(sorted(patched))}
            if o["op"] == "restore":
                patched.clear()
            else:
                patched.discard(o["hook"])
        elif r < 0.32:
            o = {"op": "graft", "hook": rng.choice(hooks),
                 "block": rng.choice(("double", "tanh", "linear", "linear_kept")),
                 "seed": rng.randrange(1000)}
            grafted.add(o["hook"])
            n_graft += 1
        elif r < 0.38:
            if patched and rng.random() < 0.7:
                ops.append({"op": "restore"})
                patched.clear()
            o = {"op": "run", "seed": rng.randrange(1000),
                 "T": m["T"] if rng.random() < 0.6 else rng.choice((3, 5, 7))}
        elif r < 0.46:
            o = {"op": "wedit", "how": rng.choice(("add_", "data_mul")), "c": rng.choice((0.5, 1.5, -1.0)),
                 "seed": rng.randrange(1000),
                 "target": "graft" if n_graft and rng.random() < 0.3 else rng.choice(("model", "model", "buffer",
                                                                                        "input"))}
        elif r < 0.53:
            inner = []
            for _ in range(rng.randint(1, 3)):
                if rng.random() < 0.7:
                    inner.append(patch_op())
                elif rng.random() < 0.5:
                    inner.append({"op": "restore"})
                else:
                    inner.append({"op": "graft", "hook": rng.choice(hooks), "block": "double", "seed": 0})
            o = {"op": "batch", "ops": inner, "raise": rng.random() < 0.4}
        elif r < 0.57:
            o = {"op": "cutoff", "on": rng.random() < 0.6}
        elif r < 0.72:
            o = {"op": "read", "how": rng.choice(("value", "values", "demand", "demand_reads", "baseline")),
                 "hooks": rng.sample(hooks, min(len(hooks), rng.randint(1, 3)))}
        else:
            per_pos = rng.random() < 0.75
            o = {"op": "sweep", "hooks": rng.sample(hooks, min(len(hooks), rng.randint(1, 3))),
                 "per_pos": per_pos, "fn": rng.choice(("zero", "noise", "mean", "corrupt", "same")),
                 "metric": rng.choice(("last", "sum", "reads_last", "dict")),
                 "batch": rng.choice((False, False, True, 2)), "positions": rng.choice((None, None, False)),
                 "skip": rng.random() < 0.7, "seed": rng.randrange(1000)}
        ops.append(o)
    if not any(o["op"] in ("sweep", "read") for o in ops):
        ops.append({"op": "read", "how": "demand", "hooks": []})
    return ops


TL_FUNCTIONS = ("get_act_patch_resid_pre", "get_act_patch_resid_mid", "get_act_patch_attn_out",
                "get_act_patch_mlp_out", "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_out_by_pos",
                "get_act_patch_block_every", "get_act_patch_attn_head_q_all_pos", "get_act_patch_attn_head_k_by_pos",
                "get_act_patch_attn_head_v_all_pos", "get_act_patch_attn_head_pattern_all_pos",
                "get_act_patch_attn_head_pattern_by_pos", "get_act_patch_attn_head_all_pos_every",
                "get_act_patch_attn_head_by_pos_every", "get_act_patch_attn_head_pattern_dest_src_pos")


def gen_tl_spec(rng: random.Random) -> dict:
    """A TransformerBridge (boot_native, offline) through torch_ext.patching against transformer_lens.patching:
    README "Coming from TransformerLens" promises the same tensors, bit for bit."""
    m = {"family": "tl", "seed": rng.randrange(1000), "d_head": rng.choice((4, 8)), "heads": rng.choice((2, 4)),
         "vocab": rng.choice((31, 50)), "T": rng.choice((4, 5, 6)), "B": rng.choice((1, 2, 3)),
         "norm": rng.choice(("LN", "RMS")), "act": rng.choice(("gelu", "relu", "silu")), "blocks": [{}] * 2}
    ops = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.7:
            ops.append({"op": "tlpatch", "fn": rng.choice(TL_FUNCTIONS), "metric": rng.choice(("diff", "mean", "vec")),
                        "reduce": rng.choice((None, None, "mean")), "seed": rng.randrange(1000)})
        elif r < 0.85:
            ops.append({"op": "wedit", "how": rng.choice(("add_", "data_mul")), "c": rng.choice((0.5, 1.5, -1.0)),
                        "seed": rng.randrange(1000), "target": "model"})
        else:
            ops.append({"op": "prompt", "seed": rng.randrange(1000)})
    if not any(o["op"] == "tlpatch" for o in ops):
        ops.append({"op": "tlpatch", "fn": rng.choice(TL_FUNCTIONS), "metric": "diff", "reduce": None,
                    "seed": rng.randrange(1000)})
    return {"model": m, "ops": ops}


@one_intra_op_thread
@env_set_during("TQDM_DISABLE", "1")  # TransformerLens's progress bars (tqdm >= 4.66)
def run_tl_case(spec: dict, verbose: bool = False) -> tuple[list[str], dict]:
    import torch
    import transformer_lens as tl
    import transformer_lens.patching as tl_patching

    from torch_ext import patching

    _fuzz_driver.enter("eager")  # the model both sides share
    m = spec["model"]
    cfg = tl.TransformerBridgeConfig(n_layers=len(m["blocks"]), d_model=m["heads"] * m["d_head"], n_heads=m["heads"],
                                     d_head=m["d_head"], d_mlp=4 * m["heads"] * m["d_head"], n_ctx=16,
                                     d_vocab=m["vocab"], act_fn=m["act"], normalization_type=m["norm"], seed=m["seed"])
    model = tl.TransformerBridge.boot_native(cfg).eval()
    diffs, refusals = [], {}

    def prompts(seed):
        g = torch.Generator().manual_seed(seed)
        clean = torch.randint(0, m["vocab"], (m["B"], m["T"]), generator=g)
        corrupted = clean.clone()
        p = int(torch.randint(0, m["T"], (1,), generator=g))
        corrupted[:, p] = (corrupted[:, p] + 7) % m["vocab"]
        return clean, corrupted

    clean, corrupted = prompts(0)
    _fuzz_driver.enter("run")  # each op: torch_ext's call (refusals noted by op) and TransformerLens's
    for step, o in enumerate(spec["ops"]):
        where = f"op{step} {o['op']}"
        if verbose:
            print(where, json.dumps(o))
        if o["op"] == "prompt":
            clean, corrupted = prompts(o["seed"])
        elif o["op"] == "wedit":
            ps = list(model.parameters())
            with torch.no_grad():
                if o["how"] == "add_":
                    ps[o["seed"] % len(ps)].add_(o["c"] * 0.1)
                else:
                    ps[o["seed"] % len(ps)].data.mul_(o["c"])
        else:
            a, b = o["seed"] % m["vocab"], (o["seed"] // 7) % m["vocab"]
            if o["metric"] == "diff":
                metric = lambda lg: lg[:, -1, a].mean() - lg[:, -1, b].mean()  # noqa: E731
            elif o["metric"] == "mean":
                metric = lambda lg: lg[:, -1].log_softmax(-1)[:, a].mean()  # noqa: E731
            else:  # per prompt: reduce="mean" averages it, "scalar" (the default) refuses a vector
                metric = lambda lg: lg[:, -1, a] - lg[:, -1, b]  # noqa: E731
            kw = {"reduce": o["reduce"]} if o["reduce"] else {}
            _, cache = model.run_with_cache(clean)
            results = []
            for lib in (tl_patching, patching):
                try:
                    results.append(("ok", getattr(lib, o["fn"])(model, corrupted, cache, metric, **kw)))
                except Exception as exc:  # noqa: BLE001 - compared below
                    results.append(("raised", f"{type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}"))
            (ka, ta), (kb, tb) = results
            if ka == "raised" and kb == "raised":
                key = f"{where}: both raised: " + re.sub(r"\d+", "N", tb)
                refusals[key] = refusals.get(key, 0) + 1
            elif ka != kb:
                diffs.append(f"{where} {o['fn']}: TransformerLens {ka} ({ta if ka == 'raised' else 'a tensor'}), "
                             f"torch_ext {kb} ({tb if kb == 'raised' else 'a tensor'})")
            else:
                ta = ta.result if hasattr(ta, "result") else ta
                tb = tb.result if hasattr(tb, "result") else tb
                if not (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor) and ta.shape == tb.shape
                        and torch.equal(ta, tb)):
                    err = (float((ta - tb).abs().max()) if isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)
                           and ta.shape == tb.shape else "shape")
                    diffs.append(f"{where} {o['fn']}: torch_ext differs from TransformerLens (max abs diff {err})")
    return diffs, refusals


def gen_spec(rng: random.Random, new_ground: bool = False, gradients: bool = False) -> dict:
    if gradients:
        return gen_spec_grad(rng)
    if new_ground:
        return gen_spec_new(rng)
    if rng.random() < 0.12:
        return gen_tl_spec(rng)
    m = gen_model(rng)
    spec = {"model": m, "ops": gen_ops(rng, m)}
    if rng.random() < 0.3:  # ReactiveGraph's own options (README: cutoff=, positions=)
        spec["graph"] = {"cutoff": rng.random() < 0.5, "positions": rng.random() < 0.5}
    return spec


# ------------------------------------------------------------------------------------------ new ground (seeds >= 52)
# Seeds below NEW_GROUND_SEED replay the specs they always generated; from it on, cases also draw Hugging Face
# families beyond GPT-2 (rotary, grouped-query attention, sliding window, parallel attention+MLP, learned positions,
# a non-causal Bert whose token-granular cones must fall back), batch 1..8, and the operations users reach for that
# the first ground lacks: in-place patch functions, patches of another dtype / shape / layout, patch functions that
# read other nodes, steering vectors, a graft then a patch inside the grafted block, run_with_cache, sweeps over
# (hook, negative position), (hook_z, head) and mixed whole-node / position sites, metrics reading several outputs
# and reads= declared right, partially, wrongly or "auto".
NEW_GROUND_SEED = 52
HF_ARCHS = ("llama", "mistral", "qwen2", "gemma", "gpt_neox", "opt", "phi", "bert")
HF_HOOKS = {"llama": GPT2_HOOKS, "mistral": GPT2_HOOKS, "qwen2": GPT2_HOOKS, "gemma": GPT2_HOOKS,
            "gpt_neox": ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_mlp_out", "hook_resid_post"),
            "phi": ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_mlp_out", "hook_resid_post"),
            "opt": ("hook_resid_pre", "attn.hook_z", "hook_resid_post"),
            # Bert exposes no TransformerLens names: sites are the node a module path's glob ends on (its output).
            "bert": ("attention.output", "output")}
NEW_FNS = ("zero", "scale", "noise", "pos", "steer", "inplace", "inplace_clone", "dtype", "shape", "stride", "other")


def gen_model_new(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.55:
        arch = rng.choice(HF_ARCHS)
        m = {"family": "hf", "arch": arch, "seed": rng.randrange(1000), "d": 32, "heads": 4,
             "vocab": rng.choice((50, 64)), "T": rng.choice((4, 5, 6, 8)), "B": rng.choice((1, 1, 2, 3, 8)),
             "mask": rng.choice((None, None, "left", "ones")), "hs": rng.random() < 0.25,
             "dtype": "float64" if rng.random() < 0.15 else "float32", "blocks": [{"kind": "hf"}] * 2}
        if arch == "mistral":
            m["sw"] = rng.choice((2, 3, 4096))
        return m
    m = gen_model(rng)
    m["B"] = rng.choice((1, 2, 3, 8))
    return m


def gen_ops_new(rng: random.Random, m: dict) -> list:
    ops = gen_ops(rng, m)
    hooks = list(hooks_of(m))
    n_in = 0
    out = []
    for o in ops:
        if o["op"] == "patch_f" and rng.random() < 0.6:
            o = {**o, "fn": rng.choice(NEW_FNS), "other": rng.choice(hooks)}
        if o["op"] == "batch":
            o = {**o, "ops": [{**i, "fn": rng.choice(NEW_FNS), "other": rng.choice(hooks)}
                              if i["op"] == "patch_f" and rng.random() < 0.4 else i for i in o["ops"]]}
        if o["op"] == "sweep":
            o = {**o, "per": rng.choice(("pos", "pos", "neg", "whole", "mixed", "head")),
                 "fn": rng.choice(("zero", "noise", "mean", "corrupt", "same", "steer", "other", "inplace",
                                   "stride")),
                 "metric": rng.choice(("last", "sum", "reads_last", "dict", "multi", "reads_partial",
                                       "reads_wrong", "reads_auto", "reads_cols", "vec")),
                 "batch": rng.choice((False, False, True, 2, 8)), "other": rng.choice(hooks)}
        if o["op"] == "read" and rng.random() < 0.3:
            o = {**o, "how": "cache"}
        out.append(o)
        r = rng.random()
        if r < 0.15:  # a graft of Linear -> tanh, then a patch at the Linear inside it
            out.append({"op": "graft_in", "hook": rng.choice(hooks), "seed": rng.randrange(1000), "k": n_in})
            if rng.random() < 0.8:
                out.append({"op": "patch_in", "k": n_in, "fn": rng.choice(("zero", "scale", "noise", "t")),
                            "p": rng.randrange(m["T"]), "seed": rng.randrange(1000)})
            n_in += 1
    return out


def gen_spec_new(rng: random.Random) -> dict:
    if rng.random() < 0.05:
        return gen_tl_spec(rng)
    m = gen_model_new(rng)
    spec = {"model": m, "ops": gen_ops_new(rng, m)}
    if rng.random() < 0.3:
        spec["graph"] = {"cutoff": rng.random() < 0.5, "positions": rng.random() < 0.5}
    return spec


# ------------------------------------------------------------------------------------------ gradients (seeds >= 60)
# Seeds below GRADIENT_SEED replay the specs they always generated; from it on, a case of the new ground also draws
# rg.gradient (one or several hook names, over standing patches and grafts: eager autograd.grad through the same
# hooks, bit for bit, README "Gradients"), edge-form grafts graft(src, dst, block) onto one reader of a hook's node
# (the reference: forward pre-hooks on the reader's module, where the graph shows that module reads the node
# through that one edge), one-row patches (a function writing [:, p]) with positions=True on the graph or the
# sweep, and a batch axis as long as the sequence or d_model (a batch axis guessed from sizes would be wrong).
GRADIENT_SEED = 60
GRAD_METRICS = ("last", "sum", "cols", "lsm", "first")
GQA_ARCHS = ("llama", "mistral", "qwen2", "gemma")


def gen_spec_grad(rng: random.Random) -> dict:
    spec = gen_spec_new(rng)
    m = spec["model"]
    if m.get("family") == "tl":
        return spec
    r = rng.random()
    if r < 0.25:
        m["B"] = m["T"]  # batch == sequence length
    elif r < 0.4:
        m["B"] = m["d"]  # batch == d_model
    elif r < 0.7:
        m["B"] = rng.choice((1, 8))
    if rng.random() < 0.3:
        spec["graph"] = {**spec.get("graph", {}), "positions": True}
    hooks = list(hooks_of(m))
    out = []
    for o in spec["ops"]:
        if o["op"] == "sweep" and rng.random() < 0.5:
            o = {**o, "positions": rng.choice((None, True, True, False)),
                 "fn": rng.choice(("row", "row", o["fn"])), "p": rng.randrange(m["T"])}
        out.append(o)
        r = rng.random()
        if r < 0.25:
            out.append({"op": "grad", "hooks": rng.sample(hooks, min(len(hooks), rng.randint(1, 3))),
                        "one": rng.random() < 0.3, "metric": rng.choice(GRAD_METRICS)})
        elif r < 0.4:
            out.append({"op": "graft_edge", "hook": rng.choice(hooks), "pick": rng.randrange(4),
                        "block": rng.choice(("double", "tanh", "linear", "linear_kept")), "seed": rng.randrange(1000)})
        elif r < 0.5:
            out.append({"op": "patch_f", "hook": rng.choice(hooks), "fn": "row", "p": rng.randrange(m["T"]),
                        "seed": rng.randrange(1000)})
    if not any(o["op"] == "grad" for o in out):
        out.append({"op": "grad", "hooks": rng.sample(hooks, min(len(hooks), 2)), "one": False,
                    "metric": rng.choice(GRAD_METRICS)})
    spec["ops"] = out
    return spec


# ------------------------------------------------------------------------------------------ model
def build_gpt2(m: dict):
    import transformers

    import torch

    torch.manual_seed(m["seed"])
    cfg = transformers.GPT2Config(n_layer=len(m["blocks"]), n_embd=m["d"], n_head=4, vocab_size=m["vocab"],
                                  n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(getattr(torch, m["dtype"])).eval()


def gpt2_points(model, m: dict) -> dict:
    """{hook name: (module, how)} for the reference's hooks on a GPT-2, TransformerLens 4's bridge names: resid_pre:
    the block's input; attn_out / mlp_out: the attention's / MLP's output; resid_mid: ln_2's input (the bridge's
    hook_resid_mid is ln2.hook_in: a patch there reaches the MLP branch only, not the residual add, checked on a
    TransformerBridge); resid_post: the block's output; attn.hook_z: the output projection's input, seen as
    [batch, pos, head, d_head]."""
    points = {}
    for i, blk in enumerate(model.transformer.h):
        points[f"blocks.{i}.hook_resid_pre"] = (blk, "pre")
        points[f"blocks.{i}.attn.hook_z"] = (blk.attn.c_proj, "pre_z")
        points[f"blocks.{i}.hook_attn_out"] = (blk.attn, "out0")
        points[f"blocks.{i}.hook_resid_mid"] = (blk.ln_2, "pre")
        points[f"blocks.{i}.hook_mlp_out"] = (blk.mlp, "out")
        points[f"blocks.{i}.hook_resid_post"] = (blk, "out")
    return points


def build_hf(m: dict):
    """A tiny Hugging Face model of ``m["arch"]`` (HF_ARCHS) from a config: 2 layers, d 32, 4 heads, no dropout."""
    import transformers as T

    import torch

    torch.manual_seed(m["seed"])
    a, v, d = m["arch"], m["vocab"], m["d"]
    ids = dict(bos_token_id=0, eos_token_id=0)
    common = dict(vocab_size=v, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=len(m["blocks"]),
                  num_attention_heads=m["heads"], max_position_embeddings=16, pad_token_id=0, **ids)
    if a == "llama":  # rotary, grouped-query attention (2 key/value heads)
        model = T.LlamaForCausalLM(T.LlamaConfig(**common, num_key_value_heads=2))
    elif a == "mistral":  # sliding-window attention
        model = T.MistralForCausalLM(T.MistralConfig(**common, num_key_value_heads=2, sliding_window=m["sw"]))
    elif a == "qwen2":  # biases on q, k, v
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**common, num_key_value_heads=2))
    elif a == "gemma":  # scaled embedding, RMSNorm(1 + w), multi-query attention
        model = T.GemmaForCausalLM(T.GemmaConfig(**common, num_key_value_heads=1, head_dim=d // m["heads"]))
    elif a == "gpt_neox":  # parallel attention and MLP, rotary on a quarter of each head
        model = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=v, hidden_size=d, num_hidden_layers=len(m["blocks"]), num_attention_heads=m["heads"],
            intermediate_size=2 * d, max_position_embeddings=16, rotary_pct=0.25, use_parallel_residual=True,
            hidden_dropout=0.0, attention_dropout=0.0, **ids))
    elif a == "opt":  # learned positions from the attention mask's cumsum
        model = T.OPTForCausalLM(T.OPTConfig(
            vocab_size=v, hidden_size=d, num_hidden_layers=len(m["blocks"]), ffn_dim=2 * d,
            num_attention_heads=m["heads"], max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
            word_embed_proj_dim=d, pad_token_id=1, **ids))
    elif a == "phi":  # parallel, partial rotary, one LayerNorm
        model = T.PhiForCausalLM(T.PhiConfig(
            vocab_size=v, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=len(m["blocks"]),
            num_attention_heads=m["heads"], max_position_embeddings=16, partial_rotary_factor=0.5, resid_pdrop=0.0,
            embd_pdrop=0.0, attention_dropout=0.0, **ids))
    else:  # bert: bidirectional (token-granular cones must fall back to whole nodes)
        model = T.BertForMaskedLM(T.BertConfig(
            vocab_size=v, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=len(m["blocks"]),
            num_attention_heads=m["heads"], max_position_embeddings=16, pad_token_id=0, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    return model.to(getattr(torch, m["dtype"])).eval()


def hf_points(model, m: dict) -> dict:
    """{hook name: (module, how)} of an HF_ARCHS model for the reference, as ReactiveGraph names them (README,
    "Coming from TransformerLens"): resid_pre the layer's input, attn_out / mlp_out the attention's / MLP's
    output, resid_mid the pre-MLP norm's input, resid_post the layer's output, attn.hook_z the output
    projection's input as [batch, pos, head, d_head]; Bert: the module's output."""
    a, points = m["arch"], {}
    if a == "bert":
        for i, layer in enumerate(model.bert.encoder.layer):
            points[f"blocks.{i}.attention.output"] = (layer.attention.output, "out")
            points[f"blocks.{i}.output"] = (layer.output, "out")
        return points
    layers = {"gpt_neox": lambda: model.gpt_neox.layers, "opt": lambda: model.model.decoder.layers}.get(
        a, lambda: model.model.layers)()
    for i, layer in enumerate(layers):
        attn = layer.attention if a == "gpt_neox" else layer.self_attn
        proj = {"gpt_neox": "dense", "phi": "dense", "opt": "out_proj"}.get(a, "o_proj")
        points[f"blocks.{i}.hook_resid_pre"] = (layer, "pre")
        points[f"blocks.{i}.attn.hook_z"] = (getattr(attn, proj), "pre_z")
        if a != "opt":
            points[f"blocks.{i}.hook_attn_out"] = (attn, "out0")
            points[f"blocks.{i}.hook_mlp_out"] = (layer.mlp, "out")
        if a in ("llama", "mistral", "qwen2", "gemma"):
            points[f"blocks.{i}.hook_resid_mid"] = (layer.post_attention_layernorm, "pre")
        points[f"blocks.{i}.hook_resid_post"] = (layer, "out")
    return points


def logits_of(out):
    """The logits of a model's output: the tensor itself, or a Hugging Face ModelOutput's ``logits``."""
    return out if not hasattr(out, "keys") else out["logits"]


def last_dim(m: dict, hook: str) -> int:
    return m["d"] // m.get("heads", 4) if hook.endswith("attn.hook_z") else m["d"]


def build_model(m: dict):
    if m.get("family") == "gpt2":
        return build_gpt2(m)
    if m.get("family") == "hf":
        return build_hf(m)
    import torch
    import torch.nn as nn
    from transformer_lens.hook_points import HookPoint

    from torch_ext.models import Block as TinyBlock

    d, dtype = m["d"], getattr(torch, m["dtype"])
    acts = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}

    def pad_mask(b, t):  # batch row 0 does not attend to its last key
        mask = torch.zeros(b, t, dtype=torch.bool)
        mask[0, -1] = True
        return mask

    class Blk(nn.Module):
        def __init__(self, spec):
            super().__init__()
            self.spec = dict(spec)
            k = spec["kind"]
            if k == "mlp":
                self.ln = nn.LayerNorm(d)
                self.mlp = nn.Sequential(nn.Linear(d, 2 * d), acts[spec["act"]](), nn.Linear(2 * d, d))
            elif k == "tiny":
                self.blk = TinyBlock(d, 2, 2 * d)
            elif k == "mha":
                self.ln = nn.LayerNorm(d)
                self.attn = nn.MultiheadAttention(d, 2, batch_first=spec["batch_first"])
            elif k == "enc":
                self.enc = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=spec["batch_first"])
            elif k == "conv":
                self.conv = nn.Conv1d(d, d, 3, padding=2 if spec["causal"] else 1)
                self.bn = nn.BatchNorm1d(d)
            elif k == "bn":
                self.bn = nn.BatchNorm1d(d)
            elif k == "act":
                self.act = acts[spec["act"]]()
            self.hook_mid = HookPoint()
            self.hook_tbd = HookPoint()
            self.hook_out = HookPoint()

        def forward(self, x):  # x: [B, T, d]
            k, s = self.spec["kind"], self.spec
            b, t = x.shape[0], x.shape[1]
            if k == "mlp":
                return self.hook_out(x + self.hook_mid(self.mlp(self.ln(x))))
            # hook_out never reads hook_mid alone: two hook points in a row address one node (see the report).
            if k == "tiny":
                return self.hook_out(0.5 * x + self.hook_mid(self.blk(x)))
            if k in ("mha", "enc"):
                h = x if s["batch_first"] else x.transpose(0, 1)
                if not s["batch_first"] and s.get("inner_hook"):
                    h = self.hook_tbd(h)
                causal = s["mask"] == "causal"
                am = nn.Transformer.generate_square_subsequent_mask(t, dtype=x.dtype) if causal else None
                kpm = pad_mask(b, t) if s["mask"] == "pad" else None
                if k == "mha":
                    y = self.ln(h)
                    y = self.attn(y, y, y, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]
                    y = self.hook_mid(y if s["batch_first"] else y.transpose(0, 1))
                    return self.hook_out(x + y)
                y = self.enc(h, src_mask=am, src_key_padding_mask=kpm, is_causal=causal)
                y = self.hook_mid(y if s["batch_first"] else y.transpose(0, 1))
                return self.hook_out(0.5 * x + y)
            if k == "conv":
                y = self.conv(x.transpose(1, 2))[:, :, :t]
                y = self.hook_mid(self.bn(y).transpose(1, 2))
                return self.hook_out(x + torch.tanh(y))
            if k == "bn":
                return self.hook_out(self.bn(x.transpose(1, 2)).transpose(1, 2))
            return self.hook_out(self.act(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            f = m["front"]
            if f == "embed":
                self.front = nn.Embedding(16, d)
            elif f == "linear":
                self.front = nn.Linear(4, d)
            else:
                self.front = nn.Conv1d(4, d, 3, padding=1)
            self.hook_embed = HookPoint()
            self.blocks = nn.ModuleList(Blk(b) for b in m["blocks"])
            self.head = nn.Linear(d, 10)

        def forward(self, x):
            h = self.front(x)
            if m["front"] == "conv":
                h = h.transpose(1, 2)
            h = self.hook_embed(h)
            for blk in self.blocks:
                h = blk(h)
            return self.head(h)

    torch.manual_seed(m["seed"])
    model = Model().to(dtype)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm1d):
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)
    for name, mod in model.named_modules():
        if isinstance(mod, HookPoint):
            mod.name = name
    return model.eval()


def make_input(m: dict, seed: int, t: int):
    """(positional inputs, keyword inputs) of one forward."""
    import torch

    g = torch.Generator().manual_seed(seed)
    b, dtype = m["B"], getattr(torch, m["dtype"])
    if m.get("family") == "hf":
        (ids,), kw = make_input({**m, "family": "gpt2"}, seed, t)
        return (ids,), ({**kw, "output_hidden_states": True} if m.get("hs") else kw)
    if m.get("family") == "gpt2":
        ids = torch.randint(0, m["vocab"], (b, t), generator=g)
        if m["mask"] is None:
            return (ids,), {}
        mask = torch.ones(b, t, dtype=torch.long)
        if m["mask"] == "left":  # left padding: row 0 (and row 2) start 1..t-1 tokens late
            for r in range(0, b, 2):
                mask[r, :int(torch.randint(1, t, (1,), generator=g))] = 0
        return (ids,), {"attention_mask": mask}
    if m["front"] == "embed":
        return (torch.randint(0, 16, (b, t), generator=g),), {}
    if m["front"] == "linear":
        return (torch.randn(b, t, 4, generator=g, dtype=dtype),), {}
    return (torch.randn(b, 4, t, generator=g, dtype=dtype),), {}


def clone_input(x):
    args, kw = x
    return tuple(a.clone() for a in args), {k: v.clone() if hasattr(v, "clone") else v for k, v in kw.items()}


# ------------------------------------------------------------------------------------------ reference
class Reference:
    """Eager PyTorch with forward hooks on the hook points: the documented semantics, no torch_ext."""

    def __init__(self, model, x, points, heads=4):
        self.model, self.x = model, x   # x: (positional inputs, keyword inputs)
        self.heads = heads              # attn.hook_z's heads
        self.full = None                # the last forward's whole output (a metric reading several outputs)
        self._seen = None               # the running forward's {hook: value} (RefGraftIn records into it)
        self.points = points            # hook -> (module, how): "out", "out0" (a tuple's first), "pre", "pre_z"
        self.patches: dict = {}  # hook -> tensor (the frozen value)
        self.grafts: dict = {}   # hook -> [block, ...] (applied after the patch, in graft order)
        # Edge-form grafts: (hook, module path whose input gets the block, module paths inside it whose input is
        # put back, block): forward pre-hooks, checked to see the hook's value itself (edge_expressible).
        self.edges: list = []
        self._grad = None        # a forward for gradients: {hook: the tensor autograd differentiates by}
        self._flow = None        # the running forward's {hook: the value its readers get (after node-form grafts)}
        self._probe = None       # [(module path, pre-hook)] registered last (edge_expressible)

    def capture(self, name, v):
        """``v`` as the value the gradient at ``name`` is taken by: a view of it (eager's retain_grad on a hook's
        own tensor: the hook's readers only, as a graph node's), or a leaf for a constant (a standing patch)."""
        if self._grad is None or name not in self._grad_names:
            return v
        v = v.view_as(v) if v.requires_grad else v.detach().requires_grad_(True)
        self._grad[name] = v
        return v

    def forward(self, override=None):
        """(output, {hook: value its name addresses}) with the standing patches, grafts and ``override``."""
        import torch

        seen, handles = {}, []
        self._seen, self._override = seen, override
        flow = self._flow = {}
        grad_mode = self._grad is not None

        def apply(name, v):
            if name in self.patches:
                v = self.patches[name]
            if override is not None and override[0] == name:
                v = override[1]
            v = self.capture(name, v)
            seen[name] = v
            for blk in self.grafts.get(name, ()):
                with torch.set_grad_enabled(grad_mode):
                    v = blk(v)
            flow[name] = v
            return v

        def out_hook(name, how):
            def hook(mod, args, out):
                if how == "out0" or (how == "out" and isinstance(out, tuple)):
                    return (apply(name, out[0]),) + tuple(out[1:])
                return apply(name, out)
            return hook

        def pre_hook(name, how):
            def hook(mod, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                if how == "pre_z":  # [batch, pos, d] -> the hook's [batch, pos, head, d_head] and back
                    b, t, d = x.shape
                    y = apply(name, x.view(b, t, self.heads, d // self.heads)).reshape(b, t, d)
                else:
                    y = apply(name, x)
                if args:
                    return (y,) + tuple(args[1:]), kwargs
                return args, {**kwargs, "hidden_states": y}
            return hook

        # prepend: before Hugging Face's own hooks (transformers 5 records output_hidden_states by forward hooks it
        # installs at the first call and keeps), so hidden_states holds the hooked value at every call, as at the
        # first (and as the layer's returned value, which older transformers appended).
        for name, (mod, how) in self.points.items():
            if how.startswith("pre"):
                handles.append(mod.register_forward_pre_hook(pre_hook(name, how), with_kwargs=True, prepend=True))
            else:
                handles.append(mod.register_forward_hook(out_hook(name, how), prepend=True))
        # Edge-form grafts, after the hook points' hooks: the block on the reader module's input, the value put
        # back at the other readers inside it (every put-back before any block: a later edge onto one of those
        # readers gets the value put back).
        ins, backs = [], []
        for name, path, back, blk in self.edges:
            state = {}

            def swap(args, kwargs, x, y):  # every argument that is x (MultiheadAttention(x, x, x) reads it once)
                return (tuple(y if a is x else a for a in args), {k: y if a is x else a for k, a in kwargs.items()})

            def edge_in(mod, args, kwargs, name=name, blk=blk, state=state):
                x = args[0] if args else kwargs["hidden_states"]
                with torch.set_grad_enabled(grad_mode):
                    y = blk(x)
                state["orig"], state["edged"] = x, y
                return swap(args, kwargs, x, y)

            def edge_back(mod, args, kwargs, state=state):
                x = args[0] if args else kwargs["hidden_states"]
                if x is not state.get("edged"):
                    raise RuntimeError("fuzz_sweep reference: an edge's reader got another value than the block's")
                return swap(args, kwargs, x, state["orig"])
            ins.append((path, edge_in))
            backs += [(q, edge_back) for q in back]
        for path, fn in backs + ins + (self._probe or []):
            handles.append(self.model.get_submodule(path).register_forward_pre_hook(fn, with_kwargs=True))
        try:
            # Grad mode on: under no_grad an eval-mode nn.MultiheadAttention / nn.TransformerEncoderLayer takes
            # its fused fast path (torch._native_multi_head_attention), other kernels than the traced graph's.
            with torch.enable_grad():
                args, kw = self.x
                full = self.model(*args, **kw)
                out = logits_of(full)
                if grad_mode:
                    self.full_grad = full  # gradients(): the metric reads it with its graph
        finally:
            for h in handles:
                h.remove()
            self._flow = None
        # Detached, and nothing of this forward kept on self: forward64 deep-copies the reference.
        self.full = full.detach() if not hasattr(full, "keys") else {
            k: tuple(t.detach() for t in v) if isinstance(v, tuple) else v.detach() for k, v in full.items()
            if isinstance(v, torch.Tensor) or (isinstance(v, tuple) and all(isinstance(t, torch.Tensor) for t in v))}
        self._seen = self._override = None
        return out.detach(), {k: v.detach() for k, v in seen.items()}

    def gradients(self, metric, names) -> dict:
        """{hook: d metric(output) / d its value} by eager autograd through the same hooks (README "Gradients": a
        standing patch is a constant, a requested hook downstream of another is differentiated through)."""
        import torch

        self._grad, self._grad_names = {}, set(names)
        try:
            self.forward()
            grads = self._grad
            with torch.enable_grad():
                mval = metric(self.full_grad)
                wrt = [grads[n] for n in names]
                got = torch.autograd.grad(mval, wrt, allow_unused=True)
        finally:
            self._grad, self.full_grad = None, None
        self.reached = [g is not None for g in got]  # which requested hooks the metric depends on
        return {n: (torch.zeros_like(w) if g is None else g).detach() for n, g, w in zip(names, got, wrt)}

    def edge_expressible(self, name, path, back) -> bool:
        """Whether eager forward pre-hooks express a graft on one edge of ``name``'s node: the module at ``path``
        (and each of ``back``) is called once and gets the hook's value itself (what the graph's node holds)."""
        calls = []

        def probe(mod, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            calls.append(self._flow is not None and name in self._flow and x is self._flow[name])
        self._probe = [(q, probe) for q in (path, *back)]
        try:
            self.forward()
        finally:
            self._probe = None
        return len(calls) == 1 + len(back) and all(calls)

    def forward64(self, override=None):
        """forward()'s output computed in float64 (a copy of the model, grafts, patches and inputs): the exact
        answer to float32's precision, against which eager float32's own rounding error is measured."""
        import torch

        def up(t):
            return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        r = copy.deepcopy(self)  # one memo: the hook points stay the copied model's modules
        r.model.double()
        for blk in [b for blocks in r.grafts.values() for b in blocks] + [e[3] for e in r.edges]:
            if isinstance(blk, torch.nn.Module):
                blk.double()
        r.patches = {k: up(v) for k, v in r.patches.items()}
        args, kw = r.x
        r.x = tuple(up(a) for a in args), {k: up(v) for k, v in kw.items()}
        return r.forward(None if override is None else (override[0], up(override[1])))[0]


# ------------------------------------------------------------------------------------------ case
def patch_fn_of(o: dict, seq_dim: int, other=None):
    import torch

    kind = o["fn"]

    def fn(v):
        if kind == "zero":
            return torch.zeros_like(v)
        if kind == "steer":  # a steering vector, at every position
            g = torch.Generator().manual_seed(o["seed"])
            return v + torch.randn(v.shape[-1], generator=g, dtype=v.dtype)
        if kind == "inplace":  # writes into its argument and returns it (README: must return a new tensor)
            return v.mul_(0)
        if kind == "inplace_clone":  # writes into its argument (a copy), returns a new tensor
            v.mul_(0)
            return v.clone()
        if kind == "dtype":  # must be refused by name
            return v.to(torch.float64 if v.dtype == torch.float32 else torch.float32)
        if kind == "shape":  # must be refused by name
            return v.narrow(seq_dim, 0, v.shape[seq_dim] - 1).clone()
        if kind == "stride":  # the node's values times 1.5, in another memory layout
            return (v * 1.5).transpose(-1, -2).contiguous().transpose(-1, -2)
        if kind == "other":  # reads another node (the graph: rg.value inside the function)
            ov = other()
            return v + 0.5 * (ov if ov.shape == v.shape else ov.mean())
        if kind == "scale":
            return v * 1.5
        if kind == "row":  # a hook function writing one token's row, v[:, p] (one position of most nodes)
            w = v.clone()
            q = o["p"] % v.shape[1]
            w[:, q] = w[:, q] * -2 + 0.25
            return w
        if kind == "noise":
            g = torch.Generator().manual_seed(o["seed"])
            return v + torch.randn(v.shape, generator=g, dtype=v.dtype)
        w = v.clone()
        w.select(seq_dim, o["p"] % v.shape[seq_dim]).zero_()
        return w
    return fn


def graft_block(o: dict, d: int, dtype):
    import torch

    if o["block"] == "double":
        return lambda t: 2 * t
    if o["block"] == "tanh":
        return torch.tanh
    torch.manual_seed(o["seed"])
    if o["block"] == "linear_kept":
        return KeptLayout(torch.nn.Linear(d, d).to(dtype))
    return torch.nn.Linear(d, d).to(dtype)


def _kept_layout_cls():
    import torch

    class KeptLayout(torch.nn.Module):
        """A block returning its input's layout (README, grafts: a block must return the node's layout)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, t):
            return torch.empty_like(t).copy_(self.inner(t))
    return KeptLayout


def KeptLayout(inner):  # noqa: N802 - a class made on first use (torch is imported lazily here)
    global _KEPT
    if "_KEPT" not in globals():
        _KEPT = _kept_layout_cls()
    return _KEPT(inner)


def _ref_graft_in_cls():
    import torch

    class RefGraftIn(torch.nn.Module):
        """The reference of a graft nn.Sequential(Linear, Tanh) whose Linear output the graph names (a patch or a
        site there): the patch (frozen value) or the site's value replaces it, as a forward hook on the Linear."""

        def __init__(self, lin, name, ref):
            super().__init__()
            self.lin, self.name, self.ref = lin, name, ref

        def forward(self, t):
            u, r = self.lin(t), self.ref
            if self.name in r.patches:
                u = r.patches[self.name]
            if r._override is not None and r._override[0] == self.name:
                u = r._override[1]
            u = r.capture(self.name, u)
            r._seen[self.name] = u
            return torch.tanh(u)
    return RefGraftIn


def RefGraftIn(lin, name, ref):  # noqa: N802 - a class made on first use
    global _RGI
    if "_RGI" not in globals():
        _RGI = _ref_graft_in_cls()
    return _RGI(lin, name, ref)


def metric_of(kind: str, out_key=0, m=None):
    """(metric for the graph, metric for the reference (on the whole output), scale(logits), reads or None,
    whether the sweep must refuse it: a metric reading outside its reads=)."""
    import torch

    def w_of(out):
        return torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)

    if kind in ("last", "reads_last", "reads_auto"):
        met = lambda out: float((out[:, -1] * w_of(out)).sum())  # noqa: E731
        scale = lambda out: float((out[:, -1].abs() * w_of(out).abs()).sum())  # noqa: E731
        reads = {out_key: (slice(None), -1)} if kind == "reads_last" else "auto" if kind == "reads_auto" else None
        return lambda out: met(logits_of(out)), lambda out: met(logits_of(out)), scale, reads, False
    if kind == "sum":
        met = lambda out: float(out.sum())  # noqa: E731
        return lambda out: met(logits_of(out)), lambda out: met(logits_of(out)), lambda out: float(out.abs().sum()), \
            None, False
    if kind in ("multi", "reads_partial"):  # reads two outputs (logits and a hidden state) or two positions
        hs = bool(m and m.get("hs"))

        def met(out):
            lg = logits_of(out)
            second = out["hidden_states"][1][:, -1].sum() if hs else (lg[:, 0] * w_of(lg)).sum()
            return float((lg[:, -1] * w_of(lg)).sum() + 0.5 * second)

        def scale(out):
            return float((out[:, -1].abs() * w_of(out).abs()).sum() + (out[:, 0].abs() * w_of(out).abs()).sum())
        # reads_partial declares the logits' last row: the second position is outside it (refused), while a
        # hidden state is another output, which a declaration not naming it reads whole (_read_rows: -1).
        reads = {out_key: (slice(None), -1)} if kind == "reads_partial" else None
        return met, met, scale, reads, kind == "reads_partial" and not hs
    if kind == "reads_wrong":  # reads row -2, declares row -1
        met = lambda out: float((logits_of(out)[:, -2] * w_of(logits_of(out))).sum())  # noqa: E731
        return met, met, lambda out: float(out[:, -2].abs().sum()), {out_key: (slice(None), -1)}, True
    if kind == "reads_cols":  # a logit difference, its two columns declared
        met = lambda out: float((logits_of(out)[:, -1, 1] - logits_of(out)[:, -1, 2]).sum())  # noqa: E731
        return met, met, lambda out: float(out[:, -1, 1:3].abs().sum()), {out_key: (slice(None), -1, [1, 2])}, False
    if kind == "vec":  # one value per example, kept as a tensor
        met = lambda out: (logits_of(out)[:, -1, 0] - logits_of(out)[:, -1, 1]).detach().clone()  # noqa: E731
        return met, met, lambda out: float(out[:, -1, :2].abs().sum()), None, False
    met = lambda out: {"a": float(out[0, 0, 0]), "b": float(out[-1].mean())}  # noqa: E731
    return lambda out: met(logits_of(out)), lambda out: met(logits_of(out)), lambda out: float(out.abs().max()), \
        None, False


def grad_metric_of(kind: str, m=None):
    """A metric for rg.gradient and the reference: one floating-point tensor from the outputs."""
    import torch

    def met(out):
        lg = logits_of(out)
        if kind == "last":
            return (lg[:, -1] * torch.linspace(-1, 1, lg.shape[-1], dtype=lg.dtype)).sum()
        if kind == "sum":
            return lg.sum()
        if kind == "cols":  # a logit difference
            return (lg[:, -1, 1] - lg[:, -1, 2]).sum()
        if kind == "lsm":
            return lg[:, -1].log_softmax(-1)[:, 0].mean()
        return lg[:, 0].pow(2).sum()  # "first": position 0 only (a causal model gives later positions zeros)
    return met


def close(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= TOL * max(scale, 1e-30)


class _Nothing:
    """What the graph's side answers in an eager-only run (run_case(graph=False)): every attribute, call and index
    gives it again, and nothing compares it (eq does nothing there)."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __getitem__(self, key):
        return self


class _NoGraph(_Nothing):
    """The ReactiveGraph of an eager-only run: accepts every operation and does nothing."""

    def batch(self):
        return contextlib.nullcontext()

    def graft(self, *args, **kwargs):
        return ["linear"]  # graft_in names its Linear's node

    def run_with_cache(self, *args, **kwargs):
        return self, self


# Where the running case is (run_case with the graph): the op running (-1: the build; len(ops): the final check)
# and the ops the graph refused, which the reference skipped too. The eager-only rerun replays that much.
_PROGRESS: dict = {"op": -1, "refused": set()}


@one_intra_op_thread
def run_case(spec: dict, verbose: bool = False, graph: bool = True, upto: int = -1,
             skip=frozenset()) -> tuple[list[str], dict, int]:
    """Runs the spec both ways; returns (differences, {refusal message: count}, comparisons that passed only
    within FLOOR times eager float32's own error). A refused build raises.

    ``graph=False``: eager alone (what _fuzz_driver.classify asks of a case that raised: does eager fail too?), as
    far as the run that raised got: the build's forward on the spec's inputs, then the reference's side of ops
    0..``upto`` but those in ``skip`` (refused by the graph, so the reference skipped them there too), and the
    final forward where ``upto`` is past the last op. Any exception raises; nothing is compared."""
    if spec["model"].get("family") == "tl":
        if not graph:
            return [], {}, 0  # no eager-only replay of the bridge's ops: a failure stays the finding it was
        return (*run_tl_case(spec, verbose), 0)
    import torch

    import torch_ext

    _fuzz_driver.enter("eager")  # the model both sides share
    if graph:
        _PROGRESS.update(op=-1, refused=set())
    m = spec["model"]
    seq_dims = hooks_of(m)
    model = build_model(m)
    ref_model = copy.deepcopy(model)
    x = make_input(m, 0, m["T"])
    _fuzz_driver.enter("build")
    if graph:
        rg = torch_ext.ReactiveGraph(model, x[0], example_kwargs=x[1] or None, **spec.get("graph", {}))
    else:
        rg, torch_ext = _NoGraph(), _Nothing()
    _fuzz_driver.enter("run")  # operations refused by name are noted by op (note), anything else raises
    cur = [x]  # the graph's inputs now (run() replaces them): an input edit writes into them
    if m.get("family") == "gpt2":
        points = gpt2_points(ref_model, m)
    elif m.get("family") == "hf":
        points = hf_points(ref_model, m)
    else:
        points = {mod.name: (mod, "out") for mod in ref_model.modules() if type(mod).__name__ == "HookPoint"}
    ref = Reference(ref_model, clone_input(x), points, m.get("heads", 4))
    out_key = "logits" if m.get("family") in ("gpt2", "hf") else 0
    # The graph's name of each spec name: itself, Bert's module-path sites the node their glob ends on, a graft's
    # inner Linear (graft_in) the node graft() returned.
    G = {h: h for h in seq_dims}
    if m.get("family") == "hf" and m["arch"] == "bert" and graph:
        for h in list(G):
            _, i, rest = h.split(".", 2)
            G[h] = rg.nodes(f"bert.encoder.layer.{i}.{rest}*")[-1]

    def gn(h):
        return G.get(h, h)
    diffs: list[str] = []
    refusals: dict[str, int] = {}
    graft_mods = []  # (graph's block, reference's block) for nn.Module grafts
    dtype = getattr(torch, m["dtype"])

    def note(exc, where):
        if not graph:
            raise exc  # eager alone: nothing of torch_ext's is refused, and eager failing is the answer
        name = type(exc).__name__
        msg = str(exc)
        if type(exc).__module__.startswith("torch_ext"):  # torch_ext's own ValueError subclass (_ReadsOutside)
            name = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _fuzz_driver.OK_ERRORS), name)
        if name in _fuzz_driver.OK_ERRORS and not any(k in msg for k in _fuzz_driver.BAD_MARKERS):
            key = f"{where}: {name}: " + re.sub(r"\d+", "N", msg.splitlines()[0] if msg else "")[:150]
            refusals[key] = refusals.get(key, 0) + 1
            _PROGRESS["refused"].add(_PROGRESS["op"])
            if verbose:
                print("  refused:", key)
            return
        raise exc

    floored = [0]

    def within_floor(err, floor, what):
        """Whether err is within FLOOR times eager float32's own error (floor(): that error, float32 models only)."""
        if floor is None or m["dtype"] != "float32":
            return False
        try:
            own = floor()
        except Exception as exc:  # noqa: BLE001 - a float64 copy that cannot run leaves the 1e-6 verdict standing
            diffs.append(f"{what}: eager float32's own error not measured ({type(exc).__name__}: {exc})"[:300])
            return False
        if err <= FLOOR * own:
            floored[0] += 1
            if verbose:
                print(f"  {what}: {err:.3g} beyond 1e-6, within {FLOOR:g} x eager float32's own error {own:.3g}")
            return True
        diffs.append(f"{what}: also beyond {FLOOR:g} x eager float32's own error {own:.3g}")
        return False

    def eq(a, b, what, tol_ok=False, scale=None, floor=None):
        if not graph:
            return  # eager alone: nothing to compare
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                diffs.append(f"{what}: shape/dtype {tuple(a.shape)} {a.dtype} vs eager {tuple(b.shape)} {b.dtype}")
                return
            if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))):
                return  # NaN where eager has NaN (a buffer edit can make a variance negative) is agreement
            err = float((a.double() - b.double()).abs().max()) if a.is_floating_point() else float("nan")
            sc = float(b.double().abs().max()) if scale is None else scale
            if tol_ok and (err <= TOL * max(sc, 1e-30) or within_floor(err, floor, what)):
                return
            diffs.append(f"{what}: max abs diff {err:.3g} (scale {sc:.3g}){' beyond 1e-6' if tol_ok else ''}")
            return
        if a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
            return
        if tol_ok and (close(a, b, scale) or (isinstance(a, float) and isinstance(b, float)
                                               and within_floor(abs(a - b), floor, what))):
            return
        diffs.append(f"{what}: {a!r} vs eager {b!r} (scale {scale})")

    def do_patch(o, where=""):
        h = o["hook"]
        if o["op"] == "patch_t":
            _, seen = ref.forward()
            g = torch.Generator().manual_seed(o["seed"])
            t = torch.randn(seen[h].shape, generator=g, dtype=seen[h].dtype)
            rg.patch(gn(h), t.clone())
            ref.patches[h] = t
        else:
            if o["fn"] == "other":  # the other node's value now (standing patches in), read inside the function
                _, now = ref.forward()
                other_now = now.get(o["other"])
                fn = patch_fn_of(o, seq_dims[h], other=lambda: other_now)
                fn_g = patch_fn_of(o, seq_dims[h], other=lambda: rg.value(gn(o["other"])))
            else:
                fn = fn_g = patch_fn_of(o, seq_dims[h])
            rg.patch(gn(h), fn_g)
            if o["fn"] in ("dtype", "shape"):
                diffs.append(f"{where}: rg.patch({h!r}) accepted a function returning another {o['fn']}")
                raise _Stop
            # ReactiveGraph.patch: "f receives the node's baseline value (no patch active)", grafts included.
            saved, ref.patches = ref.patches, {}
            try:
                _, seen = ref.forward()
            finally:
                ref.patches = saved
            ref.patches[h] = fn(seen[h].clone())

    def do_graft(o):
        blk = graft_block(o, last_dim(m, o["hook"]), dtype)
        rblk = copy.deepcopy(blk) if isinstance(blk, torch.nn.Module) else blk
        rg.graft(gn(o["hook"]), blk)
        # A node-form graft is spliced right after the node, before the blocks grafted there earlier (intended:
        # tests/python/test_reactive_graft_blocks.py), where a second eager forward hook would run after the first.
        ref.grafts.setdefault(o["hook"], []).insert(0, rblk)
        if isinstance(blk, torch.nn.Module):
            graft_mods.append((blk, rblk))

    edge_paths = {}  # an edge-form graft's block nodes -> the module whose input the reference gives the block

    def do_graft_edge(o):
        """graft(hook, dst, block) onto the reader ``o["pick"]`` of the hook's node, where eager pre-hooks express
        it (Reference.edges); False (nothing done) where they do not, and in an eager-only run, which has no graph
        to find the reader in (its _NoGraph would iterate forever): there the edge is left out of eager's replay."""
        if not graph:
            return False
        from torch_ext.reactive import _node_inputs

        src = rg.resolve(gn(o["hook"]))
        readers = [n.name for n in rg.graph.nodes() if src in _node_inputs(n)]
        if not readers:
            return False
        dst = readers[o["pick"] % len(readers)]
        if dst in set(rg.hook_names.values()):
            # dst is another hook's node (blocks.1.hook_resid_pre's alias of blocks.0.hook_resid_post with
            # output_hidden_states): the block runs before that hook, which a pre-hook on its module cannot put
            return False

        def path(n):
            return edge_paths.get(n, rg._module_paths.get(n) or "")
        p = path(dst)
        inside = [path(n) for n in readers if n != dst and (path(n) == p or path(n).startswith(p + "."))]
        if not p or p in inside or len(set(inside)) != len(inside):
            return False
        if not ref.edge_expressible(o["hook"], p, inside):
            return False
        blk = graft_block(o, last_dim(m, o["hook"]), dtype)
        rblk = copy.deepcopy(blk) if isinstance(blk, torch.nn.Module) else blk
        names = rg.graft(gn(o["hook"]), dst, blk)
        ref.edges.append((o["hook"], p, inside, rblk))
        for n in names:
            edge_paths[n] = p
        if isinstance(blk, torch.nn.Module):
            graft_mods.append((blk, rblk))
        return True

    if not graph:  # the build's forward, eagerly
        ref.forward()
    for step, o in enumerate(spec["ops"]):
        if not graph and (step > upto or step in skip):
            continue
        if graph:
            _PROGRESS["op"] = step
        op = o["op"]
        where = f"op{step} {op}"
        if verbose:
            print(where, json.dumps(o))
        try:
            if op in ("patch_t", "patch_f"):
                do_patch(o, where)
            elif op == "graft_in":  # nn.Sequential(Linear, Tanh) grafted; its Linear's node is named in{k}
                dd = last_dim(m, o["hook"])
                torch.manual_seed(o["seed"])
                blk = torch.nn.Sequential(torch.nn.Linear(dd, dd).to(dtype), torch.nn.Tanh())
                name = f"in{o['k']}"
                rblk = RefGraftIn(copy.deepcopy(blk[0]), name, ref)
                names = rg.graft(gn(o["hook"]), blk)
                # The Linear's node (a graft at attn.hook_z starts with the reshape into heads)
                G[name] = next(n for n in names if "linear" in n)
                seq_dims[name] = seq_dims[o["hook"]]
                ref.grafts.setdefault(o["hook"], []).insert(0, rblk)
                graft_mods.append((blk, rblk))
            elif op == "graft_edge":
                if not do_graft_edge(o):
                    continue
            elif op == "grad":
                hs = o["hooks"][:1] if o["one"] else o["hooks"]
                gmet = grad_metric_of(o["metric"], m)
                try:
                    got = rg.gradient(gmet, gn(hs[0])) if o["one"] else rg.gradient(gmet, [gn(h) for h in hs])
                except Exception as exc:  # noqa: BLE001 - a refusal of torch_ext's own, or a finding
                    first = (str(exc).splitlines() or [""])[0]
                    if not _fuzz_driver.raised_by_torch_ext(exc) or first.startswith("unknown node"):
                        # torch's own error passing through rg.gradient ("derivative for aten::copy is not
                        # implemented"), or the engine asked for a node the fuzzer never named (it names hooks the
                        # graph has): no refusal naming the cause, a finding, whatever eager does.
                        try:
                            ref.gradients(gmet, hs)
                            theirs = "eager autograd gives one"
                        except Exception as e_exc:  # noqa: BLE001
                            theirs = f"eager fails too: {type(e_exc).__name__}: {str(e_exc)[:150]}"
                        diffs.append(f"{where}: gradient({hs}) raised {type(exc).__name__} in "
                                     f"{_fuzz_driver.raised_in(exc) or '?'}, not a torch_ext refusal naming the cause "
                                     f"({theirs}): {first[:200]}")
                        continue
                    # "depends on none of the requested nodes": eager's backward fails on it too (the docstring);
                    # an eager gradient here is a wrong refusal.
                    if not isinstance(exc, RuntimeError) or "depends on none" not in str(exc):
                        raise
                    try:
                        ref.gradients(gmet, hs)
                    except RuntimeError:
                        raise exc from None
                    if not any(ref.reached):
                        raise exc from None
                    diffs.append(f"{where}: gradient({hs}) refused (the metric depends on none of the requested "
                                 "nodes), where eager autograd gives one")
                    continue
                got = {gn(hs[0]): got} if o["one"] else got
                want = ref.gradients(gmet, hs)
                # README "Gradients": a grouped-query attention given an all-ones attention_mask is traced with keys
                # and values repeated (the mask a traced input, materialised), where eager skips the mask and its sdpa
                # takes enable_gqa: float rounding, not bits. With no mask the graph takes eager's path: bits.
                gqa = m.get("arch") in GQA_ARCHS and m.get("mask") == "ones"
                for h in hs:
                    eq(got[gn(h)], want[h], f"{where} gradient({h}, {o['metric']})", tol_ok=gqa)
            elif op == "patch_in":
                name = f"in{o['k']}"
                if name not in G:
                    continue
                if o["fn"] == "t":
                    do_patch({"op": "patch_t", "hook": name, "seed": o["seed"]}, where)
                else:
                    do_patch({"op": "patch_f", "hook": name, "fn": o["fn"], "p": o["p"], "seed": o["seed"]}, where)
            elif op == "restore":
                rg.restore()
                ref.patches.clear()
            elif op == "restore1":
                rg.restore(gn(o["hook"]))
                ref.patches.pop(o["hook"], None)
            elif op == "graft":
                do_graft(o)
            elif op == "run":
                nx = make_input(m, o["seed"], o["T"])
                rg.run(*nx[0], **nx[1])
                ref.x = clone_input(nx)
                cur[0] = nx
            elif op == "wedit" and o["target"] == "input":
                # README: an input written in place after the build is an edit of that input.
                a_in, b_in = cur[0][0][0], ref.x[0][0]
                with torch.no_grad():
                    for t in (a_in, b_in):
                        if t.is_floating_point():
                            if o["how"] == "add_":
                                t.add_(o["c"] * 0.1)
                            else:
                                t.data.mul_(o["c"])
                        else:  # token ids: one token changed
                            flat = t.view(-1)
                            k = o["seed"] % flat.numel()
                            flat[k] = (flat[k] + 1) % (m.get("vocab") or 16)
            elif op == "wedit":
                if o["target"] == "buffer":
                    bufs = [(a_b, b_b) for a_b, b_b in zip(model.buffers(), ref_model.buffers()) if a_b.is_floating_point()]
                    if not bufs:
                        continue
                    pa, pb = bufs[o["seed"] % len(bufs)]
                else:
                    pairs = graft_mods if o["target"] == "graft" and graft_mods else [(model, ref_model)]
                    a_mod, b_mod = pairs[o["seed"] % len(pairs)]
                    ps = list(a_mod.parameters())
                    i = o["seed"] % len(ps)
                    pa, pb = ps[i], list(b_mod.parameters())[i]
                with torch.no_grad():
                    for p in (pa, pb):
                        if o["how"] == "add_":
                            p.add_(o["c"] * 0.1)
                        else:
                            p.data.mul_(o["c"])
            elif op == "batch":
                saved = dict(ref.patches)
                try:
                    with rg.batch():
                        for inner in o["ops"]:
                            if inner["op"] == "restore":
                                rg.restore()
                                ref.patches.clear()
                            elif inner["op"] == "graft":
                                do_graft(inner)
                            else:
                                do_patch(inner, where)
                        if o["raise"]:
                            raise Boom("user's exception")
                except Boom:
                    ref.patches = saved
                except Exception:
                    ref.patches = saved
                    raise
            elif op == "cutoff":
                rg.set_cutoff(o["on"])
            elif op == "read":
                out, seen = ref.forward()
                if o["how"] == "value":
                    for h in o["hooks"]:
                        eq(rg.value(gn(h)), seen[h], f"{where} value({h})")
                elif o["how"] == "values":
                    got = rg.values([gn(h) for h in o["hooks"]])
                    for h in o["hooks"]:
                        eq(got[gn(h)], seen[h], f"{where} values()[{h}]")
                elif o["how"] == "cache":  # run_with_cache on the current inputs (refused under patches)
                    args, kws = cur[0]
                    got_out, cache = rg.run_with_cache(*args, **kws)
                    eq(logits_of(got_out), out, f"{where} run_with_cache() output")
                    for h in o["hooks"]:
                        eq(cache[gn(h)], seen[h], f"{where} run_with_cache()[{h}]")
                elif o["how"] == "demand":
                    eq(logits_of(rg.demand()), out, f"{where} demand()")
                elif o["how"] == "baseline":  # no patch active; grafts and edits included
                    saved, ref.patches = ref.patches, {}
                    try:
                        _, clean = ref.forward()
                    finally:
                        ref.patches = saved
                    for h in o["hooks"]:
                        eq(rg.baseline(gn(h)), clean[h], f"{where} baseline({h})")
                else:
                    got = logits_of(rg.demand(reads={out_key: (slice(None), -1)}))
                    eq(got[:, -1], out[:, -1], f"{where} demand(reads)[:, -1]", tol_ok=True,
                       floor=lambda: float((out[:, -1].double() - ref.forward64()[:, -1]).abs().max()))
            elif op == "sweep":
                sweep_op(o, where, rg, ref, seq_dims, m, eq, torch_ext, torch, out_key, gn, diffs)
        except _Stop:
            return diffs, refusals, floored[0]
        except Exception as exc:  # noqa: BLE001 - classified
            note(exc, where)
    if not graph and upto < len(spec["ops"]):
        return diffs, refusals, floored[0]
    if graph:
        _PROGRESS["op"] = len(spec["ops"])
    # Whatever happened, the graph's outputs must be eager's at the end.
    try:
        out, _ = ref.forward()
        eq(logits_of(rg.demand()), out, "final demand()")
    except Exception as exc:  # noqa: BLE001
        note(exc, "final")
    return diffs, refusals, floored[0]


def sweep_op(o, where, rg, ref, seq_dims, m, eq, torch_ext, torch, out_key, gn=lambda h: h, diffs=None):
    out0, seen0 = ref.forward()
    full0 = ref.full
    hooks = o["hooks"]
    t = out0.shape[1]
    per = o.get("per", "pos" if o["per_pos"] else "whole")

    def n_of(h):
        return seen0[h].shape[seq_dims[h]]

    if per == "pos":
        sites = [(h, p) for h in hooks for p in range(n_of(h))]
    elif per == "neg":  # (hook, -k): the patch function indexes with it, as a user's v[:, site[1]] does
        sites = [(h, p - n_of(h)) for h in hooks for p in range(n_of(h))]
    elif per == "mixed":  # whole-node and one-position sites in one list (the same node's too)
        sites = []
        for i, h in enumerate(hooks):
            if i % 2 == 0:
                sites.append(h)
            if i % 2 == 1 or len(hooks) == 1:
                sites += [(h, p) for p in range(n_of(h))]
    elif per == "head":  # attn.hook_z: one head at every position (TransformerLens's per-head patching)
        sites = []
        for h in hooks:
            if h.endswith("attn.hook_z"):
                sites += [(h, f"head{k}") for k in range(seen0[h].shape[2])]
            else:
                sites += [(h, p) for p in range(n_of(h))]
    else:
        sites = list(hooks)
    corrupt = None
    if o["fn"] in ("corrupt", "mean"):
        saved = ref.x
        ref.x = make_input(m, o["seed"] + 7, t)
        _, corrupt = ref.forward()
        ref.x = saved
    kind = o["fn"]
    other_ref = seen0.get(o.get("other"))
    live = o["seed"] % 2 == 0  # "other": the graph read inside the patch function, else a value read before
    captured = rg.value(gn(o["other"])).clone() if kind == "other" and not live else None

    def patch_fn(v, site, other=None):
        h, p = site if isinstance(site, tuple) else (site, None)
        sd = seq_dims[h]
        if kind == "same":
            return v.clone()
        if kind == "row" and p is None:  # a whole-node site whose patch writes one row, v[:, p]
            w = v.clone()
            q = o["p"] % v.shape[1]
            w[:, q] = w[:, q] * -2 + 0.25
            return w
        if kind == "row":
            src = v * -2 + 0.25
        elif kind == "zero":
            src = torch.zeros_like(v)
        elif kind == "noise":
            g = torch.Generator().manual_seed(o["seed"] * 131 + (p if isinstance(p, int) else 0))
            src = v + torch.randn(v.shape, generator=g, dtype=v.dtype)
        elif kind == "steer":  # a steering vector added along the last dim
            g = torch.Generator().manual_seed(o["seed"])
            src = v + torch.randn(v.shape[-1], generator=g, dtype=v.dtype)
        elif kind == "other":
            ov = other()
            src = v + 0.5 * (ov if ov.shape == v.shape else ov.mean())
        elif kind == "mean":
            src = corrupt[h].mean(dim=sd, keepdim=True).expand_as(v)
        elif kind in ("inplace", "stride"):
            src = v * 1.5
        else:
            src = corrupt[h]
        if p is None:
            w = src.clone()
        elif isinstance(p, str):  # "head<k>": dim 2 of [batch, pos, head, d_head]
            w = v.clone()
            k = int(p[4:])
            w.select(2, k).copy_(src.select(2, k))
        else:
            w = v.clone()
            w.select(sd, p).copy_(src.select(sd, p))
        if kind == "stride":  # the same values in another memory layout: another input, on every path
            w = w.transpose(-1, -2).contiguous().transpose(-1, -2)
        return w

    to_spec = {((gn(s[0]), s[1]) if isinstance(s, tuple) else gn(s)): s for s in sites}

    def graph_patch(v, gsite):
        w = patch_fn(v, to_spec[gsite], other=(lambda: rg.value(gn(o["other"]))) if live else (lambda: captured))
        if kind == "inplace":  # a TransformerLens-style setter: writes into its argument and returns it
            v.copy_(w)
            return v
        return w

    met, ref_met, scale_of, reads, expect_refusal = metric_of(o["metric"], out_key, m)
    kw = {"progress": False, "skip_identical": o["skip"]}
    if o["batch"] is not False:
        kw["batch_sites"] = o["batch"]
    if o["positions"] is not None:
        kw["positions"] = o["positions"]
    if reads is not None:
        kw["reads"] = reads
    res = torch_ext.sweep(rg, list(to_spec), graph_patch, met, **kw)
    if expect_refusal:
        diffs.append(f"{where}: a metric reading outside its reads= ({o['metric']}) was not refused")
        return
    # Tolerance: token-granular rows (positions on, per-position sites) and batched stacks; else bits.
    tol_ok = bool(o["batch"] is not False or (per != "whole" and o["positions"] is not False) or reads is not None)
    scale0 = scale_of(out0)

    def floor_of(out, override=None):  # eager float32's own error, through the metric's scale functional
        return lambda: scale_of((out.double() - ref.forward64(override)).abs())

    if not isinstance(res.clean_metric, dict):
        eq(res.clean_metric, ref_met(full0), f"{where} clean_metric", tol_ok, scale0, floor_of(out0))
    for gsite, site in to_spec.items():
        h = site[0] if isinstance(site, tuple) else site
        pv = patch_fn(seen0[h].clone(), site, other=lambda: other_ref)
        out, _ = ref.forward(override=(h, pv))
        want = ref_met(ref.full)
        got = res.metrics.get(gsite)
        sc = max(scale_of(out), scale0)
        if isinstance(want, dict):
            for k in want:
                eq(got[k] if got is not None else None, want[k], f"{where} site {site} [{k}]", tol_ok, sc,
                   floor_of(out, (h, pv)))
        else:
            eq(got, want, f"{where} site {site}", tol_ok, sc, floor_of(out, (h, pv)))


def classify(exc: BaseException, spec: dict | None = None) -> tuple[str, str]:
    """The case's status (_fuzz_driver.classify); with ``spec``, eager alone is asked whether it fails too, as far
    as the run that raised got (_PROGRESS, read now: the run that raised was the last one)."""
    at, refused = _PROGRESS["op"], frozenset(_PROGRESS["refused"])
    return _fuzz_driver.classify(exc, lambda line: re.sub(r"[0-9]+", "N", line)[:200],
                                 eager=None if spec is None else lambda: _eager_raises(spec, at, refused))


def _eager_raises(spec: dict, upto: int, skip: frozenset) -> BaseException | None:
    """What eager alone raises on ``spec`` as far as op ``upto`` (None: it runs)."""
    try:
        run_case(spec, graph=False, upto=upto, skip=skip)
    except Exception as exc:  # noqa: BLE001 - any failure of eager's
        return exc
    return None


def one(spec: dict, verbose: bool = False) -> dict:
    try:
        diffs, refusals, floored = run_case(spec, verbose)
        r = {"status": "mismatch", "msg": "\n".join(diffs[:20])} if diffs else {"status": "ok"}
        r["refusals"] = refusals
        r["floored"] = floored
        return r
    except Exception as exc:  # noqa: BLE001 - every exception is classified
        status, msg = classify(exc, spec)
        return {"status": status, "msg": msg, "refusals": {}}


def simplifications(spec: dict):
    ops, m = spec["ops"], spec["model"]
    for k in range(len(ops)):
        yield {**spec, "ops": ops[:k] + ops[k + 1:]}
    for k in range(len(m["blocks"])):
        bl = m["blocks"][:k] + m["blocks"][k + 1:]
        if bl:
            nm = {**m, "blocks": bl}
            names = set(hooks_of(nm))
            if all(o.get("hook", "hook_embed") in names and set(o.get("hooks", ())) <= names
                   and all(i.get("hook", "hook_embed") in names for i in o.get("ops", ())) for o in ops):
                yield {**spec, "model": nm}
    for key, v in (("B", 1), ("dtype", "float32"), ("front", "embed"), ("mask", None)):
        if key in m and m[key] != v:
            yield {**spec, "model": {**m, key: v}}
    for k, o in enumerate(ops):
        if o["op"] == "sweep":
            for key, v in (("batch", False), ("positions", None), ("skip", True), ("metric", "sum")):
                if o[key] != v:
                    yield {**spec, "ops": ops[:k] + [{**o, key: v}] + ops[k + 1:]}
            if len(o["hooks"]) > 1:
                for h in o["hooks"]:
                    yield {**spec, "ops": ops[:k] + [{**o, "hooks": [h]}] + ops[k + 1:]}


def minimize(spec: dict) -> dict:
    return _fuzz_driver.minimize(spec, one, simplifications)


def case_spec(seed: int, i: int) -> dict:
    return gen_spec(random.Random(f"sweep{seed}:{i}"), new_ground=seed >= NEW_GROUND_SEED,
                    gradients=seed >= GRADIENT_SEED)


class _OpTally(_fuzz_driver.Tally):
    """Counts the operations the cases ran and the refused ones (a refused operation does not end its case)."""

    def __init__(self):
        self.n_ops, self.op_refusals = 0, {}
        self.n_floored = 0  # toleranced comparisons beyond 1e-6 that passed within FLOOR x eager float32's own error

    def add(self, seed: int, r: dict) -> None:
        self.n_ops += len(case_spec(seed, r["i"])["ops"])
        self.n_floored += r.get("floored", 0)
        for k, c in r.get("refusals", {}).items():
            k = re.sub(r"^op\d+ ", "", k)
            self.op_refusals[k] = self.op_refusals.get(k, 0) + c

    def report(self, refusals: dict) -> None:
        print(f"  operations: {self.n_ops}, refused operations: {sum(self.op_refusals.values())}")
        print(f"  comparisons beyond 1e-6 relative, within {FLOOR:g} x eager float32's own error: {self.n_floored}")
        for msg, c in sorted(refusals.items(), key=lambda kv: -kv[1]):
            print(f"  case refused x{c}: {msg}")
        for msg, c in sorted(self.op_refusals.items(), key=lambda kv: -kv[1]):
            print(f"  op refused x{c}: {msg}")


def main(argv=None):
    return _fuzz_driver.main(argv, doc=__doc__, script=__file__, case_spec=case_spec, one=one, minimize=minimize,
                             replay=lambda spec: one(spec, verbose=True), tally=_OpTally())


if __name__ == "__main__":
    sys.exit(main())
