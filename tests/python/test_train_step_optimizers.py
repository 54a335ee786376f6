"""RMSprop and Adagrad in the pure step: 100 steps bit-exact with torch.optim's single-tensor path."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

from helpers import train_like_eager


OPTIMIZERS = {
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "rmsprop_centered_momentum_wd": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, alpha=0.9, momentum=0.8,
                                                                   centered=True, weight_decay=1e-3),
    "rmsprop_momentum_maximize": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, maximize=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=5e-2),
    "adagrad_decay_init_wd": lambda ps: torch.optim.Adagrad(ps, lr=5e-2, lr_decay=1e-2, weight_decay=1e-3,
                                                            initial_accumulator_value=0.1),
}


def model_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(100)]
    return model, batches


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


@pytest.mark.parametrize("warm", [0, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bit_exact_100_steps(name, warm):
    model, batches = model_and_batches()
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    for b in batches[:warm]:  # resume from existing optimizer state
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, *b).backward()
            o.step()
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    state = train_like_eager(step, step.init_state(), ref, ref_opt, loss_fn, batches[warm:])
    names = {id(p): n for n, p in ref.named_parameters()}
    for p, st in ref_opt.state.items():
        for slot, v in st.items():
            assert torch.equal(state.opt[f"opt:model.{names[id(p)]}:{slot}"].to(v.dtype), v), slot
    # write_back hands the optimizer state back so eager continues identically.
    step.write_back(state)
    for p, st in opt.state.items():
        rp = dict(zip(map(id, model.parameters()), ref.parameters()))[id(p)]
        for slot, v in ref_opt.state[rp].items():
            assert torch.equal(st[slot], v), slot


def test_planned_arena_updates_in_place():
    model, batches = model_and_batches()
    step = torch_ext.make_train_step(model, OPTIMIZERS["rmsprop_centered_momentum_wd"](model.parameters()), loss_fn,
                                     batches[0])
    planned = step.compile(plan=True, donate=True)
    assert planned.inplace_updates == len(list(model.parameters()))
    s_ref, s = step.init_state(), step.init_state()
    for b in batches[:5]:
        l_ref, s_ref = step(s_ref, *b)
        loss, s = planned(s, *b)
        assert torch.equal(loss, l_ref)
    for name in step.state_names:
        assert torch.equal(s.lookup(name), s_ref.lookup(name)), name


def test_update_ops_opcheck():
    p, g = torch.randn(4, 3), torch.randn(4, 3)
    lr = torch.tensor(0.1, dtype=torch.float64)
    torch.library.opcheck(torch.ops.torch_ext.rmsprop_update.default,
                          (p, g, torch.rand(4, 3), torch.zeros(4, 3), torch.zeros(4, 3), torch.tensor(2.0), lr,
                           0.99, 1e-8, 0.0, 0.9, True, False))
    torch.library.opcheck(torch.ops.torch_ext.adagrad_update.default,
                          (p, g, torch.rand(4, 3), torch.tensor(2.0), lr, 0.01, 0.0, 1e-10, False))
    with pytest.raises(RuntimeError, match=r"sum has shape \[3\] but the parameter has shape \[4, 3\]"):
        torch.ops.torch_ext.adagrad_update(p, g, torch.rand(3), torch.tensor(2.0), lr, 0.0, 0.0, 1e-10, False)


FOREACH = {
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                                  foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "rmsprop_centered_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.8, centered=True,
                                                                foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=5e-2, lr_decay=1e-2, foreach=True),
}


@pytest.mark.parametrize("name", list(FOREACH))
def test_foreach_is_accepted_where_it_computes_the_same_numbers(name):
    """Eager's foreach path is bit-identical to the single-tensor one for these, so the step accepts it."""
    model, batches = model_and_batches()
    ref = copy.deepcopy(model)
    ref_opt = FOREACH[name](ref.parameters())
    step = torch_ext.make_train_step(model, FOREACH[name](model.parameters()), loss_fn, batches[0])
    train_like_eager(step, step.init_state(), ref, ref_opt, loss_fn, batches[:50])
