"""torch_ext.load_step: a saved pure step back as a callable that takes and returns a TrainState.

Three artifacts, one flat layout, written into each artifact's metadata under ``torch_ext.layout``
(JSON, see ``layout_of``):

- ``torch.export.save(step.program, "step.pt2")``: the ExportedProgram (the layout rides in
  ``graph_module.meta["custom"]``, which torch.export serializes); ``load_step`` runs it on the
  C++ executor, bit-exact with the in-memory step.
- ``step.to_aoti("step_aoti.pt2")``: the AOTInductor package (the layout is package metadata,
  ``AOTIModelPackageLoader::get_metadata()`` in C++).
- ``step.to_onnx("step.onnx")``: ONNX (``torch_ext.onnx``; the layout is a model metadata prop).

The loader reads only the artifact: the state entries it feeds, in order, and the outputs it
gets back come from the layout, never from a live ``TrainStep``.
"""
from __future__ import annotations

import json
import os
import zipfile

import torch
import torch.utils._pytree as pytree

from . import _C, _compat

LAYOUT_KEY = "torch_ext.layout"
FORMAT = "torch_ext.train_step/1"
_BATCH = "batch:"  # input entries "batch:<i>" are the i-th flat batch leaf; every other entry is a state name

__all__ = ["load_step", "LoadedStep", "layout_of", "LAYOUT_KEY"]


def layout_of(step) -> dict:
    """The flat I/O layout of ``step.program`` (JSON-serializable).

    ``inputs``: one entry per program input, a state name (``state.lookup(name)``: "model.<p>",
    "opt:<param>:<slot>", "opt:lr:group<k>", a scheduled hyperparameter "opt:<scalar>:group<k>"
    (momentum, beta1: fed per call like the lr, when a scheduler cycles momentum), "rng") or
    "batch:<i>" (the i-th leaf of the flat
    batch; unrolled/accumulated calls concatenate their batches). ``outputs``: "loss", then the new
    state entries ``state_names``, then "aux:<i>" leaves of ``aux_spec``.
    """
    init = step._fresh_state()  # shapes and dtypes only: no broadcast (one rank may export)
    inputs, i = [], 0
    for name, role in step._inputs:
        if role == "input":
            inputs.append(f"{_BATCH}{i}")
            i += 1
        else:
            inputs.append(name)
    entries = {name: init.lookup(name) for name in inputs if not name.startswith(_BATCH)}
    num_aux = 0 if step._aux_spec is None else step._aux_spec.num_leaves
    return {
        "format": FORMAT,
        "fingerprint": step.fingerprint,
        "inputs": inputs,
        "state_names": list(step.state_names),
        "outputs": ["loss", *step.state_names, *(f"aux:{k}" for k in range(num_aux))],
        "aux_spec": None if step._aux_spec is None else pytree.treespec_dumps(step._aux_spec),
        "params": sorted(init.params),
        "num_lr": len(init.lr),
        "state": {n: {"shape": list(t.shape), "dtype": str(t.dtype)} for n, t in entries.items()},
        "batch": [{"shape": list(t.shape), "dtype": str(t.dtype), "stride": list(t.stride()), "path": pytree.keystr(path)}
                  for t, path in zip(step._example_leaves, step.batch_paths)],
        "unroll": step.unroll,
        "accumulate": step.accumulate,
        # The lr is an input the program does not advance: a scheduler is Python, so load_step needs
        # it back (scheduler=) to follow it, or manual_lr=True to train at the lr the caller sets.
        "scheduler": step._schedule is not None,
        # Each optimizer's class and its param groups' parameter shapes, in the step's order (the order
        # of the lr inputs): load_step(path, scheduler=[...]) puts the schedulers' optimizers in this
        # order, as the step itself does, whatever order the list gives them in.
        "optimizers": [optimizer_signature(o) for o in step.optimizers],
        # A data-parallel step (process_group=): the program all-reduces each gradient over the group of
        # this name, scaled by 1/world_size, and with ZeRO-1 slices the optimizer state by this rank; a
        # loaded artifact runs only in a group of that size (and, with ZeRO-1, on that rank).
        "data_parallel": None if step._dp is None else {k: step._dp[k] for k in
                                                        ("group_name", "world_size", "rank", "shard_optimizer_state")},
    }


