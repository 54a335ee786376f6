"""Token-granular cones (issue 11): the sequence-axis analysis in the engine, row-range recompute,
metric-demanded rows, and the ledger's closed forms (docs/cost-model-positions.md).

Exactness, stated per case: a linear run on rows [p, T) alone rounds like one run on all T rows only
for some row counts (BLAS picks its kernel by the row count), so token-granular results equal a full
recompute within 1e-6 relative (to the largest magnitude of the compared tensor); rows the patch
cannot reach are the cached rows themselves, bit for bit.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
import torch.nn.functional as F

import torch_ext
from torch_ext import _C
from causal_zoo import KINDS, LM, resid_sites
from test_reactive import bits_equal

T = 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _zoo_sweep_setup(kind, batch=2, seed=0, seq=T):
    torch.manual_seed(seed)
    model = LM(kind, seq=seq).eval()
    clean = torch.randint(0, 50, (batch, seq))
    corrupt = torch.randint(0, 50, (batch, seq))
    rg = torch_ext.ReactiveGraph(model, (corrupt,))
    resid = resid_sites(rg)
    cache = {n: rg.value(n).clone() for n in resid}
    rg.run(clean)

    def patch(value, site):
        node, p = site
        v = value.clone()
        v[:, p] = cache[node][:, p]
        return v

    return rg, resid, patch, [(n, p) for n in resid for p in range(seq)]


@pytest.mark.internals
@pytest.mark.parametrize("kind", KINDS)
def test_zoo_sweep_equals_full_recompute(kind):
    rg, resid, patch, sites = _zoo_sweep_setup(kind)
    clean = rg.demand().clone()
    rg.reset_stats()
    rows = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False)
    whole = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False, positions=False)
    assert rows.extra["positions"] and not whole.extra["positions"]
    # Counts stay exact: every cone node runs once per site either way.
    assert rows.measured_evaluations == whole.measured_evaluations == sum(len(rg.cone(n)) for n, _ in sites)
    assert whole.extra["row_evaluations"] == whole.measured_evaluations
    assert rows.extra["row_evaluations"] < whole.extra["row_evaluations"]
    assert rows.cost < whole.cost
    for node, p in sites:
        got, want = rows.metrics[(node, p)], whole.metrics[(node, p)]
        assert _rel(got, want) <= 1e-6, (kind, node, p, _rel(got, want))
        if kind != "encoder":
            # Causal: logits of positions < p are the cached ones, bit for bit.
            assert torch.equal(got[:, :p], clean[:, :p]), (node, p)
    rg.check_invariants()
    assert torch.equal(rg.demand(), clean)  # the sweep puts everything back
    text = _C.sequence_axis(rg._engine.graph(), 1)
    attention = [line for line in text.splitlines() if "scaled_dot_product_attention" in line.split(":")[0]
                 or line.startswith("%matmul_1:") or line.startswith("%matmul_3:")]
    if kind == "encoder":
        # Non-causal attention: every row reads every row, the fallback; the rows before it still slice.
        assert attention and all(": all |" in line for line in attention), attention
    else:
        assert ": all" not in text, text


@pytest.mark.internals
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "encoder"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_patch_gives_what_a_full_recompute_gives(kind, poison):
    # Causal attention weighs the rows after i by zero; a full kernel makes 0 * NaN (or 0 * inf) NaN in the rows
    # before p, which the row path would keep cached (finite). Seen failing before the fix: row 0 finite on the
    # row path, NaN on a full recompute.
    rg, resid, _, _ = _zoo_sweep_setup(kind)
    p = 3
    sites = [(n, p) for n in resid]

    def patch(value, site):
        v = value.clone()
        v[:, site[1], 0] = poison
        return v

    rows = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False)
    whole = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False, positions=False)
    for site in sites:
        got, want = rows.metrics[site], whole.metrics[site]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (kind, site)
        finite = ~torch.isnan(want)
        if finite.any():
            assert _rel(got[finite], want[finite]) <= 1e-6, (kind, site)
    rg.check_invariants()


class _MaskedAttention(nn.Module):
    """One causal attention layer over given q/k/v projections; causal by is_causal or by a boolean tril mask
    (SDPA adds a boolean mask as 0/-inf itself)."""

    def __init__(self, how: str, d: int = 16, heads: int = 2):
        super().__init__()
        self.how, self.heads = how, heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        if self.how == "is_causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # per head: no output mixes NaN in
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.internals
@pytest.mark.parametrize("how", ["is_causal", "bool_mask"])
@pytest.mark.parametrize("big", [3e38, 1e30])
def test_finite_keys_whose_scores_overflow_give_what_a_full_recompute_gives(how, big):
    # Finite keys can make q . k overflow to +inf. A full kernel masks those scores by not computing them or
    # overwriting them with -inf (is_causal), or adds -inf to them (a boolean mask: inf - inf = NaN in the rows
    # before p); the row path adds -inf to its rows [p, T). Seen failing before the fix, at 3e38 for both: NaN
    # rows on one side, finite on the other. At 1e30 nothing overflows and the row path runs.
    torch.manual_seed(0)
    model = _MaskedAttention(how).eval()
    x = torch.randn(2, T, 16)
    rg = torch_ext.ReactiveGraph(model, (x,))
    clean = rg.demand().clone()
    sdpa = [n for n in rg.nodes() if n.startswith("scaled_dot_product_attention")]
    assert len(sdpa) == 1
    from torch_ext.reactive import _node_inputs

    key = _node_inputs(rg.graph.node(sdpa[0]))[1]
    p = 3

    def patch(value, site):
        # Keys [p, T-1) at -big and the last at +big: a query row i in [p, T-1) whose entries sum to > 0 meets
        # +inf only above its diagonal (the last key), and -inf below it.
        v = value.clone()
        v[:, :, site[1]:] = -big
        v[:, :, -1] = big
        return v

    sites = [(key, p)]
    rows = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False)
    whole = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False, positions=False)
    got, want = rows.metrics[sites[0]], whole.metrics[sites[0]]
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (how, big, torch.isnan(got).sum(), torch.isnan(want).sum())
    finite = ~torch.isnan(want)
    assert _rel(got[finite], want[finite]) <= 1e-6
    rg.check_invariants()
    assert torch.equal(rg.demand(), clean)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("input_index", [0, 1, 2])
def test_causal_sdpa_rows_are_the_full_kernels_bits(heads, input_index):
    # The row path runs a causal SDPA (is_causal, no mask) as the full run does, on whole queries, keys and
    # values, and keeps rows [p, T) of its result: patching q, k or v directly (the SDPA's inputs are then
    # the full recompute's, bit for bit), every row equals a whole-cone recompute's at zero tolerance. Seen
    # failing before: the row path computed rows [p, T) under an explicit additive mask, other bits.
    torch.manual_seed(0)
    model = _MaskedAttention("is_causal", d=32, heads=heads).eval()
    x = torch.randn(3, T, 32)
    rg = torch_ext.ReactiveGraph(model, (x,))
    clean = rg.demand().clone()
    sdpa = [n for n in rg.nodes() if n.startswith("scaled_dot_product_attention")]
    from torch_ext.reactive import _node_inputs

    node = _node_inputs(rg.graph.node(sdpa[0]))[input_index]

    strides = rg.value(node).stride()

    def patch(value, site):
        # In the node's own layout (q, k and v are strided views of the projection's output): a value in another
        # layout, such as the dense copy the patch function is given, is another input and runs the whole cone.
        v = torch.empty_strided(value.shape, strides, dtype=value.dtype).copy_(value)
        v[:, :, site[1]:] = v[:, :, site[1]:] * 1.7 - 0.3
        return v

    sites = [(node, p) for p in range(1, T)]
    rows = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False, skip_identical=False)
    whole = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False, positions=False,
                            skip_identical=False)
    assert rows.extra["row_evaluations"] < whole.measured_evaluations  # the row path ran
    for site in sites:
        got, want = rows.metrics[site], whole.metrics[site]
        assert bits_equal(got, want), (site, (got - want).abs().max())
        assert not torch.equal(got, clean), site  # the patch reached the output
    rg.check_invariants()
    assert bits_equal(rg.demand(), clean)


def _local(rg, resid) -> dict:
    """a_s per site: the cone nodes of s that no path through an attention reaches (the norm, qkv
    projection, split and q/k/v reshapes of s's layer; after the last layer, the final norm and
    head): they change only the patched rows."""
    sdpa = [n for n in rg.nodes() if n.startswith("scaled_dot_product_attention")]
    local = {}
    for s in resid:
        cone = rg.cone(s)
        local[s] = cone - set().union(*({a} | rg.cone(a) for a in sdpa if a in cone))
    return local


@pytest.mark.parametrize("seq", [6, 7])
def test_row_evaluations_equal_their_closed_form_exactly_at_any_length(seq):
    """stats["row_evaluations"] summed k/T fractions in a double: at T = 6 or 7 (no power of two) a sweep's share
    drifted from its closed form (docs/cost-model-positions.md) in the last bits (2718.000000000007 for 2718).
    Rows are now counted as integers per T and divided once: the rounded exact sum, and its exact parts."""
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa", seq=seq)
    rg.reset_stats()
    r = torch_ext.sweep(rg, sites, patch, lambda out: float(out[:, -1, 3].sum()), progress=False)
    local = _local(rg, resid)
    # Position p changes row p alone of the local nodes, rows [p, T) of the rest.
    exact = sum(Fraction(seq - p, seq) * (len(rg.cone(s)) - len(local[s])) + Fraction(len(local[s]), seq)
                for s in resid for p in range(seq))
    assert r.extra["row_evaluations"] == float(exact)
    assert rg.stats["row_evaluations"] == float(exact)
    parts = rg.stats["row_evaluations_exact"]
    assert set(parts) == {1, seq} and sum(Fraction(k, t) for t, k in parts.items()) == exact
    paired = torch_ext.sweep(rg, sites, patch, lambda out: float(out[:, -1, 3].sum()), progress=False, batch_sites=2)
    assert paired.extra["row_evaluations"] == float(sum(
        Fraction(seq - p0, seq) * (len(rg.cone(s)) - len(local[s])) + Fraction(len(local[s]) * (min(p0 + 2, seq) - p0), seq)
        for s in resid for p0 in range(0, seq, 2)))


def test_closed_forms_resid_pre_by_position():
    """docs/cost-model-positions.md: a sweep over every (layer, position) site of a causal L-layer
    transformer, patching position p (row p alone), costs sum_l |V+(s_l)| evaluations,
    sum_l [(T+1)/2 (|V+(s_l)| - |a_l|) + |a_l|] row-weighted evaluations and the same sum of FLOPs
    (a_l: the nodes before layer l's attention, which change row p alone; the rest change rows [p, T))."""
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    rg.reset_stats()
    r = torch_ext.sweep(rg, sites, patch, lambda out: float(out[:, -1, 3].sum()), progress=False)
    local = _local(rg, resid)
    # ln1, qkv, split, 3 x (getitem, view, transpose) for the sites entering a layer; ln_f and head
    assert [len(local[s]) for s in resid] == [12] * (len(resid) - 1) + [2]
    cones = sum(len(rg.cone(n)) for n in resid)
    costs = sum(rg.cone_cost(n) for n in resid)
    assert r.measured_evaluations == T * cones
    rows = sum(Fraction(T + 1, 2) * (len(rg.cone(s)) - len(local[s])) + len(local[s]) for s in resid)
    flops = sum((T + 1) / 2 * (rg.cone_cost(s) - sum(rg.node_cost(n) for n in local[s]))
                + sum(rg.node_cost(n) for n in local[s]) for s in resid)
    assert r.extra["row_evaluations"] == float(rows)
    assert r.cost == flops
    assert rg.stats["evaluations"] == r.measured_evaluations
    # Node-granular, the same sweep costs T * sum_l C(V+(s_l)): token-granular saves (T-1)/(2T) of it.
    whole = torch_ext.sweep(rg, sites, patch, lambda out: float(out[:, -1, 3].sum()), progress=False, positions=False)
    assert whole.cost == T * costs
    assert _full_cost(rg) * len(sites) / r.cost > _full_cost(rg) * len(sites) / whole.cost


def test_closed_forms_with_the_last_row_read():
    """docs/cost-model-positions.md, reads = the last row: a cone node that reaches the read row only
    through row-wise paths (the last layer's query path, everything after its attention, the final
    norm and unembedding: D(q of the last layer)) runs on row T-1 alone; the rest (what feeds keys
    and values) on rows [p, T); the head computes the 2 read columns alone. Per site s:
    R = (T+1)/2 |k_s| + |q_s|, F = (T+1)/2 K_s + Q_s (the head's cost in Q_s times 2/V)."""
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    reads = {"logits": (slice(None), -1, [3, 4])}
    rg.reset_stats()
    r = torch_ext.sweep(rg, sites, patch, lambda out: float((out[:, -1, 3] - out[:, -1, 4]).sum()), progress=False,
                        reads=reads)
    q_last = [n for n in rg.nodes("blocks.1*") if n.startswith("getitem")][0]  # q of the last layer
    q_part_all = rg.cone(q_last) | {q_last}
    head = rg._output_nodes()[0]
    local = _local(rg, resid)
    rows = flops = 0.0
    for s in resid:
        cone = rg.cone(s)
        q = cone & q_part_all
        k = cone - q
        cost = {n: rg.node_cost(n) * (2 / 50 if n == head else 1) for n in cone}
        # Summed over the T positions: k nodes run rows [p, T) ((T+1)/2), or row p alone when local
        # (1); q nodes row T-1 (1), or, when local, row p only where p = T-1 (1/T).
        weight = {n: ((1 if n in local[s] else Fraction(T + 1, 2)) if n in k else (Fraction(1, T) if n in local[s] else 1))
                  for n in cone}
        rows += sum(weight.values())
        # The head (a linear read at 2 of its 50 columns) computes those columns alone.
        flops += sum(float(weight[n]) * cost[n] for n in cone)
    assert len(q_part_all) == 15  # q view, transpose; sdpa .. second add; final norm; head (and q itself)
    assert r.measured_evaluations == T * sum(len(rg.cone(s)) for s in resid)
    assert r.extra["row_evaluations"] == float(rows)
    assert r.cost == flops


def _full_cost(rg) -> float:
    rg.reset_stats()
    rg.run(*rg._last_inputs[0])
    cost = rg.stats["cost"]
    rg.reset_stats()
    return cost


# Index entries that do not consume a dim (None, a bool) or consume several (Ellipsis, an n-d bool mask) shift
# which entry stands for the sequence axis and the last dim: reads={"logits": (None, -1, 2)} (row 2 of the
# last example) was taken as "row -1, column 2", only that was computed, and the metric got NaN for the row
# it declared, silently (eager: a number).
_SHIFTED_READS = {
    "none_first": ((None, -1, 2), lambda o: o[None, -1, 2]),
    "true_first": ((True, slice(None), 3), lambda o: o[True, :, 3]),
    "ellipsis_first": ((Ellipsis, 2, [3, 4]), lambda o: o[..., 2, [3, 4]]),
    "ellipsis_last": ((1, 3, Ellipsis), lambda o: o[1, 3, ...]),
    "bool_batch": ((torch.tensor([False, True]), 3, 5), lambda o: o[torch.tensor([False, True]), 3, 5]),
    "bool_batch_rows": ((torch.eye(2, T, dtype=torch.bool), 5), lambda o: o[torch.eye(2, T, dtype=torch.bool), 5]),
}


@pytest.mark.parametrize("how", list(_SHIFTED_READS))
def test_reads_with_entries_that_shift_dims_reads_the_right_rows(how):
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    sites = [(n, p) for n, p in sites if p >= 1][::3]
    index, read = _SHIFTED_READS[how]
    metric = lambda out: read(out).clone()  # noqa: E731
    whole = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=False)
    for kw in ({}, {"batch_sites": True}):
        got = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads={"logits": index}, **kw)
        for s in sites:
            a, b = torch.as_tensor(got.metrics[s]), torch.as_tensor(whole.metrics[s])
            assert not torch.isnan(a).any(), (how, kw, s)
            assert _rel(a, b) <= 1e-6, (how, kw, s)
    patched = rg.value(resid[0]).clone()
    patched[:, 1:] = 0
    rg.patch(resid[0], patched)
    full = read(rg.demand()).clone()
    assert _rel(read(rg.demand(reads={"logits": index})), full) <= 1e-6
    rg.restore()


