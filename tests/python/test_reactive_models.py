"""Models people sweep, into ReactiveGraph as they are (issue 12): Hugging Face causal LMs and
modules with submodules named after Python keywords."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_ext


def test_submodule_named_after_a_keyword():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            setattr(self, "in", nn.Linear(4, 4))
            self.out = nn.Linear(4, 4)

        def forward(self, x):
            return self.out(torch.relu(getattr(self, "in")(x)))

    m = M().eval()
    x = torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(m, (x,))
    assert torch.equal(rg.demand(), m(x))
    assert hasattr(m, "in") and not hasattr(m, "in_")  # the module is left as it was
    relu = rg.nodes("relu*")[0]
    r = torch_ext.sweep(rg, [relu], lambda v, s: v * 0, lambda o: o.sum(), progress=False, batch_sites=False)
    assert r.metrics[relu] == pytest.approx(float(m.out.bias.sum() * 2), rel=1e-6)


def test_hugging_face_gpt2_sweep_equals_forward_hooks():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    tokens = torch.randint(0, 64, (2, 6))
    rg = torch_ext.ReactiveGraph(model, (tokens,))  # _assert_tensor_metadata and the KV cache handled
    assert torch.equal(rg.demand().logits, model(tokens, use_cache=False).logits)
    assert model.config.use_cache  # restored after export
    # Patch the output of each block's MLP (module path transformer.h.<i>.mlp) at position 3.
    sites = []
    for i in range(2):
        node = [n for n in rg.nodes(f"transformer.h.{i}.mlp*")][-1]
        sites.append((node, i))

    def patch(v, site):
        out = v.clone()
        out[:, 3] = 0
        return out

    metric = lambda out: out.logits[:, -1, 5].sum()  # noqa: E731
    result = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    for (node, i) in sites:
        def hook(mod, inp, out):
            out = out.clone()
            out[:, 3] = 0
            return out

        h = model.transformer.h[i].mlp.register_forward_hook(hook)
        try:
            ref = float(metric(model(tokens, use_cache=False)))
        finally:
            h.remove()
        assert result.metrics[(node, i)] == pytest.approx(ref, rel=1e-5, abs=1e-5)
