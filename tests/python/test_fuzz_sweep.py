"""scripts/fuzz_sweep.py replays its findings: reactive mutation sequences and sweeps that differed from eager
PyTorch with forward hooks on TransformerLens HookPoints, now equal to it (bit for bit where README promises it,
within its documented tolerance elsewhere), and a few generated cases of every kind of operation."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformer_lens")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fuzz_sweep  # noqa: E402

_MHA_PAD = {"seed": 552, "front": "embed", "d": 8, "T": 8, "B": 1, "dtype": "float32",
            "blocks": [{"kind": "mha", "batch_first": True, "mask": "pad", "inner_hook": False}]}
_CONV = {"seed": 282, "front": "conv", "d": 8, "T": 5, "B": 1, "dtype": "float32",
         "blocks": [{"kind": "conv", "causal": True}, {"kind": "conv", "causal": True}]}

FINDINGS = {
    # A model with HookPoints is traced from a copy; `mask[0, -1] = True` in forward lifts a tensor constant,
    # sends it to torch.export, and _rebind gave up on the constant: the graph kept the copy's weights, and
    # demand() after `W.add_` (or `W.data.mul_`) answered with the old ones (0.18 off).
    "weight_edit_after_export_from_copy": {"model": _MHA_PAD, "ops": [
        {"op": "wedit", "how": "add_", "c": 0.5, "seed": 16, "target": "model"},
        {"op": "read", "how": "value", "hooks": ["blocks.0.hook_mid"]}]},
    "weight_data_edit_after_export_from_copy": {"model": _MHA_PAD, "ops": [
        {"op": "wedit", "how": "data_mul", "c": 1.5, "seed": 3, "target": "model"},
        {"op": "sweep", "hooks": ["blocks.0.hook_out"], "per_pos": True, "fn": "zero", "metric": "last",
         "batch": False, "positions": False, "skip": True, "seed": 1}]},
    # A standing patch in another layout than its node's (contiguous where the node is a transpose) carries that
    # layout downstream; a sweep site there, in the node's current layout, ran the prepared cone's out= steps in the
    # traced layout: 6e-8 off eager with positions off, where README promises bits (Engine::other_layout).
    "site_after_standing_patch_in_other_layout": {"model": _CONV, "ops": [
        {"op": "patch_t", "hook": "hook_embed", "seed": 470},
        {"op": "sweep", "hooks": ["blocks.0.hook_out"], "per_pos": True, "fn": "noise", "metric": "last",
         "batch": False, "positions": False, "skip": False, "seed": 437}]},
    # Every weight of block 1's MLP output projection + 0.15 (an ill-conditioned GPT-2: LayerNorm divides out the
    # residual's common mode), one-position sites: the row path runs the MLP and lm_head on the changed row alone,
    # whose 1-row sgemm rounds otherwise, and out[0, 0, 0] came 1.04e-6 of the logits' largest magnitude from eager,
    # past the former 1e-6; within 1.3 times eager float32's own error against float64 (fuzz_sweep.FLOOR, README).
    "rows_of_an_ill_conditioned_gpt2": {"model": {
        "family": "gpt2", "seed": 262, "d": 64, "vocab": 50, "T": 8, "B": 1, "mask": None, "dtype": "float32",
        "blocks": [{"kind": "gpt2"}, {"kind": "gpt2"}]}, "ops": [
        {"op": "wedit", "how": "add_", "c": 1.5, "seed": 276, "target": "model"},
        {"op": "sweep", "hooks": ["blocks.1.hook_attn_out"], "per_pos": True, "fn": "corrupt", "metric": "dict",
         "batch": False, "positions": None, "skip": True, "seed": 625}]},
}


# fuzz_sweep 52:31, reduced: after a graft through blocks.0.hook_resid_post, baseline() and run_with_cache() at
# blocks.1.hook_resid_pre (the same node) answered the value before the block, where eager's hook sees the block's
# output (0.0712 off on this Llama); refused by name now, as value() is.
_LLAMA = {"family": "hf", "arch": "llama", "seed": 158, "d": 32, "heads": 4, "vocab": 50, "T": 6, "B": 1,
          "mask": None, "hs": False, "dtype": "float32", "blocks": [{"kind": "hf"}, {"kind": "hf"}]}
FINDINGS["baseline_of_the_other_hook_name_after_a_graft"] = {"model": _LLAMA, "ops": [
    {"op": "graft", "hook": "blocks.0.hook_resid_post", "block": "double", "seed": 0},
    {"op": "read", "how": "baseline", "hooks": ["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre"]}]}
FINDINGS["run_with_cache_of_the_other_hook_name_after_a_graft"] = {"model": _LLAMA, "ops": [
    {"op": "graft", "hook": "blocks.0.hook_resid_post", "block": "double", "seed": 0},
    {"op": "read", "how": "cache", "hooks": ["blocks.1.hook_resid_pre"]}]}
# fuzz_sweep 53:99, reduced: a graft through blocks.1.hook_resid_pre after one through blocks.0.hook_resid_post (one
# node), or while blocks.1.hook_resid_pre is patched and a graft goes through blocks.0.hook_resid_post: eager runs the
# later hook's edit after the earlier one's, the graph spliced the newest block first, right after the node (0.44 off
# at the logits); refused by name now.
FINDINGS["graft_through_the_other_hook_name_after_a_graft"] = {"model": _LLAMA, "ops": [
    {"op": "graft", "hook": "blocks.0.hook_resid_post", "block": "tanh", "seed": 0},
    {"op": "graft", "hook": "blocks.1.hook_resid_pre", "block": "linear", "seed": 100},
    {"op": "read", "how": "demand", "hooks": []}]}
FINDINGS["graft_through_the_other_hook_name_while_patched"] = {"model": _LLAMA, "ops": [
    {"op": "patch_t", "hook": "blocks.1.hook_resid_pre", "seed": 3},
    {"op": "graft", "hook": "blocks.0.hook_resid_post", "block": "tanh", "seed": 0},
    {"op": "read", "how": "demand", "hooks": []}]}
# fuzz_sweep 54:190, reduced: a patch function reading the graph (rg.value of a node) at a node whose baseline a graft
# displaced under a standing patch: patch() ran the function with the patches lifted, so rg.value inside it read the
# unpatched graph, where without the graft it reads the patched one (0.02 off at the logits); the function runs with
# the patches back now, only the baseline is read lifted.
FINDINGS["patch_function_reading_the_graph_after_a_graft_under_a_patch"] = {"model": {
    "seed": 354, "front": "linear", "d": 8, "T": 4, "B": 8, "dtype": "float32",
    "blocks": [{"kind": "tiny"}, {"kind": "mha", "batch_first": False, "mask": "pad", "inner_hook": False}]}, "ops": [
    {"op": "graft_in", "hook": "blocks.0.hook_out", "seed": 902, "k": 0},
    {"op": "patch_t", "hook": "hook_embed", "seed": 191},
    {"op": "patch_f", "hook": "blocks.1.hook_mid", "fn": "other", "p": 1, "seed": 40, "other": "blocks.1.hook_mid"},
    {"op": "read", "how": "demand", "hooks": []}]}
# fuzz_sweep 60:0, reduced: rg.gradient for [blocks.1.hook_out, blocks.1.hook_tbd] with blocks.1.hook_mid (between
# them) patched: hook_out was recomputed from the requested hook_tbd's cone, but only through the patch, a constant,
# so it had no gradient and the call was refused ("depends on none of the requested nodes"), where eager autograd
# gives hook_out's (hook_tbd's is zero); a requested node reached only through a patch is a leaf now.
FINDINGS["gradient_at_a_node_downstream_of_another_only_through_a_patch"] = {"model": {
    "seed": 901, "front": "embed", "d": 8, "T": 6, "B": 1, "dtype": "float32",
    "blocks": [{"kind": "bn"}, {"kind": "enc", "batch_first": False, "mask": "pad", "inner_hook": True}]}, "ops": [
    {"op": "patch_t", "hook": "blocks.1.hook_mid", "seed": 956},
    {"op": "grad", "hooks": ["blocks.1.hook_out", "blocks.1.hook_tbd"], "one": False, "metric": "lsm"}],
    "graph": {"cutoff": False, "positions": True}}
# fuzz_sweep 60:44, reduced: rg.gradient at blocks.0.hook_resid_post while blocks.1.hook_resid_pre (the same node)
# is patched: eager's is zero (the later hook replaces the value before anything reads it), the graph answered the
# gradient with respect to the patch (4.04 off, silently); refused by name now, as value() is.
FINDINGS["gradient_at_the_other_hook_name_while_patched"] = {"model": {
    "family": "hf", "arch": "qwen2", "seed": 456, "d": 32, "heads": 4, "vocab": 50, "T": 4, "B": 1, "mask": None,
    "hs": False, "dtype": "float32", "blocks": [{"kind": "hf"}, {"kind": "hf"}]}, "ops": [
    {"op": "patch_f", "hook": "blocks.1.hook_resid_pre", "fn": "row", "p": 0, "seed": 9},
    {"op": "grad", "hooks": ["blocks.0.hook_resid_post"], "one": True, "metric": "cols"}], "graph": {"positions": True}}
# fuzz_sweep 60:44 and a Llama sweep of every hook: rg.gradient ran the alias the trace makes for
# blocks.<l>.hook_resid_mid (the pre-MLP RMSNorm's input) as an op, so the norm's two reads' gradients were summed
# before the residual's, where eager's autograd adds the three in its order: 4.8e-7 off (not bit for bit); an alias
# not asked for is its input itself now.
FINDINGS["gradient_through_an_rmsnorm_behind_a_hook_alias"] = {"model": {
    "family": "hf", "arch": "llama", "seed": 456, "d": 32, "heads": 4, "vocab": 50, "T": 4, "B": 1, "mask": None,
    "hs": False, "dtype": "float32", "blocks": [{"kind": "hf"}, {"kind": "hf"}]}, "ops": [
    {"op": "grad", "hooks": ["blocks.0.hook_attn_out"], "one": True, "metric": "cols"},
    {"op": "grad", "hooks": ["blocks.0.hook_mlp_out", "blocks.1.hook_resid_mid"], "one": False, "metric": "cols"}]}
# fuzz_sweep 60:8, reduced: rg.gradient at the last hook (a Linear head after a transpose) ran the cone on detached
# parameters, where eager's require grad: matmul folds the [batch, pos, d] input into one GEMM only when the weight
# needs no gradient, and the two paths round the input's gradient otherwise (4.8e-7 off eager). The given values
# carry eager's requires_grad now.
FINDINGS["gradient_through_a_linear_whose_weight_requires_grad"] = {"model": {
    "seed": 413, "front": "embed", "d": 8, "T": 8, "B": 8, "dtype": "float32",
    "blocks": [{"kind": "enc", "batch_first": False, "mask": "pad", "inner_hook": False}, {"kind": "bn"}]}, "ops": [
    {"op": "grad", "hooks": ["blocks.1.hook_out"], "one": False, "metric": "first"}], "graph": {"positions": True}}
# A grouped-query attention with no padding mask (fuzz_sweep allowed 1e-6 on its gradients): eager passes no mask and
# SDPA shares the key/value heads in its kernel (enable_gqa), the graph was traced with the mask materialised and the
# heads repeated (transformers' packed-sequence check keeps a mask while tracing): gradients through the attention
# 6e-8 off eager at blocks.0.hook_resid_pre; bit for bit now (README "Gradients"), also with token-granular cones.
FINDINGS["gradient_through_grouped_query_attention_without_a_mask"] = {"model": {
    "family": "hf", "arch": "qwen2", "seed": 456, "d": 32, "heads": 4, "vocab": 50, "T": 6, "B": 2, "mask": None,
    "hs": False, "dtype": "float32", "blocks": [{"kind": "hf"}, {"kind": "hf"}]}, "ops": [
    {"op": "grad", "hooks": ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_z"], "one": False, "metric": "lsm"},
    {"op": "sweep", "hooks": ["blocks.0.hook_resid_post"], "per_pos": True, "per": "pos", "fn": "noise",
     "metric": "last", "batch": False, "positions": None, "skip": True, "seed": 5},
    {"op": "grad", "hooks": ["blocks.0.hook_resid_pre"], "one": True, "metric": "sum"}],
    "graph": {"positions": True}}
# fuzz_sweep 62:395, reduced (found once the allowance above was gone; the tree before this fix gives the same bits,
# so not the attention's path): an edge graft (graft_edge, block "linear") on add_10, layer 1's residual add, one of
# the two readers of blocks.0.hook_resid_post (the other: layer 1's input RMSNorm)
# of a Llama, then rg.gradient at blocks.0.hook_resid_mid and blocks.0.hook_resid_post: 5.96e-8 off eager's
# (scale 0.957), 1.12e-8 (scale 0.0839). Without the graft bit for bit. Fixed: the gradient cone ran the block right
# before add_10, after the RMSNorm's two readers, where eager (a pre-hook on model.layers.1) creates it before them,
# so autograd added its gradient into resid_post's in another order (torch_ext/_gradient.py _eager_order).
FINDINGS["gradient_after_an_edge_graft_on_a_llama"] = {"model": {
    "family": "hf", "arch": "llama", "seed": 58, "d": 32, "heads": 4, "vocab": 64, "T": 8, "B": 1, "mask": None,
    "hs": False, "dtype": "float32", "blocks": [{"kind": "hf"}, {"kind": "hf"}]}, "ops": [
    {"op": "graft_edge", "hook": "blocks.0.hook_resid_post", "pick": 3, "block": "linear", "seed": 50},
    {"op": "grad", "hooks": ["blocks.0.hook_resid_mid", "blocks.0.hook_resid_post"], "one": False, "metric": "first"}],
    "graph": {"cutoff": True, "positions": False}}

# fuzz_sweep 62:7, reduced: rg.gradient on a BERT raised "unknown node 'p_cls_predictions_transform_layer_norm_weight'"
# (FX snake-cased the placeholder p_..._LayerNorm_weight, and the engine was asked for that name), and the fuzzer counted
# the raw error as an op refusal (x12 in 229 cases). Bit for bit now; a raw error from rg.gradient is a finding.
FINDINGS["gradient_through_a_bert_layer_norm_weight"] = {"model": {
    "family": "hf", "arch": "bert", "seed": 681, "d": 32, "heads": 4, "vocab": 50, "T": 5, "B": 8, "mask": None,
    "hs": False, "dtype": "float32", "blocks": [{"kind": "hf"}, {"kind": "hf"}]}, "ops": [
    {"op": "grad", "hooks": ["blocks.1.output"], "one": True, "metric": "lsm"}], "graph": {"positions": True}}
# fuzz_sweep 62:26 and others (x15 in 229 cases), on a Llama: a grafted block ending in empty_like(t).copy_(f(t)) (the
# fuzzer's linear_kept) is traced as the functional aten.copy, which autograd cannot differentiate: rg.gradient raised
# torch's "derivative for aten::copy is not implemented", counted as a refusal. Eager's copy_ answer, bit for bit now.
FINDINGS["gradient_through_a_graft_ending_in_copy"] = {"model": {
    "family": "hf", "arch": "llama", "seed": 593, "d": 32, "heads": 4, "vocab": 64, "T": 4, "B": 2, "mask": None,
    "hs": False, "dtype": "float32", "blocks": [{"kind": "hf"}, {"kind": "hf"}]}, "ops": [
    {"op": "graft", "hook": "blocks.1.hook_resid_pre", "block": "linear_kept", "seed": 386},
    {"op": "grad", "hooks": ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"], "one": False, "metric": "sum"}]}

_OPEN: set = set()  # findings not fixed yet: strict xfails


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="open")) if n in _OPEN
                                  else n for n in sorted(FINDINGS)])
def test_fuzz_sweep_finding(name):
    diffs, _, _ = fuzz_sweep.run_case(FINDINGS[name])
    assert diffs == [], diffs


# Generated cases covering patches (tensor, function), restore, grafts (block modules and functions), run with
# another length, weight edits, rg.batch() with a raised exception, cutoff, reads and sweeps (batched, reads=).
GENERATED = [(2, 0), (2, 3), (2, 5)]


@pytest.mark.parametrize("seed, case", GENERATED, ids=[f"{s}:{c}" for s, c in GENERATED])
def test_fuzz_sweep_generated(seed, case):
    diffs, _, _ = fuzz_sweep.run_case(fuzz_sweep.case_spec(seed, case))
    assert diffs == [], diffs


def test_weight_edit_on_a_copy_is_refused_by_demand_value_and_sweep():
    """A model with hook points and a plain tensor attribute is still exported from a copy (the attribute is a
    constant _rebind cannot find in the model): run() refused after a weight edit, while demand, value and sweep
    answered with the copy's old weights (1.14 off eager)."""
    import torch
    from transformer_lens.hook_points import HookPoint

    import torch_ext

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.hook_a, self.anchor = torch.nn.Linear(4, 4), HookPoint(), torch.ones(4)
            self.hook_a.name = "hook_a"

        def forward(self, x):
            return self.hook_a(self.a(x)) + self.anchor

    torch.manual_seed(0)
    m, x = M().eval(), torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(m, (x,))
    with torch.no_grad():
        m.a.weight.add_(1.0)
    for call in (rg.demand, lambda: rg.value("hook_a"),
                 lambda: torch_ext.sweep(rg, ["hook_a"], lambda v, s: v * 0, lambda o: float(o.sum()), progress=False)):
        with pytest.raises(ValueError, match="weights changed since this ReactiveGraph was built"):
            call()


