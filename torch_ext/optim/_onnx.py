"""Shared helpers of the optimizers' ONNX forms (``Registration.onnx``, read by ``torch_ext.onnx.to_onnx``).

An ONNX form is a plain Python function that ``torch.onnx.export(..., dynamo=True)`` traces through its
``custom_translation_table``: the exporter binds the op's arguments to the function's parameters by name
(so the parameters are named exactly as the op's schema, in its order) and treats an unannotated
parameter as an input, passing tensors as symbolic tensors and the op's scalar arguments (floats,
bools) as Python values, so a form branches on its flags and bakes its float hyperparameters in as
constants; a scheduled hyperparameter (the op's "scheduled" overload) arrives as a float64 tensor. The
forms follow the kernels in csrc/optim/: scalars computed in double, applied in the parameter's dtype.

onnx, onnxscript and numpy are imported at first use, so ``import torch_ext`` never needs them.
"""
from __future__ import annotations

__all__ = ["op", "dconst", "f64", "scalar", "scheduled", "hyper", "one_minus", "grad_of", "plus_one"]


class _Opset18:
    """``onnxscript.opset18``, imported when a form first calls an op."""

    def __getattr__(self, name):
        from onnxscript import opset18

        return getattr(opset18, name)


op = _Opset18()


def dconst(x):
    """A float64 constant (Constant has no double attribute): scalars stay as exact as the C++ doubles."""
    import numpy as np
    import onnx

    return op.Constant(value=onnx.numpy_helper.from_array(np.array(x, dtype=np.float64)))


def f64(x):
    """``x`` (a tensor: lr, a step count) cast to float64."""
    import onnx

    return op.Cast(x, to=onnx.TensorProto.DOUBLE)


def scalar(x, like):
    """A double-precision scalar (Python float or f64 tensor) in ``like``'s dtype, as a kernel would apply it."""
    return op.CastLike(x, like)


def scheduled(x) -> bool:
    """A scheduled hyperparameter: an input (a float64 tensor), not a Python float."""
    return not isinstance(x, (int, float))


def hyper(x, like):
    """A hyperparameter in ``like``'s dtype: a Python float as a constant, a scheduled one cast."""
    return scalar(x, like) if scheduled(x) else scalar(op.Constant(value_float=x), like)


def one_minus(x, like):
    """1 - x in double (as eager computes 1 - beta with a Python float), in ``like``'s dtype."""
    return scalar(op.Sub(dconst(1.0), x), like) if scheduled(x) else scalar(op.Constant(value_float=1.0 - x), like)


def grad_of(param, grad, weight_decay, maximize):
    """The gradient with maximize and coupled weight decay applied, as the C++ kernels do."""
    g = op.Neg(grad) if maximize else grad
    if weight_decay != 0:
        g = op.Add(g, op.Mul(param, scalar(op.Constant(value_float=weight_decay), param)))
    return g


def plus_one(step):
    """The step counter advanced: step + 1 in its own dtype."""
    return op.Add(step, op.CastLike(op.Constant(value_float=1.0), step))
