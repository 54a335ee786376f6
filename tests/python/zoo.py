"""Model zoo for the foundation tests: each entry builds (model, example_inputs).

Every builder is deterministic given the global torch seed (conftest seeds before each
test) and small enough that exporting and running it takes well under a second on CPU.

``ZOO`` maps a family name to a :class:`ZooEntry`. ``joint=True`` marks entries whose
model returns a scalar loss as output 0, meant for ``torch_ext._compat.export_joint``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------- MLP
class MLP(nn.Module):
    def __init__(self, sizes=(32, 64, 64, 10)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x


def mlp():
    return MLP(), (torch.randn(8, 32),)


# ---------------------------------------------------------------- CNN + BatchNorm
class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def _randomize_bn_stats(model: nn.Module) -> None:
    # Non-trivial running statistics so eval-mode BN is not an identity-like op.
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)


def cnn_bn_eval():
    m = ConvBN()
    _randomize_bn_stats(m)
    return m.eval(), (torch.randn(2, 3, 16, 16),)


def cnn_bn_train():
    # Train mode: the exported program updates bn*.running_mean/var and num_batches_tracked.
    m = ConvBN()
    _randomize_bn_stats(m)
    return m.train(), (torch.randn(4, 3, 16, 16),)


# ---------------------------------------------------------------- transformer block
class TransformerBlock(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, 4 * dim)
        self.ff2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


def transformer_block():
    return TransformerBlock(), (torch.randn(2, 10, 32),)


# ---------------------------------------------------------------- tied embedding
class TiedLM(nn.Module):
    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens):
        return self.head(self.ln(self.emb(tokens)))


def tied_embedding():
    return TiedLM(), (torch.randint(0, 50, (3, 7)),)


def tiny_transformer():
    """torch_ext.models.TinyTransformer: position-embedding slice, tied unembedding via ``@ weight.t()``."""
    from torch_ext.models import TinyTransformer

    m = TinyTransformer()
    return m.eval(), (torch.randint(0, m.vocab, (2, m.seq)),)


# ---------------------------------------------------------------- recurrent
class LSTMModel(nn.Module):
    """nn.LSTM with explicit (h0, c0): exports to aten::lstm.input."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.out = nn.Linear(12, 4)

    def forward(self, x, h0, c0):
        y, (h, c) = self.lstm(x, (h0, c0))
        return self.out(y[:, -1]), h, c


def lstm():
    return LSTMModel(), (torch.randn(3, 5, 8), torch.randn(2, 3, 12), torch.randn(2, 3, 12))


