"""Optimizers of the pure training step.

Each module here registers one optimizer family (see ``_registry.Registration``): a torch.optim
class mapped to a C++ descriptor in csrc/optim/, with its update written in ATen for compilers that
fuse (``Registration.aten``, optional) and in onnxscript for ``to_onnx`` (``Registration.onnx``, optional;
helpers in ``_onnx.py``). Adding an optimizer is one C++ file there and one module here; every module of this package is imported, and the names in its ``__all__`` (an eager
optimizer class such as :class:`Lion`) are exported from ``torch_ext.optim``.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from ._registry import (Registration, aten_updates, descriptor, group_input_name, lr_name, once,  # noqa: F401
                        onnx_kinds, onnx_updates, parse_state_name, register, registration_for, registrations,
                        state_name)

# Sorted, so the registration order (and the "supported:" list in errors) does not depend on the file system.
for _mod in sorted(m.name for m in _pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
    _module = _importlib.import_module(f"{__name__}.{_mod}")
    for _name in getattr(_module, "__all__", ()):
        globals()[_name] = getattr(_module, _name)
