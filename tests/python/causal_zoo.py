"""A causal transformer zoo for token-granular cones (tests/python/test_reactive_positions.py).

``LM(kind)``: pre-LN GPT-style blocks whose attention is
  'sdpa'    scaled_dot_product_attention(is_causal=True),
  'mask'    an explicit mask built in forward: (q k^T).masked_fill(ones(T, T).tril() == 0, -inf),
  'rope'    rotary position embeddings on q and k, then causal SDPA (no learned positions),
  'encoder' non-causal SDPA (every position reads every position: the analysis must fall back).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("sdpa", "mask", "rope", "encoder")


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kind: str):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.heads = heads
        self.kind = kind

    def forward(self, x):
        b, t, d = x.shape
        h, dh = self.heads, d // self.heads
        q, k, v = (z.view(b, t, h, dh).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        if self.kind == "rope":
            pos = torch.arange(t, dtype=torch.float32)
            inv = 1.0 / (10000 ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
            ang = pos[:, None] * inv[None, :]
            cos = torch.cat([ang.cos(), ang.cos()], -1)
            sin = torch.cat([ang.sin(), ang.sin()], -1)

            def rotate(z):
                lo, hi = z[..., : dh // 2], z[..., dh // 2:]
                return z * cos + torch.cat([-hi, lo], -1) * sin

            q, k = rotate(q), rotate(k)
        if self.kind == "mask":
            att = (q @ k.transpose(-2, -1)) * (dh ** -0.5)
            att = att.masked_fill(torch.ones(t, t).tril() == 0, float("-inf")).softmax(-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.kind != "encoder")
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kind: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, kind)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, kind: str = "sdpa", vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 8):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads, kind) for _ in range(layers)])
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        if self.kind != "rope":
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.lnf(x))


def resid_sites(rg, layers: int = 2) -> list[str]:
    """The residual stream entering each block (resid_pre of every layer) and the final one."""
    from torch_ext.reactive import _node_inputs

    first_ln = rg.nodes("blocks.0.ln1")[0]
    return [_node_inputs(rg.graph.node(first_ln))[0]] + [rg.nodes(f"blocks.{i}")[-1] for i in range(layers)]