def test_chained_hook_points_refuse_what_one_node_cannot_answer():
    """hook_pre(hook_post(x)): TransformerLens's blocks.l.hook_resid_post then blocks.{l+1}.hook_resid_pre. Eager:
    a sweep site at hook_post with hook_pre pinned changes nothing (the pin stands after it). The graph names both
    hooks 'relu': value(hook_post) returned hook_pre's pin and the sweep answered 1.207 where eager gives -0.287,
    silently. Now reading, patching or sweeping the other name while one is patched is refused naming both; the
    patched name itself, and both names once restored, answer as eager."""
    import torch
    from transformer_lens.hook_points import HookPoint

    import torch_ext

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.hook_post, self.hook_pre = HookPoint(), HookPoint()
            self.hook_post.name, self.hook_pre.name = "hook_post", "hook_pre"

        def forward(self, x):
            return self.b(self.hook_pre(self.hook_post(torch.relu(self.a(x)))))

    torch.manual_seed(0)
    m, x = M().eval(), torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(m, (x,))
    assert rg.resolve("hook_pre") == rg.resolve("hook_post")
    pin = torch.ones(2, 4)
    rg.patch("hook_pre", pin)
    both = r"hooks 'hook_post' and 'hook_pre' are two hook points in a row"
    with pytest.raises(ValueError, match=both):
        torch_ext.sweep(rg, ["hook_post"], lambda v, s: v * 0, lambda o: float(o.sum()), progress=False)
    with pytest.raises(ValueError, match=both):
        rg.value("hook_post")
    with pytest.raises(ValueError, match=both):
        rg.values(["hook_pre", "hook_post"])
    with pytest.raises(ValueError, match=both):
        rg.patch("hook_post", torch.zeros(2, 4))
    with torch.no_grad():
        assert torch.equal(rg.value("hook_pre"), pin) and torch.equal(rg.demand(), m.b(pin))
        rg.restore("hook_pre")
        assert torch.equal(rg.value("hook_post"), torch.relu(m.a(x)))
        res = torch_ext.sweep(rg, ["hook_post"], lambda v, s: v * 0, lambda o: float(o.sum()), progress=False)
        assert res.metrics["hook_post"] == float(m.b(torch.zeros(2, 4)).sum())