def example_digest(names: list, flat: list) -> str:
    """A digest of the state entries among a program's example inputs (``names``: the layout's
    ``inputs``; batch leaves left out): tells ``example_state`` whether the example inputs are still
    the ones whose scheduler epoch the layout's ``example_sched_epoch`` records."""
    import hashlib

    state = [t.detach() for name, t in zip(names, flat) if not name.startswith(_BATCH)]
    return hashlib.sha256(repr(_C.content_digests(state)).encode()).hexdigest()[:16]


def optimizer_signature(opt) -> dict:
    """An optimizer's class name and, per param group, its parameters' shapes: what a loaded artifact
    can tell of the optimizers of the step it was saved from (not their parameters' names)."""
    return {"type": type(opt).__name__, "groups": [[list(p.shape) for p in g["params"]] for g in opt.param_groups]}


def _in_saved_order(optimizers: list, saved, path: str) -> list:
    """The schedulers' optimizers in the order of the step's own (``saved``: the layout's
    ``optimizers``), matched by param-group shapes, then class; optimizers alike in both keep the
    order given. An artifact from before the layout recorded them keeps the order given."""
    if saved is None:
        return optimizers
    if len(optimizers) != len(saved):
        raise ValueError(f"load_step: {path} was saved from a step with {len(saved)} optimizers "
                         f"({', '.join(o['type'] for o in saved)}), the schedulers given drive {len(optimizers)}; "
                         "pass a scheduler for each of the step's optimizers")
    remaining, ordered = list(optimizers), []
    for j, want in enumerate(saved):
        # by its groups' shapes; the class only breaks ties (a subclass of the step's optimizer, or the
        # class itself, schedules the same lrs)
        alike = [i for i, o in enumerate(remaining) if optimizer_signature(o)["groups"] == want["groups"]]
        k = next((i for i in alike if type(remaining[i]).__name__ == want["type"]), alike[0] if alike else None)
        if k is None:
            got = "; ".join(f"{optimizer_signature(o)['type']} with groups of shapes {optimizer_signature(o)['groups']}"
                            for o in remaining)
            raise ValueError(f"load_step: {path} was saved from a step whose optimizer {j} is {want['type']} with "
                             f"param groups of shapes {want['groups']}, and no scheduler given drives one like it "
                             f"(left: {got}); pass the schedulers of the step's optimizers")
        ordered.append(remaining.pop(k))
    return ordered


# torch dtype -> ATen ScalarType name (c10::toString), for the C++ runner's batch check.
_SCALAR_TYPE = {"torch.float32": "Float", "torch.float64": "Double", "torch.float16": "Half",
                "torch.bfloat16": "BFloat16", "torch.int64": "Long", "torch.int32": "Int", "torch.int16": "Short",
                "torch.int8": "Char", "torch.uint8": "Byte", "torch.bool": "Bool", "torch.complex64": "ComplexFloat",
                "torch.complex128": "ComplexDouble"}


