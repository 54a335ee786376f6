"""Small MODEL factories for the CLI tests: (model, optimizer, loss_fn, example_batch[, batches])."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(6)]
    return model, opt, lambda m, x, y: F.cross_entropy(m(x), y), batches[0], batches


def nan_loss():
    model, opt, _, batch, batches = mlp()
    return model, opt, lambda m, x, y: F.cross_entropy(m(x), y) * float("nan"), batch, batches


def nan_weights():
    """Every loss finite, the weights NaN after the first update (a NaN learning rate)."""
    model, _, loss_fn, batch, batches = mlp()
    return model, torch.optim.SGD(model.parameters(), lr=float("nan")), loss_fn, batch, batches


def causal_mask_buffer():
    """A buffer that is non-finite from the start (a -inf attention mask): no failure of its own."""
    model, opt, _, batch, batches = mlp()
    model.register_buffer("mask", torch.tensor([0.0, float("-inf"), 0.0]))
    return model, opt, lambda m, x, y: F.cross_entropy(m(x) + m.mask.clamp(min=-1e4), y), batch, batches


def not_a_factory():
    return 42


class _Seq(nn.Module):
    """[batch, position] tokens -> [batch, position, vocab] logits, optionally as a dict."""

    def __init__(self, as_dict=False):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 16)
        self.as_dict = as_dict

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.mlp(h)
        logits = self.head(h)
        return {"logits": logits, "hidden": h} if self.as_dict else logits


def _seq(as_dict):
    torch.manual_seed(0)
    model = _Seq(as_dict)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 16, (2, 5), generator=g)

    def loss_fn(m, x, y):
        out = m(x)
        logits = out["logits"] if as_dict else out
        return F.cross_entropy(logits.reshape(-1, 16), y.reshape(-1))

    return model, opt, loss_fn, (idx, idx.roll(-1, dims=1))


def seq():
    return _seq(False)


def seq_dict():
    return _seq(True)


def three_items():
    model, opt, loss_fn, batch, _ = mlp()
    return model, opt, loss_fn


def raises():
    raise RuntimeError("the factory broke")
