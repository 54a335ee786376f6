"""torch_ext: pure fused training steps, global memory planning and reactive sweeps for PyTorch."""
import torch  # noqa: F401  (loads libtorch before the extension)
# Imported now, before any process group exists: torch 2.9's dynamo, imported while a default process group
# is alive (our first trace imports it), takes references to that group that destroy_process_group never
# drops, so gloo's worker threads outlive it into interpreter exit, where one releasing a Python tensor
# aborts the process ("terminate called without an active exception", SIGABRT in a torchrun job's last
# moment). Every use of torch_ext traces, which imports dynamo anyway.
import torch._dynamo  # noqa: F401,E402

from . import _C  # noqa: F401
from . import _fake  # noqa: F401  (fake kernels for torch.ops.torch_ext)
from . import distributed, ir, testing  # noqa: F401
from .executor import Executor
from .reactive import ReactiveGraph, SweepResult, sweep
from .train_step import TrainState, TrainStep, make_train_step
from .memory import MemoryReport, PlannedStep, memory_report
from .deploy import load_step

__all__ = ["Executor", "MemoryReport", "PlannedStep", "ReactiveGraph", "SweepResult", "TrainState", "TrainStep", "ir", "load_step", "make_train_step", "memory_report", "sweep"]
__version__ = "0.1.0"
