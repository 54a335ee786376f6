"""The one registry of the process-global patches torch_ext installs while it traces.

To trace what eager computes, torch_ext swaps process-global things for the duration of a trace: module
attributes of torch (aot_autograd's ``make_fx``, the RNN decomposition's helper, ``torch._VF``'s
``_pack_padded_sequence``, the autograd engine's entry, ``inference_mode``'s methods, ...), Python kernels on
ATen ops (``aten.prod``'s Autograd kernel, ``aten.cumprod_backward``'s), Inductor's lowerings, the environment
variable reader, the stack-trace recording of make_fx's module-stack tracer. Stacked by hand in each entry
point, two threads tracing at once saw each other's patches, and one thread's exit removed a patch the other
still relied on (or put back the other's, leaving it installed for good).

Here every patch is entered through ``patched(*names)``:

- under one process-wide re-entrant lock, held for the whole block: **tracing is serialized** (building a
  train step, a ``ReactiveGraph``, a joint export, an AOTInductor package in several threads at once is
  safe, and each waits for the trace before it). Running what was built (a step, a graph, the executor)
  takes no lock and runs concurrently. A traced forward that waits on another thread which itself builds
  would wait forever (the lock is re-entrant on its own thread only): the waiting builder raises instead, at
  once when the holder is joining it (``Thread.join``), or once the holder has stayed blocked in a wait
  (an event, a condition, a queue, a future) for ``HOLDER_BLOCKED_LIMIT_S`` while the builder waits;
- in one fixed order (``ORDER``), and restored in reverse order when the block exits, also when it raises;
- nested (a trace inside a trace, on the thread that holds the lock): a patch already installed is not
  entered again (a collector, which yields what the block saw, is entered again so each level gets its own);
- the patches that replace Python functions act only on the thread that holds the lock
  (``gated``): an eager forward or backward in another thread during a trace runs torch's own code. The
  Python kernels on ATen ops are read only under the Python dispatcher, which is per thread and on only while
  a trace runs; another library tracing in another thread at the same moment (not through torch_ext) would
  see those, and another thread's ``torch.compile`` (dynamo) at that moment would see the function patches too.

When no trace runs, nothing is installed (``installed()`` is empty).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time

import torch

_LOCK = threading.RLock()
_owner: int | None = None  # the thread that holds the lock (and the patches), None when none does
_stack: list[str] = []  # names installed now, in the order entered

# How long the lock's holder may stay blocked in a wait (threading's, queue's, a future's) while another thread
# waits for the lock, before that thread raises (a deadlock, unless the holder waits on a third thread).
HOLDER_BLOCKED_LIMIT_S = 60.0
_POLL_S = 0.05
_WAIT_FILES = frozenset(os.path.normcase(os.path.abspath(m.__file__)) for m in (threading, __import__("queue"))) | {
    os.path.normcase(os.path.abspath(os.path.join(os.path.dirname(threading.__file__), "concurrent", "futures",
                                                  "_base.py")))}


def _holder_wait(holder: int, me: threading.Thread) -> tuple[bool, bool, str]:
    """(whether the thread ``holder`` is blocked in a wait of threading, queue or concurrent.futures, whether
    that wait is ``me.join()``, where it waits)."""
    frame = sys._current_frames().get(holder)
    waits, where = False, ""
    while frame is not None and os.path.normcase(os.path.abspath(frame.f_code.co_filename)) in _WAIT_FILES:
        waits, where = True, frame.f_code.co_qualname
        if frame.f_code.co_name == "join" and frame.f_locals.get("self") is me:
            return True, True, where
        frame = frame.f_back
    if waits and frame is not None:
        where += f" (called from {frame.f_code.co_filename}:{frame.f_lineno}, in {frame.f_code.co_name})"
    return waits, False, where


def _acquire() -> None:
    """Takes the registry's lock, waiting for the thread that holds it; raises RuntimeError (holding nothing)
    when that thread waits on this one: joining it, or blocked in a wait for ``HOLDER_BLOCKED_LIMIT_S``."""
    if _LOCK.acquire(blocking=False):
        return
    me = threading.current_thread()
    blocked_since = None
    while not _LOCK.acquire(timeout=_POLL_S):
        holder = _owner
        if holder is None:  # between two traces, or a build-cache walk (which waits on nothing)
            blocked_since = None
            continue
        waits, on_me, where = _holder_wait(holder, me)
        holder_thread = threading._active.get(holder)
        who = f"thread {holder_thread.name if holder_thread else '?'!r} (ident {holder})"
        if on_me:
            raise RuntimeError(
                f"torch_ext: thread {me.name!r} waits to trace (build a step, a graph, an export), but {who} "
                "holds the trace lock and waits on this thread (Thread.join) inside its own trace: both would wait "
                "forever. Tracing is serialized process-wide; a traced forward must not wait on a thread that "
                "builds. Build it before or after that trace")
        now = time.monotonic()
        if not waits:
            blocked_since = None
        elif blocked_since is None:
            blocked_since = now
        elif now - blocked_since >= HOLDER_BLOCKED_LIMIT_S:
            raise RuntimeError(
                f"torch_ext: thread {me.name!r} waits to trace (build a step, a graph, an export), but {who} holds "
                f"the trace lock and has stayed blocked in {where} for {now - blocked_since:.1f} s "
                f"(_trace_patches.HOLDER_BLOCKED_LIMIT_S = {HOLDER_BLOCKED_LIMIT_S}): most likely its traced "
                "forward waits on this thread, and both would wait forever. Tracing is serialized process-wide; a "
                "traced forward must not wait on a thread that builds. Build it before or after that trace")


@contextlib.contextmanager
def _locked():
    _acquire()
    try:
        yield
    finally:
        _LOCK.release()


def _factories() -> dict:
    from . import _compat, _env_reads

    return {
        "env_reads": _env_reads._recorder,
        "python_random_draws": _compat.python_random_draws,
        "backward_only_code": _compat.backward_only_code,
        "global_module_hooks_restored": _compat.global_module_hooks_restored,
        "eager_attention_masks": _compat.eager_attention_masks,
        "eager_attention_mask_skips": lambda: _compat.eager_attention_masks(branches=False),
        "eager_sdpa_math_choice": _compat.eager_sdpa_math_choice,
        "inline_reentrant_checkpoints": _compat.inline_reentrant_checkpoints,
        "inference_mode_as_no_grad": _compat.inference_mode_as_no_grad,
        "no_grad_inside_autocast": _compat.no_grad_inside_autocast,
        "autocast_weight_cache": _compat.autocast_weight_cache,
        "refuse_autograd_in_trace": _compat.refuse_autograd_in_trace,
        "rnn_dropout_between_layers": _compat.rnn_dropout_between_layers,
        "eager_gru_cell": _compat.eager_gru_cell,
        "eager_onednn_lstm": _compat.eager_onednn_lstm,
        "onednn_lstm_forward": lambda: _compat.eager_onednn_lstm(own_gradients=False),
        "onednn_rnn_backward_dtypes": _compat.onednn_rnn_backward_dtypes,
        "eager_batch_norm_layouts": _compat.eager_batch_norm_layouts,
        "packed_sequences_refused": _compat.packed_sequences_refused,
        "grad_scaler_refused": _compat.grad_scaler_refused,
        "data_assignment_refused": _compat.data_assignment_refused,
        "eager_autograd_kernels": _compat.eager_autograd_kernels,
        "eager_matmul_fold": _compat.eager_matmul_fold,
        "cond_branches_with_eager_requires_grad": _compat.cond_branches_with_eager_requires_grad,
        "eager_pad_sequence": _compat.eager_pad_sequence,
        "joint_replayed_without_autograd": _compat.joint_replayed_without_autograd,
        "eager_cumprod_backward": _compat.eager_cumprod_backward,
        "eager_prod_backward": _compat.eager_prod_backward,
        "eager_half_dropout_backward": _compat.eager_half_dropout_backward,
        "aten_max_pool_backward_in_inductor": _compat.aten_max_pool_backward_in_inductor,
        "exact_subgraph_strides": _compat.exact_subgraph_strides,
        "make_fx_without_stack_traces": _compat.make_fx_without_stack_traces,
    }


# Every patch, in the order it is entered (restored in reverse).
ORDER = ("env_reads", "python_random_draws", "backward_only_code", "global_module_hooks_restored",
         "eager_attention_masks", "eager_attention_mask_skips", "eager_sdpa_math_choice", "inline_reentrant_checkpoints",
         "inference_mode_as_no_grad", "no_grad_inside_autocast", "autocast_weight_cache",
         "refuse_autograd_in_trace", "rnn_dropout_between_layers", "eager_gru_cell", "onednn_lstm_forward",
         "eager_onednn_lstm", "onednn_rnn_backward_dtypes", "eager_batch_norm_layouts", "packed_sequences_refused",
         "grad_scaler_refused", "data_assignment_refused", "eager_autograd_kernels", "eager_matmul_fold",
         "cond_branches_with_eager_requires_grad", "eager_pad_sequence", "joint_replayed_without_autograd",
         "eager_cumprod_backward", "eager_prod_backward", "eager_half_dropout_backward", "aten_max_pool_backward_in_inductor",
         "exact_subgraph_strides", "make_fx_without_stack_traces")
# Patches that yield what the block did (reads, draws, code found): entered again at each nesting level.
COLLECTORS = frozenset({"env_reads", "python_random_draws", "backward_only_code"})

# What each entry point traces under.
STEP_EXPORT = ("env_reads", "python_random_draws", "backward_only_code", "global_module_hooks_restored",
               "eager_attention_masks", "eager_sdpa_math_choice", "inline_reentrant_checkpoints",
               "inference_mode_as_no_grad", "no_grad_inside_autocast", "autocast_weight_cache",
               "refuse_autograd_in_trace", "rnn_dropout_between_layers", "eager_gru_cell", "onednn_lstm_forward",
               "packed_sequences_refused", "grad_scaler_refused", "data_assignment_refused", "eager_pad_sequence")
JOINT_EXPORT = ("rnn_dropout_between_layers", "eager_gru_cell", "eager_onednn_lstm", "onednn_rnn_backward_dtypes",
                "eager_batch_norm_layouts",
                "eager_autograd_kernels", "eager_matmul_fold", "cond_branches_with_eager_requires_grad",
                "eager_pad_sequence", "joint_replayed_without_autograd", "eager_cumprod_backward", "eager_prod_backward", "eager_half_dropout_backward")
INFERENCE_TRACE = ("python_random_draws", "global_module_hooks_restored", "eager_attention_mask_skips",
                   "rnn_dropout_between_layers", "eager_gru_cell",
                   "eager_batch_norm_layouts", "packed_sequences_refused", "data_assignment_refused",
                   "eager_pad_sequence", "make_fx_without_stack_traces")
AOTI_COMPILE = ("aten_max_pool_backward_in_inductor", "exact_subgraph_strides", "onednn_rnn_backward_dtypes")


def here() -> bool:
    """Whether the calling thread holds the patches (is inside ``patched``)."""
    return _owner == threading.get_ident()


def gated(patched, original):
    """``patched`` on the thread that holds the patches, ``original`` on every other thread. Inside a region
    dynamo traces (a ``torch.cond`` branch, which export traces with dynamo) the thread cannot be asked (dynamo
    does not trace ``threading.get_ident``): ``patched`` there, as the trace that runs the branch is ours while
    the patches are installed (another thread's ``torch.compile`` at that moment would see them too)."""
    @functools.wraps(patched)
    def call(*args, **kwargs):
        if torch.compiler.is_dynamo_compiling() or _owner == threading.get_ident():
            return patched(*args, **kwargs)
        return original(*args, **kwargs)
    return call


_GATE_CODE = gated(None, None).__code__


def caller_frame(depth: int = 1):
    """``sys._getframe(depth)`` of the caller, not counting ``gated``'s frames: what a patched function
    reading its caller's frame sees (``_getframe(1)`` of a gated patch is the gate's)."""
    frame = sys._getframe(1)
    while depth > 0:
        frame = frame.f_back
        while frame is not None and frame.f_code is _GATE_CODE:
            frame = frame.f_back
        depth -= 1
    return frame


def serialized():
    """The registry's lock alone (no patch): for work that reads what a trace patches or installs (the build
    cache's walk of process-global hooks), so that it never runs while another thread traces. Raises as
    ``patched`` does when the thread that holds it waits on this one."""
    return _locked()


def installed() -> list[str]:
    """The patches installed now (by any thread), in the order entered; empty when no trace runs."""
    return list(_stack)


@contextlib.contextmanager
def patched(*names: str):
    """Installs the patches ``names`` (in ``ORDER``) under the registry's lock for the block, and yields
    {name: what the patch yields}. See the module's docstring."""
    global _owner
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        raise ValueError(f"unknown trace patch(es) {unknown}; known: {list(ORDER)}")
    wanted = set(names)
    with _locked():
        outer = _owner
        _owner = threading.get_ident()
        depth = len(_stack)
        try:
            with contextlib.ExitStack() as stack:
                factories = _factories()
                from . import _compat

                _compat.build_dynamo_function_tables()  # before any patch replaces a function dynamo lists by id
                got = {}
                for name in ORDER:
                    if name not in wanted or (name in _stack and name not in COLLECTORS):
                        continue
                    got[name] = stack.enter_context(factories[name]())
                    _stack.append(name)
                    stack.callback(_stack.pop)  # runs right after the patch's own exit (reverse order)
                yield got
        finally:
            del _stack[depth:]  # (already so: each exit popped its name)
            _owner = outer