def test_patch_function_after_a_graft_and_a_patch_gets_the_grafted_baseline():
    """Fuzzer case 2:55, reduced: graft upstream, patch a node by value (nothing demanded in between), then
    patch it again by function. The function was handed the node's value from before the graft (the engine saved
    the stale value as the baseline at the first patch), so the pin was fn(baseline without the block), silently
    (2.29 off on the fuzzer's model). Stop 47 refused it ("baseline of %tanh is not cached while patches are
    active", which users read as an internal error); now the baseline is computed with the patches lifted and put
    back: the function gets what eager hooks give with no patch active (the grafted baseline), and the other pins
    stand as they were."""
    import torch

    import torch_ext

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))

    torch.manual_seed(0)
    m, x = M().eval(), torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(m, (x,), cache=False)
    rg.graft("relu", lambda t: 2 * t)
    rg.patch("tanh", torch.full((2, 4), 5.0))
    with torch.no_grad():
        want = torch.tanh(m.b(2 * torch.relu(m.a(x))))
    assert torch.equal(rg.baseline("tanh"), want)
    assert torch.equal(rg.value("tanh"), torch.full((2, 4), 5.0))
    rg.patch("tanh", lambda v: v * 1.5)
    assert torch.equal(rg.value("tanh"), want * 1.5)
    rg.check_invariants()
    with torch.no_grad():
        assert torch.equal(rg.demand(), m.c(want * 1.5))


