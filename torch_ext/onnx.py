"""The pure step in ONNX: ``to_onnx(step, path)`` and ``load_onnx_step(path, step)``.

The step program (forward, backward and the update, ``(loss, S') = F(S, batch)``) goes through
``torch.onnx.export(..., dynamo=True)``; each ``torch_ext`` update op is translated by its
optimizer's ONNX form (``Registration.onnx`` in torch_ext/optim/<name>.py: onnxscript, traced with
the op's scalar arguments as Python values), which follows the kernel in ``csrc/optim/``: scalars
computed in double, applied in the parameter's dtype. A plain ``onnxruntime.InferenceSession`` then
trains by feeding the state outputs back as inputs. An optimizer without an ONNX form (Muon: a
Newton-Schulz iteration in bfloat16; Lion) and dropout's RNG op are refused by name.
"""
from __future__ import annotations

from typing import Sequence

import os

import torch

__all__ = ["to_onnx", "OnnxStep", "load_onnx_step"]


def _translations() -> dict:
    """{torch_ext update OpOverload: its ONNX form}, the exporter's custom_translation_table: every
    optimizer's ``Registration.onnx`` (torch_ext/optim/<name>.py, helpers in torch_ext/optim/_onnx.py)."""
    from .optim import onnx_updates

    return onnx_updates()


def _silu_backward(grad, x):
    sigmoid = torch.sigmoid(x)
    return grad * (sigmoid * (1 + x * (1 - sigmoid)))


def _mish_backward(grad, x):
    tanh_softplus = torch.tanh(torch.nn.functional.softplus(x))
    return grad * (tanh_softplus + x * torch.sigmoid(x) * (1 - tanh_softplus * tanh_softplus))


