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


def export_joint(ep: torch.export.ExportedProgram, loss_index: int = 0, *,
                 decompose: bool = False) -> torch.export.ExportedProgram:
    """The joint forward/backward program: outputs gain the gradients of output `loss_index`.

    torch.export.experimental._export_forward_backward always applies the core-ATen decomposition
    table, which swaps eager autograd's backward kernels (nll_loss_backward,
    _log_softmax_backward_data, native_layer_norm_backward, ...) for decompositions that round
    differently. With decompose=False we run the same internal entry point with an empty table,
    so the joint graph calls exactly the kernels eager autograd calls and gradients match bit
    for bit.
    """
    from torch._decomp import core_aten_decompositions
    from torch.export.exported_program import _decompose_exported_program
    from torch.export.experimental import _copy_graph_module_and_signature, _remove_detach_pass

    joint = _decompose_exported_program(
        ep,
        cia_to_decomp={},
        python_decomp_table=core_aten_decompositions() if decompose else {},
        joint_loss_index=loss_index,
        decompose_custom_triton_ops=False,
    )
    gm, signature = _copy_graph_module_and_signature(joint)
    _remove_detach_pass(gm, signature)
    return joint._update(gm, signature)


def profile_memory_deltas(fn) -> list[int]:
    """Runs fn under torch.profiler and returns its CPU allocation deltas (bytes) in time order."""
    import os

    from torch.profiler import ProfilerActivity, profile

    # Kineto probes for GPUs on a CUDA build and logs an error when there is none; keep it quiet.
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() ==
              torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]