def test_patch_function_after_a_weight_edit_under_another_patch_gets_the_new_baseline():
    """A weight edit under a standing patch, then patch(fn) at a node whose baseline the edit made stale: refused
    by stop 47 ("... is not cached while patches are active"); the function now gets the edited model's baseline
    (no patch active) and the standing patch elsewhere stays pinned to its value."""
    import torch

    import torch_ext

    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                            torch.nn.Linear(4, 4)).eval()
    x = torch.randn(3, 4)
    rg = torch_ext.ReactiveGraph(m, (x,), cache=False)
    names = rg.nodes()
    relu, tanh = next(n for n in names if n.startswith("relu")), next(n for n in names if n.startswith("tanh"))
    pin = torch.full((3, 4), 0.25)
    rg.patch(relu, pin)
    rg.patch(tanh, lambda v: v * 0)
    with torch.no_grad():
        m[2].weight.add_(0.3)
        want = torch.tanh(m[2](torch.relu(m[0](x))))
    rg.patch(tanh, lambda v: v * 2)
    assert torch.equal(rg.value(tanh), want * 2)
    assert torch.equal(rg.value(relu), pin)
    rg.check_invariants()
    with torch.no_grad():
        assert torch.equal(rg.demand(), m[4](want * 2))


@pytest.mark.parametrize("second", [{"kind": "conv", "causal": False}, {"kind": "bn"}])
def test_batched_sites_keep_eval_mode_batch_norm_from_the_export_front_end(second):
    """README: eval-mode batch norm is kept in batched cones. In torch.export's ATen graph (the front end a model
    with nn.TransformerEncoderLayer falls back to) the op is _native_batch_norm_legit_no_training, whose empty
    saved statistics ([0] on CPU, [C] from its meta kernel) made batch_sites refuse it as mixing the copies
    (fuzz_sweep case 4:158, reduced; 3 of 56 refusals in that run). Batch norm on a transposed input (case 4:215)
    then failed the IR check ("declared type ... differs"): its CPU kernel's output is laid out as
    empty_like(input, suggest_memory_format), not as the unstacked node's. Now batched agrees with one at a time
    (within the documented 1e-6) and with eager forward hooks."""
    import copy

    import torch

    import torch_ext

    spec = {"seed": 108, "front": "embed", "d": 8, "T": 6, "B": 3, "dtype": "float32",
            "blocks": [{"kind": "enc", "batch_first": False, "mask": "pad", "inner_hook": False},
                       second]}
    model = fuzz_sweep.build_model(spec)
    ref_model = copy.deepcopy(model)
    x = fuzz_sweep.make_input(spec, 0, 6)
    rg = torch_ext.ReactiveGraph(model, x[0], cache=False)
    assert any(n.startswith("_native_batch_norm_legit_no_training") for n in rg.nodes())
    sites = [("blocks.0.hook_mid", p) for p in range(6)] + [("hook_embed", p) for p in range(6)]

    def patch_fn(v, site):
        w = v.clone()
        w[:, site[1]] = 0
        return w

    def metric(o):
        return float(o[:, -1].sum())

    one = torch_ext.sweep(rg, sites, patch_fn, metric, progress=False)
    points = {mod.name: (mod, "out") for mod in ref_model.modules() if type(mod).__name__ == "HookPoint"}
    ref = fuzz_sweep.Reference(ref_model, x, points)
    _, seen = ref.forward()
    for k in (True, 4):
        batched = torch_ext.sweep(rg, sites, patch_fn, metric, progress=False, batch_sites=k)
        for s in sites:
            want = metric(ref.forward(override=(s[0], patch_fn(seen[s[0]], s)))[0])
            scale = max(1.0, abs(want))
            assert abs(batched.metrics[s] - want) <= 1e-6 * scale and abs(one.metrics[s] - want) <= 1e-6 * scale, s