def aoti_metadata(layout_json: str) -> dict[str, str]:
    """The AOTInductor package metadata for a step: the JSON layout, and for C++ readers (which have
    no JSON parser at hand, tests/cpp/aoti/aoti_train.cpp) as plain text (names newline separated):
    its input names, state names, output names (the loss, the state entries it returns, aux), the
    donated state entries (written into the input tensors, not returned), the fingerprint,
    whether the step was built with scheduler= ("1": its lr input follows a Python scheduler), and
    each batch leaf's dtype and shape ("torch_ext.batch", one "<ScalarType>:<d0>,<d1>,..." line per
    leaf); and
    for a package compiled for other than contiguous inputs (to_aoti's channels_last) each
    input's strides, one "<rank>:<s0>,<s1>,..." line per input."""
    layout = json.loads(layout_json)
    extra = {}
    # Each batch leaf's dtype (ATen's ScalarType name, as c10::toString prints it) and shape, one
    # "<dtype>:<d0>,<d1>,..." line per leaf: AOTInductor's kernels read a batch tensor with the
    # compiled shape and dtype, unchecked (a float64 batch, or a last partial batch that is a view of
    # a full one, trained silently on other values), so the C++ runner checks every call's batch.
    extra["torch_ext.batch"] = "\n".join(f"{_SCALAR_TYPE.get(b['dtype'], '?')}:{','.join(map(str, b['shape']))}"
                                         for b in layout["batch"])
    # Each batch leaf's pytree key path ("[0]['tokens']"), one per line: the C++ runner matches a dict
    # batch by key, as load_step does (positionally, a loader's dict in another key order fed the
    # wrong tensors, silently, where shapes and dtypes agree).
    # Each state input's dtype and shape, "<name>=<ScalarType>:<d0>,...": the package's kernels read a
    # state entry unchecked too (a float32 lr was read as float64 by the C++ runner, silently).
    extra["torch_ext.state"] = "\n".join(f"{name}={_SCALAR_TYPE.get(e['dtype'], '?')}:{','.join(map(str, e['shape']))}"
                                         for name, e in layout["state"].items())
    if all(b.get("path") is not None for b in layout["batch"]):
        extra["torch_ext.batch_paths"] = "\n".join(b["path"] for b in layout["batch"])
    if "input_strides" in layout:
        extra["torch_ext.input_strides"] = "\n".join(f"{len(s)}:{','.join(map(str, s))}" for s in layout["input_strides"])
    return {**extra, LAYOUT_KEY: layout_json, "torch_ext.inputs": "\n".join(layout["inputs"]),
            "torch_ext.state_names": "\n".join(layout["state_names"]),
            "torch_ext.outputs": "\n".join(layout["outputs"]),
            "torch_ext.donated": "\n".join(layout.get("donated", [])),
            "torch_ext.fingerprint": layout["fingerprint"],
            "torch_ext.scheduler": "1" if layout.get("scheduler") else "0",
            # the scheduler epochs one call advances (aoti_train --save-state)
            "torch_ext.unroll": str(int(layout.get("unroll", 1)))}


def _check_layout(layout, path: str) -> dict:
    if not isinstance(layout, dict) or layout.get("format") != FORMAT:
        got = layout.get("format") if isinstance(layout, dict) else type(layout).__name__
        raise ValueError(f"{path}: {LAYOUT_KEY} metadata has format {got!r}, this torch_ext reads {FORMAT!r}")
    return layout