class GRUModel(nn.Module):
    """nn.GRU without an initial state: nn.GRU builds h0 with torch.zeros(..., dtype=...)."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 12, batch_first=True)

    def forward(self, x):
        y, h = self.gru(x)
        return y, h


def gru():
    return GRUModel(), (torch.randn(3, 5, 8),)


# ---------------------------------------------------------------- multi-output ops
class MultiOutput(nn.Module):
    def forward(self, x):
        a, b, c = torch.split(x, [2, 3, 3], dim=1)
        vals, idx = torch.topk(x, 3, dim=1)
        mx, amx = torch.max(x, dim=0)
        mn, amn = x.min(dim=1, keepdim=True)
        parts = x.chunk(2, dim=0)
        return a * 2, b.sum(1), c, vals, idx, mx, amx, mn, amn, parts[1]


def multi_output():
    return MultiOutput(), (torch.randn(6, 8),)


# ---------------------------------------------------------------- integer and shape arithmetic
class IntShape(nn.Module):
    """Integer tensors and shape-derived Python ints (no dtype= arguments; see DtypeArgs)."""

    def forward(self, x, labels):
        n, c = x.shape
        pred = x.argmax(dim=1)                                    # int64 result
        correct = (pred == labels).sum()                          # bool -> int64 reduction
        pos = torch.arange(n) * c + labels                        # shape-derived int64 math
        flat = x.reshape(-1)[pos]                                 # advanced indexing (aten.index)
        picked = torch.gather(x, 1, labels.unsqueeze(1)).squeeze(1)
        onehot = labels.new_zeros((n, c)).scatter_(1, labels.unsqueeze(1), 1)
        buckets = torch.div(labels * 7 + 3, 4, rounding_mode="floor") % c
        hist = onehot.sum(0)
        sel = x.index_select(1, torch.tensor([0, c - 1]))        # lifted constant tensor
        return flat, picked, correct, buckets, hist, sel, labels.cumsum(0), x.size(1) * pred, pred // 2


def int_shape():
    return IntShape(), (torch.randn(6, 5), torch.randint(0, 5, (6,)))


class DtypeArgs(nn.Module):
    """Constant dtype / memory_format arguments (dtype=, .to(dtype), full_like)."""

    def forward(self, x, labels):
        n, c = x.shape
        w = torch.arange(c, dtype=torch.float32)
        onehot = torch.zeros(n, c, dtype=x.dtype).scatter(1, labels.unsqueeze(1), 1.0)
        y = (x * w + onehot).to(torch.float64)
        return y, labels.to(torch.float32), torch.full_like(x, 2.0)


def dtype_args():
    return DtypeArgs(), (torch.randn(6, 5), torch.randint(0, 5, (6,)))


# ---------------------------------------------------------------- joint forward/backward
class LossModel(nn.Module):
    """Returns the scalar loss as output 0, as ``_export_forward_backward`` requires.

    Requirements (torch 2.9, checked in test_zoo): output ``joint_loss_index`` (0 here) must be
    a 0-dim tensor that requires grad; every other output must not require grad (hence the
    ``.detach()``); gradients are taken w.r.t. parameters that require grad.
    """

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(10, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x, target):
        logits = self.l2(torch.tanh(self.l1(x)))
        return F.cross_entropy(logits, target), logits.detach()


def joint_mlp():
    return LossModel(), (torch.randn(6, 10), torch.randint(0, 4, (6,)))


@dataclass(frozen=True)
class ZooEntry:
    build: Callable[[], tuple]
    joint: bool = False
    mutates_buffers: bool = False
    # Why the exported (not decomposed) program can't be compared bit-exactly with ep.module();
    # None means bit-exact. Such entries are compared within atol = rtol = 1e-6.
    inexact: str | None = None


ZOO: dict[str, ZooEntry] = {
    "mlp": ZooEntry(mlp),
    "cnn_bn_eval": ZooEntry(cnn_bn_eval),
    "cnn_bn_train": ZooEntry(cnn_bn_train, mutates_buffers=True),
    "transformer_block": ZooEntry(transformer_block),
    "tied_embedding": ZooEntry(tied_embedding),
    "tiny_transformer": ZooEntry(tiny_transformer),
    "lstm": ZooEntry(lstm),
    "gru": ZooEntry(gru, inexact=(
        "aten::gru.input is CompositeImplicitAutograd; inside it, matmul picks its kernel (fold to mm "
        "or not) from the weights' requires_grad. ep.module() holds nn.Parameters (requires_grad), the "
        "executor and the flat GraphModule inputs hold detached copies, so different kernels run "
        "(max diff ~9e-8). The decomposed program is bit-exact.")),
    "multi_output": ZooEntry(multi_output),
    "int_shape": ZooEntry(int_shape),
    "dtype_args": ZooEntry(dtype_args),
    "joint_mlp": ZooEntry(joint_mlp, joint=True),
}


# ---------------------------------------------------------------- helpers shared by the tests
def make_executor(ep):
    import torch_ext

    return torch_ext.Executor(ep)


def flat_lifted_inputs(graph, state: dict, user_inputs) -> list:
    """Inputs for every placeholder of ``graph`` in order: state tensors (cloned) and user inputs."""
    import torch.utils._pytree as pytree

    flat_user = iter(pytree.tree_leaves((tuple(user_inputs), {})))
    out = []
    for n in graph.nodes():
        if n.kind != "placeholder":
            continue
        if n.role == "input":
            out.append(next(flat_user))
        else:
            out.append(state[n.state_name].detach().clone())
    rest = list(flat_user)
    assert not rest, f"{len(rest)} user inputs left over"
    return out


def assert_bit_exact(actual, expected, what: str = "output", tol: float | None = None) -> None:
    """Same pytree structure and, leaf by leaf, torch.equal tensors (dtype and shape included).

    With ``tol``, floating-point leaves need only agree within atol = rtol = tol.
    """
    import torch.utils._pytree as pytree

    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} != {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{what}[{i}]: expected a tensor, got {type(a).__name__}"
            assert a.dtype == e.dtype and a.shape == e.shape, \
                f"{what}[{i}]: {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}"
            if tol is not None and e.is_floating_point():
                torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m: f"{what}[{i}]: {m}")
                continue
            assert torch.equal(a, e), f"{what}[{i}]: max abs diff {(a.double() - e.double()).abs().max().item()}"
        else:
            assert a == e, f"{what}[{i}]: {a!r} != {e!r}"