def test_sites_alternating_between_nodes_and_reads_get_each_nodes_own_row_plan():
    # A sweep whose consecutive sites are on different nodes, with patches that change one row and patches
    # that change every row (which take the whole cone before any row bookkeeping), under two read
    # declarations in turn: each site gets the row plan of its own node and reads (plans are kept per node).
    rg, resid, patch, _ = _zoo_sweep_setup("sdpa")
    torch.manual_seed(1)
    noise = {n: torch.randn_like(rg.value(n)) for n in resid}

    def patch_any(value, site):
        node, p = site
        return value + noise[node] if p == "all" else patch(value, site)

    sites = [(n, p) for p in (2, "all", T - 1, 0) for n in resid]
    assert all(a[0] != b[0] for a, b in zip(sites, sites[1:]))
    reads = {"logits": (slice(None), -1, [3, 4])}

    def narrow_metric(out):
        return float((out[:, -1, 3] - out[:, -1, 4]).sum())

    whole = torch_ext.sweep(rg, sites, patch_any, lambda out: out.clone(), progress=False, positions=False)
    runs = []
    for narrow in (True, False, True):
        rg.reset_stats()
        if narrow:
            r = torch_ext.sweep(rg, sites, patch_any, narrow_metric, progress=False, reads=reads)
        else:
            r = torch_ext.sweep(rg, sites, patch_any, lambda out: out.clone(), progress=False)
        runs.append(r)
        assert r.measured_evaluations == whole.measured_evaluations
        for s in sites:
            want = whole.metrics[s]
            if narrow:
                want = narrow_metric(want)
                assert abs(r.metrics[s] - want) <= 1e-6 * max(1.0, abs(want)), s
            elif s[1] == "all":
                # Every row changed and every output row read: the whole cone, the full recompute's bits.
                assert bits_equal(r.metrics[s], want), s
            else:
                assert _rel(r.metrics[s], want) <= 1e-6, s
    # The narrow plans were found again after the wide ones (the same rows computed), and the wide sweep
    # computed more rows than the narrow one.
    assert runs[0].extra["row_evaluations"] == runs[2].extra["row_evaluations"] < runs[1].extra["row_evaluations"]
    assert runs[0].cost == runs[2].cost < runs[1].cost
    rg.check_invariants()


