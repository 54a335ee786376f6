"""bfloat16 autocast in the pure step, bit-exact with the eager loop (fuzz_step seeds 18-21):

- eager's autocast weight cache (``at::autocast::cached_cast``): inside one outermost autocast region a parameter is
  cast to bfloat16 once, and every later use reads that copy, so a layer applied twice (or a weight shared by two
  layers) has its uses' gradients added in bfloat16 before one cast back. The trace cast at each use and added
  float32 gradients: momentum buffers 1e-4 off eager after 3 SGD steps (``--case 20:28``, ``20:52``, ``21:12``);
- a ``torch.no_grad()`` block inside the autocast region: torch 2.9's export dropped its grad mode, and the step
  trained a parameter read only there (``--case 18:165``).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

from helpers import eager_step

BF16 = torch.bfloat16


def _autocast(**kw):
    return torch.autocast("cpu", dtype=BF16, **kw)


def _train_both(model, forward, runner="executor", steps=3, lr=0.1):
    """Trains ``steps`` SGD (momentum) steps of the loss ``forward(model, x)`` against a target, through the step
    and eagerly; every loss, parameter and momentum buffer must be equal. Returns the step."""
    def loss_fn(m, x, y):
        return F.mse_loss(forward(m, x).float(), y)

    torch.manual_seed(0)
    ref = copy.deepcopy(model)

    def make_opt(m):
        return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr, momentum=0.9)

    opt, ref_opt = make_opt(model), make_opt(ref)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(steps)]
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    run = step if runner == "executor" else step.compile(plan=True)
    state = step.init_state()
    losses = []
    for b in batches:
        loss, state = run(state, *b)
        losses.append(loss)
    for i, b in enumerate(batches):
        ref_loss = eager_step(ref, ref_opt, loss_fn, *b)
        assert torch.equal(losses[i], ref_loss.detach()), (i, losses[i].item(), ref_loss.item())
    step.write_back(state)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), (n, float((p - q).abs().max()))
        buf = ref_opt.state.get(q, {}).get("momentum_buffer")
        got = opt.state.get(p, {}).get("momentum_buffer")
        assert (buf is None) == (got is None), n
        if buf is not None:
            assert torch.equal(got, buf), (n, float((got - buf).abs().max()))
    return step


def _casts_of(step, name: str) -> int:
    """How many casts of parameter ``name`` the step's forward program makes (autocast's traced out with an
    empty decomposition table)."""
    ep = step._forward_program.run_decompositions({})
    ph = next(s.arg.name for s in ep.graph_signature.input_specs if s.target == f"model.{name}")
    return sum(1 for n in ep.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default
               and n.args[0].name == ph)


class Twice(nn.Module):  # one Linear applied twice (ALBERT's shared layers)
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(F.elu(self.fc(torch.relu(self.fc(x)))))


@pytest.mark.parametrize("runner", ["executor", "planned"])
def test_a_layer_applied_twice_under_autocast_trains_bit_exact(runner):
    step = _train_both(Twice(), lambda m, x: _autocast_call(m, x), runner)
    assert _casts_of(step, "fc.weight") == 1 and _casts_of(step, "fc.bias") == 1


def _autocast_call(m, x):
    with _autocast():
        return m(x)


def test_a_weight_shared_by_two_layers_under_autocast_trains_bit_exact():
    model = Twice()
    model.head.weight = model.fc.weight  # tied: one Parameter, one cached cast in eager
    _train_both(model, _autocast_call)


def test_a_frozen_layer_applied_twice_under_autocast_trains_bit_exact():
    model = Twice()
    model.fc.requires_grad_(False)  # eager casts it anew at each use (not cached): same values, no gradient
    _train_both(model, _autocast_call)


def test_two_autocast_regions_cast_the_weight_once_each():
    # eager clears the cache where the outermost region exits: two casts, their gradients added in float32
    def forward(m, x):
        with _autocast():
            h = torch.relu(m.fc(x))
        with _autocast():
            return m.head(m.fc(h.float()))

    step = _train_both(Twice(), forward)
    assert _casts_of(step, "fc.weight") == 2


def test_a_nested_autocast_region_shares_the_outer_regions_cast():
    # nested regions clear nothing; a region with autocast off in between computes in float32 from the weight
    def forward(m, x):
        with _autocast():
            h = torch.relu(m.fc(x))
            with _autocast():
                h = m.fc(h)
            with torch.autocast("cpu", enabled=False):
                h = F.linear(h.float(), m.fc.weight) * 0.5
            return m.head(m.fc(h))

    step = _train_both(Twice(), forward)
    assert _casts_of(step, "fc.weight") == 1


def test_explicit_casts_and_cache_disabled_regions_are_not_shared():
    # eager caches only autocast's own casts, and only with cache_enabled: each of these is a cast of its own
    def explicit(m, x):
        with _autocast():
            h = F.linear(x.to(BF16), m.fc.weight.to(BF16))
            return m.head(F.linear(torch.relu(h), m.fc.weight.to(BF16)))

    def uncached(m, x):
        with _autocast(cache_enabled=False):
            return m.head(F.elu(m.fc(torch.relu(m.fc(x)))))

    assert _casts_of(_train_both(Twice(), explicit), "fc.weight") == 2
    assert _casts_of(_train_both(Twice(), uncached), "fc.weight") == 2


def test_a_weight_cast_first_under_no_grad_gives_no_gradient_as_in_eager():
    # eager caches the cast made under no_grad (detached) and serves it to the use with grad after it: fc is
    # not trained at all
    def forward(m, x):
        with _autocast():
            with torch.no_grad():
                t = m.fc(x)
            return m.head(m.fc(x + t.float()))

    model = Twice()
    before = model.fc.weight.detach().clone()
    _train_both(model, forward)
    assert torch.equal(model.fc.weight, before)


class Gated(nn.Module):  # a parameter read only under no_grad inside the autocast region
    def __init__(self):
        super().__init__()
        self.fc, self.pooler = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            s = self.pooler.weight.abs().mean() + 0.5
        return y * s


def test_no_grad_inside_autocast_gives_no_gradient():
    model = Gated()
    before = model.pooler.weight.detach().clone()
    _train_both(model, _autocast_call)
    assert torch.equal(model.pooler.weight, before)  # eager never updates it


class Rotary(nn.Module):  # Hugging Face's rotary embedding: @torch.no_grad(), its own autocast off, a buffer
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    @torch.no_grad()
    def rope(self, x):
        pos = torch.arange(x.shape[0], dtype=torch.float32)[:, None]
        with torch.autocast("cpu", enabled=False):
            freqs = pos * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype)

    def forward(self, x):
        h = self.fc(x)
        return self.out(h * self.rope(h))


def test_a_rotary_embedding_under_no_grad_inside_autocast_trains_bit_exact():
    _train_both(Rotary(), _autocast_call)


class Decorated(Twice):  # an autocast decorator, made when the class is defined (outside any trace)
    @torch.autocast("cpu", dtype=BF16)
    def forward(self, x):
        return super().forward(x)


class DecoratedUncached(Twice):
    @torch.autocast("cpu", dtype=BF16, cache_enabled=False)
    def forward(self, x):
        return super().forward(x)


def test_an_autocast_decorator_shares_the_cast_as_in_eager():
    step = _train_both(Decorated(), lambda m, x: m(x))
    assert _casts_of(step, "fc.weight") == 1
    step = _train_both(DecoratedUncached(), lambda m, x: m(x))  # its flag was set where it was made
    assert _casts_of(step, "fc.weight") == 2


class Recurrent(nn.Module):  # GRU / LSTM: their decomposition casts the recurrent weights at every time step
    def __init__(self, kind, **kw):
        super().__init__()
        # (a bfloat16 input: eager's oneDNN LSTM under autocast fails on a float32 one, and so does the step)
        self.inp = nn.Linear(8, 8)
        self.rnn = getattr(nn, kind)(4, 4, batch_first=True, **kw)
        self.head = nn.Linear(8 * (2 if kw.get("bidirectional") else 1), 8)

    def forward(self, x):
        out, _ = self.rnn(self.inp(x).view(4, 2, 4))
        return self.head(out.reshape(4, -1))


@pytest.mark.parametrize("kind, kw", [("GRU", {}), ("LSTM", {}), ("GRU", {"num_layers": 2, "bidirectional": True}),
                                      ("LSTM", {"num_layers": 2, "bidirectional": True})],
                         ids=["gru", "lstm", "gru-2-bi", "lstm-2-bi"])
def test_a_recurrent_layer_under_autocast_trains_bit_exact(kind, kw):
    # eager casts weight_hh / bias_hh once (cached) and sums their per-step gradients in bfloat16 (--case 22:140)
    _train_both(Recurrent(kind, **kw), _autocast_call)


_MIX_LIB = None


def _mix_op():
    """A composite custom op that casts its weight (``mm`` under autocast) and reads it uncast (``w.sum()``)."""
    global _MIX_LIB
    if _MIX_LIB is None:
        _MIX_LIB = torch.library.Library("torch_ext_autocast_test", "DEF")
        _MIX_LIB.define("mix(Tensor x, Tensor w) -> Tensor")
        _MIX_LIB.impl("mix", lambda x, w: torch.mm(x, w) + w.sum() * 0.01, "CompositeImplicitAutograd")
    return torch.ops.torch_ext_autocast_test.mix


class CastAndReadUncast(nn.Module):
    def __init__(self, cache_enabled=True):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.cache_enabled = cache_enabled

    def forward(self, x):
        with _autocast(cache_enabled=self.cache_enabled):
            return torch.mm(_mix_op()(x, self.w), self.w)


def test_an_op_that_casts_a_weight_and_reads_it_uncast_is_refused_where_eager_shares_the_cast():
    # Eager serves the composite's cast of w from the cache, shared with the outer mm's: one bf16 copy, the
    # gradients of both casts added in bf16. The step kept a cast of its own inside the op (its uncast read stays
    # uncast) and trained 1e-5 off eager in 3 steps, silently.
    model = CastAndReadUncast()
    with pytest.raises(NotImplementedError, match=r"parameter 'model.w' inside torch_ext_autocast_test.mix.default, "
                                                  r"which also reads it uncast.*cache_enabled=False"):
        _train_both(model, lambda m, x: m(x), lr=1e-3)
    # What the refusal advises trains bit-exact: with the cache off eager casts at each use, as the step does.
    _train_both(CastAndReadUncast(cache_enabled=False), lambda m, x: m(x), lr=1e-3)


# torch.cond inside an autocast region. Eager runs the taken branch below autograd (CondAutogradOp), so a weight
# cast there enters the cache without a gradient, and later casts of it outside the cond in the region read that
# copy: no gradient through them (fc moved 3e-2 off eager in 3 steps in the step, which gave them one). The branch's
# own gradient is traced apart, a cast per use, float32 sums. _train_both's batches: x.sum() is -11.1, -7.6, 5.4 and
# x[0, 0] -1.53, -0.03, 0.71, so each predicate below takes both branches within the 3 steps.
def _bf16_twice(t, fc):
    return t.to(BF16) * 2


def _cond_forwards():
    def true_branch_casts(m, x):
        with _autocast():
            h = torch.cond(x.sum() > -9, lambda t: torch.relu(m.fc(t)), lambda t: _bf16_twice(t, m.fc), (x,))
            return m.head(m.fc(h))

    def false_branch_casts(m, x):
        with _autocast():
            h = torch.cond(x.sum() > -9, lambda t: _bf16_twice(t, m.fc), lambda t: torch.relu(m.fc(t)), (x,))
            return m.head(m.fc(h))

    def both_branches_cast(m, x):  # always without a gradient after the cond, two later uses sharing that copy
        with _autocast():
            h = torch.cond(x.sum() > 0, lambda t: torch.relu(m.fc(t)), lambda t: torch.tanh(m.fc(t)), (x,))
            return m.head(m.fc(F.elu(m.fc(h))))

    def two_conds(m, x):  # the later use has no gradient where either taken branch cast fc: T, F, T here
        with _autocast():
            h = torch.cond(x.sum() > 0, lambda t: torch.relu(m.fc(t)), lambda t: _bf16_twice(t, m.fc), (x,))
            h = torch.cond(x[0, 0] > -1, lambda t: t * 3, lambda t: torch.relu(m.fc(t)), (h,))
            return m.head(m.fc(h))

    return {f.__name__: f for f in (true_branch_casts, false_branch_casts, both_branches_cast, two_conds)}


@pytest.mark.parametrize("name", sorted(_cond_forwards()))
def test_a_weight_cast_in_a_cond_branch_gives_later_casts_in_the_region_no_gradient_as_in_eager(name):
    _train_both(Twice(), _cond_forwards()[name])


def test_a_weight_cast_in_a_cond_branch_then_outside_trains_bit_exact_planned():
    _train_both(Twice(), _cond_forwards()["two_conds"], runner="planned")


def test_casts_in_a_cond_branch_alone_or_after_a_cast_outside_train_bit_exact():
    # a weight read twice in a branch: eager's branch gradient is traced with a cast per use, as the step's; a cast
    # outside first is cached with its gradient and only lends its values to the branch
    def twice_in_branch(m, x):
        with _autocast():
            h = torch.cond(x.sum() > -9, lambda t: m.fc(torch.relu(m.fc(t))), lambda t: torch.sigmoid(m.fc(t)), (x,))
            return m.head(h)

    def outside_first(m, x):
        with _autocast():
            h = m.fc(torch.relu(m.fc(x)))
            h = torch.cond(h.sum() > 0, lambda t: m.fc(t), lambda t: t * 2, (h,))
            return m.head(m.fc(h))

    _train_both(Twice(), twice_in_branch)
    _train_both(Twice(), outside_first)


def test_a_cond_branch_with_its_own_autocast_region_is_refused_where_a_later_cast_would_read_its_copy():
    def forward(m, x, cache_enabled=True):
        def branch(t):
            with torch.autocast("cpu", enabled=False):
                t = m.fc(t)
            return torch.relu(m.fc(t))

        with _autocast(cache_enabled=cache_enabled):
            h = torch.cond(x.sum() > -9, branch, lambda t: _bf16_twice(t, m.fc), (x,))
            return m.head(m.fc(h))

    with pytest.raises(ValueError, match=r"parameter 'model.fc.(weight|bias)' is cast by autocast inside a branch of "
                                         r"the torch.cond in loss_fn.*cache_enabled=False"):
        _train_both(Twice(), forward)
    _train_both(Twice(), lambda m, x: forward(m, x, cache_enabled=False))  # what the refusal advises
