"""Large parameters are updated block by block (csrc/optim/define.cpp: each block's passes stay in
cache; Adam/AdamW, AMSGrad, RMSprop, Lion, Adamax, NAdam, RAdam and Adadelta, while SGD and Adagrad run whole, Descriptor::blocked).
The blocks run the same ATen ops on the same values, so the result must equal eager torch.optim bit
for bit: over several blocks with a ragged last one, in the functional op (the executor, results
written into whole fresh tensors) and in place (the planned arena, donated), at one and two threads,
with the step counter read and written once per update whatever the number of blocks, and where a
gradient laid out unlike its parameter keeps the update whole."""
from __future__ import annotations

import pytest
import torch

import torch_ext

BLOCK_BYTES = 256 * 1024  # kBlockBytes in csrc/optim/define.cpp

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad_l2_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
    "sgd_momentum_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "rmsprop_centered_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.5, weight_decay=0.01),
    "adagrad_lr_decay": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, weight_decay=0.01),
    "lion": lambda ps: torch_ext.optim.Lion(ps, lr=1e-3, weight_decay=0.1),
    "adamax_wd": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.1),
    # mu_product, a scalar slot like the step: read before and written once per update, whatever the blocks
    "nadam_decoupled": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam_l2_maximize": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1, maximize=True),
    "adadelta_wd": lambda ps: torch.optim.Adadelta(ps, weight_decay=0.01),
}


class Linear(torch.nn.Module):
    """loss = sum(w * g): the gradient of w is exactly g (or g's transpose layout with `transposed`)."""

    def __init__(self, w: torch.Tensor, transposed: bool):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())
        self.transposed = transposed

    def forward(self, g):
        # g arrives transposed: the gradient of w is then g.t(), a view in the other memory order.
        return (self.w * (g.t() if self.transposed else g)).sum()


def eager(make_opt, w0, grads):
    p = torch.nn.Parameter(w0.clone())
    opt = make_opt([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


def run_step(make_opt, w0, grads, *, planned: bool, transposed: bool = False):
    model = Linear(w0, transposed)
    feed = [g.t().contiguous() if transposed else g for g in grads]
    step = torch_ext.make_train_step(model, make_opt(model.parameters()), lambda m, g: m(g), (feed[0],))
    runner = step.compile(plan=True, donate=True) if planned else step
    state = step.init_state()
    for g in feed:
        _, state = runner(state, g)
    return state


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("planned", [False, True], ids=["functional", "in_place"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_blocked_update_is_bit_exact(name, planned, threads):
    block = BLOCK_BYTES // 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        w0 = torch.randn(3 * block + 7, generator=g)  # three whole blocks and a ragged fourth
        grads = [torch.randn(w0.shape, generator=g) for _ in range(3)]
        ref, ref_state = eager(OPTIMIZERS[name], w0, grads)
        state = run_step(OPTIMIZERS[name], w0, grads, planned=planned)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(state.params["model.w"], ref)
    for slot, v in ref_state.items():
        assert torch.equal(state.opt[f"opt:model.w:{slot}"].to(v.dtype), v), slot


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_blocks_sized_by_bytes_are_bit_exact_at_other_dtypes(dtype):
    block = BLOCK_BYTES // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(2 * block + 3, generator=g).to(dtype)
    grads = [torch.randn(w0.shape, generator=g).to(dtype) for _ in range(2)]
    ref, ref_state = eager(OPTIMIZERS["adamw"], w0, grads)
    state = run_step(OPTIMIZERS["adamw"], w0, grads, planned=False)
    assert torch.equal(state.params["model.w"], ref)
    assert torch.equal(state.opt["opt:model.w:exp_avg_sq"], ref_state["exp_avg_sq"])


def test_gradient_laid_out_unlike_its_parameter():
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(517, 509, generator=g)  # 263k elements: four blocks if it were blocked
    grads = [torch.randn(w0.shape, generator=g) for _ in range(2)]
    ref, ref_state = eager(OPTIMIZERS["adamw"], w0, grads)
    for planned in (False, True):
        state = run_step(OPTIMIZERS["adamw"], w0, grads, planned=planned, transposed=True)
        assert torch.equal(state.params["model.w"], ref)
        assert torch.equal(state.opt["opt:model.w:exp_avg"], ref_state["exp_avg"])


def test_update_ops_called_directly_match_eager_in_place_and_functional():
    """The ops eager scripts call (torch.ops.torch_ext.adam_update_) and the functional op, on a
    tensor of several blocks: the functional op leaves its inputs unwritten."""
    block = BLOCK_BYTES // 4
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(2 * block + 5, generator=g)
    grad = torch.randn(w0.shape, generator=g)
    ref, ref_state = eager(OPTIMIZERS["adamw"], w0, [grad])
    lr = torch.tensor([1e-2], dtype=torch.float64)
    scalars = (0.9, 0.999, 1e-8, 0.1, True, False)
    p, m, v, step = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0), torch.zeros(())
    inputs = [t.clone() for t in (p, m, v, step)]
    p2, m2, v2, step2 = torch.ops.torch_ext.adam_update(p, grad, m, v, step, lr, *scalars)
    for before, after in zip(inputs, (p, m, v, step)):
        assert torch.equal(before, after)  # the functional op wrote none of its inputs
    torch.ops.torch_ext.adam_update_(p, grad, m, v, step, lr, *scalars)
    for got in (p2, p):
        assert torch.equal(got, ref)
    for got in (m2, m):
        assert torch.equal(got, ref_state["exp_avg"])
    assert float(step2) == float(step) == 1.0


@pytest.mark.parametrize("planned", [False, True], ids=["functional", "in_place"])
def test_blocked_radam_across_its_rectification_threshold(planned):
    """Steps 1-5 unrectified, 6-7 rectified (default betas): every block takes the same branch."""
    block = BLOCK_BYTES // 4
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(2 * block + 3, generator=g)
    grads = [torch.randn(w0.shape, generator=g) for _ in range(7)]
    make = lambda ps: torch.optim.RAdam(ps, lr=1e-2)  # noqa: E731
    ref, ref_state = eager(make, w0, grads)
    state = run_step(make, w0, grads, planned=planned)
    assert torch.equal(state.params["model.w"], ref)
    for slot, v in ref_state.items():
        assert torch.equal(state.opt[f"opt:model.w:{slot}"].to(v.dtype), v), slot