def _every_node(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of ``gm`` and of every subgraph it calls (torch.cond's branches), so an op the
    exporter cannot translate is named wherever it sits."""
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def to_onnx(step, path: str) -> str:
    """Exports ``step``'s pure program to ``path`` (ONNX), with the program's inputs and outputs:
    the flat layout of every artifact (``torch_ext.deploy.layout_of``: ``inputs`` in order, state
    entries and ``batch:<i>`` leaves; ``outputs``: the loss, the new state in ``state_names`` order,
    then the aux leaves), written into the model's metadata (``torch_ext.layout``, JSON)."""
    import json

    import onnx

    table = _translations()
    program = step.program
    nodes = _every_node(program.graph_module)
    unsupported = sorted({str(n.target) for n in nodes
                          if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                          and n.target.namespace == "torch_ext" and n.target not in table})
    if unsupported:
        from .optim import onnx_kinds

        raise NotImplementedError(f"to_onnx: no ONNX translation for {', '.join(unsupported)} (supported: "
                                  f"{', '.join(onnx_kinds())}; dropout's explicit RNG state is not)")
    from ._onnx_backward import decompositions as backward_decompositions

    written_out = backward_decompositions()
    attention_backward = sorted({str(n.target) for n in nodes if n.op == "call_function"
                                 and "attention" in str(n.target) and "backward" in str(n.target)
                                 and n.target not in written_out})
    if attention_backward:
        raise NotImplementedError(
            f"to_onnx: torch {torch.__version__}'s ONNX exporter has no translation for {', '.join(attention_backward)} "
            "(the backward of scaled_dot_product_attention on this device's kernel; to_onnx writes out the CPU flash "
            "kernel's): build the step on the CPU, or write attention as matmul + softmax to train in ONNX")
    # torch's own core-ATen decompositions first: the exporter's translation of some backward ops
    # (nll_loss_backward's mean reduction) is wrong, while their ATen decompositions are what Inductor runs.
    # Training-mode batch norm too: the exporter translates _native_batch_norm_legit_functional as
    # inference (normalising by the running statistics, returning them unchanged).
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    decompositions = torch.export.default_decompositions()
    decompositions.update(get_decompositions([aten._native_batch_norm_legit_functional,
                                              aten.native_batch_norm_backward]))
    # silu_backward and mish_backward (passes/recompose_activation_backward.h) as their autograd formulas: the
    # default table's forms go through empty_permuted, which the exporter cannot translate.
    decompositions[aten.silu_backward.default] = _silu_backward
    decompositions[aten.mish_backward.default] = _mish_backward
    # Convolution, pooling, upsampling and CPU attention backward: torch has no decomposition and the exporter no
    # translation of them; their definitions in ops it translates (torch_ext/_onnx_backward.py).
    # (The CPU attention kernel's forward too: torch's decomposition returns its output contiguous where the kernel
    # lays it out [batch, seq, heads, dim], and the exporter's translation gives NaN for a fully masked row.)
    decompositions.update(written_out)
    program = program.run_decompositions(decompositions)
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the exporter logs a line per unannotated translation argument
    try:
        # optimize=False: the exporter's graph optimizer drops `x + 1e-8` (Adam's eps), turning 0/0 into NaN.
        onnx_program = torch.onnx.export(program, (), dynamo=True, custom_translation_table=table, verbose=False,
                                         optimize=False)
    except Exception as e:  # noqa: BLE001 - re-raised naming the op torch.onnx cannot translate
        import re

        found = re.search(r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>", str(e))
        if found:
            raise NotImplementedError(
                f"to_onnx: torch {torch.__version__}'s ONNX exporter has no translation for {found[1]}.{found[2]}, "
                "and to_onnx has no form of it (it supplies convolution, average/max/adaptive pooling and nearest "
                "upsampling backward: torch_ext/_onnx_backward.py): to train this model in ONNX, write that layer "
                "with ops the exporter translates") from e
        raise
    finally:
        logging.disable(previous)
    onnx_program.save(path)
    model = onnx.load(path)
    from .deploy import layout_of

    # The flat layout every artifact carries (README, torch_ext.deploy.layout_of): inputs in order,
    # outputs (loss, new state, aux leaves), shapes, fingerprint, scheduler.
    layout = layout_of(step)
    if len(layout["inputs"]) != len(model.graph.input) or len(layout["outputs"]) != len(model.graph.output):
        raise RuntimeError(f"to_onnx: the ONNX model has {len(model.graph.input)} inputs and {len(model.graph.output)} "
                           f"outputs, the step's layout {len(layout['inputs'])} and {len(layout['outputs'])}")
    layout["input_state_names"] = [n for n in layout["inputs"] if not n.startswith("batch:")]
    layout["num_inputs"] = len(model.graph.input)
    entry = model.metadata_props.add()
    entry.key, entry.value = "torch_ext.layout", json.dumps(layout)
    onnx.save(model, path)
    try:
        _check_against_the_program(step, path, layout)
    except Exception:
        os.remove(path)  # a file that trains differently is not left behind
        raise
    return path


def _check_against_the_program(step, path: str, layout: dict) -> None:
    """Runs the exported file once in onnxruntime (when installed) on the step's example inputs and
    compares every output with the program's (run on the executor): the exporter has translated ops
    as something else before (training-mode batch norm as inference, nll_loss_backward's mean
    reduction).

    The tolerance of each output is 1e-4 of its scale, widened only by what the program itself does
    with rounding-sized changes of its inputs (``_rounding_spread``): a parameter whose gradient is
    rounding noise (a Linear bias before a training-mode BatchNorm, whose true gradient is 0) moves
    by about lr under Adam, whose update divides the noise by its own size, in whichever direction
    the noise points; the program moves it as far when its inputs change by 1 part in 2**20. A
    mistranslated op is still refused: a well-conditioned output keeps the 1e-4 tolerance."""
    try:
        import onnxruntime as ort
    except ImportError:
        return
    batch = step._example_batch * (step.unroll * step.accumulate)
    flat = step.flat_inputs(step._fresh_state(), *batch)
    # The executor is the program's reference semantics (ExportedProgram.module() runs a view the
    # executor reshapes: batch norm's CPU kernels lay out a transposed input's result otherwise
    # than their meta kernels, csrc/runtime/kernel.cpp).
    want = step._executor.run(list(flat))
    got = _run_once(ort, path, flat)
    spread = None
    for k, (name, w, g) in enumerate(zip(layout["outputs"], want, got)):
        w = w.detach()
        if g.shape != w.shape or g.dtype != w.dtype:
            raise RuntimeError(f"to_onnx: output {name!r} of the ONNX model has shape {tuple(g.shape)} and dtype "
                               f"{g.dtype}, the program's {tuple(w.shape)} and {w.dtype}")
        if not w.is_floating_point():
            ok, tol = torch.equal(g, w), 0.0
        else:
            tol = _base_tolerance(w)
            diff = _max_diff(g, w)
            if diff > tol:
                if spread is None:
                    spread = _rounding_spread(step, flat, want)
                tol = max(tol, 4 * spread[k])
            ok = diff <= tol
        if not ok:
            diff = _max_diff(g, w) if w.is_floating_point() else float("nan")
            raise RuntimeError(f"to_onnx: the ONNX model computes output {name!r} differently from the program on the "
                               f"step's example inputs (max |difference| {diff:.3g}, tolerance {tol:.3g}): torch "
                               f"{torch.__version__}'s ONNX exporter mistranslates an op of this step; file not written")


def _run_once(ort, path: str, inputs) -> list[torch.Tensor]:
    """The ONNX file's outputs for ``inputs`` (positional, in the model's input order), in a fresh CPU session."""
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(g) for g in session.run(None, feeds)]


def _base_tolerance(want: torch.Tensor) -> float:
    """1e-4 of an output's scale (at least 1): what two runtimes' float32 kernels may differ by."""
    return 1e-4 * (max(1.0, float(want.double().abs().max())) if want.numel() else 1.0)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, NaN where only one side is NaN (so it never passes a tolerance), 0 where both are."""
    if not b.numel():
        return 0.0
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = torch.where(same, torch.zeros_like(a), (a - b).abs())
    return float("inf") if not bool(torch.isfinite(d).all()) else float(d.max())


def _rounding_spread(step, flat: list, want: list) -> list[float]:
    """Per output, how far the program's own output moves when every floating input tensor (batch
    and state, not the scalars: lr, step counts) is scaled by 1 +- 2**-20 or 1 + 2**-19, i.e. by a
    few float32 roundings: the part of an output that rounding noise decides."""
    spread = [0.0] * len(want)
    for factor in (1 + 2.0 ** -20, 1 - 2.0 ** -20, 1 + 2.0 ** -19):
        moved = [t * factor if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0 else t
                 for t in flat]
        for k, (a, b) in enumerate(zip(step._executor.run(moved), want)):
            if isinstance(b, torch.Tensor) and b.is_floating_point():
                spread[k] = max(spread[k], _max_diff(a.detach(), b.detach()))
    return spread


class OnnxStep:
    """``loss, state = onnx_step(state, *batch)`` on a plain onnxruntime session (``.session``).

    ``state`` is a ``TrainState`` (the result is one too) or a dict {state name: tensor} (the result
    is a new dict), so a deployment needs neither the model nor the step that made the file."""

    def __init__(self, path: str, *, scheduler=None, manual_lr: bool = False):
        import json

        import onnx
        import onnxruntime as ort

        from .deploy import loaded_schedule

        meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
        if "torch_ext.layout" not in meta:
            raise ValueError(f"{path}: no torch_ext.layout metadata (not written by torch_ext.onnx.to_onnx)")
        self.layout = json.loads(meta["torch_ext.layout"])
        # A dict state carries no scheduler epoch: following a scheduler takes a TrainState.
        self.schedule = loaded_schedule(self.layout, path, scheduler, manual_lr)
        self.path = path
        self.state_names = list(self.layout["state_names"])
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self._input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, state, *batch):
        from .deploy import refuse_state_dict

        refuse_state_dict(state, f"load_step({self.path!r})")  # (a flat {name: tensor} dict is taken)
        is_dict = isinstance(state, dict)
        if not is_dict:
            from .train_step import TrainState

            if not isinstance(state, TrainState):
                raise TypeError(f"the ONNX step takes a TrainState or a dict of state tensors, got {type(state).__name__}")
            if state.consumed_by is not None:  # its tensors hold the next state's values (as load_step refuses)
                raise ValueError(f"{state.describe()} was donated to {state.consumed_by}; use the state that call "
                                 "returned")
            made_by = self.layout.get("fingerprint")
            if made_by is not None and state.fingerprint != made_by:
                raise ValueError(f"{state.describe()} was made by a different program (fingerprint "
                                 f"{state.fingerprint!r}) than this ONNX step (fingerprint {made_by!r})")
            if self.schedule is not None:
                self.schedule.check_state(state, f"load_step({self.path!r})")
        elif self.schedule is not None:
            raise TypeError(f"load_step({self.path!r}) follows a scheduler, which counts epochs in a TrainState: "
                            "pass a TrainState, not a dict")
        lookup = state.__getitem__ if is_dict else state.lookup
        try:
            entries = [lookup(n) for n in self.layout["input_state_names"]]
        except KeyError as e:
            raise KeyError(f"the state has no entry {e} that this ONNX step needs") from None
        # Each entry's shape and dtype as exported (load_step of a .pt2 checks the same): onnxruntime
        # checks a tensor input's rank only when the model declares it above 0, so a scalar entry given
        # with another shape (a step count or lr of shape (1,), a float64 lr tensor of several values)
        # was accepted and broadcast into the update, returning state entries of other shapes.
        declared = self.layout.get("state", {})
        for name, t in zip(self.layout["input_state_names"], entries):
            w = declared.get(name)
            if w is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state entry {name!r}: expected a tensor, got {type(t).__name__}")
            if list(t.shape) != w["shape"] or str(t.dtype) != w["dtype"]:
                raise ValueError(f"state entry {name!r} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                                 f"{self.path} expects {tuple(w['shape'])} and {w['dtype']}")
        want = self.layout.get("batch")
        if want is not None:
            from .deploy import LoadedStep

            # Matched by key path, as load_step of a .pt2 does: tree_leaves lists a dict's leaves in its
            # insertion order, so a loader whose dicts list their keys in another order than the saved
            # example's fed same-shaped tensors to the wrong inputs, silently.
            leaves = LoadedStep._batch_leaves(batch, want)
        else:  # a file written before the layout recorded the batch
            leaves = list(torch.utils._pytree.tree_leaves(batch))
        if len(entries) + len(leaves) != len(self._input_names):
            raise ValueError(f"the ONNX step takes {len(self._input_names) - len(entries)} batch tensors, got "
                             f"{len(leaves)}")
        for i, (t, w) in enumerate(zip(leaves, want or ())):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"batch[{i}]: expected a tensor, got {type(t).__name__}")
            if list(t.shape) != w["shape"] or str(t.dtype) != w["dtype"]:
                raise ValueError(f"batch[{i}]: {self.path} expects shape {tuple(w['shape'])} and dtype {w['dtype']}, "
                                 f"got shape {tuple(t.shape)} and dtype {t.dtype}")
        if "inputs" in self.layout:  # the program's own input order (state and batch entries may interleave)
            by_state = dict(zip(self.layout["input_state_names"], entries))
            flat = [leaves[int(n[len("batch:"):])] if n.startswith("batch:") else by_state[n]
                    for n in self.layout["inputs"]]
        else:  # written before the layout named every input: state entries, then the batch
            flat = entries + leaves
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(self._input_names, flat)}
        outs = [torch.from_numpy(o) for o in self.session.run(None, feeds)]
        new = dict(zip(self.state_names, outs[1:1 + len(self.state_names)]))
        new_state = {**state, **new} if is_dict else state.replace(new)
        if self.schedule is not None:
            self.schedule.advance(new_state, state.sched_epoch + int(self.layout.get("unroll", 1)))
        if self.layout.get("aux_spec") is not None:  # (loss, state, aux), as the step itself returns
            spec = torch.utils._pytree.treespec_loads(self.layout["aux_spec"])
            return outs[0], new_state, torch.utils._pytree.tree_unflatten(outs[1 + len(self.state_names):], spec)
        return outs[0], new_state


def load_onnx_step(path: str, *, scheduler=None, manual_lr: bool = False) -> OnnxStep:
    """The ONNX step written by ``to_onnx`` as a state-in, state-out callable (``scheduler=`` and
    ``manual_lr=`` as for ``torch_ext.load_step``)."""
    return OnnxStep(path, scheduler=scheduler, manual_lr=manual_lr)


def forward_to_onnx(model: torch.nn.Module, example_inputs: tuple, path: str) -> str:
    """Exports ``model``'s inference forward (eval mode) to ONNX with the dynamo exporter, the
    companion of ``to_onnx`` for deployment; ``load_forward`` runs it in ONNX Runtime."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"forward_to_onnx: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple) or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        raise TypeError("forward_to_onnx: example_inputs must be a tuple of tensors")
    if model.training:
        raise ValueError("forward_to_onnx exports inference: call model.eval() first (dropout and batch "
                         "statistics would otherwise be baked in)")
    from . import _compat

    program = torch.export.export(model, _compat.distinct_inputs(example_inputs))  # (x, x): two inputs
    # optimize=False for the same reason as to_onnx: the graph optimizer drops small additive constants.
    onnx_program = torch.onnx.export(program, (), dynamo=True, verbose=False, optimize=False)
    onnx_program.save(path)
    try:
        _check_forward_against_eager(model, example_inputs, path)
    except Exception:
        os.remove(path)  # a file that computes otherwise is not left behind
        raise
    return path