def test_a_graft_returning_another_layout_than_its_node_is_refused_naming_both_and_the_fix():
    """fuzz_sweep seed 4: 16 of 56 refusals were "graft: block output type f32[2,5,8] differs from %transpose_5 :
    f32[2,5,8]{8,16,1}" (an nn.Linear grafted after a transposed node returns a contiguous result), which read like
    an internal error. Now a ValueError names the hook, the node, both strides and the fix; the fix works, bit for
    bit with an eager forward hook returning the same block's output."""
    import copy

    import torch

    import torch_ext

    spec = {"seed": 1, "front": "embed", "d": 8, "T": 5, "B": 2, "dtype": "float32",
            "blocks": [{"kind": "mha", "batch_first": False, "mask": None, "inner_hook": False},
                       {"kind": "act", "act": "gelu"}]}
    model = fuzz_sweep.build_model(spec)
    ref_model = copy.deepcopy(model)
    x = fuzz_sweep.make_input(spec, 0, 5)
    rg = torch_ext.ReactiveGraph(model, x[0], cache=False)
    before = rg.demand().clone()
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"graft after 'blocks\.0\.hook_mid' \(node 'transpose_\d+'\): the block "
                                         r"returns its result with strides \(40, 8, 1\), while the node's value has "
                                         r"strides \(8, 16, 1\).*torch\.empty_like\(x\)\.copy_\(y\)"):
        rg.graft("blocks.0.hook_mid", lin)
    assert torch.equal(rg.demand(), before)

    class Kept(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, t):
            return torch.empty_like(t).copy_(self.lin(t))

    block = Kept()
    rg.graft("blocks.0.hook_mid", block)
    points = {mod.name: (mod, "out") for mod in ref_model.modules() if type(mod).__name__ == "HookPoint"}
    ref = fuzz_sweep.Reference(ref_model, x, points)
    ref.grafts["blocks.0.hook_mid"] = [copy.deepcopy(block)]
    assert torch.equal(rg.demand(), ref.forward()[0])