class LoadedStep:
    """``loss, new_state = loaded(state, *batch)`` (plus aux when the step returns it) from an artifact.

    ``kind`` is "exported_program" or "aoti"; ``layout`` is the artifact's flat I/O layout; ``runner``
    the object that runs the flat program (a ``torch_ext.Executor`` or an AOTInductor model).
    A state is accepted when its fingerprint is the artifact's (``step.init_state()``, a state
    returned by a call, or one loaded with ``torch.load``), so a state of another program is refused
    in any process.
    """

    def __init__(self, path: str, kind: str, layout: dict, runner, schedule=None):
        self.path, self.kind, self.layout, self.runner = path, kind, _check_layout(layout, path), runner
        self.schedule = schedule
        self.state_names = list(layout["state_names"])
        self._aux_spec = None if layout["aux_spec"] is None else pytree.treespec_loads(layout["aux_spec"])
        self._calls = 0
        # An AOTInductor package allocates its intermediates and outputs afresh every call; run it in
        # a CallPool (csrc/runtime/call_pool.h) so the next call reuses those blocks instead of
        # first-touching new pages (GPT-2 / ResNet-18 benchmark steps: ~14,000-16,000 page faults).
        # Only the calling thread's allocations inside the call are pooled; release_memory() frees
        # the cache.
        self._pool = _C.CallPool() if kind == "aoti" else None
        # State entries and batch tensors copied into the package's compiled strides (flat_inputs).
        self.converted_entries = 0

    @property
    def fingerprint(self) -> str:
        return self.layout["fingerprint"]

    def flat_inputs(self, state, *batch) -> list:
        """The program's positional inputs for ``state`` and ``batch``, in the artifact's order."""
        from .train_step import TrainState

        if not isinstance(state, TrainState):
            refuse_state_dict(state, f"load_step({self.path!r})")
            raise TypeError(f"load_step({self.path!r}) takes a TrainState, got {type(state).__name__}")
        if state.consumed_by is not None:
            raise ValueError(f"{state.describe()} was donated to {state.consumed_by}; use the state that call returned")
        if state.fingerprint != self.fingerprint:
            raise ValueError(f"{state.describe()} was made by a different program (fingerprint {state.fingerprint!r}) "
                             f"than {self.path} (fingerprint {self.fingerprint!r}); use a state of the step that "
                             "saved this artifact")
        if self.schedule is not None:
            self.schedule.check_state(state, f"load_step({self.path!r})")
        check_process_group(self.layout.get("data_parallel"), self.path)
        want = self.layout["batch"]
        leaves = self._batch_leaves(batch, want)
        if len(leaves) != len(want):
            raise ValueError(f"{self.path} takes {len(want)} batch tensors, got {len(leaves)}")
        for i, (t, w) in enumerate(zip(leaves, want)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"batch[{i}]: expected a tensor, got {type(t).__name__}")
            if list(t.shape) != w["shape"] or str(t.dtype) != w["dtype"]:
                raise ValueError(f"batch[{i}]: {self.path} expects shape {tuple(w['shape'])} and dtype {w['dtype']}, "
                                 f"got shape {tuple(t.shape)} and dtype {t.dtype}")
        flat = []
        for name in self.layout["inputs"]:
            if name.startswith(_BATCH):
                i = int(name[len(_BATCH):])
                flat.append(self._batch_in_layout(leaves[i], want[i]))
                continue
            try:
                t = state.lookup(name)
            except (KeyError, IndexError):
                raise ValueError(f"{state.describe()} has no entry {name!r} that {self.path} reads") from None
            w = self.layout["state"][name]
            if list(t.shape) != w["shape"] or str(t.dtype) != w["dtype"]:
                raise ValueError(f"{state.describe()}: entry {name!r} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                                 f"{self.path} expects {tuple(w['shape'])} and {w['dtype']}")
            flat.append(t)
        donated = self.layout.get("donated")
        # (A .pt2's executor copies a state entry in other strides than traced, the channels-last state
        # of an AOTInductor package, into the traced ones itself: runtime::to_traced_layout.)
        if self.kind == "aoti":
            # AOTInductor's kernels index their inputs with the strides the program was compiled for
            # (the layout's input_strides: contiguous, and channels-last convolution weights and
            # moments; contiguous for a package without them), without checking: other strides would
            # be read as garbage. An entry in other strides is copied into the compiled ones; the
            # package's new state has them, so a state is converted once, on its first call. A
            # donating package then writes into the copy, which the new state holds.
            strides = self.layout.get("input_strides")
            for i, (name, t) in enumerate(zip(self.layout["inputs"], flat)):
                want = None if strides is None else tuple(strides[i])
                if (t.is_contiguous() if want is None else t.stride() == want):
                    continue
                flat[i] = t.contiguous() if want is None else torch.empty_strided(t.shape, want, dtype=t.dtype,
                                                                                  device=t.device).copy_(t)
                self.converted_entries += 1
        if donated:
            # The package writes each donated entry into its tensor: two entries sharing memory would
            # overwrite each other's new values.
            seen = {}
            for name, t in zip(self.layout["inputs"], flat):
                if name not in donated:
                    continue
                key = t.untyped_storage().data_ptr()
                if key in seen:
                    raise ValueError(f"{state.describe()}: entries {seen[key]!r} and {name!r} share memory, and "
                                     f"{self.path} updates both in place (a donating package); pass a state whose "
                                     "entries are separate tensors (e.g. cloned)")
                seen[key] = name
        return flat

    @staticmethod
    def _batch_in_layout(t, entry):
        """A batch leaf in the strides the program was traced with (recorded in the layout; an older
        artifact records none), as the step itself does (train_step.in_layout_of)."""
        from .train_step import in_layout_of

        if "stride" not in entry:
            return t
        return in_layout_of(t, torch.empty_strided(entry["shape"], entry["stride"], dtype=t.dtype, device="meta"),
                            f"batch{entry.get('path', '')}")

    @staticmethod
    def _batch_leaves(batch, want) -> list:
        """The batch's leaves in the artifact's order: matched by key path where the layout records
        them (a dict's keys in another order than the saved example's), else by position."""
        _compat.register_batch_containers()
        with_paths = pytree.tree_flatten_with_path(batch)[0]
        saved = [w.get("path") for w in want]
        if None in saved:
            return [leaf for _, leaf in with_paths]  # an artifact from before paths were recorded
        by_path = {pytree.keystr(p): leaf for p, leaf in with_paths}
        if len(by_path) == len(with_paths) and set(by_path) == set(saved):
            return [by_path[p] for p in saved]
        if len(by_path) == len(with_paths) and any("['" in p for p in saved + list(by_path)):
            missing, extra = sorted(set(saved) - set(by_path)), sorted(set(by_path) - set(saved))
            raise ValueError(f"the batch's keys differ from the saved example batch's: missing "
                             f"{', '.join(missing) or 'none'}; not in the example: {', '.join(extra) or 'none'}")
        return [leaf for _, leaf in with_paths]

    def __call__(self, state, *batch):
        flat = self.flat_inputs(state, *batch)
        outs = list(self._run(flat))
        if len(outs) != len(self.layout["outputs"]):
            raise RuntimeError(f"{self.path}: the program returned {len(outs)} outputs, its layout lists "
                               f"{len(self.layout['outputs'])}")
        self._calls += 1
        by_name = dict(zip(self.layout["outputs"], outs))
        # A donating package (step.to_aoti(path, donate=True)) wrote these entries into the state's
        # own tensors: the new state holds them, and the old one is consumed.
        donated = self.layout.get("donated", [])
        # (the tensors passed: a state entry itself, or the copy flat_inputs made in the compiled strides)
        passed = dict(zip(self.layout["inputs"], flat))
        by_name.update((name, passed[name]) for name in donated)
        new_state = state.replace({name: by_name[name] for name in self.state_names})
        new_state.origin = f"output of call {self._calls} of load_step({self.path!r})"
        if self.schedule is not None:
            self.schedule.advance(new_state, state.sched_epoch + int(self.layout.get("unroll", 1)))
        if donated:
            state.consumed_by = f"load_step({self.path!r}) (call {self._calls})"
        if self._aux_spec is not None:
            aux = [by_name[f"aux:{k}"] for k in range(self._aux_spec.num_leaves)]
            return by_name["loss"], new_state, pytree.tree_unflatten(aux, self._aux_spec)
        return by_name["loss"], new_state

    def _run(self, flat: list):
        if self._pool is not None:
            return self._pool.call(self.runner, *flat)
        return self.runner(*flat)

    def memory_stats(self) -> dict:
        """The AOTInductor call pool's counters: cached_bytes (kept for the next call), reused_blocks
        and fresh_blocks (allocations served from the cache, and newly made, since loading); {} for
        other kinds."""
        return {} if self._pool is None else dict(self._pool.stats())

    def release_memory(self) -> None:
        """Frees the blocks an AOTInductor package's calls cached (the next call allocates afresh)."""
        if self._pool is not None:
            self._pool.release()

    def load_state(self, saved):
        """A saved state of this artifact as a TrainState: ``saved`` is a path to ``torch.save(state.state_dict())``
        or to what ``build/aoti_train ... --save-state out.pt`` wrote (the same format), or that dict.
        Its fingerprint must be this artifact's, and every entry the program reads must have the
        compiled shape and dtype; the scheduler epoch, RNG and "unstepped" are kept, so the state
        continues exactly where the run that saved it stopped."""
        from .train_step import TrainState

        what = repr(saved) if isinstance(saved, (str, os.PathLike)) else "the dict"
        if isinstance(saved, (str, os.PathLike)):
            saved = torch.load(os.fspath(saved), weights_only=True)
        if not isinstance(saved, dict) or not _STATE_DICT_KEYS - {"sched_epoch"} <= set(saved):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"load_state: {what} is not a state_dict() (keys {sorted(_STATE_DICT_KEYS)}), got {got}")
        if saved["fingerprint"] != self.fingerprint:
            raise ValueError(f"load_state: {what} was made by a different program (fingerprint "
                             f"{saved['fingerprint']!r}) than {self.path} (fingerprint {self.fingerprint!r})")
        state = TrainState(dict(saved["params"]), dict(saved["buffers"]), dict(saved["opt"]), list(saved["lr"]),
                           rng=saved["rng"], sched_epoch=int(saved.get("sched_epoch", 0)),
                           fingerprint=self.fingerprint, unstepped=tuple(saved.get("unstepped", ())))
        for name, want in self.layout["state"].items():
            try:
                t = state.lookup(name)
            except (KeyError, IndexError):
                raise ValueError(f"load_state: {what} has no entry {name!r} that {self.path} reads") from None
            if not isinstance(t, torch.Tensor) or list(t.shape) != want["shape"] or str(t.dtype) != want["dtype"]:
                got = f"shape {tuple(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"load_state: {what}: entry {name!r} has {got}, {self.path} expects shape "
                                 f"{tuple(want['shape'])} and dtype {want['dtype']}")
        state.origin = f"load_state({what}) of load_step({self.path!r})"
        return state

    def example_state(self, sched_epoch: int | None = None):
        """The state stored as the ExportedProgram's example inputs (``step.init_state()``, or the
        trained state ``torch-ext step --steps N --export`` ships), as a TrainState of this artifact.

        Its scheduler epoch (a step built with ``scheduler=``) is not an input: the layout records the
        epoch of the example inputs ``step.program`` was exported with, and ``sched_epoch=`` gives it
        for example inputs set by hand (``program.example_inputs = ...``, e.g. a trained state's
        ``step.flat_inputs(state, ...)``: pass ``state.sched_epoch``). Taken as 0, the scheduler would
        restart its schedule from the trained lr, silently where the two lrs agree (StepLR before its
        first decay)."""
        from . import optim
        from .train_step import TrainState

        example = getattr(self, "_example_inputs", None)
        if example is None:
            raise ValueError(f"{self.path}: only a torch.export .pt2 carries example inputs (this is {self.kind}); "
                             "load a saved state with torch.load(path, weights_only=True)")
        if sched_epoch is not None and (isinstance(sched_epoch, bool) or not isinstance(sched_epoch, int)
                                        or sched_epoch < 0):
            raise ValueError(f"example_state: sched_epoch must be an int >= 0, got {sched_epoch!r}")
        if sched_epoch is None:
            recorded = self.layout.get("example_sched_epoch")
            if not self.layout.get("scheduler"):
                sched_epoch = 0  # a state of a step without scheduler= counts no epochs
            elif recorded is not None and example_digest(self.layout["inputs"], example) == recorded["digest"]:
                sched_epoch = recorded["epoch"]
            else:
                raise ValueError(f"example_state: {self.path} was saved from a step built with scheduler=, and its "
                                 "example inputs are not the ones step.program was exported with (set by hand, e.g. "
                                 "a trained state), so the scheduler epoch they were made at is not recorded; pass "
                                 "example_state(sched_epoch=state.sched_epoch) of the state they came from")
        values = dict(zip(self.layout["inputs"], example))
        params = set(self.layout["params"])
        state = TrainState(
            params={n: values[n] for n in self.layout["params"]},
            # buffers, and tensor constants ("model.<...>" from forward, unprefixed from the loss function)
            buffers={n: v for n, v in values.items() if n not in params and n != "rng" and not n.startswith(_BATCH)
                     and optim.parse_state_name(n) is None},
            opt={n: v for n, v in values.items() if (optim.parse_state_name(n) or ("",))[0] in ("slot", "hyper")},
            lr=[values[optim.lr_name(k)] for k in range(self.layout["num_lr"])],
            rng=values.get("rng"), sched_epoch=sched_epoch, fingerprint=self.fingerprint)
        state.origin = f"example_state() of load_step({self.path!r})"
        return state


