"""Lion (torch_ext.optim.Lion, kind "lion"): the pure step against a reference Lion written here
with plain tensor ops (lion-pytorch's update), bit for bit; opcheck; the planned arena; state
round trips; schedulers and param groups as for Adam."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.optim import Lion

VOCAB = 11


def reference_lion(params, exp_avgs, lr, beta1, beta2, weight_decay):
    """lion-pytorch's update_fn, applied to every parameter with a gradient."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            m = exp_avgs.setdefault(p, torch.zeros_like(p))
            p.mul_(1.0 - lr * weight_decay)
            update = m.clone().mul_(beta1).add(p.grad, alpha=1.0 - beta1).sign_()
            p.add_(update, alpha=-lr)
            m.mul_(beta2).add_(p.grad, alpha=1.0 - beta2)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


def mlp_and_batches(n=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def tied_and_batches(n=6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    return TiedLM(), [(torch.randint(0, VOCAB, (4, 5), generator=g), torch.randint(0, VOCAB, (4, 5), generator=g))
                      for _ in range(n)]


def loss_fn(m, x, y):
    out = m(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


HYPER = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)


def side_by_side(step, ref, ref_update, batches):
    """The pure step's state after ``batches``; each loss equals the eager ``ref``'s, which
    ``ref_update()`` updates after each backward."""
    state = step.init_state()
    for i, b in enumerate(batches):
        ref.zero_grad()
        ref_loss = loss_fn(ref, *b)
        ref_loss.backward()
        ref_update()
        loss, state = step(state, *b)
        assert torch.equal(loss, ref_loss.detach()), i
    return state


@pytest.mark.parametrize("make", [mlp_and_batches, tied_and_batches], ids=["mlp", "tied"])
def test_pure_step_matches_reference_bit_exact(make):
    model, batches = make()
    ref = copy.deepcopy(model)
    step = torch_ext.make_train_step(model, Lion(model.parameters(), **HYPER), loss_fn, batches[0])
    exp_avgs: dict = {}
    state = side_by_side(step, ref, lambda: reference_lion(ref.parameters(), exp_avgs, HYPER["lr"], *HYPER["betas"],
                                                           HYPER["weight_decay"]), batches)
    names = {id(p): n for n, p in ref.named_parameters()}  # tied: the first name only, as the state
    assert len(state.opt) == len(names)
    for p, m in exp_avgs.items():
        assert torch.equal(state.params["model." + names[id(p)]], p.detach()), names[id(p)]
        assert torch.equal(state.opt[torch_ext.optim.state_name("model." + names[id(p)], "exp_avg")], m)


def test_eager_lion_matches_reference_bit_exact():
    model, batches = mlp_and_batches()
    ref = copy.deepcopy(model)
    opt, exp_avgs = Lion(model.parameters(), **HYPER), {}
    for b in batches:
        for m in (model, ref):
            m.zero_grad()
            loss_fn(m, *b).backward()
        opt.step()
        reference_lion(ref.parameters(), exp_avgs, HYPER["lr"], *HYPER["betas"], HYPER["weight_decay"])
    for p, rp in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, rp)
        assert torch.equal(opt.state[p]["exp_avg"], exp_avgs[rp])


def test_lion_refuses_bad_hyperparameters():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="lr must be positive, got 0.0"):
        Lion(params, lr=0.0)
    with pytest.raises(ValueError, match=r"betas must be two values in \[0, 1\], got \(0.9, 1.5\)"):
        Lion(params, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="weight_decay must be >= 0, got -1"):
        Lion(params, weight_decay=-1)


def test_opcheck():
    p, g, m = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)
    lr = torch.tensor(0.1, dtype=torch.float64)
    torch.library.opcheck(torch.ops.torch_ext.lion_update.default, (p, g, m, lr, 0.9, 0.99, 0.01))
    torch.library.opcheck(torch.ops.torch_ext.lion_update_.default, (p.clone(), g, m.clone(), lr, 0.9, 0.99, 0.01))
    with pytest.raises(RuntimeError, match=r"exp_avg has shape \[3\] but the parameter has shape \[4, 3\]"):
        torch.ops.torch_ext.lion_update(p, g, torch.zeros(3), lr, 0.9, 0.99, 0.0)


def test_planned_and_default_paths_agree():
    model, batches = mlp_and_batches()
    step = torch_ext.make_train_step(model, Lion(model.parameters(), **HYPER), loss_fn, batches[0])
    planned = step.compile(plan=True)
    assert planned.inplace_updates == len(list(model.parameters()))  # lion_update_ in the arena
    default = step.compile()
    s_ref, s_plan, s_def = step.init_state(), step.init_state(), step.init_state()
    for b in batches:
        l_ref, s_ref = step(s_ref, *b)
        l_plan, s_plan = planned(s_plan, *b)
        l_def, s_def = default(s_def, *b)
        assert torch.equal(l_plan, l_ref) and torch.equal(l_def, l_ref)
    for name in step.state_names:
        assert torch.equal(s_plan.lookup(name), s_ref.lookup(name)), name
        assert torch.equal(s_def.lookup(name), s_ref.lookup(name)), name


def test_state_round_trip():
    model, batches = mlp_and_batches()
    opt = Lion(model.parameters(), **HYPER)
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    state = step.init_state()
    for b in batches[:3]:
        _, state = step(state, *b)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    loaded = step.load_state_dict(torch.load(buf, weights_only=True))
    # write_back hands the momentum to the eager Lion, which continues as the pure step does.
    step.write_back(state)
    for b in batches[3:]:
        _, state = step(state, *b)
        _, loaded = step(loaded, *b)
        opt.zero_grad()
        loss_fn(model, *b).backward()
        opt.step()
    for name in step.state_names:
        assert torch.equal(loaded.lookup(name), state.lookup(name)), name
    for n, p in model.named_parameters():
        assert torch.equal(state.params["model." + n], p.detach()), n
        assert torch.equal(state.opt[torch_ext.optim.state_name("model." + n, "exp_avg")], opt.state[p]["exp_avg"])
    # A fresh step reads the eager optimizer's state back.
    again = torch_ext.make_train_step(model, opt, loss_fn, batches[0]).init_state()
    for n, p in model.named_parameters():
        assert torch.equal(again.opt[torch_ext.optim.state_name("model." + n, "exp_avg")], opt.state[p]["exp_avg"])


MAKERS = {
    "lion": lambda groups: Lion(groups, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05),
    "adam": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_scheduler_and_param_groups_as_for_adam(name):
    model, batches = mlp_and_batches(n=8)
    ref = copy.deepcopy(model)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 3e-3, "weight_decay": 0.0}, {"params": m[3].parameters()}]

    opt, ref_opt = MAKERS[name](groups(model)), MAKERS[name](groups(ref))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], scheduler=sched)
    state = side_by_side(step, ref, lambda: (ref_opt.step(), ref_sched.step()), batches)
    assert [float(v) for v in state.lr] == [g["lr"] for g in ref_opt.param_groups]
    for n, p in ref.named_parameters():
        assert torch.equal(state.params["model." + n], p.detach()), n