@pytest.mark.parametrize("what", ["token_view", "weight_view"])
def test_cutoff_sees_an_in_place_edit_read_through_a_view(what):
    """fuzz_sweep seed 77 (GPT-2, ReactiveGraph(..., cutoff=True), a token of input_ids edited in place): the
    logits stayed those of the old token, 0.33 off, silently. GPT-2 reads ``input_ids.view(-1, T)``: the cached
    view shares the input's memory, so the recomputed view compared equal to it and early cutoff kept its cone.
    A weight read through a view (``W.t()[0]``) was refused at the first demand ("cached value of %select was
    modified in place ... a patch function, metric or other caller wrote into it", which no caller did) and the
    next demand answered the old weight's value, silently."""
    import torch

    import torch_ext

    torch.manual_seed(0)
    if what == "token_view":
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.e, self.lin = torch.nn.Embedding(16, 4), torch.nn.Linear(4, 3)

            def forward(self, ids):
                return self.lin(torch.tanh(self.e(ids.view(-1, ids.shape[-1]))))

        m, x = M().eval(), torch.randint(0, 16, (2, 5))
    else:
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 3)

            def forward(self, x):
                return torch.tanh(self.lin.weight.t()[0] + x)

        m, x = M().eval(), torch.randn(3)
    rg = torch_ext.ReactiveGraph(m, (x,), cache=False, cutoff=True)
    rg.demand()
    with torch.no_grad():
        if what == "token_view":
            x[0, 3] = (x[0, 3] + 1) % 16
        else:
            m.lin.weight.add_(0.5)
        want = m(x)
    assert torch.equal(rg.demand(), want)
    assert torch.equal(rg.demand(), want)