def check_process_group(dp: dict | None, path: str) -> None:
    """Refuses to run a data-parallel artifact (layout ``data_parallel``) outside a process group like
    the one it was built for: run in a group of another size, its gradients, scaled by 1/world_size
    as built and summed over the group, were the average times new/old size, silently."""
    if not dp:
        return
    import torch.distributed as dist

    what = (f"{path} was saved from a data-parallel step on {dp['world_size']} ranks (process group "
            f"{dp['group_name']!r}), whose program all-reduces the gradients across that group")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{what}: call torch.distributed.init_process_group(...) with {dp['world_size']} ranks "
                         "first (e.g. under torchrun)")
    try:
        pg = dist.distributed_c10d._resolve_process_group(dp["group_name"])
    except Exception:  # noqa: BLE001 - torch raises RuntimeError or KeyError by version
        raise ValueError(f"{what}, and this process has no process group of that name") from None
    world = dist.get_world_size(pg)
    if world != dp["world_size"]:
        raise ValueError(f"{what}, but that group has {world} ranks here: the program scales each gradient by "
                         f"1/{dp['world_size']} before summing it over the group, so it would train on {world}/"
                         f"{dp['world_size']} of the average gradient; run it on {dp['world_size']} ranks")
    rank = dist.get_rank(pg)
    if dp.get("shard_optimizer_state") and rank != dp["rank"]:
        raise ValueError(f"{what} with its optimizer state sharded (ZeRO-1) for rank {dp['rank']}, but this process "
                         f"is rank {rank}: load each rank's own artifact")


