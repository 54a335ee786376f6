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


def not_a_factory():
    return 42
