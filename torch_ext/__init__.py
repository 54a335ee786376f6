"""torch_ext: pure fused training steps, global memory planning and reactive sweeps for PyTorch."""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401
from . import ir
from .executor import Executor

__all__ = ["Executor", "ir"]
__version__ = "0.1.0"