def test_a_graft_after_a_node_whose_layout_differs_only_in_a_size_one_dim_is_taken():
    """fuzz_sweep case 4:36: at batch 1 a transposed node [1, T, d] has strides [d, d, 1]; an nn.Linear grafted
    there returns [T * d, d, 1], the same layout (a size-1 dim's stride addresses nothing), and was refused
    ("graft: block output type f32[1,5,8] differs from %transpose_5 : f32[1,5,8]{8,8,1}"). Now it is taken, bit for
    bit with an eager forward hook returning the block's output."""
    import copy

    import torch

    import torch_ext

    spec = {"seed": 39, "front": "embed", "d": 8, "T": 5, "B": 1, "dtype": "float32",
            "blocks": [{"kind": "enc", "batch_first": False, "mask": "causal", "inner_hook": False},
                       {"kind": "act", "act": "tanh"}]}
    model = fuzz_sweep.build_model(spec)
    ref_model = copy.deepcopy(model)
    x = fuzz_sweep.make_input(spec, 0, 5)
    rg = torch_ext.ReactiveGraph(model, x[0], cache=False)
    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8)
    rg.graft("blocks.0.hook_mid", block)
    points = {mod.name: (mod, "out") for mod in ref_model.modules() if type(mod).__name__ == "HookPoint"}
    ref = fuzz_sweep.Reference(ref_model, x, points)
    ref.grafts["blocks.0.hook_mid"] = [copy.deepcopy(block)]
    out, seen = ref.forward()
    assert torch.equal(rg.demand(), out)
    assert torch.equal(rg.value("blocks.1.hook_out"), seen["blocks.1.hook_out"])


