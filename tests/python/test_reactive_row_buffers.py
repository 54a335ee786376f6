"""The row path's pooled buffers (csrc/reactive/row_buffers.h): values written into reused memory are the
bits of fresh allocations, and nothing a caller still holds is overwritten by a later site or unit."""
from __future__ import annotations

import pytest
import torch

import torch_ext
from torch_ext.models import TinyTransformer


def _setup(d: int, scratch: bool):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, d_model=d, n_heads=4, n_layers=3, seq=12).eval()
    clean = torch.randint(0, 64, (4, 12))
    corrupt = clean.clone()
    for p in (2, 7, 10):
        corrupt[:, p] = (corrupt[:, p] + 1 + p) % 64
    rg = torch_ext.ReactiveGraph(model, (clean,))
    rg._engine.set_scratch(scratch)
    resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(2)]
    rg_c = torch_ext.ReactiveGraph(model, (corrupt,))
    donor = {n: rg_c.value(n) for n in resid}

    def patch(value, site):
        node, pos = site
        v = value.clone()
        v[:, pos] = donor[node][:, pos]
        return v

    sites = [(n, p) for n in resid for p in range(12)]
    return rg, sites, patch


def _metric(logits):
    return (logits[:, -1, 3] - logits[:, -1, 5]).mean()


@pytest.mark.parametrize("batch_sites", [True, 4, False])
def test_pooled_buffers_give_the_bits_of_fresh_allocations(batch_sites):
    results = {}
    for scratch in (False, True):
        rg, sites, patch = _setup(64, scratch)
        with torch.no_grad():
            first = torch_ext.sweep(rg, sites, patch, _metric, progress=False, batch_sites=batch_sites)
            again = torch_ext.sweep(rg, sites, patch, _metric, progress=False, batch_sites=batch_sites)
        assert again.metrics == first.metrics  # the second sweep runs in the memory the first left
        results[scratch] = (first.metrics, rg._engine.row_buffers_reused())
    assert results[True][0] == results[False][0]  # bit for bit
    assert results[False][1] == 0
    if batch_sites is not False:  # batched units run the row path in pooled memory (shared with the base engine)
        assert results[True][1] > 0


def test_outputs_and_cached_values_a_caller_holds_survive_later_sites():
    rg, sites, patch = _setup(64, True)
    eng = rg._engine
    node = rg.nodes("blocks.0")[-1]
    names = [n["name"] for n in eng.graph().nodes() if n["kind"] == "call"]
    cached = {n: eng.value(n).clone() for n in names if isinstance(eng.value(n), torch.Tensor)}
    held = []
    with torch.no_grad():
        for pos in (9, 3, 6, 0):
            value = patch(eng.value(node), (node, pos))
            outs = eng.evaluate_patched_rows(node, value, [-1], [[]])
            held.append((outs, [o.clone() for o in outs]))
    for outs, copies in held:  # every earlier site's outputs, unchanged by the later sites' runs
        for o, c in zip(outs, copies):
            assert torch.equal(o.view(torch.int32), c.view(torch.int32))
    for n, v in cached.items():  # the cache restore needs, bit for bit
        assert torch.equal(eng.value(n).view(torch.int32), v.view(torch.int32)), n


def test_qkv_joined_once_keeps_no_rows_of_an_earlier_site():
    # On TinyTransformer the row path joins the qkv projection's recomputed rows with its cached ones where
    # they are computed (one kept buffer; q, k and v are views of it). A one-row patch recomputes rows
    # [p, p + 1) of the first layer's projection, so the buffer's rows after them must be the cached ones
    # again after a site at an earlier row wrote there: each site in a shuffled order gives the bits a fresh
    # graph (fresh buffers) gives for it alone, and the whole-cone recompute's values.
    rg, _, patch = _setup(32, True)
    eng = rg._engine
    node = "add"
    with torch.no_grad():
        for pos in (9, 3, 11, 2, 0, 7, 3):
            value = patch(eng.value(node), (node, pos))
            got = [o.clone() for o in eng.evaluate_patched_rows(node, value, [], [])]
            fresh, _, _ = _setup(32, True)
            want = fresh._engine.evaluate_patched_rows(node, value, [], [])
            whole = eng.evaluate_patched(node, value)
            for g, w, f in zip(got, want, whole):
                assert torch.equal(g.view(torch.int32), w.view(torch.int32)), pos
                assert torch.equal(g[:, :pos], f[:, :pos]), pos  # causal: the rows before p are cached
                assert float((g - f).abs().max() / f.abs().max()) <= 1e-6, pos
    rg.check_invariants()


def test_the_row_path_reads_a_copy_on_write_cached_value_without_materialising_it():
    # evaluate_patched_rows compares the patched value's edge rows with the cached value's bytes; read
    # through a mutable data_ptr(), a cached value sharing its memory copy-on-write (a lazy copy handed to
    # a patch function or metric and kept) was given a copy of its own at every site: a whole-value copy.
    rg, sites, patch = _setup(16, scratch=True)
    eng = rg._engine
    node, pos = sites[2]  # ("add", 2): a corrupted position
    cached = eng.value(node)
    kept = torch_ext._C.lazy_copy(cached)
    assert kept is not None and torch._C._is_cow_tensor(cached)
    value = patch(cached, (node, pos))
    assert eng.first_changed_row(node, value) == pos
    eng.evaluate_patched_rows(node, value, *rg._read_spec(None))
    assert eng.value(node) is cached or torch.equal(eng.value(node), cached)
    assert torch._C._is_cow_tensor(eng.value(node)), "the cached value was materialised"
    assert torch.equal(kept, cached)
