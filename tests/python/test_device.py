"""Device-agnostic code: the optimizer update ops have CUDA kernels (ATen calls on the tensors' own device); what is
CPU by nature (the explicit-state RNG ops, oneDNN's LSTM layer) has no CUDA kernel and a model that needs it off the
CPU is refused by name at build time. The tests marked ``cuda`` run the CUDA paths where a GPU is present."""
import pytest
import torch

import torch_ext
from torch_ext import distributed

ops = torch.ops.torch_ext
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _update_ops():
    """Every update op's qualified name and overload: functional and in place, plain and "scheduled"."""
    names = []
    for d in torch_ext._C.optimizer_descriptors():
        for op in (d["op"], d["inplace_op"]):
            names.append(f"torch_ext::{op}")
            if d["schedulable"]:
                names.append(f"torch_ext::{op}.scheduled")
    return names


UPDATE_OPS = _update_ops()
CPU_ONLY_OPS = ["native_dropout_rng", "randn_like_rng", "rand_like_rng", "randn_rng", "rand_rng", "randint_rng",
                "bernoulli_p_rng", "rng_seed", "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"]


def test_every_update_op_has_cpu_cuda_and_meta_kernels():
    assert len(UPDATE_OPS) >= 2 * len(torch_ext._C.optimizer_descriptors())
    missing = [(name, key) for name in UPDATE_OPS for key in ("CPU", "CUDA", "Meta") if not has_kernel(name, key)]
    assert missing == []


@pytest.mark.parametrize("name", CPU_ONLY_OPS)
def test_cpu_only_ops_have_no_cuda_kernel(name):
    # The RNG ops' state is the CPU generator's mt19937 bytes; oneDNN runs on the CPU only.
    assert has_kernel(f"torch_ext::{name}", "CPU")
    assert not has_kernel(f"torch_ext::{name}", "CUDA")


def _adam_args(device):
    g = torch.Generator().manual_seed(0)
    p, grad, m, v = (torch.randn(700, 400, generator=g).to(device) for _ in range(4))  # past two cache blocks
    return [p, grad, m, v.abs(), torch.tensor(3.0), torch.tensor(1e-3, dtype=torch.float64), 0.9, 0.999, 1e-8, 0.01,
            True, False]


def test_update_ops_run_under_fake_tensors_of_any_device():
    """The fake kernels, not the CPU/CUDA kernels, answer for fake tensors, on a device this machine lacks too: a
    program is traced for a CUDA model here without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for device in ("cpu", "cuda"):
            args = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) and a.dim() else a
                    for a in _adam_args("cpu")]
            args[:4] = [torch.empty_like(a, device=device) for a in args[:4]]
            p, m, v, step = ops.adam_update(*args)
            assert (p.device.type, m.device.type, v.device.type) == (device,) * 3 and p.shape == (700, 400)
            assert step.device.type == "cpu"  # the step counter stays on the CPU, as torch.optim keeps it


def test_update_ops_on_meta_tensors_run_the_fake_kernel():
    args = _adam_args("cpu")
    args[:4] = [a.to("meta") for a in args[:4]]
    p, m, v, _ = ops.adam_update(*args)
    assert p.device.type == "meta" and m.shape == (700, 400)


def test_collective_device_is_the_cpu_under_gloo(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0, world_size=1)
    try:
        assert distributed._collective_device(dist.group.WORLD) == torch.device("cpu")
        assert distributed.ranks_where(True, dist.group.WORLD) == [0]
        assert distributed.ranks_where(False, dist.group.WORLD) == []
    finally:
        dist.destroy_process_group()


@cuda
@pytest.mark.parametrize("inplace", [False, True])
def test_adam_update_on_cuda_equals_torch_optim_on_cuda(inplace):
    """The CUDA kernel runs the single-tensor torch.optim lines (no cache blocking): bit-exact with torch.optim.AdamW
    (foreach=False) on the same device; the step counter stays on the CPU."""
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(700, 400, generator=g)
    grads = [torch.randn(700, 400, generator=g) for _ in range(3)]
    p = torch.nn.Parameter(p0.cuda())
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=False)
    param, m, v, step = p0.cuda(), torch.zeros(700, 400, device="cuda"), torch.zeros(700, 400, device="cuda"), \
        torch.tensor(0.0)
    lr = torch.tensor(1e-3, dtype=torch.float64)
    for grad in grads:
        p.grad = grad.cuda()
        opt.step()
        args = (param, grad.cuda(), m, v, step, lr, 0.9, 0.999, 1e-8, 0.01, True, False)
        if inplace:
            ops.adam_update_(*args)
        else:
            param, m, v, step = ops.adam_update(*args)
    assert param.device.type == "cuda" and step.device.type == "cpu"
    assert torch.equal(param, p.detach()) and torch.equal(m, opt.state[p]["exp_avg"])
    assert torch.equal(v, opt.state[p]["exp_avg_sq"]) and float(step) == 3


def _mlp(dropout: float):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(16, 2))


@cuda
def test_a_cuda_model_trains_as_eager():
    from torch_ext.testing import assert_step_matches_eager

    model = _mlp(0.0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 2, device="cuda")
    assert_step_matches_eager(model, opt, torch.nn.functional.mse_loss, [(x, y)] * 3)


@cuda
def test_a_cuda_model_with_dropout_is_refused_naming_the_device():
    model = _mlp(0.5).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 2, device="cuda")
    with pytest.raises(RuntimeError, match=r"draws on cuda:0; the pure step's RNG state is the CPU generator's"):
        torch_ext.make_train_step(model, opt, torch.nn.functional.mse_loss, (x, y))



@cuda
@pytest.mark.parametrize("donate", [False, True])
def test_a_cuda_models_planned_arena_equals_its_executor(donate):
    """The plan holds CUDA buffers (activations, parameters' updates) and CPU ones (Adam's step counters): the arena
    executor keeps one arena per device, and runs bit-exact with the executor."""
    model = _mlp(0.0).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 2, device="cuda")
    step = torch_ext.make_train_step(model, opt, torch.nn.functional.mse_loss, (x, y))
    planned = step.compile(plan=True, donate=donate)
    ref_state, state = step.init_state(), step.init_state()
    for _ in range(3):
        ref_loss, ref_state = step(ref_state, x, y)
        loss, state = planned(state, x, y)
        assert torch.equal(loss, ref_loss)
        for name in step.state_names:
            assert torch.equal(state.lookup(name), ref_state.lookup(name)), name
