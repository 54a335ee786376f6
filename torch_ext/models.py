"""Built-in models used by `torch-ext demo`, the tests and the benchmarks (no files, no network)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-2-shaped decoder: token + position embeddings, pre-LN blocks, tied unembedding."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_heads: int = 4, n_layers: int = 2, seq: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) / math.sqrt(d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads, 4 * d_model) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.seq = seq
        self.vocab = vocab

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.t()


def tiny_transformer_example(batch: int = 4, seed: int = 0):
    """(model, example_inputs) for the built-in default."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    idx = torch.randint(0, model.vocab, (batch, model.seq))
    return model, (idx,)


def relu_mlp(width: int = 1024, depth: int = 8, seed: int = 0) -> nn.Sequential:
    """``depth`` Linear(width, width) layers with a ReLU between each two (the parameter-heavy memory
    benchmark's model), initialised from ``seed``."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])