def test_reads_last_row_computes_only_what_reaches_it():
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    seen = {}

    def metric(out):
        seen["out"] = out.clone()
        return float((out[:, -1, 3] - out[:, -1, 4]).sum())

    reads = {"logits": (slice(None), -1, [3, 4])}
    rg.reset_stats()
    narrow = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=reads)
    wide = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    assert narrow.measured_evaluations == wide.measured_evaluations
    assert narrow.cost < wide.cost and narrow.extra["row_evaluations"] < wide.extra["row_evaluations"]
    for s in sites:
        assert abs(narrow.metrics[s] - wide.metrics[s]) <= 1e-6 * max(1.0, abs(wide.metrics[s])), s
    # The engine: a patch at position 2 leaves output rows [2, T-1) uncomputed (NaN), rows [0, 2) clean.
    rows = rg._engine.evaluate_patched_rows(resid[0], patch(rg.value(resid[0]), (resid[0], 2)), *rg._read_spec(reads))
    assert torch.isnan(rows[0][:, 2:T - 1]).all() and not torch.isnan(rows[0][:, :2]).any()
    del rows
    narrow_one = torch_ext.sweep(rg, [(resid[0], 2)], patch, metric, progress=False, reads=reads)
    assert narrow_one.metrics[(resid[0], 2)] == pytest.approx(wide.metrics[(resid[0], 2)], rel=1e-6)
    # The metric sees the declared elements only (the rest poisoned: its last call, the finite poison 0.75).
    out = seen["out"]
    assert not torch.isinf(out[:, -1, [3, 4]]).any() and (out[:, :-1] == 0.75).all()
    # The same declaration by output index and by node name.
    out_node = rg._output_nodes()[0]
    assert rg._read_rows({0: (slice(None), -1)}) == rg._read_rows({out_node: (slice(None), T - 1)}) == [T - 1]
    assert rg._read_rows({"logits": (slice(None), slice(3, None))}) == [3]
    assert rg._read_rows({"logits": (slice(None), [5, -2])}) == [5]
    assert rg._read_cols({"logits": (slice(None), -1, [4, 3, -1])}) == [[3, 4, 49]]
    assert rg._read_cols({"logits": (slice(None), -1)}) == [[]]  # no column entry: every column
    with pytest.raises(ValueError, match="columns \\[50\\]"):
        rg._read_cols({"logits": (slice(None), -1, [50])})
    # Only the two read columns of the last row are computed; the rest of the row is NaN.
    rows = rg._engine.evaluate_patched_rows(resid[1], patch(rg.value(resid[1]), (resid[1], 3)), *rg._read_spec(reads))
    last = rows[0][:, -1]
    assert not torch.isnan(last[:, [3, 4]]).any() and torch.isnan(last[:, :3]).all()
    del rows, last
    # A callable says the same by indexing the outputs.
    assert rg._read_rows(lambda logits: logits[:, -1, [3, 4]]) == [T - 1]
    assert rg._read_rows(lambda logits: (logits[:, 5], logits[0, 2:4, 1])) == [2]
    with pytest.raises(ValueError, match="not elements of an output"):
        rg._read_rows(lambda logits: logits.sum())
    with pytest.raises(TypeError, match="must return the indexed outputs"):
        rg._read_rows(lambda logits: 3.0)
    by_callable = torch_ext.sweep(rg, sites[-T:], patch, metric, progress=False,
                                  reads=lambda logits: logits[:, -1, [3, 4]])
    for s in sites[-T:]:
        assert abs(by_callable.metrics[s] - wide.metrics[s]) <= 1e-6 * max(1.0, abs(wide.metrics[s])), s
    assert by_callable.cost < torch_ext.sweep(rg, sites[-T:], patch, metric, progress=False).cost


def test_batched_sites_use_rows_too():
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    # A node's sites are stacked into one batch and share one row range, from the earliest changed
    # position of the group: positions 3.. recompute rows [3, T).
    sites = [(n, p) for n, p in sites if p >= 3]
    metric = lambda out: float((out[:, -1, 3] - out[:, -1, 4]).sum())  # noqa: E731
    one = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    per_node = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=len(sites))
    whole = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True, positions=False)
    assert per_node.measured_evaluations == whole.measured_evaluations
    assert per_node.extra["row_evaluations"] == float(Fraction(T - 3, T) * int(whole.extra["row_evaluations"]))
    # batch_sites=True chains the nodes (each in the cone of the one before): copies enter at their own
    # node, so the units run fewer evaluations than one batch per node.
    batched = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)
    assert batched.measured_evaluations == batched.predicted_evaluations < per_node.measured_evaluations
    # batch_sites=K: each node's sites sorted by their patched row, K per batch, each batch from its
    # own smallest row: positions 3-4, 5-6, 7 recompute rows [3, T), [5, T), [7, T).
    paired = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=2)
    assert paired.groups == 3 * len(resid)
    assert paired.measured_evaluations == 3 * sum(len(rg.cone(n)) for n in resid)
    # The nodes before the site's layer's attention (local) run only the group's patched rows.
    local = _local(rg, resid)
    assert paired.extra["row_evaluations"] == float(sum((len(rg.cone(n)) - len(local[n])) * Fraction(T - p, T)
                                                        + len(local[n]) * Fraction(h - p, T)
                                                        for n in resid for p, h in ((3, 5), (5, 7), (7, 8))))
    for s in sites:
        assert abs(batched.metrics[s] - one.metrics[s]) <= 1e-6 * max(1.0, abs(one.metrics[s])), s
        assert abs(per_node.metrics[s] - one.metrics[s]) <= 1e-6 * max(1.0, abs(one.metrics[s])), s
        assert abs(whole.metrics[s] - one.metrics[s]) <= 1e-6 * max(1.0, abs(one.metrics[s])), s
        assert abs(paired.metrics[s] - one.metrics[s]) <= 1e-6 * max(1.0, abs(one.metrics[s])), s
    with pytest.raises(ValueError, match="batch_sites"):
        torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=1)


def test_cutoff_gives_the_same_bits_and_standing_patches_fall_back_to_whole_nodes():
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    # Half the sites patch a value equal to the clean one (cutoff stops them at the site).
    same = lambda v, s: v.clone() if s[1] % 2 else patch(v, s)  # noqa: E731
    metric = lambda out: out.clone()  # noqa: E731
    # skip_identical=False: the identical sites reach the engine, where cutoff stops them.
    whole = torch_ext.sweep(rg, sites, same, metric, progress=False, positions=False, skip_identical=False)
    rows = torch_ext.sweep(rg, sites, same, metric, progress=False, skip_identical=False)
    rg.set_cutoff(True)
    before = rg.stats["cutoffs"]
    cut = torch_ext.sweep(rg, sites, same, metric, progress=False, skip_identical=False)
    cut_whole = torch_ext.sweep(rg, sites, same, metric, progress=False, positions=False, skip_identical=False)
    changed = [s for s in sites if s[1] % 2 == 0]
    # Row-range recompute with cutoff on runs the same kernels on the same rows as with it off.
    for s in sites:
        assert torch.equal(cut.metrics[s], rows.metrics[s]), s
        assert torch.equal(cut_whole.metrics[s], whole.metrics[s]), s
    # A value equal to the clean one is cut off at the site; a changed one costs its cone, on rows.
    assert cut.measured_evaluations == sum(len(rg.cone(n)) for n, _ in changed)
    local = _local(rg, resid)
    assert cut.extra["row_evaluations"] == float(sum((len(rg.cone(n)) - len(local[n])) * Fraction(T - p, T)
                                                     + Fraction(len(local[n]), T) for n, p in changed))
    assert rg.stats["cutoffs"] - before >= sum(len(rg.cone(n)) for n, p in sites if p % 2)
    rg.set_cutoff(False)
    rg.patch(resid[-1], lambda v: v * 1.5)
    standing = torch_ext.sweep(rg, sites[:T], patch, metric, progress=False)
    assert not standing.extra["positions"]
    assert standing.extra["row_evaluations"] == standing.measured_evaluations
    rg.restore()
    rg.check_invariants()


