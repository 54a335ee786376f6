"""Small models, patch functions and checks that several test files share."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext


class ResidTanh(nn.Module):
    """x + tanh(fc(x)), ``layers`` times on width 8 (seeded): a residual stream with one site per layer."""

    def __init__(self, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        for fc in self.fc:
            x = x + torch.tanh(fc(x))
        return x


def position_patch(fill: float):
    """patch(value, (node, pos)): the value with row ``pos`` of dim 1 set to ``fill``."""

    def patch(value, site):
        out = value.clone()
        out[:, site[1]] = fill
        return out

    return patch


def sum_metric(out):
    return out.sum()


def assert_verifier_and_executor_refuse(text: str, pattern: str):
    """verify() lists the problem; the Executor verifies first, so it is not built either."""
    g = torch_ext.ir.Graph.parse(text)
    with pytest.raises(RuntimeError, match=r"IR verification failed(.|\n)*" + pattern):
        g.verify()
    with pytest.raises(RuntimeError, match=pattern):
        torch_ext.Executor(g)
    return g


def eager_step(model, opt, loss_fn, *batch):
    """One eager PyTorch training step, the reference the step tests compare with: ``opt.zero_grad()``, the loss
    ``loss_fn(model, *batch)``, its ``backward()`` and ``opt.step()``. Returns that loss (its graph freed)."""
    opt.zero_grad()
    loss = loss_fn(model, *batch)
    loss.backward()
    opt.step()
    return loss


def assert_params_near_eager(state, eager, rel: float = 1e-5) -> None:
    """Every parameter of ``state`` (``model.<name>``) within ``rel`` times the largest magnitude of ``eager``'s: the
    bound for float32 kernels of another runtime, which drift apart from eager's by rounding only."""
    for name, p in eager.named_parameters():
        got = state.params["model." + name]
        assert float((got - p.detach()).abs().max()) <= rel * float(p.detach().abs().max()), name


def assert_optimizer_slots_equal(state, ref_model, ref_opt) -> None:
    """Every optimizer slot of eager's ``ref_opt`` (over ``ref_model``) equals the step state's (``opt:model.<name>:
    <slot>``, in its dtype and shape) bit for bit, and every parameter has at least one."""
    names = {id(p): n for n, p in ref_model.named_parameters()}
    compared = 0
    for p, slots in ref_opt.state.items():
        for slot, value in slots.items():
            got = state.opt[f"opt:model.{names[id(p)]}:{slot}"]
            assert torch.equal(got, value.to(got.dtype).reshape(got.shape)), (names[id(p)], slot)
            compared += 1
    assert compared >= len(names)


def train_like_eager(step, state, ref, ref_opt, loss_fn, batches, losses=None):
    """Runs the step and eager PyTorch (``ref`` with ``ref_opt``) on every batch: each loss and, at the
    end, every parameter bit for bit. Returns the step's last state; ``losses`` (a list) gets each loss."""
    for i, b in enumerate(batches):
        loss, state = step(state, *b)
        if losses is not None:
            losses.append(loss.item())
        ref_loss = eager_step(ref, ref_opt, loss_fn, *b)
        assert torch.equal(loss, ref_loss.detach()), i
    for n, p in ref.named_parameters():
        assert torch.equal(state.params["model." + n], p.detach()), n
    return state


def assert_adamw_steps_bit_exact(model, loss_fn, batch, run: str, steps: int = 20):
    """``steps`` AdamW steps of ``model`` on ``batch`` through the executor (``run="executor"``) or the planned
    arena: every loss and the final state bit for bit with an eager torch.optim loop, and the loss going down (a
    step that left the weights alone would match eager's first loss only)."""
    import copy

    eager = copy.deepcopy(model)
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = torch_ext.make_train_step(model, opt, loss_fn, batch)
    runner = step if run == "executor" else step.compile(plan=True)
    losses = []
    state = train_like_eager(runner, step.init_state(), eager, eager_opt, loss_fn, [batch] * steps, losses)
    assert losses[-1] < losses[0]
    step.write_back(state)
    for (key, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), key


class PositiveFactors(nn.Module):
    """Linear(8, 8) then Linear(8, 3), and the factors of a product: ``zeros``, through a ReLU so that some are
    zero; else in (0.5, 1.5). The cumprod and prod step tests build on it."""

    def __init__(self, dim=-1, zeros=False):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.dim, self.zeros = dim, zeros

    def factors(self, x):
        h = self.fc(x)
        return F.relu(h) + (h > 0.4).float() * 0.5 if self.zeros else torch.sigmoid(h) + 0.5


class _SummedLoss(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x).sum()


def joint_of_summed(module: nn.Module, x: torch.Tensor):
    """The joint forward/backward program (``_compat.export_joint``) of ``module(x).sum()``."""
    from torch_ext import _compat

    return _compat.export_joint(torch.export.export(_SummedLoss(module), (x,)))


def tiny_gpt_step(vocab: int, d_model: int, n_heads: int, n_layers: int, seq: int, batch: int):
    """(step, batch): a seeded TinyTransformer with AdamW (lr 1e-3) and a next-token loss."""
    from torch_ext.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=vocab, d_model=d_model, n_heads=n_heads, n_layers=n_layers, seq=seq)
    data = (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     lambda m, i, t: F.cross_entropy(m(i).reshape(-1, vocab), t.reshape(-1)), data)
    return step, data


def assert_same_training(step, other, batch, steps: int) -> None:
    """``other`` (a compiled variant of ``step``) gives the same losses and final state, bit for bit."""
    s_ref, s_other = step.init_state(), step.init_state()
    for _ in range(steps):
        loss_ref, s_ref = step(s_ref, *batch)
        loss, s_other = other(s_other, *batch)
        assert torch.equal(loss, loss_ref)
    for name in step.state_names:
        assert torch.equal(s_ref.lookup(name), s_other.lookup(name)), name


class Steer:
    """A forward hook object with a knob (activation steering: out * alpha)."""

    def __init__(self, alpha):
        self.alpha = alpha

    def __call__(self, module, args, out):
        return out * self.alpha


class TransposedWeight(nn.Module):
    """``x @ w`` with ``w`` a transposed nn.Parameter (8 x 16, strides (1, 8)), as a checkpoint saved from
    ``weight.t()`` loads (seeded)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(16, 8).t())
        self.b = nn.Parameter(torch.randn(16) * 0.1)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.w + self.b))