def _check_forward_against_eager(model: torch.nn.Module, example_inputs: tuple, path: str) -> None:
    """Runs the exported forward once in onnxruntime (when installed) on the example inputs against eager, each
    output within 1e-4 of its scale (to_onnx's check of the step, without its rounding-spread widening: a forward
    has no optimizer to amplify noise). The exporter has mistranslated ops before (to_onnx's check found two)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return
    import torch.utils._pytree as pytree

    with torch.no_grad():
        want = [t for t in pytree.tree_leaves(model(*example_inputs)) if isinstance(t, torch.Tensor)]
    got = _run_once(ort, path, example_inputs)
    if len(got) != len(want):
        raise RuntimeError(f"forward_to_onnx: the ONNX model has {len(got)} outputs, the model's forward returns "
                           f"{len(want)} tensors")
    for k, (g, w) in enumerate(zip(got, want)):
        w = w.detach().cpu()
        if g.shape != w.shape:
            raise RuntimeError(f"forward_to_onnx: output {k} of the ONNX model has shape {tuple(g.shape)}, the "
                               f"model's {tuple(w.shape)}")
        if not w.is_floating_point():
            ok, diff, tol = torch.equal(g, w.to(g.dtype)), float("nan"), 0.0
        else:
            tol = _base_tolerance(w)
            diff = _max_diff(g, w)
            ok = diff <= tol
        if not ok:
            raise RuntimeError(f"forward_to_onnx: the ONNX model computes output {k} differently from the model on "
                               f"the example inputs (max |difference| {diff:.3g}, tolerance {tol:.3g}): torch "
                               f"{torch.__version__}'s ONNX exporter mistranslates an op of this model; file not "
                               "written")


class OnnxForward:
    """An ONNX forward in an ``onnxruntime.InferenceSession`` (``.session``): tensors in, tensors out."""

    def __init__(self, path: str):
        import onnxruntime as ort

        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self._input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != len(self._input_names):
            raise ValueError(f"the ONNX forward takes {len(self._input_names)} inputs, got {len(inputs)}")
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(self._input_names, inputs)}
        outs = [torch.from_numpy(o) for o in self.session.run(None, feeds)]
        return outs[0] if len(outs) == 1 else tuple(outs)


def load_forward(path: str) -> OnnxForward:
    """The forward written by ``forward_to_onnx`` as a callable backed by ONNX Runtime."""
    return OnnxForward(path)