@pytest.mark.internals
def test_positions_off_and_bad_arguments():
    torch.manual_seed(0)
    model = LM("sdpa", seq=T).eval()
    x = torch.randint(0, 50, (2, T))
    rg = torch_ext.ReactiveGraph(model, (x,), positions=False)
    assert not rg.positions and rg.seq_axis("add") == -1
    rg.set_positions(True)
    assert rg.positions and rg.seq_axis("add") == 1
    with pytest.raises(ValueError, match="seq_dim"):
        torch_ext.ReactiveGraph(model, (x,), seq_dim=-1)
    with pytest.raises(TypeError, match="positions"):
        torch_ext.sweep(rg, ["add"], lambda v, s: v, lambda o: 0.0, progress=False, positions="yes")
    with pytest.raises(TypeError, match="reads must be a dict"):
        torch_ext.sweep(rg, ["add"], lambda v, s: v, lambda o: 0.0, progress=False, reads=[1])
    with pytest.raises(ValueError, match="out of range"):
        rg._read_rows({3: (slice(None), -1)})
    with pytest.raises(ValueError, match="outside the sequence axis"):
        rg._read_rows({0: (slice(None), 99)})
    with pytest.raises(ValueError, match="step 1"):
        rg._read_rows({0: (slice(None), slice(0, None, 2))})
    with pytest.raises(RuntimeError, match="positions are off"):
        rg.set_positions(False)
        rg._engine.evaluate_patched_rows("add", rg.value("add"), [])
    rg.set_positions(True)
    before = rg.stats["evaluations"]
    # A value equal to the cached one changes no row: the cone runs whole, outputs bit-identical.
    outs = rg._engine.evaluate_patched_rows("add", rg.value("add").clone(), [])
    assert torch.equal(outs[0], rg.demand())
    assert rg.stats["evaluations"] - before == len(rg.cone("add"))


# ---- property test: the analysis is conservative on random graphs of the supported ops

OPS = ("linear", "layer_norm", "gelu", "square", "add_pos", "causal_sdpa", "mask_attention", "rms", "transpose_back",
       "mean_over_seq", "cumsum", "encoder_sdpa", "split_cat", "conv1d", "position_mask_sdpa")