_STATE_DICT_KEYS = frozenset(("params", "buffers", "opt", "lr", "rng", "sched_epoch", "fingerprint"))


def refuse_state_dict(state, who: str) -> None:
    """A loaded step takes a TrainState: refuses ``state.state_dict()`` (the checkpoint format, which
    ``build/aoti_train`` reads) naming how to wrap it, instead of failing on its first entry."""
    if isinstance(state, dict) and _STATE_DICT_KEYS <= set(state):
        raise TypeError(f"{who} takes a TrainState, got the dict of state.state_dict() (fingerprint "
                        f"{state.get('fingerprint')!r}): pass torch_ext.TrainState(**d), which keeps its fingerprint, "
                        "RNG and scheduler epoch")


def _pt2_kind(path: str) -> str:
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not a .pt2 archive (not a zip file)") from None
    if any("/data/aotinductor/" in n for n in names):
        return "aoti"
    if any(n.endswith("/models/model.json") for n in names):
        return "exported_program"
    raise ValueError(f"{path} is neither a torch.export ExportedProgram nor an AOTInductor package")


def _no_layout(path: str, how: str) -> ValueError:
    return ValueError(f"{path} has no {LAYOUT_KEY} metadata, so it is not a torch_ext pure step (or was written "
                      f"before the layout was recorded); {how}")