def test_the_other_of_two_hook_points_in_a_row_is_refused_after_a_graft_through_one():
    """fuzz_sweep case 6:240, reduced (GPT-2): graft(blocks.0.hook_resid_post, block), then a sweep at
    blocks.1.hook_resid_pre answered 1.745 where eager gives 1.322, silently: both names address one node, before
    the block, while eager's resid_pre hook runs after resid_post's and sees the block's output. Reading, patching
    or sweeping the other name is now refused naming both; the grafted name keeps working, as eager."""
    import copy

    import torch

    import torch_ext

    spec = {"family": "gpt2", "seed": 559, "d": 32, "vocab": 100, "T": 6, "B": 1, "mask": None, "dtype": "float32",
            "blocks": [{"kind": "gpt2"}, {"kind": "gpt2"}]}
    model = fuzz_sweep.build_model(spec)
    ref_model = copy.deepcopy(model)
    x = fuzz_sweep.make_input(spec, 0, 6)
    rg = torch_ext.ReactiveGraph(model, x[0], cache=False)
    rg.graft("blocks.0.hook_resid_post", lambda t: 2 * t)
    both = r"hooks 'blocks\.1\.hook_resid_pre' and 'blocks\.0\.hook_resid_post' are two hook points in a row"
    with pytest.raises(ValueError, match=both):
        torch_ext.sweep(rg, ["blocks.1.hook_resid_pre"], lambda v, s: v * 0, lambda o: float(o["logits"].sum()),
                        progress=False)
    with pytest.raises(ValueError, match=both):
        rg.value("blocks.1.hook_resid_pre")
    with pytest.raises(ValueError, match=both):
        rg.patch("blocks.1.hook_resid_pre", lambda v: v * 0)
    # fuzz_sweep 52:31 (a Llama; GPT-2 the same): baseline(), run_with_cache()'s entry and gradient() at the other
    # name answered the value before the block (and its gradient) silently, 0.0712 off eager's hook value.
    with pytest.raises(ValueError, match=both):
        rg.baseline("blocks.1.hook_resid_pre")
    _, cache = rg.run_with_cache(*x[0])
    with pytest.raises(ValueError, match=both):
        cache["blocks.1.hook_resid_pre"]
    with pytest.raises(ValueError, match=both):
        rg.gradient(lambda o: o["logits"][0, -1, 0], ["blocks.1.hook_resid_pre"])
    ref = fuzz_sweep.Reference(ref_model, x, fuzz_sweep.gpt2_points(ref_model, spec))
    ref.grafts["blocks.0.hook_resid_post"] = [lambda t: 2 * t]
    out, seen = ref.forward()
    assert torch.equal(rg.value("blocks.0.hook_resid_post"), seen["blocks.0.hook_resid_post"])
    assert torch.equal(rg.baseline("blocks.0.hook_resid_post"), seen["blocks.0.hook_resid_post"])
    assert torch.equal(cache["blocks.0.hook_resid_post"], seen["blocks.0.hook_resid_post"])
    assert torch.equal(cache["blocks.1.hook_mlp_out"], seen["blocks.1.hook_mlp_out"])
    assert torch.equal(rg.demand()["logits"], out)


# The fuzzer's classes (_fuzz_driver.classify, shared with fuzz_step): a failing case is run again eagerly alone, as
# far as it got, so that eager's own failure is counted apart ("eager_failed"), never as a finding.
_PLAIN = {"model": {"seed": 1, "front": "linear", "d": 8, "T": 4, "B": 1, "dtype": "float32", "blocks": []},
          "ops": [{"op": "read", "how": "demand", "hooks": []}]}


class _Broken(__import__("torch").nn.Module):
    def forward(self, x):
        return x[:, :, 9]  # x is [batch, pos, 4]: eager and the trace raise the same IndexError


def test_fuzz_sweep_classifies_a_build_failing_as_eager_does_as_eager_failed(monkeypatch):
    monkeypatch.setattr(fuzz_sweep, "build_model", lambda m: _Broken())
    r = fuzz_sweep.one(_PLAIN)
    assert r["status"] == "eager_failed" and "IndexError" in r["msg"] and "the build failed too" in r["msg"], r


def test_fuzz_sweep_classifies_eager_failing_inside_an_operation_as_eager_failed(monkeypatch):
    # The reference (eager, forward hooks) runs inside each operation: its failure surfaced at run time, an "error".
    def forward(self, override=None):
        raise IndexError("eager's own failure")
    monkeypatch.setattr(fuzz_sweep.Reference, "forward", forward)
    r = fuzz_sweep.one(_PLAIN)
    assert r["status"] == "eager_failed" and "eager raises the same at run time" in r["msg"], r


def test_fuzz_sweep_classifies_a_graph_failing_where_eager_runs_as_an_error(monkeypatch):
    import torch_ext

    def set_cutoff(self, on):
        raise IndexError("the graph's failure")
    monkeypatch.setattr(torch_ext.ReactiveGraph, "set_cutoff", set_cutoff)
    r = fuzz_sweep.one({**_PLAIN, "ops": [{"op": "cutoff", "on": False}]})
    assert r["status"] == "error" and r["msg"].startswith("IndexError at run time: the graph's failure"), r
    assert "eager" not in r["msg"].splitlines()[0], r


def test_fuzz_sweep_counts_torch_s_own_error_from_gradient_as_a_finding_not_a_refusal(monkeypatch):
    """A raw PyTorch error passing through rg.gradient names no cause: a finding (it was an "op refused")."""
    import torch
    import torch_ext

    def gradient(self, metric, names):
        return torch.autograd.grad(torch.ones(()), [torch.ones(())])  # raises in torch: no grad_fn
    monkeypatch.setattr(torch_ext.ReactiveGraph, "gradient", gradient)
    diffs, refusals, _ = fuzz_sweep.run_case({**_PLAIN, "ops": [{"op": "grad", "hooks": ["hook_embed"],
                                                                  "one": True, "metric": "sum"}]})
    assert refusals == {} and len(diffs) == 1, (diffs, refusals)
    assert "not a torch_ext refusal naming the cause (eager autograd gives one)" in diffs[0], diffs