class RandomNet(nn.Module):
    def __init__(self, ops, d=8, seq=T):
        super().__init__()
        self.ops = list(ops)
        self.lins = nn.ModuleList([nn.Linear(d, d) for _ in ops])
        self.lns = nn.ModuleList([nn.LayerNorm(d) for _ in ops])
        self.pos = nn.Parameter(torch.randn(seq, d))

    def forward(self, x):
        b, t, d = x.shape
        for i, op in enumerate(self.ops):
            if op == "linear":
                y = self.lins[i](x)
            elif op == "layer_norm":
                y = self.lns[i](x)
            elif op == "gelu":
                y = torch.nn.functional.gelu(x)
            elif op == "square":
                y = x * x
            elif op == "add_pos":
                y = x + self.pos
            elif op in ("causal_sdpa", "encoder_sdpa"):
                q = self.lins[i](x).view(b, t, 2, d // 2).transpose(1, 2)
                k = x.view(b, t, 2, d // 2).transpose(1, 2)
                y = torch.nn.functional.scaled_dot_product_attention(q, k, k * 0.5, is_causal=op == "causal_sdpa")
                y = y.transpose(1, 2).reshape(b, t, d)
            elif op == "conv1d":  # Hugging Face GPT-2's Conv1D: [b, t] flattened into b*t rows around the GEMM
                y = torch.addmm(self.lins[i].bias, x.reshape(-1, d), self.lins[i].weight.t()).view(b, t, d)
                y = torch.nn.functional.gelu(y.view(-1, d)).view(b, t, d)
            elif op == "position_mask_sdpa":  # a boolean mask from positions (j <= i), as transformers builds it
                pos = torch.arange(t)
                mask = (pos[None, :] <= pos[:, None]).expand(b, 1, t, t)
                q = self.lins[i](x).view(b, t, 2, d // 2).transpose(1, 2)
                k = x.view(b, t, 2, d // 2).transpose(1, 2)
                y = torch.nn.functional.scaled_dot_product_attention(q, k, k * 0.5, attn_mask=mask)
                y = y.transpose(1, 2).reshape(b, t, d)
            elif op == "mask_attention":
                att = (self.lins[i](x) @ x.transpose(-2, -1)).masked_fill(torch.ones(t, t).tril() == 0, float("-inf"))
                y = att.softmax(-1) @ x
            elif op == "rms":
                y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            elif op == "transpose_back":
                y = x.transpose(1, 2).contiguous().transpose(1, 2) + 1.0
            elif op == "mean_over_seq":
                y = x - x.mean(1, keepdim=True)
            elif op == "cumsum":
                y = x.cumsum(1)
            else:  # split_cat
                lo, hi = x.split(d // 2, dim=-1)
                y = torch.cat([hi, lo * 2], dim=-1)
            x = x + y
        return x


@pytest.mark.internals
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=5), seed=st.integers(0, 2**16),
       p=st.integers(0, T - 1), pick=st.integers(0, 10**6))
def test_rows_called_unchanged_are_bit_identical(ops, seed, p, pick):
    torch.manual_seed(seed)
    net = RandomNet(ops).eval()
    x = torch.randn(2, T, 8)
    rg = torch_ext.ReactiveGraph(net, (x,))
    graph = rg._engine.graph()
    sources = [n for n in rg.nodes() if rg.seq_axis(n) >= 0 and rg.value(n).is_floating_point()]
    src = sources[pick % len(sources)]
    axis = rg.seq_axis(src)
    base = {n: rg.value(n).clone() for n in rg.nodes() if isinstance(rg.value(n), torch.Tensor)}
    changes = _C.sequence_cone(graph, src, 1)
    value = base[src].clone()
    value.narrow(axis, p, T - p).add_(torch.randn_like(value.narrow(axis, p, T - p)))
    fast = rg._engine.evaluate_patched_rows(src, value, [])
    rg.patch(src, value)
    full = rg.demand()
    # A patched value may make NaN (rsqrt of a negative mean): both must have it at the same places.
    nan = torch.isnan(full)
    assert torch.equal(torch.isnan(fast[0]), nan), (ops, src, p)
    assert _rel(fast[0][~nan], full[~nan]) <= 1e-5 if (~nan).any() else True, (ops, src, p)
    # The analysis's claim (rows before p unchanged) holds for finite values: a full kernel spreads a NaN or inf
    # in the rows a causal reader weighs by zero into the rows before p (0 * NaN), and the engine then runs the
    # cone whole (test_a_non_finite_patch_gives_what_a_full_recompute_gives), as checked just above.
    spread = not all(bool(torch.isfinite(v).all()) for v in (rg.value(n) for n in changes if n in base)
                     if isinstance(v, torch.Tensor) and v.is_floating_point())
    for n, change in changes.items():
        if spread or change != "rows" or n not in base:
            continue
        a, fold = rg._engine.seq_fold(n)  # rows in blocks (a flattened [batch, seq]): rows [0, p) of each block
        now = rg.value(n).unflatten(a, (fold, -1))
        was = base[n].unflatten(a, (fold, -1))
        assert torch.equal(now.narrow(a + 1, 0, p), was.narrow(a + 1, 0, p)), (ops, src, p, n)
    for n in base:  # outside the cone: untouched
        if n not in changes and n != src and n not in rg.cone(src):
            assert torch.equal(rg.value(n), base[n])
    rg.restore()
    rg.check_invariants()


@pytest.mark.internals
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=5), seed=st.integers(0, 2**16),
       p=st.integers(0, T - 1), width=st.integers(1, 3), pick=st.integers(0, 10**6))
def test_patches_of_a_few_rows_match_a_full_recompute(ops, seed, p, width, pick):
    # A patch of rows [p, p + width) alone: the local nodes (no attention between the patch and them) keep
    # only those rows and join their cached rows on when a reader needs them (a local reader that also
    # reads an attention's rows [p, T), attention reading keys and values whole, an output).
    torch.manual_seed(seed)
    net = RandomNet(ops).eval()
    x = torch.randn(2, T, 8)
    rg = torch_ext.ReactiveGraph(net, (x,))
    sources = [n for n in rg.nodes() if rg.seq_axis(n) >= 0 and rg.value(n).is_floating_point()]
    src = sources[pick % len(sources)]
    axis = rg.seq_axis(src)
    value = rg.value(src).clone()
    rows = value.narrow(axis, p, min(width, T - p))
    rows.add_(torch.randn_like(rows))
    fast = rg._engine.evaluate_patched_rows(src, value, [])
    rg.patch(src, value)
    full = rg.demand()
    nan = torch.isnan(full)
    # A patch may make NaN (rsqrt of a negative mean): both must have it at the same places, also where a causal
    # kernel run on all rows spreads a later row's NaN to earlier ones (0 * NaN): the engine then runs whole.
    assert torch.equal(torch.isnan(fast[0]), nan), (ops, src, p, width)
    assert _rel(fast[0][~nan], full[~nan]) <= 1e-5 if (~nan).any() else True, (ops, src, p, width)
    # Where the analysis bounds the output to rows [p, T), its rows before p are the cached ones, bit for bit
    # (an op that mixes the sequence, e.g. a mean over it, changes every row: no such claim there).
    if _C.sequence_cone(rg._engine.graph(), src, 1).get(rg._output_nodes()[0]) == "rows" and not nan.any():
        assert torch.equal(fast[0].narrow(1, 0, p), full.narrow(1, 0, p)), (ops, src, p, width)
    rg.restore()
    rg.check_invariants()


def test_one_row_patch_through_local_and_attention_readers():
    # The patched row p reaches x + y (a local add) both directly and through causal attention (rows
    # [p, T)): the add must read the local branch's rows [p, T), its recomputed row p joined with cached ones.
    torch.manual_seed(1)
    net = RandomNet(["linear", "causal_sdpa", "gelu"]).eval()
    x = torch.randn(2, T, 8)
    rg = torch_ext.ReactiveGraph(net, (x,))
    src = rg.nodes()[[rg.seq_axis(n) >= 0 for n in rg.nodes()].index(True)]
    for p in range(T):
        value = rg.value(src).clone()
        value[:, p] += 1.0
        fast = rg._engine.evaluate_patched_rows(src, value, [])[0].clone()
        rg.patch(src, value)
        full = rg.demand()
        assert _rel(fast, full) <= 1e-6, p
        assert torch.equal(fast[:, :p], full[:, :p]), p
        rg.restore()
    rg.check_invariants()


def test_cli_sweep_no_positions(monkeypatch, capsys):
    import json
    from pathlib import Path

    from torch_ext import cli

    monkeypatch.chdir(Path(__file__).parent)
    runs = {}
    for flag in ([], ["--no-positions"]):
        assert cli.main(["sweep", "factories:seq", "--positions", "--metric", "logit:3", "--json", "--quiet",
                         *flag]) == 0
        runs[bool(flag)] = json.loads(capsys.readouterr().out)
    token, whole = runs[False], runs[True]
    assert token["measured_evaluations"] == whole["measured_evaluations"] == whole["row_evaluations"]
    assert token["row_evaluations"] < whole["row_evaluations"] and token["flops"] < whole["flops"]
    for a, b in zip(token["metrics"], whole["metrics"]):
        assert (a["node"], a["position"]) == (b["node"], b["position"])
        assert a["metric"] == pytest.approx(b["metric"], rel=1e-6, abs=1e-6)


@pytest.mark.internals
def test_demand_with_reads_on_a_standing_patch():
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    node, p = resid[1], 5
    value = patch(rg.value(node), (node, p))
    rg.patch(node, value)
    rg.reset_stats()
    narrow = rg.demand(reads={"logits": (slice(None), -1, [3, 4])})
    assert rg.stats["evaluations"] == len(rg.cone(node))
    assert rg.stats["row_evaluations"] < len(rg.cone(node))
    assert rg._engine.pinned() == [node] and rg._engine.num_dirty() == len(rg.cone(node))  # nothing cached
    full = rg.demand()
    assert _rel(narrow[:, -1, [3, 4]], full[:, -1, [3, 4]]) <= 1e-6
    assert torch.isnan(narrow[:, p:T - 1]).all() and torch.equal(narrow[:, :p], full[:, :p])
    rg.check_invariants()
    # With two standing patches it is a plain demand.
    rg.patch(resid[0], lambda v: v + 0.0)
    assert torch.equal(rg.demand(reads={"logits": (slice(None), -1)}), rg.demand())
    rg.restore()
    rg.check_invariants()


def test_cutoff_on_off_same_bits_where_rows_round_differently():
    # Regression (bench_sweep part 3): at d_model 64, batch 8, T 16 a GEMM on rows [p, T) rounds
    # differently from one on all rows for some p, so cutoff must not switch a changed site to
    # whole-node recompute: cutoff on and off give the same bits with positions on.
    from torch_ext.models import TinyTransformer

    torch.manual_seed(0)
    seq = 16
    model = TinyTransformer(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=seq).eval()
    clean, corrupt = torch.randint(0, 128, (8, seq)), torch.randint(0, 128, (8, seq))
    rg = torch_ext.ReactiveGraph(model, (corrupt,))
    resid = ["add", rg.nodes("blocks.0")[-1]]
    cache = {n: rg.value(n).clone() for n in resid}
    rg.run(clean)

    def patch(v, site):
        node, p = site
        if p < 4:  # the clean row: an identical value, cut off at the site
            return v.clone()
        v = v.clone()
        v[:, p] = cache[node][:, p]
        return v

    sites = [(n, p) for n in resid for p in range(seq)]
    metric = lambda out: out[:, -1].clone()  # noqa: E731
    off = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    rg.set_cutoff(True)
    on = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    rg.set_cutoff(False)
    for s in sites:
        assert torch.equal(on.metrics[s], off.metrics[s]), s
    rg.check_invariants()


@pytest.mark.parametrize("reads", [None, {0: (slice(None), -1, [3, 4])}])
def test_outputs_a_caller_keeps_are_never_written_again(reads):
    # Assembled outputs are buffers reused across sites while the engine holds the only reference:
    # a metric that keeps an output, or a view of one, must find it unchanged after later sites.
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    kept, views = [], []

    def keep(out):
        kept.append(out)
        views.append(out[:, -1])
        return 0.0

    torch_ext.sweep(rg, sites, patch, keep, progress=False, reads=reads)
    if reads is None:
        ref = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False)
        assert len(kept) == len(sites) + 1  # the unpatched run first
        for s, k, v in zip(sites, kept[1:], views[1:]):
            torch.testing.assert_close(k, ref.metrics[s], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(v, ref.metrics[s][:, -1], rtol=0, atol=0, equal_nan=True)
    else:
        # The metric gets copies (declared elements, the rest NaN, +inf, -inf, 0.75: four calls per site),
        # and a copy it keeps is not reused for a later site either.
        ref = torch_ext.sweep(rg, sites, patch, lambda out: out[:, -1, [3, 4]].clone(), progress=False, reads=reads)
        assert len(kept) == 4 * (len(sites) + 1)
        for i, s in enumerate(sites):
            for j, poison in enumerate((float("nan"), float("inf"), float("-inf"), 0.75)):
                k, v = kept[4 * (i + 1) + j], views[4 * (i + 1) + j]
                torch.testing.assert_close(k[:, -1, [3, 4]], ref.metrics[s], rtol=0, atol=0)
                torch.testing.assert_close(v[:, [3, 4]], ref.metrics[s], rtol=0, atol=0)
                rest = k.clone()
                rest[:, -1, [3, 4]] = poison
                assert torch.equal(rest, torch.full_like(k, poison)) or (poison != poison and rest.isnan().all())
    # An output dropped by the caller is reused: the next site writes only the rows that differ.
    node, p = sites[-1]
    value = patch(rg.value(node), (node, p))
    first = rg._engine.evaluate_patched_rows(node, value, [])[0]
    ptr = first.data_ptr()
    del first
    again = rg._engine.evaluate_patched_rows(node, patch(rg.value(node), (node, p - 1)), [])[0]
    assert again.data_ptr() == ptr
    assert torch.equal(again, ref.metrics[(node, p - 1)]) if reads is None else True
    rg.check_invariants()


_OUTSIDE = {
    # reads column 5 too, NaN turned into 0: batched gave 0 there, one at a time the true value
    "nan_to_num": lambda out: float(torch.nan_to_num(out[:, -1, [3, 4, 5]]).sum()),
    # the whole last row: NaN is the max, argmax picked it batched
    "argmax": lambda out: float(out[0, -1].argmax()),
    # a comparison absorbs NaN (False)
    "comparison": lambda out: float((out[:, -1] > 0).sum()),
    # an undeclared row
    "other_row": lambda out: float(out[:, -2, 3].sum()),
    # every non-finite value mapped to one number: NaN, +inf and -inf all gave 0 there, the check passed and
    # the sweep returned the declared elements' sum where eager adds column 5's true values
    "nan_to_num_all_zero": lambda out: float(torch.nan_to_num(out[:, -1, [3, 4, 5]], nan=0.0, posinf=0.0,
                                                              neginf=0.0).sum()),
    # an undeclared element times zero: NaN under all three poisons, so the sweep returned NaN where eager
    # gives the declared elements' sum
    "times_zero": lambda out: float(out[:, -1, [3, 4]].sum() + 0.0 * out[:, -2, 3].sum()),
}


@pytest.mark.parametrize("how", list(_OUTSIDE))
def test_a_metric_reading_outside_reads_is_refused_on_every_path(how):
    # Before: undeclared elements were NaN on the row paths (batched sites) and true values on whole
    # cones (one at a time, positions off), so the same metric gave different numbers, silently.
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    sites = [(n, p) for n, p in sites if p >= 3][:6]
    metric = _OUTSIDE[how]
    reads = {"logits": (slice(None), -1, [3, 4])}
    match = r"the metric reads elements of output 0 \('\w+'\) outside reads=\{'logits'"
    for kw in ({}, {"batch_sites": True}, {"positions": False}, {"batch_sites": 2}):
        with pytest.raises(ValueError, match=match):
            torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=reads, **kw)
    with pytest.raises(ValueError, match=r"outside what the reads callable indexes"):
        torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=lambda logits: logits[:, -1, [3, 4]],
                        batch_sites=True)
    assert rg.patched() == []
    rg.check_invariants()


