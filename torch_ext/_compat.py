"""Every torch-version-specific call lives here; nothing else checks torch's version.

Checked against torch 2.9.1 (the CI pin). torch >= 2.9 is required.
"""
from __future__ import annotations

import operator

import torch
from torch.export.graph_signature import InputKind, OutputKind

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 9):
    raise ImportError(f"torch_ext needs torch >= 2.9, found {torch.__version__}")

# InputKind -> IR placeholder role.
INPUT_ROLES = {
    InputKind.USER_INPUT: "input",
    InputKind.PARAMETER: "param",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "const",
}

GETITEM = operator.getitem


def module_path(node: torch.fx.Node) -> str:
    """Innermost module path from export metadata ("layers.0.attn"), or ""."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Older releases spell the root as L['self'].
    for prefix in ("L['self'].", "L__self__."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return path


def op_name(target) -> tuple[str, str] | None:
    """(qualified schema name, overload) for an OpOverload, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    return None


def export_joint(ep: torch.export.ExportedProgram, loss_index: int = 0) -> torch.export.ExportedProgram:
    """The joint forward/backward program: outputs gain the gradients of output `loss_index`."""
    from torch.export.experimental import _export_forward_backward

    return _export_forward_backward(ep, joint_loss_index=loss_index)