def loaded_schedule(layout: dict, path: str, scheduler, manual_lr: bool):
    """What a loaded artifact does with its lr input: follow ``scheduler`` (an LRScheduler, or a list of
    them, one per optimizer of the step, in any order) as the in-memory step did, or nothing (``None``).

    A step built with ``scheduler=`` saves a program whose lr is an input it does not advance (a
    scheduler is Python, not graph). Run without its scheduler it would train every call at the
    lr it was given, where the step it came from followed the schedule: so one of ``scheduler=`` or
    ``manual_lr=True`` (the caller sets ``state.lr`` before each call) is required there.
    """
    from . import optim
    from .train_step import _LrSchedule

    built_with = bool(layout.get("scheduler", False))
    if scheduler is None:
        if built_with and not manual_lr:
            raise ValueError(f"load_step: {path} was saved from a step built with scheduler=, and the program does "
                             "not advance its lr input (a scheduler is Python, not part of the artifact): pass "
                             "load_step(path, scheduler=sched) to follow the schedule as the step did (the "
                             "scheduler fresh, or restored at or before the state's epoch), or manual_lr=True to "
                             "set state.lr yourself before each call")
        return None
    if manual_lr:
        raise ValueError("load_step: pass scheduler= or manual_lr=True, not both")
    if not built_with:
        raise ValueError(f"load_step: scheduler= given, but {path} was saved from a step built without one, whose "
                         "states do not count scheduler epochs; build the step with make_train_step(..., "
                         "scheduler=) and save it again")
    schedulers = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
    optimizers = []
    for sch in schedulers:
        opt = getattr(sch, "optimizer", None)
        if opt is not None and not any(opt is o for o in optimizers):
            optimizers.append(opt)
    fed: dict[int, list[str]] = {}  # the scheduled hyperparameters the program takes, per group
    for name in layout["inputs"]:
        parsed = optim.parse_state_name(name) if name.startswith("opt:") else None
        if parsed is not None and parsed[0] == "hyper":
            fed.setdefault(parsed[2], []).append(parsed[1])
    if all(isinstance(sch, torch.optim.lr_scheduler.LRScheduler) for sch in schedulers):  # else refused below
        count = sum(len(o.param_groups) for o in optimizers)
        if count != layout["num_lr"]:
            saved = layout.get("optimizers")
            which = "" if saved is None else f" ({len(saved)}: {', '.join(o['type'] for o in saved)})"
            raise ValueError(f"load_step: the scheduler's optimizers have {count} param groups, {path} takes "
                             f"{layout['num_lr']} lr values; pass a scheduler for each of the step's optimizers{which} "
                             "(a loaded step cannot follow a scheduler of only some of them)")
        # In the step's order: the lr inputs are its optimizers' groups in order, and the step maps each
        # scheduler to its optimizer whatever the list's order (taken as given, a list in another order
        # fed one optimizer's schedule to the other's groups, silently where their lrs agreed at the start).
        optimizers = _in_saved_order(optimizers, layout.get("optimizers"), path)
    return _LrSchedule(schedulers, optimizers, fed)