def test_a_metric_reading_inside_reads_gets_the_same_bits_on_every_path():
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    sites = [(n, p) for n, p in sites if p >= 3][:6]
    metric = lambda out: out[:, -1, [4, 3]] * 2  # noqa: E731  (per-example tensors, columns reordered)
    reads = {"logits": (slice(None), -1, [3, 4])}
    ref = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=reads)
    for kw in ({"batch_sites": True}, {"positions": False}, {"batch_sites": 2}):
        other = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=reads, **kw)
        for s in sites:
            torch.testing.assert_close(other.metrics[s], ref.metrics[s], rtol=1e-6, atol=1e-6)
    plain = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    for s in sites:
        torch.testing.assert_close(plain.metrics[s], ref.metrics[s], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"batch_sites": 2}, {"positions": False}])
def test_a_metric_writing_into_its_copy_gets_freshly_poisoned_copies(kw):
    # The read check's copies of the output are kept across sites (one buffer for the four poisons): a
    # copy the metric wrote into must not be handed out again, or its undeclared elements would no longer
    # hold the poison (and a metric reading them could pass the check).
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    sites = [(n, p) for n, p in sites if p >= 3][:6]
    reads = {"logits": (slice(None), -1, [3, 4])}
    poisoned = []

    def metric(out):
        rest = torch.ones(out.shape, dtype=torch.bool)
        rest[:, -1, [3, 4]] = False
        undeclared = out[rest]  # one poison throughout: NaN, +inf, -inf or 0.75
        poisoned.append(bool(undeclared.isnan().all() or (undeclared == undeclared[0]).all()))
        value = float(out[:, -1, [3, 4]].sum())
        out.fill_(0.0)  # the metric's own copy: allowed, but that copy is spoiled
        return value

    ref = torch_ext.sweep(rg, sites, patch, lambda out: float(out[:, -1, [3, 4]].sum()), progress=False,
                          reads=reads, **kw)
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=reads, **kw)
    assert len(poisoned) == 4 * (len(sites) + 1) and all(poisoned)
    assert got.metrics == ref.metrics
    rg.check_invariants()


class _SignOfZero(nn.Module):
    """relu then atan(1 / h): the sign of a zero decides the value (1/+0 = +inf, 1/-0 = -inf)."""

    def forward(self, x):
        return torch.atan(1.0 / torch.relu(x))


@pytest.mark.parametrize("batch_sites", [True, 2])
def test_batched_row_sites_are_identical_by_bits(batch_sites):
    # Batched sites on the row path learn identity from the same byte scan that finds the first changed
    # row (an identical value changes no row). -0.0 over a +0.0 is a change there (1 / x tells them apart):
    # only the unchanged copies and the flip of row 3 (which holds no zero) are identical.
    x = torch.tensor([[[-1.0, 2.0], [0.5, -3.0], [-2.0, -1.0], [1.0, 1.0]]])
    rg = torch_ext.ReactiveGraph(_SignOfZero().eval(), (x,))
    node = next(n for n in rg.nodes() if n.startswith("relu"))

    def patch(v, site):
        out = v.clone()
        if site[2] == "flip":
            row = out[:, site[1]]
            out[:, site[1]] = torch.where(row == 0, torch.full_like(row, -0.0), row)
        return out

    sites = [(node, p, kind) for p in range(4) for kind in ("same", "flip")]
    got = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False, batch_sites=batch_sites)
    assert got.extra["identical_sites"] == 5
    for s in sites:
        assert bits_equal(got.metrics[s], torch.atan(1.0 / patch(torch.relu(x), s))), s
    rg.check_invariants()


@pytest.mark.parametrize("cutoff", [False, True])
@pytest.mark.parametrize("kw", [{}, {"reads": {0: (slice(None), 2)}}, {"batch_sites": True}])
def test_a_patch_that_only_flips_the_sign_of_a_zero_is_recomputed(cutoff, kw):
    # Before: the changed rows were found with `ne` (-0.0 == 0.0), so a patch writing -0.0 over row p's
    # zeros and changing row 3 recomputed rows [3, T) only (cutoff on: a patch writing only -0.0 was cut
    # off at the site), and row p kept its clean +pi/2 where eager gives -pi/2.
    x = torch.tensor([[[-1.0, 2.0], [0.5, -3.0], [-2.0, -1.0], [1.0, 1.0]]])
    model = _SignOfZero().eval()
    rg = torch_ext.ReactiveGraph(model, (x,), cutoff=cutoff)
    node = next(n for n in rg.nodes() if n.startswith("relu"))

    def patch(v, site):
        out = v.clone()
        row = out[:, site[1]]
        out[:, site[1]] = torch.where(row == 0, torch.full_like(row, -0.0), row)
        if site[2]:
            out[:, 3] += 1.0
        return out

    metric = (lambda out: float(out[:, 2].sum())) if "reads" in kw else (lambda out: float(out.sum()))
    sites = [(node, p, also) for p in range(4) for also in (False, True)]
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    for s in sites:
        ref = metric(torch.atan(1.0 / patch(torch.relu(x), s)))
        assert got.metrics[s] == ref, s
    rg.check_invariants()


def _spread_setup(n_layers=2, seq=16, seed=0):
    """A d_model 32 TinyTransformer, the resid_pre node of every layer, and patches taking row p from a
    corrupted run (every position differs, so the first changed row of site (node, p) is p)."""
    from torch_ext.models import TinyTransformer

    torch.manual_seed(seed)
    model = TinyTransformer(vocab=64, d_model=32, n_heads=4, n_layers=n_layers, seq=seq).eval()
    clean = torch.randint(0, 64, (2, seq))
    corrupt = torch.randint(0, 64, (2, seq))
    rg = torch_ext.ReactiveGraph(model, (corrupt,))
    resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(n_layers - 1)]
    cache = {n: rg.value(n).clone() for n in resid}
    rg.run(clean)

    def patch(value, site):
        node, p = site
        v = value.clone()
        v[:, p] = cache[node][:, p]
        return v

    return rg, resid, patch, seq


@pytest.mark.internals
def test_a_stack_of_sites_runs_from_its_earliest_first_row():
    # Stacked copies given out of row order, one identical to the clean value: the stack must run from the
    # earliest changed row of any copy (2, the second copy's), and each copy must equal its own
    # one-at-a-time evaluation. A stack started at another copy's row (12, the first's) would keep cached
    # rows where a patch changed them, far beyond 1e-6.
    rg, resid, patch, seq = _spread_setup()
    eng = rg._engine
    for node in resid:
        rows = [12, 2, seq, 7]  # seq: the clean value itself
        values = [patch(eng.value(node), (node, p)) if p < seq else eng.value(node).clone() for p in rows]
        bc = rg._batched_cone(node, len(rows))
        before = bc.engine.stats()["row_evaluations"]
        got = bc.split(bc.engine.evaluate_patched_rows(node, torch.cat(values), [], []))
        assert bc.engine.stats()["row_evaluations"] - before < len(rg.cone(node))  # rows, not the whole cone
        for k, (p, v) in enumerate(zip(rows, values)):
            want = eng.evaluate_patched_rows(node, v, [], []) if p < seq else eng.evaluate_patched(node, v)
            assert _rel(got[k][0], want[0]) <= 1e-6, (node, p, _rel(got[k][0], want[0]))
            assert torch.equal(got[k][0][:, :2], eng.value(rg._output_nodes()[0])[:, :2]), (node, p)
    rg.check_invariants()


