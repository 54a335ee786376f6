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
