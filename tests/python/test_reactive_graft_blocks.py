"""Blocks grafted into a ReactiveGraph: exported at the graft, and again for each input shape's graph, read by
reference afterwards. What their export bakes in (a Python attribute, a path taken on state the block writes) and
what the engine reads of them (parameters written through .data) must stay what eager would use."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_ext

_X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = 2.0

    def forward(self, v):
        return v * self.alpha


def test_a_grafted_blocks_attribute_changed_after_the_graft_is_refused():
    # Before: the graph for the example's shape kept alpha = 2.0 and a graph for another shape exported the block
    # again with 3.0: rg.run(x) and rg.run(x5) answered with two different blocks, silently.
    model, block = _chain(), _Scale()
    x5 = torch.randn(5, 4)
    rg = torch_ext.ReactiveGraph(model, (_X,))
    rg.graft("relu", block)
    with torch.no_grad():
        assert torch.equal(rg.run(_X), model[2](torch.relu(model[0](_X)) * 2.0))
    block.alpha = 3.0
    for call in (lambda: rg.run(x5), lambda: rg.run(_X), lambda: rg.demand()):
        with pytest.raises(ValueError, match=r"the block grafted after 'relu' \(_Scale\) changed: block\.alpha is 3\.0 "
                                             r"now, 2\.0 when it was grafted"):
            call()
    block.alpha = 2.0
    with torch.no_grad():
        assert torch.equal(rg.run(x5), model[2](torch.relu(model[0](x5)) * 2.0))


def test_a_grafted_block_reading_state_it_writes_is_refused_and_left_as_it_was():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self._n = 0

        def forward(self, v):
            self._n += 1
            return v * 2 if self._n > 1 else v * 1

    rg = torch_ext.ReactiveGraph(_chain(), (_X,))
    block = Counts()
    with pytest.raises(TypeError, match=r"graft: the block's forward writes block\._n 0 -> 1 while traced and reads"):
        rg.graft("relu", block)
    assert block._n == 0


def test_a_grafted_blocks_parameter_written_through_data_is_recomputed():
    # Before: the model's weights written through .data were found by content, the grafted block's were not: the
    # cached outputs from the old block weights were handed out again.
    model, block = _chain(), nn.Linear(4, 4)
    rg = torch_ext.ReactiveGraph(model, (_X,))
    names = rg.graft("relu", block)
    last = [n for n in rg._countable if n not in names][-1]
    with torch.no_grad():
        ref = lambda: model[2](block(torch.relu(model[0](_X))))  # noqa: E731
        assert torch.equal(rg.value(last), ref())
        block.weight.data.mul_(2)
        assert torch.equal(rg.value(last), ref())
        block.bias.numpy()[:] = 0.5
        assert torch.equal(rg.value(last), ref())


def test_run_after_grafting_blocks_with_parameters_matches_eager_on_every_shape():
    # Before: the blocks' parameters became placeholders of the graph and run() did not hand them in
    # ("run: expected 7 inputs, got 5"): a graft of any block with parameters ended the graph's run().
    model = _chain()
    torch.manual_seed(1)
    first, second = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # parameters of the same shapes
    rg = torch_ext.ReactiveGraph(model, (_X,))
    rg.graft("relu", first)
    rg.graft("relu", second)  # after relu, for every consumer: before `first`

    def eager(x):
        return model[2](first(second(torch.relu(model[0](x)))))

    with torch.no_grad():
        for x in (_X, torch.randn(3, 4), torch.randn(5, 4), _X):
            assert torch.equal(rg.run(x), eager(x))
        first.weight.mul_(2)
        assert torch.equal(rg.run(_X), eager(_X))
        result = torch_ext.sweep(rg, ["relu"], lambda v, site: v * 0, lambda out: out.sum().item())
        assert result.metrics["relu"] == eager_from_relu(model, first, second, torch.zeros(3, 4))


def eager_from_relu(model, first, second, h):
    return model[2](first(second(h))).sum().item()


class _Shift(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.inner = nn.Module()
        self.inner.register_buffer("shift", torch.ones(4, device=device))
        self.offset = torch.zeros(4)

    def forward(self, v):
        return v + self.inner.shift + self.offset


@pytest.mark.parametrize("make, culprit", [(lambda: nn.Linear(4, 4, device="meta"), "weight"),
                                          (lambda: _Shift("meta"), "inner.shift")])
def test_a_block_on_another_device_is_refused_by_name_and_changes_nothing(make, culprit):
    # Before: its export failed with "Unhandled FakeTensor Device Propagation for aten.mm.default, found two
    # different devices cpu, meta", naming neither the graft nor the tensor.
    model = _chain()
    rg = torch_ext.ReactiveGraph(model, (_X,))
    before = (str(rg), rg.nodes(), dict(rg.stats), rg.demand().clone())
    with pytest.raises(ValueError, match=rf"graft after 'relu': the block's tensor '{culprit}' is on meta, the value "
                                         r"it is grafted after on cpu: move the block there first"):
        rg.graft("relu", make())
    assert (str(rg), rg.nodes(), dict(rg.stats)) == before[:3]
    assert torch.equal(rg.demand(), before[3])
    shift = _Shift("cpu")
    rg.graft("relu", shift)  # the same block on the graph's device is taken
    with torch.no_grad():
        assert torch.equal(rg.demand(), model[2](shift(torch.relu(model[0](_X)))))
    rg.check_invariants()


@pytest.mark.parametrize("kind", ["registered", "removed"])
def test_a_grafted_blocks_hook_changed_after_the_graft_is_refused(kind):
    # Before: the block's hooks were exported with it and never looked at again: a hook registered on the block
    # after the graft acted in eager and not in the graph (and one removed still acted in it), silently for
    # demand() and value(); run() on another shape failed replaying the graft ("produced nodes [...], not [...]").
    model, block = _chain(), nn.Linear(4, 4)
    traced = block.register_forward_hook(lambda m, a, out: out * 3) if kind == "removed" else None
    rg = torch_ext.ReactiveGraph(model, (_X,))
    rg.graft("relu", block)

    def eager(x):
        with torch.no_grad():
            return model[2](block(torch.relu(model[0](x))))

    assert torch.equal(rg.demand(), eager(_X))
    if kind == "registered":
        handle = block.register_forward_hook(lambda m, a, out: out * 2)
        message = r"block \(Linear\) has a hook registered \(register_forward_hook\) after it was grafted"
    else:
        traced.remove()
        message = r"a hook on the block \(Linear\) \(register_forward_hook\) was removed after it was grafted"
    last = rg.nodes("linear_1")[0]
    for where, call in (("demand", rg.demand), ("value", lambda: rg.value(last)), ("run", lambda: rg.run(_X)),
                        ("run", lambda: rg.run(torch.randn(5, 4)))):
        with pytest.raises(ValueError, match=rf"{where}: the block grafted after 'relu' \(Linear\) changed: "
                                             rf"(the )?{message}"):
            call()
    if kind == "registered":
        handle.remove()  # changed back: the graph is right again
        x5 = torch.randn(5, 4)
        assert torch.equal(rg.run(x5), eager(x5))
        assert torch.equal(rg.run(_X), eager(_X))


@pytest.mark.parametrize("first", ["edge", "node"])
def test_a_second_graft_on_a_grafted_edge_says_so_and_names_the_edge_to_graft_onto(first):
    """The edge relu -> linear_1 is gone once grafted (linear_1 reads the block's output): a second graft on it
    was refused with "no edge relu -> linear_1 (linear_1 does not read relu)", which hid why. It is refused,
    naming the edge to graft onto instead, and changes nothing; grafting there stacks the second block after
    the first, as eager does."""
    model = _chain()
    rg = torch_ext.ReactiveGraph(model, (_X,))
    names = rg.graft("relu", "linear_1", lambda t: t * 2) if first == "edge" else rg.graft("relu", lambda t: t * 2)
    out = names[-1]
    text, stats = str(rg), rg.stats
    with pytest.raises(ValueError, match=rf"graft relu -> linear_1: .* already grafted, so 'linear_1' reads the "
                                         rf"block's output '{out}' now, not 'relu'; .* graft onto the edge '{out}' -> "
                                         r"'linear_1'"):
        rg.graft("relu", "linear_1", lambda t: t + 1)
    assert str(rg) == text and rg.stats == stats
    rg.graft(out, "linear_1", lambda t: t + 1)
    with torch.no_grad():
        assert torch.equal(rg.demand(), model[2](torch.relu(model[0](_X)) * 2 + 1))


class _RMSNorm(nn.Module):
    """Llama's RMSNorm: casts its input to float32 first, which on a float32 stream is the tensor itself."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class _PreNormLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = _RMSNorm(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        residual = x
        return residual + self.proj(self.norm(x))


def _with_pre_hook(module, fn, model, x):
    handle = module.register_forward_pre_hook(lambda m, args: (fn(args[0]),))
    try:
        with torch.no_grad():
            return model(x)
    finally:
        handle.remove()


def test_an_edge_graft_into_a_norm_that_casts_to_its_own_dtype_leaves_the_residual_stream_alone():
    # Before: the norm's `x.to(torch.float32)` on a float32 stream returns x itself, so the trace gave the layer's
    # residual add the cast's node to read; a graft on the edge (layer input -> norm), path patching into the
    # sublayer only, reached the residual stream too, silently (logits off eager by ~1 here).
    torch.manual_seed(0)
    model = nn.Sequential(_PreNormLayer(8), _PreNormLayer(8)).eval()
    x = torch.randn(2, 3, 8)
    delta = torch.randn(8)
    rg = torch_ext.ReactiveGraph(model, (x,))
    norm_in = rg.nodes("1.norm*")[0]
    resid = next(a for n in rg.graph.nodes() if n.name == norm_in for a in torch_ext.reactive._node_inputs(n))
    rg.graft(resid, norm_in, lambda t: t + delta)
    expected = _with_pre_hook(model[1].norm, lambda t: t + delta, model, x)
    assert torch.equal(rg.demand(), expected)
    x2 = torch.randn(1, 5, 8)  # another shape's graph replays the graft on the same edge
    assert torch.equal(rg.run(x2), _with_pre_hook(model[1].norm, lambda t: t + delta, model, x2))


def test_path_patching_a_head_into_a_later_llama_layers_attention_only_matches_two_pass_eager():
    # Sender: layer 0 head 1's corrupted output, added to layer 2's attention input only (input_layernorm), as a
    # two-pass eager path patch does. The residual stream of layer 2 must keep the clean value.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    clean = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 7) % 64
    rg = torch_ext.ReactiveGraph(model, (clean,))
    z_corrupted = rg.run_with_cache(corrupted)[1]["blocks.0.attn.hook_z"][:, :, 1].clone()
    z_clean = rg.run_with_cache(clean)[1]["blocks.0.attn.hook_z"][:, :, 1].clone()
    w_o = model.model.layers[0].self_attn.o_proj.weight[:, 8:16]
    with torch.no_grad():
        delta = (z_corrupted - z_clean) @ w_o.T
    resid = rg.resolve("blocks.2.hook_resid_pre")
    norm = set(rg.nodes("model.layers.2.input_layernorm*"))
    into_norm = [n.name for n in rg.graph.nodes() if n.name in norm and resid in torch_ext.reactive._node_inputs(n)]
    assert len(into_norm) == 1
    rg.graft(resid, into_norm[0], lambda t: t + delta)
    got = rg.demand().logits
    expected = _with_pre_hook(model.model.layers[2].input_layernorm, lambda t: t + delta, model, clean).logits
    assert torch.equal(got, expected)