@pytest.mark.parametrize("batch_sites", [True, 2, 4, 16])
def test_batched_sites_at_mixed_positions_and_layers_equal_one_at_a_time(batch_sites):
    rg, resid, patch, seq = _spread_setup()
    sites = [(n, p) for n in resid for p in (1, 3, 4, 9, 10, 15)]
    metric = lambda out: out.clone()  # noqa: E731  every logit: rows of every position are read
    one = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=batch_sites)
    assert got.measured_evaluations == got.predicted_evaluations
    for s in sites:
        assert _rel(got.metrics[s], one.metrics[s]) <= 1e-6, (s, _rel(got.metrics[s], one.metrics[s]))
        # Rows before the site's position are the cached logits, bit for bit (causal), in every batch.
        assert torch.equal(got.metrics[s][:, :1], one.metrics[s][:, :1]), s
    rg.check_invariants()


def test_sites_of_one_position_across_layers_share_a_unit_and_equal_one_at_a_time():
    # batch_sites=True on the row path chains the resid_pre nodes (each in the cone of the one before):
    # a unit's copies enter at their own layers, so fewer units run than one batch per node, and every
    # site equals its one-at-a-time evaluation (at the row path's tolerance; rows before the site's
    # position bit for bit).
    rg, resid, patch, seq = _spread_setup(n_layers=3, seq=12, seed=1)
    sites = [(n, p) for n in resid for p in (2, 3, 7, 8, 11)]
    metric = lambda out: out.clone()  # noqa: E731
    one = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)
    assert got.measured_evaluations == got.predicted_evaluations
    chained = [key for key in rg._batched if isinstance(key[0], tuple)]
    assert chained and all(len(key) >= 2 and [n for n, _ in key] == [n for n in resid if n in dict(key)]
                           for key in chained)
    for s in sites:
        assert _rel(got.metrics[s], one.metrics[s]) <= 1e-6, (s, _rel(got.metrics[s], one.metrics[s]))
        assert torch.equal(got.metrics[s][:, :s[1]], one.metrics[s][:, :s[1]]), s
    rg.check_invariants()


@pytest.mark.internals
def test_each_copy_of_a_chained_unit_enters_at_its_own_layer():
    # One copy per layer, all at position 5: copy j must equal the site patched at layer j alone. The same
    # value entering at another layer gives a far other answer, so a copy at the wrong layer fails here.
    rg, resid, patch, seq = _spread_setup(n_layers=3, seq=12, seed=1)
    eng = rg._engine
    values = [patch(eng.value(n), (n, 5)) for n in resid]
    bc = rg._batched_entries(tuple((n, 1) for n in resid))
    before = bc.engine.stats()["row_evaluations"]
    got = bc.split(bc.engine.evaluate_patched_rows(resid[0], torch.cat(values), [], []))
    assert bc.engine.stats()["row_evaluations"] - before < bc.calls  # rows [5, T), not whole nodes
    for j, (n, v) in enumerate(zip(resid, values)):
        want = eng.evaluate_patched_rows(n, v, [], [])
        assert _rel(got[j][0], want[0]) <= 1e-6, (n, _rel(got[j][0], want[0]))
        assert torch.equal(got[j][0][:, :5], eng.value(rg._output_nodes()[0])[:, :5]), n
        other = resid[(j + 1) % len(resid)]
        wrong = eng.evaluate_patched_rows(other, v, [], [])
        assert _rel(got[j][0], wrong[0]) > 1e-3, (n, other)
    # Two entries of one unit with their counts: the copies come in entry order.
    bc2 = rg._batched_entries(((resid[1], 2), (resid[2], 1)))
    vals2 = [patch(eng.value(resid[1]), (resid[1], 3)), values[1], values[2]]
    got2 = bc2.split(bc2.engine.evaluate_patched_rows(resid[1], torch.cat(vals2), [], []))
    for j, (n, v) in enumerate(zip([resid[1], resid[1], resid[2]], vals2)):
        assert _rel(got2[j][0], eng.evaluate_patched_rows(n, v, [], [])[0]) <= 1e-6, (j, n)
    with pytest.raises(ValueError, match="not in the cone of the entry before it"):
        rg._batched_entries(((resid[2], 1), (resid[1], 1)))
    rg.check_invariants()


class _AttentionThenView(nn.Module):
    """Causal attention through an explicit mask, its output viewed back to [b, t, d] after a transpose,
    as Mixtral and Falcon write it: that view needs SDPA's own output layout ([b, t, h, d] in memory)."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        mask = torch.full((t, t), float("-inf")).triu(1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).view(b, t, d))


def test_a_view_of_joined_attention_rows_keeps_their_layout():
    # Rows recomputed from p were joined with the cached rows into a contiguous buffer, so the view after
    # the transpose failed ("view size is not compatible with input tensor's size and stride") on every
    # Mixtral and Falcon sweep. The joined value now has the cached value's layout.
    torch.manual_seed(0)
    model = nn.Sequential(_AttentionThenView(), _AttentionThenView()).eval()
    x = torch.randn(1, T, 16)
    rg = torch_ext.ReactiveGraph(model, (x,))
    sites = [(n, p) for n in rg.nodes("add*") for p in range(T)]

    def patch(value, site):
        v = value.clone()
        v[:, site[1]] *= -1
        return v

    rows = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False)
    whole = torch_ext.sweep(rg, sites, patch, lambda out: out.clone(), progress=False, positions=False)
    assert rows.extra["positions"] and rows.extra["row_evaluations"] < whole.extra["row_evaluations"]
    for site in sites:
        assert _rel(rows.metrics[site], whole.metrics[site]) <= 1e-6, site
    rg.check_invariants()


class _DictOut(nn.Module):
    """Outputs a dict, as Hugging Face's ModelOutput flattens: {"logits": ..., "hidden": ...}."""

    def __init__(self, d: int = 16, vocab: int = 11):
        super().__init__()
        self.block, self.head = _AttentionThenView(d), nn.Linear(d, vocab)

    def forward(self, x):
        h = self.block(x)
        return {"logits": self.head(h), "hidden": h}


def test_reads_names_an_output_by_its_key_in_the_output_structure():
    # Was: reads={"logits": ...} on a Hugging Face model raised "names no output (outputs: ['linear_14'])",
    # as its ModelOutput has several leaves and only node names were accepted.
    torch.manual_seed(0)
    rg = torch_ext.ReactiveGraph(_DictOut().eval(), (torch.randn(1, T, 16),))
    site_node = rg.nodes("add*")[0]
    sites = [(site_node, p) for p in range(T)]

    def patch(value, site):
        v = value.clone()
        v[:, site[1]] *= -1
        return v

    def metric(out):
        return out["logits"][:, -1].clone()

    whole = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=False)
    for key in ("logits", "['logits']"):
        got = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads={key: (slice(None), -1)})
        for site in sites:
            assert _rel(got.metrics[site], whole.metrics[site]) <= 1e-6, (key, site)
    with pytest.raises(ValueError, match=r"reads: 'logitz' names no output \(outputs: .*'hidden', 'logits'\]\)"):
        torch_ext.sweep(rg, sites, patch, metric, progress=False, reads={"logitz": (slice(None), -1)})


class _WithPredictions(nn.Module):
    """(logits, argmax tokens): an integer output beside the float one."""

    def __init__(self):
        super().__init__()
        self.lm = LM("sdpa", seq=T)

    def forward(self, idx):
        logits = self.lm(idx)
        return logits, logits.argmax(-1)


