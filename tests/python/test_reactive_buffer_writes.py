"""A forward that writes a buffer a later call's output reads (a call counter in the computation, a running average
returned, a KV cache): eager's second call differs from its first, and the reactive graph, which never writes the
module's buffers, kept answering eager's first call forever. Refused at build, naming the buffer and its module.
A buffer written and never read back into an output (BatchNorm's running statistics in training mode, a counter
nothing reads) is accepted, and left unwritten."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

import torch_ext
from torch_ext import patching


class Counted(nn.Module):
    """Scales by the number of calls so far."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.fc(x) * self.calls


class Ema(nn.Module):
    """Returns a running average of its input, updated in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        self.avg.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x + self.avg


class KvCache(nn.Module):
    """Attends over a rolling cache of past inputs, rebound each call (same shape)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x):
        self.cache = torch.cat([self.cache[x.shape[0]:], x], 0)
        return torch.softmax(x @ self.cache.T, -1) @ self.cache


class Chained(nn.Module):
    """``a`` is written and feeds the write of ``b``, which the output reads: ``a``'s value reaches the output
    two calls later."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.ones(8))
        self.register_buffer("b", torch.zeros(8))

    def forward(self, x):
        out = x + self.b
        self.b.copy_(self.a * 2)
        self.a.add_(x.mean(0))
        return out


class Blocks(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Identity(), inner])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("make,buffer,module", [
    (lambda: Counted().train(), "calls", "'<root>' (Counted)"),
    (lambda: Ema(), "avg", "'<root>' (Ema)"),
    (lambda: KvCache(), "cache", "'<root>' (KvCache)"),
    (lambda: Blocks(Counted().train()), "calls", "'blocks.1' (Counted)"),
], ids=["counter", "ema", "kv-cache", "nested"])
def test_state_read_back_is_refused_by_name(make, buffer, module):
    torch.manual_seed(0)
    model, x = make(), torch.randn(2, 8)
    first, second = model(x).detach(), model(x).detach()
    assert not torch.equal(first, second)  # eager's answer moves with the state
    before = _state(model)
    with pytest.raises(ValueError, match=rf"forward writes buffer '{buffer}' of module {re.escape(module)}.*later call's output "
                                         r"reads the written value.*Make the state an input of forward.*\.eval\(\)"):
        torch_ext.ReactiveGraph(model, (x,))
    after = _state(model)  # refused: the model is left as it was
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_buffer_that_feeds_a_read_back_buffer_is_named_too():
    model, x = Chained(), torch.randn(2, 8)
    outs = [model(x) for _ in range(3)]
    assert torch.equal(outs[0], x) and torch.equal(outs[1], x + 2) and not torch.equal(outs[2], outs[1])
    with pytest.raises(ValueError, match=r"buffer '(a|b)' of module '<root>' \(Chained\) \(and 1 more: (a|b)\)"):
        torch_ext.ReactiveGraph(Chained(), (x,))


def test_a_mode_that_does_not_write_is_accepted():
    torch.manual_seed(0)
    model, x = Counted(), torch.randn(2, 8)
    model(x)  # calls = 1
    model.eval()
    rg = torch_ext.ReactiveGraph(model, (x,))
    with torch.no_grad():
        assert torch.equal(rg.run(x), model(x))
        assert torch.equal(rg.run(x), model(x))


class WriteOnly(nn.Module):
    """Counts its calls and keeps its last input's mean, reads neither; a train-mode BatchNorm too."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("last_mean", torch.zeros(8))

    def forward(self, x):
        self.seen += 1
        self.last_mean.copy_(x.mean(0))
        return self.bn(self.fc(x))


def test_write_only_buffers_are_accepted_and_left_unwritten():
    torch.manual_seed(0)
    model, x = WriteOnly().train(), torch.randn(4, 8)
    before = _state(model)
    rg = torch_ext.ReactiveGraph(model, (x,))
    out = rg.run(x)
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(out, model(x))  # eager updates its buffers; its output reads none of them
        assert torch.equal(rg.run(x), model(x))


class TokenCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.unembed = nn.Embedding(11, 8), nn.Linear(8, 11)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens):
        self.calls += 1
        return self.unembed(self.embed(tokens) * self.calls)


def test_patching_refuses_state_read_back():
    model, tokens = TokenCounter().eval(), torch.randint(0, 11, (2, 5))
    with pytest.raises(ValueError, match=r"forward writes buffer 'calls' of module '<root>' \(TokenCounter\)"):
        patching.run_with_cache(model, tokens)


def test_train_mode_instance_norm_with_running_stats_leaves_them_unwritten():
    """aten::instance_norm with use_input_stats and running statistics writes them in place although its schema
    declares no mutation: every build, run and demand wrote the module's buffers. The output does not read them
    in that mode; it stays eager's, bit for bit."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv1d(3, 4, 3), nn.InstanceNorm1d(4, track_running_stats=True, affine=True), nn.ReLU()).train()
    with torch.no_grad():
        m[1].running_mean.uniform_()
        m[1].running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 10)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    expected = copy.deepcopy(m)(x)
    rg = torch_ext.ReactiveGraph(m, (x,), cache=False)
    out = rg.run(x)
    conv = rg.nodes()[0]
    rg.patch(conv, rg.value(conv) * 2)
    patched = rg.demand()
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert torch.equal(out, expected)
    m2 = copy.deepcopy(m)  # eager writes its copy's statistics
    with torch.no_grad():
        assert torch.equal(patched, m2[2](m2[1](m2[0](x) * 2)))
    # A program the user passes is not changed by the rewrite.
    ep = torch.export.export(copy.deepcopy(m), (x,))
    text = str(ep.graph)
    torch_ext.ReactiveGraph(ep, (x,), cache=False)
    assert str(ep.graph) == text


def test_spectral_norm_in_training_mode_is_refused_by_name_and_accepted_in_eval():
    # spectral_norm's training forward runs its power iteration under torch.no_grad(), writing the new vectors
    # into its _u and _v buffers with out= (F.normalize(..., out=self._u)), and the next call's weight reads them.
    # Export keeps that block as a region functionalization does not reach: the build failed inside the engine
    # ("node %clamp_min_ (aten::clamp_min_.default) mutates its inputs; cached values need a functional graph").
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    model = nn.Sequential(spectral_norm(nn.Linear(8, 8)), nn.ReLU())
    x = torch.randn(2, 5, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"ReactiveGraph: forward writes in place \(aten::clamp_min_\) inside a "
                                         r"torch.no_grad\(\) block of module '0.parametrizations.weight.0' "
                                         r"\(_SpectralNorm\).*model.eval\(\)"):
        torch_ext.ReactiveGraph(model.train(), (x,), cache=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    rg = torch_ext.ReactiveGraph(model.eval(), (x,), cache=False)
    with torch.no_grad():
        assert torch.equal(rg.run(x), model(x))