def load_step(path, *, scheduler=None, manual_lr: bool = False):
    """A saved pure step as a callable ``loss, new_state = loaded(state, *batch)`` over TrainStates.

    ``path`` ends in ``.pt2`` (``torch.export.save(step.program, path)``, run on the C++ executor,
    or ``step.to_aoti(path)``, run by AOTInductor) or ``.onnx`` (``step.to_onnx(path)``, run by an
    onnxruntime ``InferenceSession``, ``.session``). The flat inputs and outputs are read from the
    artifact's ``torch_ext.layout`` metadata.

    A step built with ``scheduler=`` needs ``scheduler=`` here too (its lr follows the scheduler
    from the state's ``sched_epoch``, as the in-memory step's does), or ``manual_lr=True`` (the
    state's lr as the caller sets it); see ``loaded_schedule``.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_step expects a path, got {type(path).__name__}")
    path = os.fspath(path)
    ext = os.path.splitext(path)[1]
    if ext not in (".pt2", ".onnx"):
        raise ValueError(f"load_step: {path!r} has extension {ext or '(none)'!r}; expected .pt2 (torch.export or "
                         "AOTInductor package) or .onnx")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_step: no such file {path!r}")
    if ext == ".onnx":
        from .onnx import OnnxStep

        return OnnxStep(path, scheduler=scheduler, manual_lr=manual_lr)
    kind = _pt2_kind(path)
    if kind == "aoti":
        runner = torch._inductor.aoti_load_package(path)
        meta = runner.get_metadata()
        if LAYOUT_KEY not in meta:
            raise _no_layout(path, "compile it with step.to_aoti(path)")
        layout = json.loads(meta[LAYOUT_KEY])
        return LoadedStep(path, kind, layout, runner, loaded_schedule(layout, path, scheduler, manual_lr))
    from .executor import Executor

    ep = torch.export.load(path)
    layout = (ep.graph_module.meta.get("custom") or {}).get(LAYOUT_KEY)
    if layout is None:
        raise _no_layout(path, "save it with torch.export.save(step.program, path)")
    layout = json.loads(layout)
    loaded = LoadedStep(path, kind, layout, Executor(ep), loaded_schedule(layout, path, scheduler, manual_lr))
    if ep.example_inputs is not None:
        loaded._example_inputs = list(ep.example_inputs[0])
    return loaded
