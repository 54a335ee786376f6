"""torch_ext: pure fused training steps, global memory planning and reactive sweeps for PyTorch."""
import torch  # noqa: F401  (loads libtorch before the extension)
# Imported now, before any process group exists: torch 2.9's torch.distributed.nn.functional binds
# `group=group.WORLD` as the default argument of 10 functions when first imported, and our first trace
# imports it (through dynamo). Imported while a default group is alive, it keeps that group past
# destroy_process_group, so gloo's worker threads lived into interpreter exit, where one releasing a Python
# tensor aborts the process ("terminate called without an active exception", SIGABRT at a torchrun job's
# end). Imported with no group, its defaults are None. (~5 ms; all of dynamo would cost ~1 s.)
if torch.distributed.is_available():
    import torch.distributed.nn  # noqa: F401,E402

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