def test_an_integer_output_a_reads_callable_indexes_declares_no_float_element():
    # The read check tells elements apart by ids written into the float outputs; an integer output kept its
    # values, so a reads callable that indexed it declared the float elements whose ids equal those values
    # (token ids: logits[0, 0, :vocab]). A metric reading one of those then passed the check, and on the row
    # path (row 0 not computed for a patch at 0) got NaN where eager gives a number.
    torch.manual_seed(0)
    model = _WithPredictions().eval()
    x = torch.randint(0, 50, (2, T))
    rg = torch_ext.ReactiveGraph(model, (x,))
    site = rg.nodes("lm.blocks.0")[-1]
    pred = int(rg.demand()[1][0, -1])

    def patch(v, s):
        v = v.clone()
        v[:, s[1]] = 0.0
        return v

    def metric(out):  # reads logits[0, 0, pred]: not declared below
        return float(out[0][:, -1, 3].sum() + out[0][0, 0, pred])

    reads = lambda out: (out[0][:, -1, 3], out[1][:, -1])  # noqa: E731
    with pytest.raises(ValueError, match="outside what the reads callable indexes"):
        torch_ext.sweep(rg, [(site, 0), (site, 2)], patch, metric, progress=False, reads=reads)
    assert rg.patched() == []
    good = lambda out: float(out[0][:, -1, 3].sum() + out[1][:, -1].sum())  # noqa: E731
    got = torch_ext.sweep(rg, [(site, 0), (site, 2)], patch, good, progress=False, reads=reads)
    whole = torch_ext.sweep(rg, [(site, 0), (site, 2)], patch, good, progress=False, positions=False)
    for s in whole.metrics:
        assert abs(got.metrics[s] - whole.metrics[s]) <= 1e-6 * max(1.0, abs(whole.metrics[s]))


class _Squeezes(nn.Module):
    """A batch-1 model that drops the batch dim with squeeze (no dim: every size-1 dim) or squeeze(1) (the
    sequence dim, a no-op at T > 1), runs a position-wise op and puts the dim back."""

    def __init__(self, how, d=6):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.lin(x) * 1.0
        if self.how == "squeeze":
            y = F.gelu(h.squeeze()).unsqueeze(0)
        else:
            y = F.gelu(h.squeeze(1))
        return self.head(y + h)


@pytest.mark.parametrize("how", ["squeeze", "squeeze_seq_dim"])
@pytest.mark.parametrize("kw", [{}, {"reads": {0: (slice(None), -1)}}])
def test_a_squeeze_evaluated_on_one_row_keeps_the_row_axis(how, kw):
    # Rows [p, T) of a squeeze were run by its kernel on the slice: at p = T - 1 a one-row slice lost its row
    # axis too ([1, 1, d] -> [d]), and gelu's [d] was put back as [1, d]: the last site answered 2.7 off eager
    # (or raised "Tensors must have same number of dimensions" where rows were joined). Now a squeeze keeps its
    # traced sizes with the rows computed, as a view does.
    torch.manual_seed(0)
    model = _Squeezes(how).eval()
    x = torch.randn(1, 5, 6) if how == "squeeze" else torch.randn(2, 5, 6)
    rg = torch_ext.ReactiveGraph(model, (x,))
    mul = rg.nodes("mul*")[0]
    sites = [(mul, p) for p in range(5)]

    def patch(v, site):
        w = v.clone()
        w[:, site[1]] = w[:, site[1]] * -2 + 0.5
        return w

    metric = (lambda o: o[:, -1].clone()) if kw else (lambda o: o.clone())
    r = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    for site in sites:
        hook = model.lin.register_forward_hook(lambda m, a, o, s=site: patch(o, s))
        try:
            with torch.no_grad():
                ref = metric(model(x))
        finally:
            hook.remove()
        assert _rel(r.metrics[site], ref) <= 1e-6, (site, _rel(r.metrics[site], ref))


def test_rows_of_an_ill_conditioned_gpt2_are_the_changed_rows_run_alone_and_as_accurate_as_eager():
    # fuzz_sweep seed 48 case 161: every weight of block 1's MLP output projection + 0.15 gives the residual stream a
    # common mode (row 0: mean 0.49, spread 0.034) that ln_f divides out. A patch of position 0 at blocks.1.hook_attn_out
    # changes row 0 alone; everything after it is position-wise, so the row path runs c_fc, c_proj and lm_head on
    # that one row ([1, 64] x [64, 256] and so on), where the full recompute runs 8 rows: MKL's sgemm rounds a 1-row
    # product otherwise (c_proj's row differs by 4 ulps), and ln_f amplifies it to 1.04e-6 of the logits' largest
    # magnitude (out[0, 0, 0]: 0.341786534 against eager's 0.341787547), past README's former 1e-6 bound. What holds:
    # the row path's rows are those modules run on the changed row alone, bit for bit, and it is about as far from
    # eager as eager is from float64 (README, token-granular cones; scripts/fuzz_sweep.py's FLOOR).
    import copy

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(262)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    blk = model.transformer.h[1]
    with torch.no_grad():
        blk.mlp.c_proj.weight.add_(0.15)
    ids = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(0))
    corrupt_ids = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(632))
    seen = {}
    h = blk.attn.register_forward_hook(lambda mod, args, out: seen.__setitem__("attn", out[0].detach().clone()))
    h2 = blk.register_forward_pre_hook(lambda mod, args: seen.__setitem__("resid", args[0].detach().clone()))
    with torch.no_grad():
        model(corrupt_ids)
        corrupt_attn = seen["attn"]
        model(ids)
    h.remove()
    h2.remove()
    patched = seen["attn"].clone()
    patched[:, 0] = corrupt_attn[:, 0]

    def eager(m, dtype):
        m = copy.deepcopy(m).to(dtype)
        hk = m.transformer.h[1].attn.register_forward_hook(lambda mod, args, out: (patched.to(dtype),) + tuple(out[1:]))
        with torch.no_grad():
            out = m(ids).logits
        hk.remove()
        return out

    want, exact = eager(model, torch.float32), eager(model, torch.float64)
    rg = torch_ext.ReactiveGraph(copy.deepcopy(model), (ids,))
    site = ("blocks.1.hook_attn_out", 0)

    def patch(v, s):
        v = v.clone()
        v[:, 0] = corrupt_attn[:, 0]
        return v

    def logits(out):
        return out["logits"].clone()

    rows = torch_ext.sweep(rg, [site], patch, logits, progress=False).metrics[site]
    whole = torch_ext.sweep(rg, [site], patch, logits, progress=False, positions=False).metrics[site]
    assert torch.equal(whole, want)  # positions=False: the full product, bit for bit
    assert torch.equal(rows[:, 1:], want[:, 1:])  # rows the patch does not reach: the cached ones
    with torch.no_grad():  # the changed row through the same modules, alone
        mid = seen["resid"][:, :1] + patched[:, :1]
        alone = model.lm_head(model.transformer.ln_f(mid + blk.mlp(blk.ln_2(mid))))
    assert torch.equal(rows[:, :1], alone)
    own = float((want.double() - exact).abs().max())  # eager float32's own error
    assert own > 0
    assert float((rows.double() - want.double()).abs().max()) <= 16 * own
    rg.check_invariants()


def test_grouped_query_causal_attention_keeps_token_granular_cones():
    """A grouped-query attention with no padding mask is traced as eager runs it (SDPA is_causal, enable_gqa: the
    key/value heads shared in the kernel); the sequence axis analysis refused enable_gqa, so every site's cone ran
    whole from the attention on (2x the FLOPs of a Llama sweep). The row path passes enable_gqa on now: rows run,
    and the metrics equal eager hooks (rows before p bit for bit)."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                             max_position_embeddings=64, attn_implementation="sdpa")).eval()
    tokens = torch.randint(0, 100, (2, 12))
    rg = torch_ext.ReactiveGraph(model, (tokens,), positions=True)
    sdpa = [line for line in _C.sequence_axis(rg._engine.graph(), 1).splitlines()
            if "scaled_dot_product_attention" in line.split(":")[0]]
    assert len(sdpa) == 2 and all("causal-attention" in line for line in sdpa), sdpa
    clean = rg.demand().logits.clone()
    node = rg.hook_names["blocks.0.hook_resid_post"]
    sites = [(node, p) for p in range(12)]

    def patch(value, site):
        v = value.clone()
        v[:, site[1]] = 0
        return v

    rows = torch_ext.sweep(rg, sites, patch, lambda out: out.logits.clone(), progress=False)
    whole = torch_ext.sweep(rg, sites, patch, lambda out: out.logits.clone(), progress=False, positions=False)
    assert rows.extra["row_evaluations"] < whole.extra["row_evaluations"] and rows.cost < whole.cost
    for site in sites:
        h = model.model.layers[0].register_forward_hook(
            lambda m, i, o, site=site: patch(o, site) if not isinstance(o, tuple) else (patch(o[0], site),) + o[1:])
        try:
            with torch.no_grad():
                want = model(tokens, use_cache=False).logits
        finally:
            h.remove()
        p = site[1]
        assert torch.equal(whole.metrics[site], want), site
        assert torch.equal(rows.metrics[site][:, :p], clean[:, :p]), site
        assert _rel(rows.metrics[site], want) <= 1e-6, (site, _rel(rows.metrics[site], want))
