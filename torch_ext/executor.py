"""torch_ext.Executor: run an ExportedProgram through the IR and the C++ dispatcher executor."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from . import _C, _compat
from .ir import Graph


class Executor:
    """Callable with the same user inputs and outputs as ``ep.module()``.

    Parameters, buffers and constants are read from ``ep`` (copied once). Buffers that the
    program mutates in place (BatchNorm running statistics in train mode) are updated in the
    executor's own copy, as ``ep.module()`` updates its buffers.

    ``Executor(graph)`` with a ``torch_ext.ir.Graph`` (parsed IR text, say) takes every placeholder
    as a flat positional input, in graph order, and returns the flat list of outputs; binding
    problems raise here, input problems when called, each naming the node.
    """

    def __init__(self, ep: "torch.export.ExportedProgram | Graph"):
        if isinstance(ep, Graph):
            self.graph = ep
            self._ex = _C.Executor(ep._g)
            self._slots = None  # flat: no signature, no state
            return
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"Executor expects a torch.export.ExportedProgram, got {type(ep).__name__} "
                            "(or a torch_ext.ir.Graph)")
        # A batch norm result declared in torch's meta-kernel layout (torch.export's own, a step saved by an older
        # release) is retraced in the CPU kernels' layout, which the IR checker infers.
        ep = _compat.batch_norm_in_cpu_layout(ep)
        self.graph = Graph.from_exported(ep)
        self._ex = _C.Executor(self.graph._g)
        self._in_spec = ep.call_spec.in_spec
        self._out_spec = ep.call_spec.out_spec
        self._constants = _compat.user_input_constants(ep)
        sig = ep.graph_signature
        state = {**ep.state_dict, **ep.constants}
        self.state: dict[str, torch.Tensor] = {}
        self._slots: list = []  # state name, or None for the next user input
        for spec in sig.input_specs:
            if spec.kind.name == "USER_INPUT":
                self._slots.append(None)
            else:
                self.state[spec.target] = state[spec.target].detach().clone()
                self._slots.append(spec.target)
        self._num_user = sum(s is None for s in self._slots)  # not list.count: Tensor == None costs ~20 us each
        self._mutations = [(i, spec.target) for i, spec in enumerate(sig.output_specs)
                           if spec.kind.name == "BUFFER_MUTATION"]
        # The loss of a joint program (export_joint) is an output of the forward, so it belongs to the
        # out_spec like any user output; gradient outputs do not.
        self._user_outputs = [i for i, spec in enumerate(sig.output_specs)
                              if spec.kind.name in ("USER_OUTPUT", "LOSS_OUTPUT")]

    def __call__(self, *args, **kwargs):
        if self._slots is None:
            if kwargs:
                raise TypeError(f"an Executor over an ir.Graph takes positional inputs only, got keywords "
                                f"{sorted(kwargs)}")
            return self._ex.run(list(args))
        flat = _compat.user_input_leaves(args, kwargs, self._in_spec, self._constants)
        if len(flat) != self._num_user:
            raise TypeError(f"expected {self._num_user} user inputs, got {len(flat)}")
        it = iter(flat)
        inputs = [next(it) if s is None else self.state[s] for s in self._slots]
        outs = self._ex.run(inputs)
        for i, name in self._mutations:
            self.state[name] = outs[i]
        user = [outs[i] for i in self._user_outputs]
        return pytree.tree_unflatten(user, self._out_spec)
