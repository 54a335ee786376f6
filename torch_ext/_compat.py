"""Every torch-version-specific call lives here; nothing else checks torch's version.

Checked against torch 2.9.1 (the CI pin). torch >= 2.9 is required.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import operator

import sys
import threading
import weakref

import torch
from torch.utils._pytree import tree_leaves, tree_map_only
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


def _gated(patched, original):
    """A patch that acts on the tracing thread only (see _trace_patches)."""
    from ._trace_patches import gated

    return gated(patched, original)


@contextlib.contextmanager
def _gated_attribute(owner, name: str, patched):
    """``owner.<name>`` replaced by ``patched`` on the tracing thread (``_gated``; the original on every other) for
    the block, and put back after it, also when it raises."""
    original = getattr(owner, name)
    setattr(owner, name, _gated(patched, original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def uncompiled(module):
    """The module a ``torch.compile`` wrapper (OptimizedModule) wraps, unwrapped: export traces the
    Python module, and tracing it through the wrapper's Dynamo frame compiles it a second time (torch
    raises a fake-mode mismatch). The wrapper holds no tensors of its own (its parameters are the
    wrapped module's), so optimizers and write-backs act on the same tensors, named as in eager."""
    frame = sys.modules.get("torch._dynamo.eval_frame")  # a compiled module means it was imported: never import it
    while frame is not None and isinstance(module, frame.OptimizedModule):
        module = module._orig_mod
    return module


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


def parameters_without_gradient(ep: torch.export.ExportedProgram, loss_index: int = 0) -> list[str]:
    """The trainable parameters (signature targets) that user output ``loss_index`` has no gradient
    for: read only through ``.detach()`` or under ``torch.no_grad()``. Found by running the forward
    graph on fake tensors and asking autograd, so nothing real is computed, drawn or mutated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    specs = ep.graph_signature.input_specs
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode()
    args, trainable = [], []
    with mode:
        for spec, node in zip(specs, placeholders):
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                args.append(val)
                continue
            t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)
            if spec.kind.name == "PARAMETER" and t.is_floating_point():
                t.requires_grad_(True)
                trainable.append((spec.target, t))
            args.append(t)
        with torch.enable_grad():
            outs = ep.graph_module(*args)
            users = [i for i, s in enumerate(ep.graph_signature.output_specs) if s.kind.name == "USER_OUTPUT"]
            loss = outs[users[loss_index]]
            if not loss.requires_grad:
                return [name for name, _ in trainable]
            grads = torch.autograd.grad(loss, [t for _, t in trainable], allow_unused=True)
    return [name for (name, _), g in zip(trainable, grads) if g is None]


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

    from . import _trace_patches

    # The retrace decomposes aten.lstm & co. here, and differentiates what it traces.
    with _trace_patches.patched(*_trace_patches.JOINT_EXPORT):
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


def optimizer_step_hooks(opt: torch.optim.Optimizer) -> list[str]:
    """Names of the step pre/post hooks that would run around ``opt.step()`` (private torch.optim state)."""
    from torch.optim import optimizer as optim_mod

    found = [h.strip("_") for h in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks") if getattr(opt, h, None)]
    if getattr(optim_mod, "_global_optimizer_pre_hooks", None) or getattr(optim_mod, "_global_optimizer_post_hooks", None):
        found.append("global optimizer step hooks")
    return found


def gradient_hooks(model: torch.nn.Module) -> list[str]:
    """The hooks on ``model`` that change gradients in eager training, each as "where (how it was
    registered)": tensor hooks and post-accumulate-grad hooks on parameters, full backward (pre-)hooks
    on modules, and the global module backward hooks. A pure step computes its gradients inside its
    program, where none of them runs."""
    from torch.nn.modules import module as module_mod

    found = []
    for name, p in model.named_parameters():
        if p._backward_hooks:
            found.append(f"parameter '{name}' (Tensor.register_hook)")
        if p._post_accumulate_grad_hooks:
            found.append(f"parameter '{name}' (Tensor.register_post_accumulate_grad_hook)")
    for name, m in model.named_modules():
        where = f"module '{name}' ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
        if m._backward_hooks:
            found.append(f"{where} (register_full_backward_hook)")
        if m._backward_pre_hooks:
            found.append(f"{where} (register_full_backward_pre_hook)")
    if getattr(module_mod, "_global_backward_hooks", None) or getattr(module_mod, "_global_backward_pre_hooks", None):
        found.append("every module (register_module_full_backward_hook / register_module_full_backward_pre_hook)")
    return found


def leaves_by_key(tree, spec, paths=None) -> list | None:
    """The leaves of ``tree`` in the order of the structure ``spec`` (whose leaves sit at the pytree
    key ``paths``; computed from spec when not given): positionally when ``tree`` has that structure,
    else matched by key path when ``tree`` has exactly those key paths. Python gives no meaning to the
    order of keyword arguments or of a dict's keys (a data loader's collate function may order them
    otherwise than the example), so neither may move a tensor to another input. None when the paths
    differ too."""
    import torch.utils._pytree as pytree

    if pytree.tree_structure(tree) == spec:
        return pytree.tree_leaves(tree)
    if paths is None:
        paths = key_paths(spec)
    with_paths = pytree.tree_flatten_with_path(tree)[0]
    by_path = dict(with_paths)
    if len(by_path) == len(with_paths) and set(by_path) == set(paths):
        return [by_path[p] for p in paths]
    return None


NOT_CONSTANT = object()


def user_input_constants(ep) -> list:
    """For each flat user input of ``ep``, the value export specialised the program to (a non-tensor
    input: ``scale=2.0``, ``flag=True``; the graph computes with it as a constant), or NOT_CONSTANT."""
    return [getattr(spec.arg, "value", None) if type(spec.arg).__name__ == "ConstantArgument" else NOT_CONSTANT
            for spec in ep.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]


def _same_constant(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return repr(a) == repr(b)  # -0.0 is not 0.0 (x * -0.0 has other zeros)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot compare: the same object only
        return a is b


def user_input_leaves(args, kwargs, in_spec, constants=None) -> list:
    """The flat user inputs of a call ``(*args, **kwargs)`` of a program exported with input
    structure ``in_spec`` (None: taken as they come): keywords and dict keys matched by name, in any
    order (leaves_by_key); another structure is refused, showing both. ``constants``
    (user_input_constants): a non-tensor input of another value than the program was exported with is
    refused, as ``ep.module()`` refuses it (the program would compute with the exported one)."""
    import torch.utils._pytree as pytree

    if in_spec is None:
        return pytree.tree_leaves((args, kwargs))
    flat = leaves_by_key((args, kwargs), in_spec)
    if flat is None:
        spec = pytree.tree_structure((args, kwargs))
        raise TypeError(f"inputs do not match the exported signature: expected {in_spec}, got {spec}")
    if constants:
        for i, (v, c) in enumerate(zip(flat, constants)):
            if c is not NOT_CONSTANT and not _same_constant(v, c):
                where = pytree.keystr(key_paths(in_spec)[i])
                raise ValueError(f"input {where}: the program was exported with the constant {c!r} there and "
                                 f"computes with it; got {v!r}. Export again with this value (a ReactiveGraph of "
                                 "the module moves to a graph for it by itself)")
    return flat


def key_paths(spec) -> list:
    """The pytree key path of every leaf of the structure ``spec``, in leaf order."""
    import torch.utils._pytree as pytree

    return [path for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * spec.num_leaves, spec))[0]]


def register_batch_containers() -> None:
    """Makes the batch containers of loaded libraries pytree nodes, so a step takes them as batches:
    Hugging Face's ``BatchEncoding`` (what a tokenizer and the data collators return, passed on as
    ``model(**batch)``) flattens like the dict it wraps (export refused it: "Unsupported input type").
    Its tokenizer-side ``encodings`` are not tensors and are not carried: ``loss_fn`` gets a
    BatchEncoding of the same keys and tensors. Nothing is imported; registering twice is a no-op."""
    import torch.utils._pytree as pytree

    tokenization = sys.modules.get("transformers.tokenization_utils_base")
    batch_encoding = getattr(tokenization, "BatchEncoding", None)
    if batch_encoding is None or batch_encoding in pytree.SUPPORTED_NODES:
        return

    def flatten(b):
        return list(b.values()), list(b.keys())

    def flatten_with_keys(b):
        return [(pytree.MappingKey(k), v) for k, v in b.items()], list(b.keys())

    def unflatten(values, keys):
        return batch_encoding(dict(zip(keys, values)))

    pytree.register_pytree_node(batch_encoding, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys,
                                serialized_type_name="transformers.BatchEncoding")


def _eager_sdpa_choice(query, key, value, attn_mask, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False) -> int:
    """Eager's SDPA backend (``torch._fused_sdp_choice``, 0: math) for arguments of these shapes, strides, dtypes
    and requires_grad flags (already cast as autocast would), read on plain empty tensors outside any trace."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        def plain(t):
            if t is None:
                return None
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).requires_grad_(t.requires_grad)

        return int(torch._fused_sdp_choice(plain(query), plain(key), plain(value), plain(attn_mask), dropout_p,
                                           is_causal, scale=scale, enable_gqa=enable_gqa))


def _attention_shape(query, key) -> tuple:
    """The shape of SDPA's attention weights (batch dims broadcast, query length, key length)."""
    batch = torch.broadcast_shapes(tuple(query.shape[:-2]), tuple(key.shape[:-2]))
    return tuple(batch) + (query.shape[-2], key.shape[-2])


def _sdpa_math_with_mask(query, key, value, attn_mask, dropout_p, scale, keep):
    """SDPA's CPU math kernel (``at::_scaled_dot_product_attention_math`` in torch 2.9, CompositeImplicitAutograd) op
    by op, forward and backward, with its attention dropout taking the drawn ``keep`` mask (bool, the attention
    weights' shape) instead of drawing: bfloat16 / float16 arguments are computed in float32 (``.to(float)``), q and
    k each scaled by sqrt(scale), ``matmul``, the float mask added, ``_safe_softmax``, then ``at::dropout``'s CPU path
    (``noise = empty_like(attn).bernoulli_(1 - p); noise.div_(1 - p); attn * noise``: the draws as ``keep``),
    ``matmul`` with v and the result cast back. Only what ``_bias_branch`` passes: a float mask, no causal flag, no
    grouped-query heads."""
    origin = query.dtype
    if origin in (torch.float16, torch.bfloat16):
        query, key, value = query.to(torch.float32), key.to(torch.float32), value.to(torch.float32)
    negative = scale is not None and scale < 0.0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    query = query * ((0.0 - factor) if negative else factor)
    attn = torch.matmul(query, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = attn * keep.to(attn.dtype).div(1 - dropout_p)
    return torch.matmul(attn, value).to(origin)


# Eager's SDPA choice for the call inside the torch.cond branches being traced (``_bias_branch``), read before
# the cond: dynamo traces the branches and cannot run ``_eager_sdpa_choice`` there. None: no mask that requires
# grad (SDPA as traced). Empty outside such branches.
_branch_sdpa_choice: list = []


@contextlib.contextmanager
def eager_sdpa_math_choice():
    """Inside the block, a CPU ``scaled_dot_product_attention`` whose float mask requires grad runs SDPA's math
    kernel, as eager's choice (``torch._fused_sdp_choice``) on the traced flags says: eager takes math for a mask
    that requires grad, flash otherwise. The joint trace decides again on functional tensors, where a mask that
    requires grad only because the forward set the flag (Hugging Face T5 checkpointed in training:
    ``position_bias.requires_grad = True`` on a zeros bias) requires none, and took flash (a few ulp off eager,
    fuzz_step 38:55). The choice is read on plain empty tensors of the same layout and flags, outside the trace."""
    F = torch.nn.functional
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # In a cond branch of _bias_branch (traced by dynamo, autocast off around it): eager's choice and the
        # autocast dtype to apply by hand were read before the cond.
        branch = _branch_sdpa_choice[-1] if _branch_sdpa_choice and torch.compiler.is_dynamo_compiling() else None
        keep = None
        if branch is not None:
            choice, low, keep = branch
            applies = (isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point()
                       and query.device.type == "cpu")
        else:
            applies = (torch.is_grad_enabled() and isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad
                       and attn_mask.is_floating_point() and query.device.type == "cpu")
            low = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        if applies:
            autocast = low is not None
            if autocast:  # as CPU autocast casts SDPA's floating arguments (but float64), done here by hand
                query, key, value, attn_mask = (t.to(low) if t.dtype != torch.float64 else t
                                                for t in (query, key, value, attn_mask))
            if branch is None:
                choice = _eager_sdpa_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            if keep is not None and dropout_p > 0:  # the attention dropout drawn before the cond (_bias_branch)
                if choice != 0 or is_causal or enable_gqa or tuple(keep.shape) != _attention_shape(query, key):
                    raise NotImplementedError(
                        f"scaled_dot_product_attention in a torch.cond branch with attention dropout {dropout_p}: "
                        f"the dropout mask drawn before the cond (shape {list(keep.shape)}) replays only eager's math "
                        f"kernel on a float mask (here: kernel {choice}, is_causal={is_causal}, "
                        f"enable_gqa={enable_gqa}, attention shape {list(_attention_shape(query, key))})")
                with torch.autocast("cpu", enabled=False) if autocast else contextlib.nullcontext():
                    return _sdpa_math_with_mask(query, key, value, attn_mask, dropout_p, scale, keep)
            if choice == 0:  # SDPBackend.math
                with torch.autocast("cpu", enabled=False) if autocast else contextlib.nullcontext():
                    return torch.ops.aten._scaled_dot_product_attention_math(
                        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
                        enable_gqa=enable_gqa)[0]
            if autocast:
                with torch.autocast("cpu", enabled=False):
                    return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                    enable_gqa=enable_gqa)
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    with _gated_attribute(F, "scaled_dot_product_attention", sdpa):
        yield


@contextlib.contextmanager
def eager_attention_masks(branches: bool = True):
    """Inside the block, Hugging Face transformers builds attention masks as it does in eager: with no
    padding mask (or one it can read as all ones) and a shape where SDPA's own ``is_causal`` fits, it
    passes no mask, so SDPA runs causal, and grouped-query attention shares its key/value heads inside
    the kernel. While exporting it always materialises the mask instead, because an exported model may
    be called at other sequence lengths; with that mask it repeats every key/value head (repeat_kv), and
    the backward sums the repeated heads' gradients in another order than the kernel does, so Llama,
    Mistral, Qwen2 and Gemma trained about 1e-8 off eager per step (Adam amplified it on Qwen2's key
    biases, whose gradient is rounding noise, to 7e-5 relative). The pure step is specialised to its
    example's shapes (another shape is refused, or exported again with ``batch_shapes='cache'``), so
    eager's choice for those shapes is the right one. A padding mask given as a tensor is still traced,
    and transformers materialises it then, as eager does when a token is padded.

    The same holds for the packed-sequence check (``find_packed_sequence_indices``), which transformers
    runs whenever there is no cache (``use_cache=False``, as training scripts and gradient checkpointing
    set): it reads the position ids' values, and while tracing it always keeps a packed-sequence mask.
    Position ids that no program input reaches (the model's own ``arange``) are constants of the
    program, so eager's reading of their values is computed here and holds for every call. Position ids
    given in the batch stay data: their mask is traced, correct for any values.
    Nothing is imported: only a ``transformers.masking_utils`` already loaded can be tracing this model.

    ``branches=False`` (``ReactiveGraph``'s trace, ``eager_attention_mask_skips``) leaves a padding mask given as
    a tensor as transformers traces it (materialised, heads repeated): the ``torch.cond`` that takes eager's
    decision on its values at every call is the step's. The skips above (no padding mask, or one no input
    reaches; position ids no input reaches) are decided once, as eager decides them for the graph's shapes."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "is_torchdynamo_exporting", None)
    if original is None:
        yield
        return
    find_packed = getattr(masking, "find_packed_sequence_indices", None)

    def eager_find_packed(position_ids):
        value = traced_constant_value(position_ids)
        if value is not None and eagerly(lambda: find_packed(value)) is None:
            return None  # eager's answer for the only values these position ids can take
        return find_packed(position_ids)

    def eagerly(fn):  # run as outside any trace: no tracing modes, and transformers' is_tracing() False
        from torch.utils._python_dispatch import _disable_current_modes

        is_tracing = masking.is_tracing
        masking.is_tracing = _gated(lambda tensor=None: False, is_tracing)
        try:
            with _disable_current_modes():
                return fn()
        finally:
            masking.is_tracing = is_tracing

    masking.is_torchdynamo_exporting = _gated(lambda: False, original)
    if find_packed is not None:
        masking.find_packed_sequence_indices = _gated(eager_find_packed, find_packed)
    try:
        with _mask_skips_as_branches(masking, eagerly) if branches else _constant_mask_skips(masking, eagerly):
            yield
    finally:
        masking.is_torchdynamo_exporting = original
        if find_packed is not None:
            masking.find_packed_sequence_indices = find_packed


class _HoistedDropouts:
    """Attention dropout taken out of the ``torch.cond`` that decides eager's mask skip (see
    ``_mask_skips_as_branches``). The step's random numbers are state threaded through the top-level graph, so no
    branch may draw; and eager's dropout draws the same numbers on either path (the CPU ``at::_dropout``:
    ``noise = empty_like(input).bernoulli_(1 - p)``, one draw per call, whose bits depend on the input's shape and
    strides, not its dtype), then ``noise.div_(1 - p)`` and ``input * noise`` in the input's dtype, which is what
    differs between the paths (bfloat16 scores without the mask, float32 with it). So each dropout call is drawn
    once at the top level, where eager draws it (``drawing``: the masked path's call, traced there as before), as a
    mask; each branch then drops out with that mask in its own dtype, eager's formula, forward and backward
    (``replaying``). ``check`` proves from the traced branches that each drew nothing itself and used each mask once,
    in the order drawn; anything else is refused by name. Within one call the masks are told apart by the input's
    shape and strides and ``p`` (the branches are traced by dynamo, which allows them no counter): two calls alike
    are refused."""

    def __init__(self, culprit: str, dropout, scores_dtype, mask_dtype):
        self.culprit, self.dropout, self.scores_dtype, self.mask_dtype = culprit, dropout, scores_dtype, mask_dtype
        self.masks: dict = {}  # key -> the drawn mask (bool), in the order drawn
        self._dropout = torch.nn.functional.dropout

    @staticmethod
    def _key(input, p, training, inplace):
        """(shape, strides, p) of a dropout call this class can hoist, else None: a CPU floating-point input,
        out of place, in training, 0 < p < 1 (``p == 1`` draws nothing in eager) and static sizes."""
        if (not training or inplace or not isinstance(input, torch.Tensor) or not input.is_floating_point()
                or input.device.type != "cpu" or isinstance(p, bool) or not isinstance(p, (int, float))
                or not 0 < p < 1):
            return None
        shape, stride = tuple(input.shape), tuple(input.stride())
        if not all(type(d) is int for d in shape + stride):
            return None
        return shape, stride, float(p)

    @staticmethod
    def _apply(input, mask, p):
        # at::_dropout's CPU path (aten/src/ATen/native/Dropout.cpp): noise = the draws in the input's dtype,
        # noise.div_(1 - p), input * noise; autograd's gradient is then grad * noise, as eager's.
        return input * mask.to(input.dtype).div(1 - p)

    def _refuse(self, why):
        return NotImplementedError(
            f"{self.culprit}: eager attention with attention dropout {self.dropout} under autocast, given a padding "
            f"mask (attention_mask, {self.mask_dtype} mask on {self.scores_dtype} scores): eager skips an all-ones "
            f"mask and runs softmax and dropout in {self.scores_dtype}, and the step decides as eager does with a "
            f"torch.cond whose branches cannot draw random numbers; {why}, so the branch cannot reuse the dropout "
            "masks drawn outside it. Use attn_implementation='sdpa', attention dropout 0, or no attention_mask "
            "when nothing is padded")

    def _draw(self, input, p=0.5, training=True, inplace=False):
        key = self._key(input, p, training, inplace)
        if key is None:
            return self._dropout(input, p, training, inplace)  # drawn as before; a branch drawing is refused
        if key in self.masks:
            raise self._refuse(f"it calls dropout twice on inputs of shape {list(key[0])} and strides {list(key[1])}")
        zeros = torch.empty_strided(key[0], key[1], dtype=input.dtype, device=input.device).zero_()
        self.masks[key] = torch.ops.aten.native_dropout.default(zeros, p, True)[1]
        return self._apply(input, self.masks[key], p)

    def _replay(self, input, p=0.5, training=True, inplace=False):
        key = self._key(input, p, training, inplace)
        mask = self.masks.get(key) if key is not None else None
        if mask is None:
            return self._dropout(input, p, training, inplace)  # draws inside the branch: refused by check
        return self._apply(input, mask, p)

    @contextlib.contextmanager
    def drawing(self):
        with _gated_attribute(torch.nn.functional, "dropout", self._draw):
            yield

    @contextlib.contextmanager
    def replaying(self):
        """The block traces one ``torch.cond`` whose branches drop out with the drawn masks; checked after it."""
        from torch.fx.experimental import proxy_tensor

        tracer = getattr(proxy_tensor.get_proxy_mode(), "tracer", None)
        graph = getattr(tracer, "graph", None)
        start = len(graph.nodes) if graph is not None else 0
        with _gated_attribute(torch.nn.functional, "dropout", self._replay):
            yield
        if graph is not None:
            self.check(tracer, list(graph.nodes)[start:])
        elif self.masks:
            raise self._refuse("no traced graph to check the branches in")

    @staticmethod
    def _draws(node) -> bool:
        """Whether ``node`` draws random numbers. A dropout in eval, or (but ``native_dropout``, whose CPU kernel draws
        for any ``p``) with p == 0, draws nothing: eager's ``at::dropout`` returns its input, torch's decomposition
        a clone (a model's dropout set to 0 in training, traced with its p)."""
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            return False
        if torch.Tag.nondeterministic_seeded not in op.tags:
            return False
        names = [a.name for a in op._schema.arguments]
        if "p" in names and "train" in names:
            bound = dict(zip(names, node.args), **node.kwargs)
            p, train = bound.get("p"), bound.get("train", True)
            if train is False or (p == 0 and op.overloadpacket is not torch.ops.aten.native_dropout):
                return False
        return True

    def check(self, tracer, nodes):
        """Refuses the cond among ``nodes`` unless neither branch draws (at any depth) and each uses each drawn
        mask exactly once, in the order drawn."""
        from torch.fx.experimental import proxy_tensor

        conds = [n for n in nodes if n.op == "call_function" and n.target is torch.ops.higher_order.cond]
        if len(conds) != 1:
            if self.masks:
                raise self._refuse(f"{len(conds)} torch.cond nodes were traced where one was expected")
            return
        cond = conds[0]
        operands = list(cond.args[3])
        keys = list(self.masks)
        where = {}
        for key in keys:
            node = proxy_tensor.get_proxy_slot(self.masks[key], tracer).proxy.node
            if node not in operands:
                raise self._refuse(f"a branch does not use the mask of its dropout on shape {list(key[0])}")
            where[operands.index(node)] = key
        for side, attr in (("all-ones", cond.args[1]), ("masked", cond.args[2])):
            branch = getattr(tracer.root, attr.target)
            for sub in branch.modules():
                if not isinstance(sub, torch.fx.GraphModule):
                    continue
                drawn = sorted({str(n.target) for n in sub.graph.nodes if self._draws(n)})
                if drawn:
                    raise self._refuse(f"its {side} branch draws random numbers ({', '.join(drawn)})")
            placeholders = [n for n in branch.graph.nodes if n.op == "placeholder"]
            order = {n: i for i, n in enumerate(branch.graph.nodes)}
            firsts = []
            for i, key in where.items():
                users = list(placeholders[i].users)
                if len(users) != 1:
                    raise self._refuse(f"its {side} branch calls dropout on shape {list(key[0])} {len(users)} times "
                                       "where eager's masked path calls it once")
                firsts.append((order[users[0]], key))
            if [key for _, key in sorted(firsts)] != keys:
                raise self._refuse(f"its {side} branch calls its dropouts in another order than the masked path")


def _bias_mask_rounding(query: torch.Tensor, bias) -> torch.dtype | None:
    """The dtype SDPA's float mask is rounded to before its gradient leaves the kernel, where that makes eager's
    two mask paths differ; None where they are bit-identical. Transformers' SDPA folds a position bias that
    requires grad (T5's relative bias, shape (1, heads, q, k)) into the padding mask: eager, skipping an all-ones
    padding mask, passes the bias itself, and its gradient is summed over the batch and then rounded to the mask's
    dtype; the traced program materialises ``where(padding, bias, min)`` of shape (batch, heads, q, k), whose
    gradient is rounded per batch row and summed after. In float32 both are the same sum of the same values; in a
    reduced precision (the bias a bfloat16 or float16 tensor, or cast to one by CPU autocast) they round
    differently (T5 under CPU bfloat16 autocast: the relative bias's gradient off by 4e-8 at step 1, 1.5e-4 in the
    weight at step 2, the loss off at step 3)."""
    if not isinstance(bias, torch.Tensor) or not bias.requires_grad or not bias.is_floating_point():
        return None
    if query.device.type != "cpu":  # (the branch applies CPU autocast by hand; other devices: as traced)
        return None
    dtype = bias.dtype
    if torch.is_autocast_enabled("cpu") and dtype != torch.float64:
        dtype = torch.get_autocast_dtype("cpu")
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _bias_branch(module, sdpa_attention, predicate, rounding, query, key, value, attention_mask, dropout, scaling,
                 is_causal, kwargs):
    """``torch.cond(padding mask all ones, SDPA with the bias alone, SDPA with the bias folded into the mask)``:
    eager's choice at every call (``_bias_mask_rounding``). Attention dropout cannot draw inside the cond (the
    step's random numbers are state threaded through the top-level graph), so its mask is drawn here, before the
    cond, where eager's one SDPA call draws it (``at::dropout`` in the math kernel: one ``bernoulli_`` on the
    attention weights' shape, contiguous, in the kernel's float32), and each branch runs the math kernel op by op
    with that mask (``_sdpa_math_with_mask``); ``_HoistedDropouts.check`` proves each branch draws nothing and uses
    the mask once."""
    if dropout and not 0 < dropout < 1:
        raise NotImplementedError(
            f"{type(module).__name__}: SDPA with attention dropout {dropout}, a position bias that requires grad and "
            f"a padding mask, with the mask rounded to {rounding}: only 0 < dropout < 1 is replayed in the branches")
    rest = {k: v for k, v in kwargs.items() if k != "position_bias"}

    def branch(skip):
        # Flat: cond's fake tracing cannot always prove a 4-d output's strides dense (see branching_eager).
        def run(q, k, v, m, bias):
            return sdpa_attention(module, q, k, v, None if skip else m, dropout, scaling, is_causal,
                                  position_bias=bias, **rest)[0].reshape(-1)
        return run

    # Eager's SDPA backend in each branch (the bias alone, or folded into the padding mask: broadcast, contiguous),
    # read here: the branches are traced by dynamo. Both take the math kernel on CPU (a mask that requires grad).
    from torch.utils._python_dispatch import _disable_current_modes

    bias = kwargs["position_bias"]
    choices = set()
    autocast = torch.is_autocast_enabled("cpu")
    with _disable_current_modes():  # plain tensors of the arguments' metadata, as autocast would cast them
        def plain(t, shape=None):
            dtype = rounding if autocast and t.dtype != torch.float64 else t.dtype
            if shape is not None:
                return torch.empty(shape, dtype=dtype).requires_grad_(True)
            return torch.empty_strided(t.shape, t.stride(), dtype=dtype).requires_grad_(t.requires_grad)

        q, k, v = plain(query), plain(key), plain(value)
        for shape in (bias.shape, torch.broadcast_shapes(bias.shape, attention_mask.shape)):
            choices.add(_eager_sdpa_choice(q, k, v, plain(bias, shape), dropout, False, scaling))
    if len(choices) > 1:
        raise NotImplementedError(
            f"{type(module).__name__}: eager's SDPA takes a different kernel with the position bias alone than with "
            f"it folded into the padding mask ({sorted(choices)}); the step cannot branch on the mask there")
    out_shape = (query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    # Autocast is off around the cond and applied by hand to SDPA's arguments in the branches: cond differentiates
    # its branches while it traces them, so their backward would run under the forward's autocast (the math
    # kernel's float32 matmuls cast to bfloat16) where eager's backward runs outside it.
    low = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    choice = choices.pop()
    keep, drops, tracer, start = None, None, None, 0
    if dropout:
        if choice != 0:
            raise NotImplementedError(
                f"{type(module).__name__}: SDPA with attention dropout {dropout} and a position bias that requires "
                f"grad takes eager's kernel {choice}, not the math kernel the branches replay with the drawn mask")
        from torch.fx.experimental import proxy_tensor

        tracer = getattr(proxy_tensor.get_proxy_mode(), "tracer", None)
        graph = getattr(tracer, "graph", None)
        if graph is None:
            raise NotImplementedError(
                f"{type(module).__name__}: SDPA with attention dropout {dropout} in a mask branch outside a traced "
                "graph: no graph to check the branches in")
        start = len(graph.nodes)
        # The math kernel's weights: float32 for bfloat16 / float16 arguments (as autocast casts them), contiguous.
        dtype = q.dtype if q.dtype not in (torch.float16, torch.bfloat16) else torch.float32
        shape = _attention_shape(q, k)
        zeros = torch.zeros(shape, dtype=dtype, device=query.device)
        keep = torch.ops.aten.native_dropout.default(zeros, dropout, True)[1]
        drops = _HoistedSdpaDropout(type(module).__name__, dropout, rounding, attention_mask.dtype)
        drops.masks[(shape, zeros.stride(), float(dropout))] = keep
    _branch_sdpa_choice.append((choice, low, keep))
    try:
        with torch.autocast("cpu", enabled=False) if low is not None else contextlib.nullcontext():
            flat = torch.cond(predicate, branch(True), branch(False), (query, key, value, attention_mask, bias))
    finally:
        _branch_sdpa_choice.pop()
    if drops is not None:
        drops.check(tracer, list(tracer.graph.nodes)[start:])
    return flat.view(out_shape), None


class _HoistedSdpaDropout(_HoistedDropouts):
    """SDPA's attention dropout drawn before ``_bias_branch``'s cond; checked as ``_HoistedDropouts`` checks."""

    def _refuse(self, why):
        return NotImplementedError(
            f"{self.culprit}: SDPA with attention dropout {self.dropout}, a position bias that requires grad and a "
            f"padding mask, rounded to {self.scores_dtype} (autocast or such a model): eager skips an all-ones mask, "
            f"and the step decides as eager does with a torch.cond whose branches cannot draw random numbers; {why}, "
            "so the branch cannot reuse the dropout mask drawn outside it. Ways out, bit-exact: attention dropout 0 "
            "(T5: dropout_rate=0.0), no attention_mask when nothing is padded, or float32 without autocast")


@contextlib.contextmanager
def _constant_mask_skips(masking, eagerly):
    """A padding mask that no program input reaches (a constant of the traced program) is read here once, as
    eager reads it: transformers' skip checks refuse to read a traced tensor's values, and would materialise it
    (repeating grouped-query key/value heads) where eager, finding it all ones, skips it. A padding mask that is
    an input stays traced: materialised, correct for any values."""
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    originals = {name: getattr(masking, name, None) for name in names}
    if None in originals.values():
        yield
        return

    def reading(original):
        def ignore(padding_mask, *args, **kwargs):
            if padding_mask is not None and masking.is_tracing(padding_mask):
                value = traced_constant_value(padding_mask)
                if value is not None:
                    return eagerly(lambda: original(value, *args, **kwargs))
            return original(padding_mask, *args, **kwargs)
        return ignore

    for name, fn in originals.items():
        setattr(masking, name, _gated(reading(fn), fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(masking, name, fn)


@contextlib.contextmanager
def _mask_skips_as_branches(masking, eagerly):
    """A padding mask given in the batch (a tokenizer's ``attention_mask``, all ones when nothing is
    padded) is read by eager transformers at every call: all ones, and SDPA runs with no mask, sharing
    grouped-query key/value heads inside the kernel (``enable_gqa``); any padding, and the mask is
    materialised and every key/value head repeated. Both are right, but they round differently, and Adam
    amplifies that: Qwen2 trained 4e-4 relative off eager in 3 AdamW steps on an all-ones mask. While
    tracing, transformers always takes the second path. Here the program takes eager's decision at
    every call instead: the mask builder records the traced predicate eager would test (the padding
    mask is all ones, for the shapes where eager may skip), and a grouped-query SDPA call given that
    mask becomes ``torch.cond(predicate, without the mask, with it)``. The artifact stays right for any
    mask. A padding mask that no program input reaches is read here once, as eager would read it.
    Only grouped-query attention is branched: with one key/value head per query head both paths are
    already bit-identical (checked on Llama, GPT-2 and BERT), so a branch would buy nothing. Except with a
    position bias that requires grad (T5) and a mask rounded to bfloat16 / float16 (autocast, or such a
    model): the two paths round its gradient differently (``_bias_mask_rounding``), so it is branched too."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    sdpa_module = sys.modules.get("transformers.integrations.sdpa_attention")
    mask_table = getattr(getattr(masking, "AttentionMaskInterface", None), "_global_mapping", None)
    attention_table = getattr(getattr(modeling_utils, "AttentionInterface", None), "_global_mapping", None)
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    originals = {name: getattr(masking, name, None) for name in names}
    if (None in originals.values() or sdpa_module is None or not isinstance(mask_table, dict)
            or not isinstance(attention_table, dict) or "sdpa" not in mask_table or "sdpa" not in attention_table):
        yield  # another transformers layout: today's traced masks, right for any values
        return
    sdpa_mask, sdpa_attention = mask_table["sdpa"], attention_table["sdpa"]
    pending: list[torch.Tensor] = []  # the predicate of the mask sdpa_mask is building
    predicates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(mask) -> (mask, predicate)

    def skip_predicate(padding_mask, kv_length, local_attention_size):
        # Eager skips when every token is kept and no local window bites (masking_utils' two checks).
        if padding_mask.dim() != 2 or padding_mask.shape[-1] != kv_length:
            return None
        if local_attention_size is not None and kv_length >= local_attention_size:
            return None
        return padding_mask.all()

    def ignore_causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        call = lambda pm: originals[names[0]](pm, q_length, kv_length, q_offset, kv_offset, local_attention_size)
        if padding_mask is None or not masking.is_tracing(padding_mask):
            return call(padding_mask)
        value = traced_constant_value(padding_mask)
        if value is not None:
            return eagerly(lambda: call(value))
        if isinstance(q_offset, int) and isinstance(kv_offset, int) and q_length == kv_length > 1:
            predicate = skip_predicate(padding_mask, kv_length, local_attention_size)
            if predicate is not None:
                pending.append(predicate)
        return False

    def ignore_bidirectional(padding_mask, kv_length, local_attention_size=None):
        call = lambda pm: originals[names[1]](pm, kv_length, local_attention_size)
        if padding_mask is None or not masking.is_tracing(padding_mask):
            return call(padding_mask)
        value = traced_constant_value(padding_mask)
        if value is not None:
            return eagerly(lambda: call(value))
        predicate = skip_predicate(padding_mask, kv_length, local_attention_size)
        if predicate is not None:
            pending.append(predicate)
        return False

    def recording_sdpa_mask(*args, **kwargs):
        pending.clear()
        mask = sdpa_mask(*args, **kwargs)
        if len(pending) == 1 and isinstance(mask, torch.Tensor):
            predicates[id(mask)] = (mask, pending[0])
        pending.clear()
        return mask

    def branching_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
        entry = predicates.get(id(attention_mask)) if attention_mask is not None else None
        call = lambda q, k, v, m: sdpa_attention(module, q, k, v, m, dropout, scaling, is_causal, **kwargs)
        if entry is None or entry[0] is not attention_mask:
            return call(query, key, value, attention_mask)
        bias = kwargs.get("position_bias")
        rounding = _bias_mask_rounding(query, bias)
        if rounding is not None:
            return _bias_branch(module, sdpa_attention, entry[1], rounding, query, key, value, attention_mask,
                                dropout, scaling, is_causal, kwargs)
        if (getattr(module, "num_key_value_groups", 1) <= 1 or not sdpa_module.use_gqa_in_sdpa(None, key, value)
                or bias is not None or dropout):
            return call(query, key, value, attention_mask)
        # The two branches' backwards must lay out the operands' gradients alike. The CPU kernel
        # returns key and value gradients as (batch, seq, head, dim) transposed; repeat_kv's backward
        # returns them contiguous. So the masked branch reads key and value through a transpose and
        # reshape, whose backward copies their gradients into that layout (the forward is a view of a
        # model's usual (batch, seq, head, dim) projections, and copies no value either way).
        def seq_major(t):
            b, h, s, d = t.shape
            return t.transpose(1, 2).reshape(b, s, h * d).view(b, s, h, d).transpose(1, 2)

        output = torch.cond(entry[1], lambda q, k, v, m: call(q, k, v, None)[0],
                            lambda q, k, v, m: call(q, seq_major(k), seq_major(v), m)[0],
                            (query, key, value, attention_mask))
        return output, None

    # Eager attention adds the mask to the scores. Under autocast the scores are bfloat16 and the mask float32
    # (the embeddings' dtype): the add promotes, so softmax and its backward run in float32 where eager, which
    # skipped the all-ones mask, runs them in bfloat16 (BERT regression trained 1e-9 off eager per step, the
    # forward equal). A mask of the scores' dtype adds zeros exactly: no branch needed there.
    eager_mask = mask_table.get("eager")

    def recording_eager_mask(*args, **kwargs):
        pending.clear()
        mask = eager_mask(*args, **kwargs)
        if len(pending) == 1 and isinstance(mask, torch.Tensor):
            predicates[id(mask)] = (mask, pending[0])
        pending.clear()
        return mask

    def branching_eager(original):
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            entry = predicates.get(id(attention_mask)) if isinstance(attention_mask, torch.Tensor) else None
            if entry is None or entry[0] is not attention_mask or attention_mask.dtype == query.dtype:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            # Dropout draws here, once per call as eager does, and both branches drop out with those masks in
            # their own dtype (see _HoistedDropouts); the weights keep the masked path (as traced before): only
            # the output is eager's choice.
            dropout = kwargs.get("dropout", args[1] if len(args) > 1 else 0.0)
            drops = _HoistedDropouts(type(module).__name__, dropout, query.dtype, attention_mask.dtype)
            with drops.drawing():
                output, weights = original(module, query, key, value, attention_mask, *args, **kwargs)

            # The branches return the output flat: cond's fake tracing cannot prove the 4-d output's strides
            # dense when batch and heads share a size (RuntimeError on BERT with batch 2 and 2 heads).
            def flat_output(q, k, v, m):
                return original(module, q, k, v, m, *args, **kwargs)[0].reshape(-1)

            with drops.replaying():
                flat = torch.cond(entry[1], lambda q, k, v, m: flat_output(q, k, v, None), flat_output,
                                  (query, key, value, attention_mask))
            return flat.view(output.shape), weights

        return attention

    # Models call their own module's eager_attention_forward by its global name.
    eager_forwards = {name: mod.eager_attention_forward for name, mod in list(sys.modules.items())
                      if name.startswith("transformers.models.") and mod is not None
                      and callable(getattr(mod, "eager_attention_forward", None))}
    setattr(masking, names[0], _gated(ignore_causal, originals[names[0]]))
    setattr(masking, names[1], _gated(ignore_bidirectional, originals[names[1]]))
    mask_table["sdpa"] = _gated(recording_sdpa_mask, sdpa_mask)
    attention_table["sdpa"] = _gated(branching_sdpa, sdpa_attention)
    if eager_mask is not None:
        mask_table["eager"] = _gated(recording_eager_mask, eager_mask)
        for name, fn in eager_forwards.items():
            sys.modules[name].eager_attention_forward = _gated(branching_eager(fn), fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(masking, name, fn)
        mask_table["sdpa"], attention_table["sdpa"] = sdpa_mask, sdpa_attention
        if eager_mask is not None:
            mask_table["eager"] = eager_mask
            for name, fn in eager_forwards.items():
                sys.modules[name].eager_attention_forward = fn


# Eager recomputes a checkpointed block in backward, and the recomputation writes what the block
# writes into tensors from outside it a second time: a BatchNorm in training mode updates its
# running statistics and num_batches_tracked twice per step (torchvision's DenseNet with
# memory_efficient=True). The step traces the block once, then replays those writes at the end of
# the forward (``replay_checkpoint_writes``), in backward's order: the last block first. While
# tracing, _checkpoint_writes holds one list of writes per block; None outside the step's export.
_checkpoint_writes: list | None = None


class _ExternalWrites(torch.overrides.TorchFunctionMode):
    """Records the calls inside a checkpointed block that write into a tensor the block neither made nor
    was given: an in-place method or ``__setitem__`` on it, and batch/instance norm updating running
    statistics. ``grad_flows``: whether any tensor made inside the block requires grad (else eager's
    backward never reaches the block, and never recomputes it)."""

    # Argument names by position, and the default of the "use batch statistics" flag.
    _NORMS = {
        torch.nn.functional.batch_norm: (("input", "running_mean", "running_var", "weight", "bias", "training"), False),
        torch.nn.functional.instance_norm: (("input", "running_mean", "running_var", "weight", "bias",
                                             "use_input_stats"), True),
        torch.batch_norm: (("input", "weight", "bias", "running_mean", "running_var", "training"), None),
        torch.instance_norm: (("input", "weight", "bias", "running_mean", "running_var", "use_input_stats"), None),
    }

    def __init__(self, args):
        super().__init__()
        self.inside = {id(t) for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
        self.keep = []  # tensors made inside, kept alive so their ids stay unique
        self.writes = []
        self.unreplayable = []  # writes through out= into a tensor from outside (spectral_norm's power iteration)
        self.grad_flows = False
        self.saves = 0  # tensors the block's autograd nodes saved so far
        self.saves_before = []  # per write: the tensors saved before its call
        # Autograd nodes seen: the inputs' own, so the count stops at the block's edge.
        self._nodes = {t.grad_fn for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.grad_fn is not None}

    def _count_saves(self, out) -> int:
        """Tensors saved for backward by the autograd nodes ``out`` brought (those not seen before)."""
        count, todo = 0, [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self._nodes:
                continue
            self._nodes.add(node)
            self.keep.append(node)
            for attr in dir(node):
                if attr.startswith("_raw_saved_"):
                    try:
                        saved = getattr(node, attr, None)
                    except RuntimeError:  # saved, then freed
                        saved = True
                    count += len(saved) if isinstance(saved, (list, tuple)) else saved is not None
            todo.extend(fn for fn, _ in node.next_functions)
        return count

    def _outside(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) not in self.inside

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():
            # torch.cond traces its branches with dynamo, which inlines this mode: a branch (the step's
            # attention on a padding mask, in a checkpointed Hugging Face layer) is a pure function of
            # its operands, writing nothing from outside; grad_fn, read below, stops dynamo. (Not
            # is_compiling(): that is true for the whole export, and would switch the recorder off.)
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        wrote, saved = len(self.writes), self.saves
        if func in self._NORMS:
            names, default = self._NORMS[func]
            bound = dict(zip(names, args), **kwargs)
            batch_stats = bound.get("training", bound.get("use_input_stats", default))
            if self._outside(bound.get("running_mean")) and batch_stats:
                self.writes.append((func, args, kwargs))
        elif args and self._outside(args[0]) and (name == "__setitem__" or (
                name.endswith("_") and not name.endswith("__") and name not in ("requires_grad_", "share_memory_"))):
            self.writes.append((func, args, kwargs))
        if any(self._outside(t) for t in tree_leaves(kwargs.get("out"))):
            self.unreplayable.append(f"{getattr(func, '__module__', None) or ''}.{name}(out=...)".lstrip("."))
        given = {id(t) for t in tree_leaves((args, kwargs)) if self._outside(t)}
        out = func(*args, **kwargs)
        self.saves += self._count_saves(out)
        self.saves_before.extend([saved] * (len(self.writes) - wrote))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if id(t) in given:  # an in-place method returns the tensor it wrote: still from outside
                    continue  # (`ema.mul_(0.9).add_(y)`: the add_ is a write to replay as well)
                self.inside.add(id(t))
                self.keep.append(t)
                self.grad_flows |= t.requires_grad
        return out


def replay_checkpoint_writes() -> None:
    """Replays, at the end of the step's forward, the writes of each checkpointed block that eager's
    backward recomputes (see ``_checkpoint_writes``): the last block first, each block's writes in order.
    The replayed calls read the values the first writes left, as the recomputation does."""
    global _checkpoint_writes
    if not _checkpoint_writes:
        return
    blocks, _checkpoint_writes = _checkpoint_writes, []
    for writes in reversed(blocks):
        for func, args, kwargs in writes:
            func(*args, **kwargs)


def _no_grad_without_grad_inputs(grad_in: bool):
    """Around a reentrant block none of whose tensor arguments requires grad: ``torch.no_grad()``, as eager runs
    it (its forward under no_grad, and no backward). Under autocast that matters: a parameter's cast made there
    enters the region's weight cache without a gradient, and the region's later casts of it read that copy."""
    return contextlib.nullcontext() if grad_in else torch.no_grad()


@contextlib.contextmanager
def inline_reentrant_checkpoints():
    """Inside the block, ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` (torch 2.9's
    default when ``use_reentrant`` is not given, and ``checkpoint_sequential``'s) calls ``fn`` directly.
    Its autograd.Function runs ``fn`` under no_grad, which export records as a grad-mode region the joint
    graph cannot differentiate. Checkpointing changes when eager computes, not what: the recomputation
    restores the RNG state and redraws the same numbers, and the step plans its own memory. One eager
    behaviour is kept: with no tensor argument requiring grad, the outputs require none either, so
    parameters used only inside ``fn`` get no gradient (eager's "None of the inputs have requires_grad").

    With ``preserve_rng_state=False`` (either kind of checkpoint) eager's recomputation draws new random
    numbers, so its gradients use other dropout masks than its forward: a block that draws is refused."""
    from torch.fx.experimental import proxy_tensor
    from torch.utils import checkpoint as checkpoint_mod

    @contextlib.contextmanager
    def refusing_new_draws(preserve_rng_state):
        # Nodes the tracer appends inside the block; only looked at when eager would redraw differently.
        graph = None if preserve_rng_state else getattr(getattr(proxy_tensor.get_proxy_mode(), "tracer", None),
                                                         "graph", None)
        start = len(graph.nodes) if graph is not None else 0
        yield
        if graph is None:
            return
        drawn = sorted({str(n.target) for n in list(graph.nodes)[start:] if n.op == "call_function"
                        and isinstance(n.target, torch._ops.OpOverload)
                        and torch.Tag.nondeterministic_seeded in n.target.tags})
        if drawn:
            raise ValueError(f"torch.utils.checkpoint(preserve_rng_state=False) around random ops ({', '.join(drawn)}): "
                             "eager recomputes the block in backward with new random numbers, so its gradients use "
                             "other masks than its forward. The pure step cannot reproduce that; checkpoint with "
                             "preserve_rng_state=True (the default)")

    function_cls = checkpoint_mod.CheckpointFunction
    own = function_cls.__dict__.get("apply")  # None: inherited from autograd.Function
    bound_apply = function_cls.apply  # what another thread calls meanwhile
    non_reentrant = checkpoint_mod._checkpoint_without_reentrant_generator

    def recorded(writes):
        if writes.unreplayable and _checkpoint_writes is not None:
            # spectral_norm's power iteration (normalize(..., out=self._u)): eager's recomputation starts from
            # the vectors the forward left and iterates again, so its gradients come from another weight than
            # its forward, and its buffers move twice; the step's trace sees the block once.
            raise ValueError(
                f"torch.utils.checkpoint around a block that writes into a tensor from outside it with out= "
                f"({', '.join(sorted(set(writes.unreplayable)))}; e.g. spectral_norm's power iteration into its "
                "_u and _v buffers): eager recomputes the block in backward from the values its forward left, so "
                "its gradients come from another weight than its forward. The pure step cannot reproduce that; "
                "keep the parametrized layer outside the checkpointed block")
        if writes.writes and _checkpoint_writes is not None:
            _checkpoint_writes.append(writes.writes)

    def apply(function, preserve_rng_state, *args):
        from . import _reentrant_grads

        writes = _ExternalWrites(args)
        grad_in = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        # The block's parameter reads marked: eager adds the block's gradient into .grad on its own
        with refusing_new_draws(preserve_rng_state), writes, _reentrant_grads.block_reads(args, function) as marked, \
                _no_grad_without_grad_inputs(grad_in):
            out = function(*marked)  # once: the block draws eager's forward numbers
        if grad_in:
            recorded(writes)  # eager's backward recomputes the block
            return out
        return tree_map_only(torch.Tensor, torch.Tensor.detach, out)

    def checked_non_reentrant(fn, preserve_rng_state=True, context_fn=None, determinism_check=None, debug=False,
                              *args, **kwargs):
        rest = (context_fn or checkpoint_mod.noop_context_fn, determinism_check or
                checkpoint_mod._DEFAULT_DETERMINISM_MODE, debug)
        writes = _ExternalWrites((args, kwargs))
        with refusing_new_draws(preserve_rng_state), writes:
            yield from non_reentrant(fn, preserve_rng_state, *rest, *args, **kwargs)  # the block runs at its yield
        early_stop = checkpoint_mod._enable_checkpoint_early_stop
        if early_stop is None:  # the argument after debug (checkpoint passes it positionally), True by default
            early_stop = args[0] if args and isinstance(args[0], bool) else kwargs.get("early_stop", True)
        if early_stop:
            # Eager's recomputation stops once it has saved as many tensors as the forward did: the writes after
            # the block's last saving call are never made again (an EMA updated under no_grad at its end).
            writes.writes = [w for w, saved in zip(writes.writes, writes.saves_before) if saved < writes.saves]
        if writes.grad_flows:
            recorded(writes)

    global _checkpoint_writes
    function_cls.apply = staticmethod(_gated(apply, bound_apply))
    checkpoint_mod._checkpoint_without_reentrant_generator = _gated(checked_non_reentrant, non_reentrant)
    outer_writes, _checkpoint_writes = _checkpoint_writes, []
    try:
        yield
    finally:
        _checkpoint_writes = outer_writes
        checkpoint_mod._checkpoint_without_reentrant_generator = non_reentrant
        if own is None:
            del function_cls.apply
        else:
            function_cls.apply = own


@contextlib.contextmanager
def no_grad_inside_autocast():
    """Inside the block, a ``torch.no_grad()`` (or ``torch.enable_grad()``) block inside a ``torch.autocast``
    region is exported as a grad-mode region. torch 2.9's export splits the flat graph at each grad-mode change
    (split_module), starting each piece with the autocast region re-entered, and then looks for the grad-mode
    change as the piece's first node: it found the re-entered autocast, inlined the piece and dropped its grad
    mode. The joint graph then differentiated through the no_grad block, and a parameter read only there got an
    update eager never makes. Here the re-entered autocast nodes are skipped when looking for that first node."""
    from torch._export.passes import replace_set_grad_with_hop_pass as grad_pass

    enter_autocast = torch.amp.autocast_mode._enter_autocast

    def is_set_grad_sub_mod(node, omit_if_same_with_ambient=False):
        if node.op != "call_module":
            return False
        sub = getattr(node.graph.owning_module, node.target)
        first = next((n for n in sub.graph.nodes if n.op != "placeholder"
                      and not (n.op == "call_function" and n.target is enter_autocast)), None)
        if first is None or first.op != "call_function" or first.target is not torch._C._set_grad_enabled:
            return False
        return first.args[0] != torch.is_grad_enabled() if omit_if_same_with_ambient else True

    with _gated_attribute(grad_pass, "_is_set_grad_enabled_sub_mod", is_set_grad_sub_mod):
        yield


@contextlib.contextmanager
def autocast_weight_cache():
    """Inside the block, an export's autocast regions reuse one cast of a parameter as eager's weight cache
    does (share_autocast_weight_casts, run before torch's grad-mode pass on the flat graph). Each traced
    ``_enter_autocast`` is marked with the cache flag eager has there: ``torch.autocast``'s own
    ``cache_enabled``, else the flag in force where it is made (tracing turns the cache off, and export records
    that ``False`` for every region), kept on a stack as eager's thread-local flag is."""
    from torch._export.passes import replace_set_grad_with_hop_pass as grad_pass
    from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode

    from ._autocast_weight_cache import CACHE_FLAG, share_autocast_weight_casts

    cls = torch.amp.autocast_mode.autocast
    init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__
    flags = [torch.is_autocast_cache_enabled()]  # eager's thread-local flag, outside the trace's own setting

    def patched_init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        init(self, device_type, dtype, enabled, cache_enabled)
        self._torch_ext_cache = flags[-1] if cache_enabled is None else bool(cache_enabled)

    def recording_modes():
        if not torch._C._is_torch_function_mode_enabled():
            return []
        return [m for m in torch.overrides._get_current_function_mode_stack()
                if isinstance(m, PreDispatchTorchFunctionMode)]

    def patched_enter(self):
        modes = recording_modes()
        before = [len(m.enter_autocast_nodes) for m in modes]
        out = enter(self)
        # (one made before the block, a @torch.autocast decorator's, read its flag from eager's own state)
        flags.append(getattr(self, "_torch_ext_cache", getattr(self, "_cache_enabled", flags[-1])))
        for m, k in zip(modes, before):
            if len(m.enter_autocast_nodes) > k:
                m.enter_autocast_nodes[-1].meta[CACHE_FLAG] = flags[-1]
        return out

    def patched_exit(self, *exc):
        if len(flags) > 1:
            flags.pop()
        return exit_(self, *exc)

    pass_ = grad_pass.replace_set_grad_with_hop_pass

    def grad_pass_after_sharing(gm, graph_signature):
        if graph_signature is not None:
            share_autocast_weight_casts(gm, graph_signature)
        return pass_(gm, graph_signature)

    cls.__init__ = _gated(patched_init, init)
    cls.__enter__, cls.__exit__ = _gated(patched_enter, enter), _gated(patched_exit, exit_)
    try:
        with _gated_attribute(grad_pass, "replace_set_grad_with_hop_pass", grad_pass_after_sharing):
            yield
    finally:
        cls.__init__, cls.__enter__, cls.__exit__ = init, enter, exit_


@contextlib.contextmanager
def inference_mode_as_no_grad():
    """Inside the block, ``torch.inference_mode()`` disables gradients as ``torch.no_grad()`` does. Tracing
    does not record inference mode, so a block under it (a frozen teacher's forward) was differentiated,
    and the step trained parameters that eager gives no gradient: AdamW moved a teacher's weights 1e-2
    in one step where eager left them. Patched on the class, so ``@torch.inference_mode()`` decorators and
    a name imported before the block behave the same."""
    from torch.autograd import grad_mode

    cls = grad_mode.inference_mode
    enter, exit_ = cls.__enter__, cls.__exit__

    def no_grad_enter(self):
        self._torch_ext_grad_before = torch.is_grad_enabled()
        if self.mode:
            torch.set_grad_enabled(False)

    def no_grad_exit(self, *exc):
        torch.set_grad_enabled(self._torch_ext_grad_before)

    cls.__enter__, cls.__exit__ = _gated(no_grad_enter, enter), _gated(no_grad_exit, exit_)
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_


@contextlib.contextmanager
def refuse_autograd_in_trace():
    """Inside the block, ``torch.autograd.grad`` / ``backward`` (a gradient penalty, an adversarial example
    made from the input's gradient) raise a NotImplementedError that says what the step is. torch 2.9's
    export traces them, and the joint graph then fails on an internal assertion naming a backward op.
    Patched where both functions call the engine, so names imported before the block are covered too."""
    import torch.autograd as autograd_mod

    engine = autograd_mod._engine_run_backward

    def refuse(*args, **kwargs):
        raise NotImplementedError(
            "the model or loss_fn computes a gradient itself (torch.autograd.grad or .backward(): a gradient "
            "penalty, an adversarial example from the input's gradient). The pure step is one traced forward "
            "and the backward of its loss; a gradient inside that forward cannot be traced into it by torch "
            f"{torch.__version__}. Train this model eagerly")

    with _gated_attribute(autograd_mod, "_engine_run_backward", refuse):
        yield


def _rnn_helper_with_dropout(input, hidden, params, has_biases, num_layers, dropout, train, bidirectional,
                             batch_first, layer_fn):
    """torch 2.9's ``torch._decomp.decompositions._rnn_helper`` (what tracing runs for nn.RNN, GRU and
    LSTM), with eager's dropout between layers: torch's copy zeroes it for every layer
    (``dropout if (train and num_layers < i - 1) else 0.0`` is never true), so a traced multi-layer
    RNN with ``dropout=p`` trained with no dropout at all. Eager (aten/src/ATen/native/RNN.cpp) applies
    ``at::dropout`` to each layer's output but the last when training."""
    from torch._decomp.decompositions import params_hiddens

    input = input.transpose(0, 1) if batch_first else input
    final_hiddens = []
    for i in range(num_layers):
        cur_params, cur_hidden, bidir_params, bidir_hidden = params_hiddens(params, hidden, i, bidirectional)
        fwd_inp, fwd_hidden = layer_fn(input, cur_hidden, cur_params, has_biases)
        final_hiddens.append(fwd_hidden)
        if bidirectional:
            bwd_inp, bwd_hidden = layer_fn(input, bidir_hidden, bidir_params, has_biases, reverse=True)
            final_hiddens.append(bwd_hidden)
            input = torch.cat([fwd_inp, bwd_inp], fwd_inp.dim() - 1)
        else:
            input = fwd_inp
        if dropout != 0 and train and i < num_layers - 1:
            input = torch.dropout(input, dropout, train=True)
    input = input.transpose(0, 1) if batch_first else input
    return input, final_hiddens


# Ops whose autograd torch's Python decompositions take over while tracing (py_impl for
# DispatchKey.Autograd): the joint graph then differentiates the decomposition (index, lerp, masks)
# instead of calling the backward kernel eager autograd calls. The gradients round differently
# (bilinear and bicubic upsampling 1 ulp off eager), or are wrong: torch 2.9's decomposition of
# multilabel_margin_loss_forward gives 28.19 where eager gives 2.65 (the step trained 0.72 off eager's
# loss in 3 steps, silently); its decomposition of multi_margin_loss (p=2, weight) rounds 1 ulp off eager's
# loss and gradient. Traced with these removed, the op runs its C++ kernel and autograd
# records eager's derivative (upsample_bilinear2d_backward, multilabel_margin_loss_backward, multi_margin_loss_backward).
EAGER_AUTOGRAD_OPS = (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    "multilabel_margin_loss_forward", "multi_margin_loss",
)


@contextlib.contextmanager
def eager_autograd_kernels(names=EAGER_AUTOGRAD_OPS):
    """Inside the block, the ops ``names`` (every overload) trace as eager runs them: their Python
    Autograd and CompositeImplicitAutograd kernels (torch._decomp's) are set aside."""
    from torch._C import DispatchKey

    removed = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            for key in (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd):
                kernel = op.py_kernels.pop(key, None)
                if kernel is not None:
                    removed.append((op, key, kernel))
            op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, key, kernel in removed:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()


@contextlib.contextmanager
def eager_pad_sequence():
    """Inside the block, ``pad_sequence`` runs ATen's kernel: torch 2.9's Python decomposition (its
    CompositeImplicitAutograd kernel, which the Python dispatcher of a trace runs) has no ``padding_side``
    argument, so ``pad_sequence(..., padding_side="left")`` failed to trace with a TypeError. ATen's copies each
    sequence into a padded buffer, on either side (the values are copies: eager's, bit for bit)."""
    with eager_autograd_kernels(("pad_sequence",)):
        yield


def _eager_should_fold(tensor1, tensor2, is_out: bool) -> bool:
    """ATen's ``should_fold`` (aten/src/ATen/native/LinearAlgebra.cpp, torch 2.9): whether ``matmul`` folds the
    batch of its larger (N >= 3-D) argument into one ``mm``/``mv`` instead of running ``bmm``."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    larger = tensor1.dim() >= tensor2.dim()
    t1 = tensor1 if larger else tensor2.mT  # ATen transposes the 3-D right-hand side
    if not (t1.dim() >= 3 and (tensor2 if larger else tensor1).dim() <= 2):
        return False
    if _eager_requires_grad(tensor2 if larger else tensor1) and not is_out:
        return True
    if tensor1.dim() == 2:
        return False
    if guard_or_false(t1.numel() == 0):
        return True
    # Only the batch dims are checked, each against the next, size-1 dims included (no contiguity check).
    sizes, strides = t1.shape, t1.stride()
    return all(guard_or_false(strides[i] == strides[i + 1] * sizes[i + 1]) for i in range(t1.dim() - 2))


@contextlib.contextmanager
def eager_matmul_fold():
    """Inside the block, ``matmul``'s Python decomposition (torch._decomp's, which the Python dispatcher of a trace
    runs for ``linear`` and ``matmul`` in place of ATen's C++ one) folds a batch into one ``mm`` exactly when
    eager's does. Its ``should_fold`` asked for a contiguous input, skipping size-1 dims, where ATen checks each
    batch dim's stride against the next one's times its size, size-1 dims included: a frozen bias-free ``Linear`` (or ``x @ w``, ``w`` needing no gradient)
    on a batch-1 input whose size-1 dim has another stride (``MultiheadAttention(batch_first=True)``'s output,
    [1, 6, 4] with strides (4, 4, 1)) traced the folded ``mm`` where eager runs ``bmm`` (1 ulp off, fuzz_step
    ``--case 24:257``), and one on an input sliced in its last dim (``h[..., ::2]``) traced ``bmm`` where eager
    folds. The rest of the decomposition is eager's; the C++ one is not kept instead, as it takes the trace's
    functional tensors for subclasses and squeezes a broadcast 3-D batch eager does not squeeze."""
    # Only while torch's copy still skips size-1 dims (the code this corrects): a torch that changes it keeps its own.
    with _decomposition_replaced("should_fold", "size == 1", _eager_should_fold):
        yield


_cond_branch = threading.local()  # pending: (operand signature, requires_grad flags) of the conds being traced above
# autograd; grad: the storages of a branch's operands that require grad in eager (one entry per branch being traced)


def _storage_key(t: torch.Tensor):
    """The storage ``t``'s values live in, through functionalization's wrappers (a view's is its base's)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    try:
        if isinstance(t, FunctionalTensor):
            t = t.elem
        if torch._is_functional_tensor(t):
            t = torch._from_functional_tensor(t)
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage: no eager flag to find
        return None


def _eager_requires_grad(t: torch.Tensor) -> bool:
    """Whether ``t`` requires grad as eager's would: its own flag, or, inside a cond branch being traced (whose
    tensors require none), whether it is a view of an operand that requires grad in eager (eager runs the branch
    below autograd on the real operands: a view of one requires grad, a result computed from one does not)."""
    if t.requires_grad:
        return True
    stack = getattr(_cond_branch, "grad", None)
    if not stack:
        return False
    key = _storage_key(t)
    return key is not None and any(key in keys for keys in stack)


@contextlib.contextmanager
def cond_branches_with_eager_requires_grad():
    """Inside the block, ``matmul``'s fold decision in a ``torch.cond`` branch reads its operands'
    ``requires_grad`` as eager has them. Eager runs the taken branch below autograd on the real operands, which
    keep their flags (a trainable weight lifted into the branch requires grad, and so does its ``.t()`` view);
    the joint trace traces the branch on functional tensors that require none. ``should_fold`` reads the flag: a
    ``Linear`` in a branch on a [B, T, D] operand that is not contiguous (a stream transposed back from
    channels-first) traced ``bmm`` + ``add`` where eager folds into one ``addmm``-like ``mm`` (the branch's output
    1 ulp off, then every gradient: fuzz_step ``--case 28:277``). The flags come from ``CondAutogradOp.forward``
    (which sees the operands above autograd) to the ``trace_cond`` it leads to; while each branch is traced, the
    storages of its operands that require grad are where ``_eager_requires_grad`` looks."""
    import torch._higher_order_ops.cond  # noqa: F401 - the package's ``cond`` attribute is the function, not the module

    cond_mod = sys.modules["torch._higher_order_ops.cond"]
    op = cond_mod.CondAutogradOp
    forward, trace = op.__dict__["forward"], cond_mod.trace_cond

    def signature(operands) -> list:
        return [(tuple(map(str, o.shape)), o.dtype) if isinstance(o, torch.Tensor) else type(o) for o in operands]

    def forward_recording(ctx, pred, true_fn, false_fn, *operands):
        pending = _cond_branch.__dict__.setdefault("pending", [])
        pending.append((signature(operands), [isinstance(o, torch.Tensor) and o.requires_grad for o in operands]))
        try:
            return forward.__func__(ctx, pred, true_fn, false_fn, *operands)
        finally:
            pending.pop()

    def trace_with_flags(proxy_mode, func_overload, pred, true_fn, false_fn, operands):
        # This cond's flags: the innermost pending ones, where its operands are theirs (a cond nested in a branch
        # is traced while its outer cond's flags are pending, by torch's checks of the outer branch, and has its own)
        pending = getattr(_cond_branch, "pending", None)
        flags = pending[-1][1] if pending and pending[-1][0] == signature(operands) else None
        if flags is None or not any(flags):
            return trace(proxy_mode, func_overload, pred, true_fn, false_fn, operands)

        def as_eager(fn):
            def branch(*args):
                keys = {_storage_key(a) for a, f in zip(args, flags) if f and isinstance(a, torch.Tensor)} - {None}
                stack = _cond_branch.__dict__.setdefault("grad", [])
                stack.append(keys)
                try:
                    return fn(*args)
                finally:
                    stack.pop()
            return branch

        return trace(proxy_mode, func_overload, pred, as_eager(true_fn), as_eager(false_fn), operands)

    op.forward = staticmethod(_gated(forward_recording, forward.__func__))
    cond_mod.trace_cond = _gated(trace_with_flags, trace)
    try:
        yield
    finally:
        op.forward = forward
        cond_mod.trace_cond = trace


@contextlib.contextmanager
def joint_replayed_without_autograd():
    """Inside the block, torch 2.9's ``aot_export_module(trace_joint=True)`` replays its joint graph (forward
    and backward, already differentiated and functionalized) under ``torch.no_grad()``. It retraces that graph
    with ``make_fx`` to drop its tangents, with grad mode on and the parameters requiring grad, so autograd
    records every backward op again, and an op whose autograd refuses complex outputs stops the export:
    ``fft_r2c_backward`` (eager's derivative of ``torch.fft.rfft``) pads the gradient with
    ``new_zeros(...).slice(...).copy_(grad)``, functionalized into a complex ``slice_scatter``, and the replay
    failed with "slice_scatter does not support automatic differentiation for outputs with complex dtype".
    Nothing differentiates the replay, and grad mode changes neither the ops it records nor the kernels
    they dispatch to. Only the module-level ``make_fx`` name of ``torch._functorch.aot_autograd`` (that
    replay's only user) is wrapped."""
    import functools

    from torch._functorch import aot_autograd

    make_fx = aot_autograd.make_fx

    @functools.wraps(make_fx)
    def make_fx_without_grad(*args, **kwargs):
        traced = make_fx(*args, **kwargs)

        @functools.wraps(traced)
        def run(*inputs):
            with torch.no_grad():
                return traced(*inputs)
        return run

    with _gated_attribute(aot_autograd, "make_fx", make_fx_without_grad):
        yield


def _reversed_cumsum(w: torch.Tensor, dim: int) -> torch.Tensor:
    return w.flip(dim).cumsum(dim).flip(dim)


def _cumprod_backward_first_order(grad, input, dim, output):
    """ATen's ``cumprod_backward`` (aten/src/ATen/native/ReduceOps.cpp, torch 2.9) as eager autograd runs it for
    a first-order gradient, written without reading data: eager picks ``reversed_cumsum(output * grad) / input``
    when ``input`` holds no zero, else an O(n) formula built with ``masked_scatter_``. Both are computed here,
    with the same kernels, each ``masked_scatter_`` as a ``where`` (the same elements copied), and
    ``where(any zero, ...)`` picks eager's."""
    if input.numel() <= 1:
        return grad
    dim = dim % input.dim()
    if input.shape[dim] == 1:
        return grad
    input_conj, output_conj = input.conj(), output.conj()
    w = output_conj * grad
    is_zero = input == 0
    no_zero = _reversed_cumsum(w, dim).div(input_conj)
    cumsum = is_zero.cumsum(dim)
    mask = cumsum == 0  # before the first zero
    before = _reversed_cumsum(w.masked_fill(~mask, 0.), dim).div(input_conj)
    grad_input = torch.where(mask, before, torch.zeros_like(grad))
    mask = cumsum == 1  # from the first zero to the second
    first_zero_index = mask.max(dim, keepdim=True).indices
    first_zero_mask = torch.zeros_like(mask).scatter(dim, first_zero_index, 1).logical_and(mask)
    mask = mask & ~first_zero_mask
    at_first_zero = (input_conj.masked_fill(~mask, 1.).cumprod(dim).mul(grad.masked_fill(cumsum != 1, 0.))
                     .sum(dim, keepdim=True)
                     .mul(torch.gather(output_conj, dim, (first_zero_index - 1).relu())
                          .masked_fill(first_zero_index == 0, 1.)))
    grad_input = torch.where(first_zero_mask, at_first_zero, grad_input)
    return torch.where(is_zero.any(), grad_input, no_zero)


@contextlib.contextmanager
def eager_cumprod_backward():
    """Inside the block, ``aten.cumprod_backward`` (the derivative autograd records for ``torch.cumprod``) traces
    as eager computes a first-order gradient (``_cumprod_backward_first_order``). ATen's kernel branches on the
    input's data (any zero?) and, given a tensor subclass (the trace's functional tensors), always takes its
    O(n^2) form meant for double backward: products of slices, which round differently (the step's gradients
    were 1.5e-8 off eager's). Under grad mode (a gradient of the gradient) ATen's kernel runs as before."""
    from torch._C import DispatchKey

    op = torch.ops.aten.cumprod_backward.default
    key = DispatchKey.CompositeImplicitAutograd

    def kernel(grad, input, dim, output):
        if torch.is_grad_enabled():  # ATen's C++ kernel (op.decompose would call this one again)
            return op._op_dk(key, grad, input, dim, output)
        return _cumprod_backward_first_order(grad, input, dim, output)

    with _python_kernels(key, {op: kernel}):
        yield


_FAKE_UNCACHED: dict = {}  # OpOverload -> how many open blocks keep fake tensors' cache off for it


@contextlib.contextmanager
def _fake_cache_bypassed(ops):
    """Fake tensors compute ``ops`` afresh in the block instead of through their dispatch cache
    (``FakeTensorMode.cache``, process-global, keyed by the op and its inputs' metadata only). A trace patch that
    changes what an op's meta kernel or decomposition returns otherwise read results cached before the block
    without it, and left its own in the cache for traces after the block: exporting a model's training loss
    before ``make_train_step`` (transposed BatchNorm1d) made the step trace batch norm in the meta kernels'
    layout, which the IR checker refused, and ``to_aoti``'s decompositions saw whichever layout had been
    cached."""
    from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache

    ops = list(ops)
    if not _FAKE_UNCACHED:
        original = FakeTensorMode._cache_key

        def cache_key(self, state, func, args, kwargs):
            if func in _FAKE_UNCACHED:
                raise _BypassDispatchCache("torch_ext: a trace patch changes this op's fake result")
            return original(self, state, func, args, kwargs)

        FakeTensorMode._cache_key = cache_key
        _fake_cache_bypassed.original = original
    for op in ops:
        _FAKE_UNCACHED[op] = _FAKE_UNCACHED.get(op, 0) + 1
    try:
        yield
    finally:
        for op in ops:
            _FAKE_UNCACHED[op] -= 1
            if not _FAKE_UNCACHED[op]:
                del _FAKE_UNCACHED[op]
        if not _FAKE_UNCACHED:
            FakeTensorMode._cache_key = _fake_cache_bypassed.original


@contextlib.contextmanager
def _python_kernels(key, kernels: dict):
    """``{op: kernel}`` as each op's Python kernel for dispatch key ``key`` for the block; what was there is put
    back after it, also when it raises. A Meta kernel's results bypass fake tensors' cache in the block
    (``_fake_cache_bypassed``)."""
    from torch._C import DispatchKey

    uncached = _fake_cache_bypassed(kernels) if key == DispatchKey.Meta else contextlib.nullcontext()
    previous = {op: op.py_kernels.pop(key, None) for op in kernels}
    for op, kernel in kernels.items():
        op.py_kernels[key] = kernel
        op._dispatch_cache.clear()
    try:
        with uncached:
            yield
    finally:
        for op in kernels:
            del op.py_kernels[key]
            if previous[op] is not None:
                op.py_kernels[key] = previous[op]
            op._dispatch_cache.clear()


class _EagerHalfDropout(torch.autograd.Function):
    """``aten.native_dropout`` on a float16 / bfloat16 input, differentiated as eager's CPU dropout is (see
    ``eager_half_dropout_backward``)."""

    @staticmethod
    def forward(ctx, input, p, train):
        with torch._C._AutoDispatchBelowAutograd():
            output, mask = torch.ops.aten.native_dropout.default(input, p, train)
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(mask)
        ctx.p = p
        return output, mask

    @staticmethod
    def backward(ctx, grad, _grad_mask):
        (mask,) = ctx.saved_tensors
        # at::_dropout (aten/src/ATen/native/Dropout.cpp): noise = bernoulli draws in the input's dtype,
        # noise.div_(1 - p), output = input * noise (p == 1: input * zeros), so the gradient is grad * noise.
        noise = torch.zeros_like(grad) if ctx.p == 1 else mask.to(grad.dtype).div(1 - ctx.p)
        return grad * noise, None, None


@contextlib.contextmanager
def eager_half_dropout_backward():
    """Inside the block, ``aten.native_dropout`` of a float16 or bfloat16 input in training differentiates as
    eager's CPU dropout. Eager runs ``at::_dropout`` on the CPU (the fused ``native_dropout`` only on CUDA and
    other accelerators): the mask drawn in the input's dtype and divided by ``1 - p`` there, its gradient
    ``grad * noise``. Tracing records ``native_dropout`` (the same draws and forward values) and its derivative
    ``native_dropout_backward(grad, mask, 1 / (1 - p))``, which scales in float32 and rounds once: in half
    precision the step's gradients differed from eager's (a bfloat16 GPT-2 trained 4e-5 off eager's loss after
    one step, silently). In float32 and float64 both round alike, and the trace is left as it was."""
    from torch._C import DispatchKey

    key = DispatchKey.Autograd
    op = torch.ops.aten.native_dropout.default
    previous = op.py_kernels.get(key)

    def kernel(input, p, train):
        if (input.dtype in (torch.float16, torch.bfloat16) and train is not False and input.device.type == "cpu"
                and torch.is_grad_enabled() and input.requires_grad):
            return _EagerHalfDropout.apply(input, p, train)
        if previous is not None:
            return previous(input, p, train)
        return op._op_dk(key, input, p, train)

    with _python_kernels(key, {op: kernel}):
        yield


def _prod_safe_zeros_backward(grad, input, dim):
    """ATen's ``prod_safe_zeros_backward`` (torch/csrc/autograd/FunctionsManual.cpp, torch 2.9), the same kernels:
    exclusive cumulative products from the front and from the back, multiplied, so that no division by the input
    is needed (exact with zeros)."""
    if input.numel() == 0:
        return grad.expand_as(input)
    n = input.shape[dim]
    if n == 1:
        return grad
    ones_size = list(input.shape)
    ones_size[dim] = 1
    ones = torch.ones(ones_size, dtype=grad.dtype, device=grad.device)
    exclusive_normal = torch.cat([ones, input.narrow(dim, 0, n - 1)], dim).cumprod(dim)
    narrow_reverse = input.narrow(dim, 1, n - 1).flip(dim)
    exclusive_reverse = torch.cat([ones, narrow_reverse], dim).cumprod(dim).flip(dim)
    return grad * (exclusive_normal * exclusive_reverse).conj()


def _prod_backward_first_order(grad, input, result, dim=None, keepdim=False):
    """ATen's ``prod_backward`` (FunctionsManual.cpp, torch 2.9) as eager autograd runs it for a first-order
    gradient, written without reading data. Eager reads the input: with no zero it takes
    ``grad * (result / input).conj()``; else ``prod_safe_zeros_backward`` (over the flattened input for a full
    prod), except that a full prod with two zeros or more, outside grad mode, gives ``zeros_like(input)``. All are
    computed here, with the same kernels, and ``where`` picks eager's. ``dim=None``: the full ``prod``."""
    if input.dim() == 0:
        return grad
    if dim is None:
        no_zero = grad * (result / input).conj()
        safe = _prod_safe_zeros_backward(grad, input.contiguous().view(-1), 0).view_as(input)
        zeros = (input == 0).sum()
        return torch.where(zeros > 1, torch.zeros_like(input), torch.where(zeros == 0, no_zero, safe))
    dim = dim % input.dim()
    if not keepdim:
        grad, result = grad.unsqueeze(dim), result.unsqueeze(dim)
    no_zero = grad * (result / input).conj()
    safe = _prod_safe_zeros_backward(grad, input, dim)
    return torch.where((input == 0).any(), safe, no_zero)


def _is_tensor_subclass_like(t: torch.Tensor) -> bool:
    """ATen's ``input.is_meta() || isTensorSubclassLike(input)`` (ATen/TensorSubclassLikeUtils.h): a dispatch mode
    is on, or the tensor is meta, a Python subclass (FunctionalTensor, FakeTensor), a functional wrapper, a functorch
    wrapper or sparse."""
    from torch._C import DispatchKey

    if torch._C._len_torch_dispatch_stack() > 0 or t.is_meta or type(t) is not torch.Tensor:
        return True
    keys = torch._C._dispatch_keys(t)
    return any(keys.has(k) for k in (DispatchKey.Python, DispatchKey.Functionalize, DispatchKey.FuncTorchGradWrapper,
                                      DispatchKey.FuncTorchBatched, DispatchKey.Sparse, DispatchKey.SparseCsr))


def _prod_backward_atens(grad, input, result, dim=None, keepdim=False):
    """ATen's ``prod_backward`` under grad mode (a gradient of the gradient), branches included: the differentiable
    ``prod_safe_zeros_backward`` for a tensor subclass (a trace's tensors), else branched on the input's zeros."""
    if input.dim() == 0:
        return grad
    if dim is not None:
        dim = dim % input.dim()
        if not keepdim:
            grad, result = grad.unsqueeze(dim), result.unsqueeze(dim)
    subclass = _is_tensor_subclass_like(input)
    if not subclass and not bool((input == 0).any()):
        return grad * (result / input).conj()
    if dim is None:
        return _prod_safe_zeros_backward(grad, input.contiguous().view(-1), 0).view_as(input)
    return _prod_safe_zeros_backward(grad, input, dim)


class _EagerProd(torch.autograd.Function):
    """``aten.prod`` / ``aten.prod.dim_int`` whose backward is eager's (see ``eager_prod_backward``)."""

    @staticmethod
    def forward(ctx, input, op, args, kwargs, dim, keepdim):
        with torch._C._AutoDispatchBelowAutograd():
            result = op(input, *args, **kwargs)
        ctx.save_for_backward(input, result)
        ctx.dim, ctx.keepdim = dim, keepdim
        return result

    @staticmethod
    def backward(ctx, grad):
        input, result = ctx.saved_tensors
        input = input.to(grad.dtype)  # derivatives.yaml: prod_backward(grad, self.to(grad.scalar_type()), result, ...)
        backward = _prod_backward_atens if torch.is_grad_enabled() else _prod_backward_first_order
        return backward(grad, input, result, ctx.dim, ctx.keepdim), None, None, None, None, None


@contextlib.contextmanager
def eager_prod_backward():
    """Inside the block (with the Python dispatcher on, as in a trace), ``aten.prod`` and ``aten.prod.dim_int``
    differentiate as eager autograd does a first-order gradient (``_prod_backward_first_order``). ATen's
    ``prod_backward`` is no dispatcher op: it is called from the ops' C++ autograd kernel, branches on the input's
    data (any zero?) and, given a tensor subclass (the trace's functional tensors), always takes
    ``prod_safe_zeros_backward``, which rounds differently from eager's ``grad * (result / input)`` (the step's
    gradients were ~3e-8 off eager's). So the ops' Autograd kernel is replaced by a Python one that records
    ``_EagerProd``. Under grad mode in the backward (a gradient of the gradient) ATen's branches are kept
    (``_prod_backward_atens``)."""
    from torch._C import DispatchKey

    key = DispatchKey.Autograd
    ops = (torch.ops.aten.prod.default, torch.ops.aten.prod.dim_int)

    def make_kernel(op):
        def kernel(input, *args, **kwargs):
            if not (torch.is_grad_enabled() and input.requires_grad):
                with torch._C._AutoDispatchBelowAutograd():
                    return op(input, *args, **kwargs)
            if op is torch.ops.aten.prod.default:
                dim, keepdim = None, False
            else:
                bound = op._schema.arguments
                values = dict(zip((a.name for a in bound[1:]), args), **kwargs)
                dim, keepdim = values["dim"], values.get("keepdim", False)
            return _EagerProd.apply(input, op, args, kwargs, dim, keepdim)
        return kernel

    with _python_kernels(key, {op: make_kernel(op) for op in ops}):
        yield


@contextlib.contextmanager
def rnn_dropout_between_layers():
    """Traces nn.RNN / GRU / LSTM with their dropout between layers, as eager runs them (see
    ``_rnn_helper_with_dropout``). Only where torch's decomposition has the bug, which is read from its
    source so that a torch that fixes it keeps its own."""
    with _decomposition_replaced("_rnn_helper", "num_layers < i - 1", _rnn_helper_with_dropout):
        yield


@contextlib.contextmanager
def _decomposition_replaced(name: str, marker: str, replacement):
    """``torch._decomp.decompositions.<name>`` replaced by ``replacement`` on the tracing thread (``_gated``) for
    the block, and put back after it, also when it raises; only where torch's source of it contains ``marker``
    (the code the replacement corrects), so that a torch that changes it keeps its own."""
    import inspect

    import torch._decomp.decompositions as decomps

    original = getattr(decomps, name, None)
    try:
        differs = original is not None and marker in inspect.getsource(original)
    except (OSError, TypeError):
        differs = False
    if not differs:
        yield
        return
    with _gated_attribute(decomps, name, replacement):
        yield


def _gru_cell_as_eager(inp, cur_hidden, ih_weight, ih_bias, hh_weight, hh_bias):
    """torch 2.9's ``torch._decomp.decompositions.gru_cell`` (what tracing runs for nn.GRU) with eager's
    layouts. Eager's cell (aten/src/ATen/native/RNN.cpp, ``GRUCell``) adds the reset and update chunks of the
    input gates in place into the hidden gates and applies ``sigmoid_`` to those chunks, views of width H in
    rows of 3H; torch's copy applies ``sigmoid`` to a fresh contiguous sum. The CPU kernel vectorizes a
    contiguous tensor whole but a row of H alone (its scalar tail when H is below the vector width), and the
    two round apart: a GRU with batch 8 trained 1.2e-7 off eager's loss in 3 SGD steps, silently. Here the
    gates are summed whole and each sigmoid reads its chunk of the sum, a view with eager's strides
    (``lstm_cell`` already does so); the new gate and the blend are eager's as they were."""
    hgates = torch.nn.functional.linear(cur_hidden, hh_weight, hh_bias)
    gates = hgates + inp
    chunked_igates, chunked_hgates, chunked_gates = inp.chunk(3, -1), hgates.chunk(3, -1), gates.chunk(3, -1)
    reset_gate = chunked_gates[0].sigmoid()
    input_gate = chunked_gates[1].sigmoid()
    new_gate = (chunked_igates[2] + (chunked_hgates[2] * reset_gate)).tanh()
    return (cur_hidden - new_gate) * input_gate + new_gate


def _gru_cell_op_as_eager(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``aten.gru_cell`` (``nn.GRUCell``, ``torch.gru_cell``) as eager's CPU ``GRUCell`` computes it
    (aten/src/ATen/native/RNN.cpp): ``hgates.chunk(3)[k].add_(igates.chunk(3)[k]).sigmoid_()`` for the reset and
    update gates, in place on views of width H in rows of 3H. Traced, the C++ composite is functionalized: each
    sigmoid reads a fresh contiguous sum, which the CPU kernel vectorizes whole where eager's strided chunk runs
    its scalar tail (H below twice the vector width), and the two round apart: the gates 1 ulp off eager's, so
    an nn.GRUCell with batch 8 trained 3e-8 off eager's parameters in 3 steps, silently. Here the two sums go
    into one tensor of eager's layout, ``[hg0 + ig0, hg1 + ig1, hg2]``, and each sigmoid reads its chunk, a view
    with eager's strides; the new gate multiplies that tensor's third chunk (eager's ``hg2.mul_(reset)`` on its
    own chunk of the hidden gates), so every gradient is a copy or eager's formula, nothing summed with zeros.
    Elsewhere than the CPU eager runs a fused kernel: the op's own composite there."""
    if input.device.type != "cpu":
        from torch._C import DispatchKey

        return torch.ops.aten.gru_cell.default._op_dk(DispatchKey.CompositeImplicitAutograd, input, hx, w_ih, w_hh,
                                                      b_ih, b_hh)
    igates, hgates = torch.nn.functional.linear(input, w_ih, b_ih), torch.nn.functional.linear(hx, w_hh, b_hh)
    ig, hg = igates.chunk(3, 1), hgates.chunk(3, 1)
    gates = torch.cat([hg[0] + ig[0], hg[1] + ig[1], hg[2]], 1).chunk(3, 1)
    reset_gate, input_gate = gates[0].sigmoid(), gates[1].sigmoid()
    new_gate = (ig[2] + gates[2] * reset_gate).tanh()
    return (hx - new_gate) * input_gate + new_gate


@contextlib.contextmanager
def eager_gru_cell():
    """Traces nn.GRU's cell with eager's layouts (see ``_gru_cell_as_eager``), where torch's decomposition
    sums the gates chunk by chunk (read from its source, so that a torch that changes it keeps its own), and
    ``aten.gru_cell`` (nn.GRUCell) as eager's CPU cell (``_gru_cell_op_as_eager``), where no Python kernel of
    torch's is registered for it (a torch that adds one keeps its own)."""
    from torch._C import DispatchKey

    op, key = torch.ops.aten.gru_cell.default, DispatchKey.CompositeImplicitAutograd
    with contextlib.ExitStack() as stack:
        stack.enter_context(_decomposition_replaced("gru_cell", "(chunked_hgates[0] + chunked_igates[0]).sigmoid()",
                                                    _gru_cell_as_eager))
        if key not in op.py_kernels:
            stack.enter_context(_python_kernels(key, {op: _gated(_gru_cell_op_as_eager,
                                                                  lambda *a, **k: op._op_dk(key, *a, **k))}))
        yield


def _eager_lstm_uses_onednn(input, hx, params, onednn_dtypes: tuple) -> bool:
    """Whether eager's ``at::lstm`` (aten/src/ATen/native/RNN.cpp, torch 2.9) runs oneDNN for these arguments:
    ``use_mkldnn`` (oneDNN enabled, every tensor on the CPU, a non-empty input of a dtype it takes) and no
    projections. ``onednn_dtypes``: those dtypes as eager sees them (``_onednn_lstm_dtypes``), read outside the trace."""
    if input.dtype not in onednn_dtypes or input.numel() == 0 or hx[0].size(2) != hx[1].size(2):
        return False
    return all(t.device.type == "cpu" for t in (input, *hx, *params))


def _onednn_lstm_dtypes() -> tuple:
    """The input dtypes for which eager's ``use_mkldnn`` holds in a training step: none with oneDNN disabled, else
    float32, and bfloat16 where ``mkldnn_bf16_device_check`` holds (float16 only without grad: never in a step). The
    flag is read here, outside the trace: ``torch.export`` sets torch.backends.mkldnn's flag off while it traces."""
    if not torch._C._get_mkldnn_enabled():
        return ()
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def refuse_onednn_rnn_dtypes(ep: torch.export.ExportedProgram, who: str = "the model") -> None:
    """Refuses a graph whose oneDNN LSTM layer (``aten.mkldnn_rnn_layer``) runs in a dtype this CPU's oneDNN has no
    LSTM for. CPU autocast lists ``mkldnn_rnn_layer`` as a lower-precision op, so an ``nn.LSTM`` on a float32 input
    in a ``torch.autocast("cpu", torch.bfloat16)`` region takes eager's oneDNN path (``use_mkldnn`` sees float32)
    and is then cast to bfloat16 whatever the CPU: without AVX-512 (``mkldnn_bf16_device_check``) oneDNN cannot
    create the primitive, in eager as in the step, whose executor failed at its first call with oneDNN's
    "could not create a primitive descriptor" (fuzz_step 27:2006). Refused here, at build time, by name."""
    supported = {torch.float32: True}
    if torch.backends.mkldnn.is_available():
        supported[torch.bfloat16] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        supported[torch.float16] = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    op = torch.ops.aten.mkldnn_rnn_layer.default
    params = ep.graph_signature.inputs_to_parameters
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target is not op:
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or supported.get(val.dtype, False):
            continue
        # The layer's module, from its weight_ih (the autocast region leaves the node no module stack): the
        # parameter the cast reads.
        w = node.args[1]
        while isinstance(w, torch.fx.Node) and w.op == "call_function" and w.all_input_nodes:
            w = w.all_input_nodes[0]
        target = params.get(w.name, "") if isinstance(w, torch.fx.Node) else ""
        path = target.rpartition(".")[0].removeprefix("model.")
        where = f"the LSTM {path!r} (layer of {target.rpartition('.')[2]})" if path else "an LSTM"
        raise NotImplementedError(
            f"{who}: {where} runs oneDNN's LSTM (aten.mkldnn_rnn_layer, graph node {node.name}) in {val.dtype}, "
            "which this CPU's oneDNN has no LSTM for (bfloat16 needs AVX-512, float16 AVX-512-FP16/AMX): CPU autocast casts the LSTM's layer to "
            "it, and eager fails the same way (\"could not create a primitive descriptor\"). Run the LSTM in float32: "
            "outside the autocast region, or inside `with torch.autocast('cpu', enabled=False):` on a float32 input")


class _OwnGradient(torch.autograd.Function):
    """The identity, whose gradient is a copy of the one it gets: ``mkldnn_rnn_layer_backward`` returns one tensor
    as the gradient of both biases, and torch 2.9's joint export cannot give two parameters one gradient output
    (it failed on an assertion in ``create_graph_signature``). Eager's two gradients hold the same values."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def _onednn_lstm_layer(inp, hidden, params, has_biases, reverse=False, *, train, own_gradients):
    """One direction of one layer as eager's ``mkldnn_rnn`` (aten/src/ATen/native/mkldnn/RNN.cpp) runs it:
    ``mkldnn_rnn_layer`` with the module's ``train``, so that autograd records eager's derivative
    (``mkldnn_rnn_layer_backward``). torch's ``mkldnn_one_layer_lstm`` is the same call with ``train=False``."""
    w0, w1 = params[0], params[1]
    w2, w3 = (params[2], params[3]) if has_biases else (w0.new_zeros(w0.shape), w1.new_zeros(w1.shape))
    if own_gradients and has_biases:
        w3 = _OwnGradient.apply(w3)
    hx, cx = hidden[0].unsqueeze(0).contiguous(), hidden[1].unsqueeze(0).contiguous()
    mode = 2  # ideep::rnn_kind::LSTM
    y, hy, cy, _ = torch.ops.aten.mkldnn_rnn_layer.default(
        inp.contiguous(), w0, w1, w2, w3, hx, cx, reverse, [], mode, hx.size(2), 1, has_biases, False, False, train)
    return y, (hy.squeeze(0), cy.squeeze(0))


def _lstm_as_eager(original, onednn_dtypes, own_gradients):
    def lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        import torch._decomp.decompositions as decomps

        if not _eager_lstm_uses_onednn(input, hx, params, onednn_dtypes):
            out, hy, cy = original(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                   batch_first)
            # torch 2.9's one_layer_lstm returns each layer's state squeezed at dim 1 (the batch) instead of
            # 0, so with a batch over 1 the states came out [L*D, 1, B, H] where eager's are hx's shape.
            return out, hy.reshape(hx[0].shape), cy.reshape(hx[1].shape)
        grouped = decomps.gather_params(params, has_biases, False)
        layer_fn = functools.partial(_onednn_lstm_layer, train=train, own_gradients=own_gradients)
        out, final_hiddens = decomps._rnn_helper(input, list(zip(hx[0], hx[1])), grouped, has_biases, num_layers,
                                                 dropout, train, bidirectional, batch_first, layer_fn)
        hy, cy = zip(*final_hiddens)
        return out, torch.stack(hy, 0), torch.stack(cy, 0)
    return lstm


def _onednn_rnn_backward_meta(original):
    """torch 2.9's meta kernel of ``mkldnn_rnn_layer_backward`` with the dtypes its CPU kernel returns: float32
    gradients (input, weights, biases, states) for a bfloat16 layer, where the meta kernel declares bfloat16.
    Eager's autograd engine casts each to its input's dtype (``validate_outputs``), which the trace records
    only when it sees the float32; with bfloat16 declared the traced step got the kernel's float32 where it
    expected bfloat16."""
    def meta(input, *args, **kwargs):
        out = original(input, *args, **kwargs)
        if input.dtype != torch.bfloat16:
            return out
        return tuple(t.new_empty(t.shape, dtype=torch.float32) for t in out)
    return meta


@contextlib.contextmanager
def onednn_rnn_backward_dtypes():
    """``mkldnn_rnn_layer_backward``'s meta kernel with its CPU kernel's float32 gradients for a bfloat16 layer
    (``_onednn_rnn_backward_meta``) for the block: while the step's joint is traced (so that it casts them as
    eager's engine does) and while AOTInductor compiles it (whose fallback kernel reads its outputs' dtypes
    from the meta kernel)."""
    from torch._C import DispatchKey

    op, key = torch.ops.aten.mkldnn_rnn_layer_backward.default, DispatchKey.Meta
    original = op.py_kernels.get(key)
    if original is None:
        yield
        return
    with _python_kernels(key, {op: _gated(_onednn_rnn_backward_meta(original), original)}):
        yield


def _elementwise_layout(args, kwargs):
    """The strides TensorIterator gives an elementwise op over its two tensor arguments (``grad * mask``,
    native_dropout_backward's CPU kernel; an activation's backward over ``(grad, self)``): the gradient's layout
    where they disagree. The C++ type checker's rule (``_C.elementwise_strides``, TensorIterator itself on meta
    tensors), so that the trace and the checker cannot disagree; None where it does not apply, as there: not
    exactly two tensors, or ones that do not broadcast."""
    from . import _C

    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if len(tensors) != 2:
        return None
    (a, b) = tensors
    return _C.elementwise_strides(a.shape, a.stride(), b.shape, b.stride())


def _batch_norm_cpu_layout(original, input_at, contiguous=False):
    """``original`` (a batch norm op's decomposition, which fake tensors run, or its meta kernel) with its first
    result laid out as the CPU kernels lay it out: ``empty_like(input,
    input.suggest_memory_format())`` (aten/src/ATen/native/Normalization.cpp, forward and backward), where torch
    2.9's decompositions keep the input's layout (``input_at``: the input's position). A transposed input
    (``x.transpose(1, 2)`` into BatchNorm1d) comes out contiguous on the CPU. A clone, so that the values stay
    the decomposition's wherever it runs. ``contiguous``: the kernel lays them out contiguous whatever the input's
    layout (layer norm's, aten/src/ATen/native/layer_norm.cpp: ``empty_like(X.contiguous(), Contiguous)``);
    "elementwise": as TensorIterator lays out ``grad * mask`` (``_elementwise_layout``)."""
    from torch._prims_common import suggest_memory_format

    @functools.wraps(original)  # its module and name: fake tensors run a decomposition of torch._decomp's only
    def kernel(*args, **kwargs):
        out = original(*args, **kwargs)
        input = args[input_at] if len(args) > input_at else kwargs["input"]
        if getattr(input, "fake_device", input.device).type != "cpu" or input.layout != torch.strided:
            return out
        single = isinstance(out, torch.Tensor)
        out = [out] if single else list(out)
        t = out[0]
        if contiguous == "elementwise":
            strides = _elementwise_layout(args, kwargs)
            if strides is not None and isinstance(t, torch.Tensor) and t.shape == input.shape and t.stride() != strides:
                out[0] = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)
            return out[0] if single else tuple(out)
        fmt = torch.contiguous_format if contiguous else suggest_memory_format(input)
        if isinstance(t, torch.Tensor) and t.shape == input.shape and not t.is_contiguous(memory_format=fmt):
            out[0] = t.clone(memory_format=fmt)
        return out[0] if single else tuple(out)
    return kernel


@contextlib.contextmanager
def eager_batch_norm_layouts():
    """Traces batch norm's results (forward output, backward input gradient) with the layout its CPU kernels give
    them (``_batch_norm_cpu_layout``), in both places export's fake tensors take them from: torch's decomposition
    table and the ops' meta kernels. With the decompositions' layout the trace saw a transposed result where eager
    has a contiguous one, and every layout-dependent choice after it went another way than eager's: a Linear's
    reshape traced as a view and its ``mm`` backward recorded as a plain ``mm`` (bn.bias 1e-9 off eager after one
    step, 2e-3 after three with Lion), found by scripts/fuzz_step.py. Layer norm's too, whose CPU kernels return
    contiguous results: its backward's meta kernel kept a transposed input's layout for the input's gradient, so the
    trace dropped the ``.contiguous()`` eager's autograd puts before a GroupNorm's backward (the gradient looked
    contiguous after a transpose), and ``native_group_norm_backward``'s CPU kernel read the real, transposed
    gradient as contiguous: GroupNorm -> transpose -> LayerNorm trained with wrong gradients (1e-2 off eager's
    parameters after one SGD step, silently), found by scripts/fuzz_step.py (seed 14)."""
    from torch._C import DispatchKey
    from torch._decomp import decomposition_table

    key = DispatchKey.Meta
    ops = _batch_norm_layout_ops()
    metas = {op: op.py_kernels.get(key) for op in ops}
    decomps = {op: decomposition_table.get(op) for op in ops}
    with contextlib.ExitStack() as stack:
        # (fake tensors' cache holds results of the meta kernels' layout, and must not keep these)
        stack.enter_context(_fake_cache_bypassed(ops))
        stack.enter_context(_python_kernels(key, {op: _gated(_batch_norm_cpu_layout(metas[op], *ops[op]), metas[op])
                                                  for op in ops if metas[op] is not None}))
        for op in ops:
            if decomps[op] is not None:
                decomposition_table[op] = _gated(_batch_norm_cpu_layout(decomps[op], *ops[op]), decomps[op])
                stack.callback(decomposition_table.__setitem__, op, decomps[op])
        yield


def _batch_norm_layout_ops() -> dict:
    """{op: (its input's position, how its first result is laid out: True contiguous whatever the input's layout,
    False the input's suggested memory format, "elementwise" as TensorIterator lays out an elementwise op over the
    tensor arguments)}: the ops
    whose CPU kernels lay their first result out otherwise than their meta kernels, from the C++ type checker's
    table (csrc/ir/type_check.h, ``cpu_layout_ops``), so that what is traced and what the checker infers cannot
    drift apart. Batch norm's results follow the input's memory format; layer norm's, mse/huber loss backward's and
    log_softmax backward's are contiguous on the CPU, where the meta kernels keep the (first) input's layout. The
    same dropped .contiguous() made GroupNorm -> transpose -> mse_loss / huber_loss train 0.1 off eager in 3
    steps. native_dropout_backward's CPU kernel (grad * mask * scale) lays its result out as TensorIterator does, like a
    transposed grad, where its meta kernel returns it contiguous: the trace dropped the .contiguous() eager puts
    before native_group_norm_backward (GroupNorm -> Dropout -> transpose -> Linear, wav2vec2's feature encoder,
    trained 0.02 to 0.1 off eager in 3 steps, silently). The backward of softplus, elu, hardswish, hardsigmoid,
    hardtanh and logit likewise: CPU in the gradient's layout, meta in ``self``'s."""
    from . import _C

    return {getattr(getattr(torch.ops.aten, name), overload): (at, contiguous)
            for name, overload, at, contiguous in _C.cpu_layout_ops()}


def batch_norm_in_cpu_layout(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep``, or, where it declares a batch norm result on the CPU in another layout than its CPU kernels give it,
    a copy retraced in that layout (``eager_batch_norm_layouts``), which the IR checker infers (it refused such a
    program). Such programs: a step saved before torch_ext traced batch norm in its CPU layout, and any
    ``torch.export`` program decomposed to ATen (``run_decompositions()``) whose batch norm reads a transposed input
    (torch's meta kernels keep the input's layout). Its ``aten.view`` nodes are retraced as ``reshape``: a view of
    such a result that the CPU layout does not allow becomes a copy, as the executor ran it before (it reshapes a
    view whose input is not viewable, csrc/runtime/kernel.cpp). The ops are the program's otherwise, so it computes
    what the executor computed on it before the IR checker inferred the CPU layout."""
    from torch._prims_common import suggest_memory_format

    ops = _batch_norm_layout_ops()
    stale = False
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        at, contiguous = ops[node.target]
        x, vals = node.args[at].meta.get("val") if len(node.args) > at else None, node.meta.get("val")
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.layout != torch.strided:
            continue
        if contiguous == "elementwise":
            args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
            strides = _elementwise_layout(args, {})
            t = vals if isinstance(vals, torch.Tensor) else None
            stale |= strides is not None and isinstance(t, torch.Tensor) and t.shape == x.shape and t.stride() != strides
            continue
        fmt = torch.contiguous_format if contiguous else suggest_memory_format(x)
        t = (vals[0] if vals else None) if isinstance(vals, (tuple, list)) else vals  # (one result: a tensor)
        stale |= isinstance(t, torch.Tensor) and t.shape == x.shape and not t.is_contiguous(memory_format=fmt)
    if not stale:
        return ep
    from torch.export.experimental import _copy_graph_module_and_signature

    from . import _trace_patches

    gm, sig = _copy_graph_module_and_signature(ep)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    custom = ep.graph_module.meta.get("custom")
    # (and a bfloat16 LSTM's backward in the float32 the step's program declares)
    with _trace_patches.patched("eager_batch_norm_layouts", "onednn_rnn_backward_dtypes"):
        out = ep._update(gm, sig).run_decompositions({})
    if custom is not None:
        out.graph_module.meta["custom"] = custom
    out.example_inputs = ep.example_inputs
    return out


@contextlib.contextmanager
def eager_onednn_lstm(own_gradients=True):
    """Traces ``nn.LSTM`` (``aten.lstm.input``) as eager runs it on the CPU: one ``mkldnn_rnn_layer`` per layer and
    direction, differentiated by eager's ``mkldnn_rnn_layer_backward``, wherever eager runs oneDNN
    (``_eager_lstm_uses_onednn``). torch 2.9's decomposition, which tracing runs, takes oneDNN only for an input
    that requires no grad (and then with ``train=False``), else the LSTM cell op by op, which rounds apart from
    oneDNN: a 2-layer LSTM trained 1 to 2 ulp (6e-8) off eager's parameters in 3 steps, silently. Elsewhere
    (projections, other devices and dtypes, oneDNN disabled) torch's decomposition runs as before, its final
    states given eager's shape: torch's squeezes the batch dim where it means the layer dim, so with a batch over 1
    ``h_n`` and ``c_n`` traced as [L*D, 1, B, H] (``h_n[-1]`` then [1, B, H], broadcast into what followed).
    ``own_gradients=False`` for the forward's export (which keeps ``aten.lstm`` whole and refuses an
    ``autograd.Function``): the biases' separate gradients matter to the joint export only."""
    from torch._C import DispatchKey

    op = torch.ops.aten.lstm.input
    # Meta too: torch registers the same decomposition as its meta kernel, which export's fake tensors run.
    keys = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd, DispatchKey.Meta)
    originals = {key: op.py_kernels.get(key) for key in keys}
    if any(kernel is None for kernel in originals.values()):
        yield
        return
    onednn_dtypes = _onednn_lstm_dtypes()
    with contextlib.ExitStack() as stack:
        for key in keys:
            # The meta kernel (shapes only) differentiates nothing; the others give each bias its own gradient.
            lstm = _lstm_as_eager(originals[key], onednn_dtypes, own_gradients and key != DispatchKey.Meta)
            stack.enter_context(_python_kernels(key, {op: _gated(lstm, originals[key])}))
        yield


@contextlib.contextmanager
def make_fx_without_stack_traces():
    """make_fx with ``record_module_stack`` (``make_fx_program``) and non-strict ``torch.export`` trace with
    torch's ``_ModuleStackTracer``, which records every node's Python stack (``node.meta["stack_trace"]``: a
    traceback extracted, symbolized, filtered and formatted per node) whatever make_fx's ``record_stack_traces``
    says (torch 2.9 has no option to turn it off): ~12% of a make_fx build, ~18% of an export one (4-layer
    d_model 128 TinyTransformer). Nothing in torch_ext reads it (the IR takes module paths from
    ``nn_module_stack``), so the tracing thread's tracers record none; the graph, its names and
    ``nn_module_stack`` are unchanged. Entered for ReactiveGraph's inference trace (``INFERENCE_TRACE``)."""
    from torch.fx.experimental import proxy_tensor

    cls = getattr(proxy_tensor, "_ModuleStackTracer", None)
    original = None if cls is None else cls.__dict__.get("__init__")
    if original is None:
        yield
        return

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.record_stack_traces = False

    with _gated_attribute(cls, "__init__", init):
        yield


@contextlib.contextmanager
def grad_scaler_refused():
    """``torch.amp.GradScaler.scale`` (and the ``torch.cuda.amp`` / ``torch.cpu.amp`` subclasses) refused by name
    inside a traced step: the step differentiates the loss ``loss_fn`` returns and updates the parameters itself,
    with no ``scaler.step`` to unscale the gradients or skip a step whose gradients are not finite. Traced, an
    enabled scaler trained on gradients multiplied by its scale (65536: 5e6 off eager's AdamW ``exp_avg_sq`` in
    3 steps, silently) and kept the trace's fake scale tensor, so the next build failed with "fake mode ...
    doesn't match mode". A disabled scaler (``enabled=False``) returns the loss as it is, in eager too: it runs."""
    from torch.amp import GradScaler

    original = GradScaler.scale

    def refuse(self, outputs):
        if not self._enabled:
            return original(self, outputs)
        raise ValueError(
            f"{type(self).__module__}.{type(self).__qualname__}.scale(loss) inside the traced step (enabled, "
            f"init_scale={self._init_scale}): the step differentiates the loss loss_fn returns and updates the parameters itself, with no "
            "scaler.step(optimizer) to unscale the gradients or skip a step whose gradients are not finite, so it "
            "would train on gradients multiplied by the scale. Return the unscaled loss from loss_fn and drop the "
            "scaler (float16 parameters and bfloat16 autocast train bit-exact with the eager loop without one; "
            "step(..., skip_nonfinite=True) keeps the state when the loss is not finite), or build the scaler with "
            "enabled=False")

    with _gated_attribute(GradScaler, "scale", refuse):
        yield


@contextlib.contextmanager
def data_assignment_refused():
    """``t.data = value`` in the traced forward or loss_fn refused by name: it swaps the tensor's storage outside
    autograd and functionalization, so the trace did not see it. A buffer's ``.data =`` (an EMA) was left out of the
    program (the first loss already off eager's, silently); a frozen parameter's (a MoCo key encoder's momentum
    update, ``p_k.data = p_k.data * m + p_q.data * (1 - m)``) crashed the process in torch's joint export."""
    import os

    from ._trace_patches import caller_frame

    base = torch._C.TensorBase.data
    torch_dir = os.path.dirname(torch.__file__) + os.sep

    def refuse(self, value):
        where = caller_frame(1)
        if where is not None and where.f_code.co_filename.startswith(torch_dir):
            return base.__set__(self, value)  # torch's own (Module._apply)
        at = f" at {where.f_code.co_filename}:{where.f_lineno}" if where is not None else ""
        raise ValueError(
            f"the model or loss_fn assigns a tensor's .data{at} (shape {list(self.shape)}): it swaps the storage "
            "behind autograd's back, which the trace cannot see, so the program would skip it (or torch's export "
            "fails). In a training step, write a buffer in place under torch.no_grad() (self.ema.mul_(0.9).add_(x)), "
            "or assign the module attribute (self.ema = new), and update a parameter (a momentum encoder) on the "
            "state between calls; a ReactiveGraph writes no model state: move the update out of forward")

    def read(self):  # recorded: an in-place write into the result is one into ``self``, which the trace lost
        result = base.__get__(self)
        _DATA_READS[id(result)] = [weakref.ref(result), self, None]
        return result

    def forget():  # the traced tensors: named by now (inside the trace), or not the model's
        for key, entry in list(_DATA_READS.items()):
            if entry[0]() is None:
                del _DATA_READS[key]
            entry[1] = None

    forget()
    torch.Tensor.data = property(_gated(read, base.__get__), _gated(refuse, base.__set__), doc=base.__doc__)
    try:
        yield
    finally:
        del torch.Tensor.data  # TensorBase's getset again
        forget()


_DATA_READS: dict = {}  # id(t.data's result) -> [weak result, t, t's name], of the traces under data_assignment_refused


def name_data_reads(module: torch.nn.Module, prefix: str = "") -> None:
    """Names, by ``module``'s parameters and buffers, the tensors whose ``.data`` the code traced so far read: called
    inside the trace, where export has put its own tensors in the module (the reads' tensors, not the user's)."""
    pending = {id(e[1]): e for e in _DATA_READS.values() if e[1] is not None}
    if not pending:
        return
    for name, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                   module.named_buffers(remove_duplicate=False)):
        entry = pending.get(id(t))
        if entry is not None and entry[1] is t and entry[2] is None:
            entry[2] = prefix + name


def data_source(t) -> str | None:
    """The name (given by name_data_reads) of the parameter or buffer whose ``.data`` the traced code read to get
    ``t``: export lifts that detached alias as a constant of its own, unrelated to the tensor it shares memory with."""
    entry = _DATA_READS.get(id(t))
    return entry[2] if entry is not None and entry[0]() is t else None


@contextlib.contextmanager
def packed_sequences_refused():
    """``nn.utils.rnn.pack_padded_sequence`` (and ``pack_sequence``, which calls it) refused with a message naming
    it: a packed sequence's layout (its ``batch_sizes``) is computed from the lengths' values, which a static
    program cannot follow, wherever the lengths come from (the batch, a Python list, a CPU int64 tensor). Traced,
    it failed inside torch's RNN ('zeros(): argument 'size' ... got FakeTensor')."""
    vf = torch._VF  # a module whose attributes come from torch._C._VariableFunctions unless set on it
    had = vars(vf).get("_pack_padded_sequence")
    original = vf._pack_padded_sequence

    def refuse(input, lengths, batch_first):
        got = (f"a {lengths.dtype} tensor on {lengths.device}" if isinstance(lengths, torch.Tensor)
               else f"a {type(lengths).__name__}")
        raise ValueError(
            f"nn.utils.rnn.pack_padded_sequence (lengths: {got}) cannot be traced: a packed sequence's layout "
            "(batch_sizes) is computed from the lengths' values, which a static program cannot follow, whether "
            "they come from the batch, a Python list or a CPU int64 tensor. Run the RNN on the padded batch "
            "instead and read each sequence where it ends, e.g. out[torch.arange(len(lengths)), lengths - 1] for "
            "a unidirectional RNN with batch_first=True, or mask the padded positions in the loss")

    vf._pack_padded_sequence = _gated(refuse, original)
    try:
        yield
    finally:
        if had is not None:
            vf._pack_padded_sequence = had
        else:
            del vf._pack_padded_sequence


_dynamo_tables_built = False


def build_dynamo_function_tables() -> None:
    """Makes dynamo compute its tables of known functions now, before a trace patches any. They are lazy,
    keyed by ``id()``, and first read when dynamo first traces (a ``torch.cond`` branch, inside the step's
    trace): computed then, they held the ids of the trace's stand-ins (``python_random_draws``' wrappers of
    ``numpy.random``'s functions), freed when the trace ended. A function made later at one of those
    addresses (a cond branch of the attention on a padding mask) was taken for numpy's, and a build failed
    at random with "Can't find numpy function <lambda> in torch._numpy"."""
    global _dynamo_tables_built
    if _dynamo_tables_built:
        return
    from torch._dynamo import trace_rules

    for table in vars(trace_rules).values():
        if isinstance(table, trace_rules.FunctionIdSet):
            table()
    # Its map of torch functions by object is loaded by name, once: built while ``torch.nn.functional.dropout`` is
    # the hoisted attention dropout's stand-in (_HoistedDropouts), it would hold the stand-in, not torch's.
    getattr(trace_rules, "get_torch_obj_rule_map", lambda: None)()
    _dynamo_tables_built = True


@contextlib.contextmanager
def python_random_draws():
    """Yields a list that names, once the block exits, each process-global Python-level generator the
    block drew from without seeding it first: Python's ``random`` module and ``numpy.random``'s global
    state. Tracing runs such a draw once and records its result as a constant, so every call of the
    program would reuse it (a layer drop decided by ``random.uniform``, noise from
    ``np.random.randn``), where eager draws anew. A forward that seeds the generator itself (Hugging
    Face's BigBird calls ``np.random.seed`` before drawing its random attention blocks) draws the same
    numbers at every call, so tracing them once is exact.

    The generators are shared by every thread, so a changed state alone does not say who drew. The draw and
    seed functions (``random``'s module functions and its instance's ``random``/``getrandbits``, through which
    all its methods draw; ``numpy.random``'s module functions) record the thread that calls them while the block
    runs: a draw on the tracing thread is the trace's; a changed state with no recorded draw is taken as the
    trace's too (a draw through a name bound before the block, ``from random import random``); a changed state
    that another thread's recorded draws explain is not refused (another thread drawing while this one traces).
    Left: the trace drawing through such an early-bound name while another thread draws through a recorded one
    is not seen."""
    import random

    np = sys.modules.get("numpy")
    me = threading.get_ident()  # the tracing thread (the block's)
    py_name, np_name = "Python's random module", "numpy.random"
    seeded: set[str] = set()
    own: set[str] = set()
    others: set[str] = set()

    def noting(name, fn, seeds):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if torch.compiler.is_dynamo_compiling() or threading.get_ident() == me:
                (seeded if seeds else own).add(name)
            else:
                others.add(name)
            return fn(*args, **kwargs)
        return wrapped

    inst = random._inst
    targets = [(random, attr, py_name) for attr, fn in vars(random).items()
               if getattr(fn, "__self__", None) is inst and attr not in ("getstate",)]
    targets += [(inst, "random", py_name), (inst, "getrandbits", py_name)]  # what random's methods draw through
    if np is not None:
        rand = getattr(np.random.mtrand, "_rand", None)
        targets += [(np.random, "seed", np_name)]
        targets += [(np.random, attr, np_name) for attr, fn in vars(np.random).items()
                    if rand is not None and getattr(fn, "__self__", None) is rand and attr != "get_state"]
    saved = [(obj, attr, name, vars(obj).get(attr, _MISSING), getattr(obj, attr)) for obj, attr, name in targets]
    py_before = random.getstate()
    np_before = np.random.get_state() if np is not None else None
    for obj, attr, name, _, fn in saved:
        setattr(obj, attr, noting(name, fn, attr in ("seed", "setstate", "set_state")))
    drawn: list[str] = []
    try:
        yield drawn
    finally:
        for obj, attr, _, had, _ in reversed(saved):
            if had is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, had)
        changed = []
        if random.getstate() != py_before:
            changed.append(py_name)
        if np_before is not None:
            np_after = np.random.get_state()
            if not (np_after[0] == np_before[0] and np.array_equal(np_after[1], np_before[1])
                    and tuple(np_after[2:]) == tuple(np_before[2:])):
                changed.append(np_name)
        drawn[:] = [name for name in (py_name, np_name)
                    if name not in seeded and (name in own or (name in changed and name not in others))]
        # Every caller refuses a build that drew: the generator is put back as the build found it, unless
        # another thread drew from it meanwhile (its draws are not the build's to undo).
        if py_name in drawn and py_name not in others:
            random.setstate(py_before)
        if np_name in drawn and np_name not in others:
            np.random.set_state(np_before)


@contextlib.contextmanager
def global_module_hooks_restored():
    """Removes the global module hooks torch.export registers and leaves behind when the trace raises:
    torch 2.9's non-strict export adds a buffer-registration hook (register_buffer_assignment_hook) and
    removes it only on success. The leaked hook kept the traced module alive and sat in the global hook
    tables, which every later build-cache key reads (a refused step made every later ReactiveGraph
    uncacheable on disk).

    Only the hooks the tracing thread registered (through ``nn.modules.module``'s three
    ``register_module_*_registration_hook`` functions, which export calls) are removed, by handle id: a hook
    another thread registers meanwhile is kept (it was deleted, silently, when every key added during the
    block was)."""
    from torch.nn.modules import module as nn_module

    names = [n for n in ("register_module_buffer_registration_hook", "register_module_module_registration_hook",
                         "register_module_parameter_registration_hook") if callable(getattr(nn_module, n, None))]
    originals = {n: getattr(nn_module, n) for n in names}
    added = []  # (table, handle id) of each hook the tracing thread registered

    def recording(fn):
        def register(*args, **kwargs):
            handle = fn(*args, **kwargs)
            table = handle.hooks_dict_ref()
            if table is not None:
                added.append((table, handle.id))
            return handle
        return register

    for n, fn in originals.items():
        setattr(nn_module, n, _gated(recording(fn), fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(nn_module, n, fn)
        for table, key in added:
            table.pop(key, None)


def traced_constant_value(t):
    """The value of a tensor being traced (by torch.export or make_fx) that no input of the program
    reaches, computed by running the ops that made it on real tensors; None when an input reaches it,
    when it is not traced, or when an op is random or not a plain function call."""
    from torch.fx.experimental import proxy_tensor
    from torch.utils._python_dispatch import _disable_current_modes

    mode = proxy_tensor.get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor):
        return None
    try:
        root = proxy_tensor.get_proxy_slot(t, mode.tracer).proxy.node
    except Exception:  # not tracked by this tracer
        return None
    order, seen, stack = [], set(), [(root, False)]
    while stack:  # post-order over the ancestors
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return None  # an input, a lifted constant, a higher-order op
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            return None
        stack.append((node, True))
        stack.extend((a, False) for a in node.all_input_nodes)
    values = {}
    with _disable_current_modes():
        for node in order:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
            values[node] = node.target(*args, **kwargs)
    return values[root]


@contextlib.contextmanager
def backward_only_code():
    """Records, inside the block, the code that would change gradients in eager training but that
    tracing (torch.export, make_fx) cannot record, as descriptions: ``Tensor.register_hook`` on an
    activation, and applications of custom ``torch.autograd.Function`` subclasses defined outside torch
    that ``_user_functions.untraceable`` refuses. Tracing runs a Function's ``forward`` only, so a graph
    differentiated afterwards would get the derivative of that forward, never the class's ``backward``:
    every other application (under grad mode, to a tensor that requires grad) is recorded as one call of
    ``_user_functions``' op, whose Autograd kernel is the class, and the joint trace runs its backward.
    Applications and hooks on tensors that require no gradient (a batch, a target) are left as they are.

    ``Function.apply`` (torch 2.9) calls the module function ``_is_setup_context_defined`` first thing,
    with the class in its local ``cls``; that call is wrapped rather than ``apply`` itself, because a
    user's ``grad_reverse = GradReverse.apply``, bound at import, would bypass a patched ``apply``."""
    from torch.autograd import function as function_mod

    from . import _trace_patches

    found: list[str] = []
    original = function_mod._is_setup_context_defined
    original_hook = torch.Tensor.register_hook

    def is_setup_context_defined(fn):
        caller = _trace_patches.caller_frame(1).f_locals
        cls = caller.get("cls")
        args, kwargs = caller.get("args", ()), caller.get("kwargs", {})
        if isinstance(cls, type) and issubclass(cls, function_mod.Function) and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in tree_leaves((args, kwargs))):
            module = getattr(cls, "__module__", "") or ""
            if not (module == "torch" or module.startswith("torch.")):
                # Recorded as one op whose Autograd kernel is the class: the joint trace runs its backward.
                from . import _user_functions

                refused = _user_functions.untraceable(cls)
                what = f"custom torch.autograd.Function {module}.{cls.__qualname__} ({refused})"
                if refused is None:
                    _user_functions.redirect_next_forward(cls, args, kwargs)
                elif what not in found:
                    found.append(what)
        return original(fn)

    def register_hook(self, hook):
        frame = _trace_patches.caller_frame(1)
        module = frame.f_globals.get("__name__", "") or ""
        if self.requires_grad and not (module == "torch" or module.startswith("torch.")):  # torch forwards hooks too
            what = f"Tensor.register_hook on an activation ({frame.f_code.co_filename}:{frame.f_lineno})"
            if what not in found:
                found.append(what)
        return original_hook(self, hook)

    function_mod._is_setup_context_defined = _gated(is_setup_context_defined, original)
    torch.Tensor.register_hook = _gated(register_hook, original_hook)
    try:
        yield found
    finally:
        function_mod._is_setup_context_defined = original
        torch.Tensor.register_hook = original_hook
        if "torch_ext._user_functions" in sys.modules:
            sys.modules["torch_ext._user_functions"].restore_all()


def merge_aliased_inputs(ep: torch.export.ExportedProgram, canonical: dict[str, str]) -> torch.export.ExportedProgram:
    """Folds placeholders of tied parameters / shared buffers into one per tensor.

    export gives every name of a shared tensor its own placeholder (``head.weight`` and
    ``emb.weight``), routing the uses through one of them. ``canonical`` maps each name to the
    name that is kept; the others' uses move to it and their inputs are dropped, so the joint
    graph sees one input per tensor and sums the gradients of all its uses, as autograd does.
    """
    from torch.export.experimental import _copy_graph_module_and_signature

    gm, sig = _copy_graph_module_and_signature(ep)
    by_arg = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    kinds = (InputKind.PARAMETER, InputKind.BUFFER)
    kept = {s.target: by_arg[s.arg.name] for s in sig.input_specs
            if s.kind in kinds and canonical.get(s.target, s.target) == s.target}
    dropped = []
    for s in sig.input_specs:
        if s.kind not in kinds or canonical.get(s.target, s.target) == s.target:
            continue
        keep = kept.get(canonical[s.target])
        if keep is None:
            raise NotImplementedError(f"shared tensor '{s.target}': its first name '{canonical[s.target]}' has no input "
                                      "in the exported program")
        node = by_arg[s.arg.name]
        node.replace_all_uses_with(keep)
        gm.graph.erase_node(node)
        dropped.append(s)
    if not dropped:
        return ep
    sig.input_specs = [s for s in sig.input_specs if s not in dropped]
    gm.recompile()
    return ep._update(gm, sig)


def for_aot_inductor(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of the pure step's program that torch 2.9's AOTInductor lowers.

    Inductor decomposes ``cat([empty, x])`` (Hugging Face's KV-cache concatenation when there is no
    past) into ``x.clone()``, which keeps x's strides where ATen's cat returns a contiguous tensor,
    so a ``view`` that export recorded after it fails to lower ("Cannot view a tensor with shape
    [8, 4, 64, 128] and strides (32768, 64, 1, 256)"). The step program mutates nothing, so each
    ``aten.view`` becomes ``aten.reshape``: a view wherever Inductor's strides allow, a copy elsewhere.

    Inductor's post-grad pattern ``add(mm(a, b), c) -> addmm(c, a, b)`` also matches an ``aten.add`` with
    ``alpha`` and drops it, so ``add(mm, c, alpha=k)`` computed ``mm + c``: every coupled weight decay
    (``grad.add(param, alpha=weight_decay)``, a Linear weight's gradient a matmul) trained as ``grad + param``,
    0.04 off eager's weight after one SGD step at weight_decay 1e-2. Each ``aten.add.Tensor`` with an alpha,
    here and in subgraphs, becomes ``add(a, mul(b, alpha))``: the same value to float32 rounding (eager's
    kernel rounds ``alpha * b`` inside an FMA).
    """
    from torch.export.experimental import _copy_graph_module_and_signature

    gm, sig = _copy_graph_module_and_signature(ep)
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            changed = True
    changed = _alpha_adds_as_muls(gm) or changed
    if not changed:
        return ep
    gm.recompile()
    return ep._update(gm, sig)


def _alpha_adds_as_muls(gm: torch.fx.GraphModule) -> bool:
    """Rewrites, in place, each ``aten.add.Tensor(a, b, alpha=k)`` (k != 1) of ``gm`` and its subgraph modules
    into ``aten.add.Tensor(a, aten.mul.Tensor(b, k))`` (see for_aot_inductor); whether any was."""
    add, mul = torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor
    changed = False
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        touched = False
        for node in list(module.graph.nodes):
            if node.op != "call_function" or node.target is not add or node.kwargs.get("alpha", 1) == 1:
                continue
            a, b = node.args
            alpha = node.kwargs["alpha"]
            with module.graph.inserting_before(node):
                scaled = module.graph.call_function(mul, (b, alpha))
            b_val = b.meta.get("val") if isinstance(b, torch.fx.Node) else None
            if isinstance(b_val, torch.Tensor):
                scaled.meta["val"] = b_val * alpha  # a FakeTensor: its shape, dtype and strides
            node.args, node.kwargs = (a, scaled), {k: v for k, v in node.kwargs.items() if k != "alpha"}
            touched = True
        if touched:
            module.recompile()
            changed = True
    return changed


@contextlib.contextmanager
def aten_kernels_in_inductor(ops):
    """Within the block, Inductor calls the ATen kernel of each OpOverload in ``ops`` (an extern call:
    AOTInductor's C shim ``aoti_torch_cpu_<op>``) instead of lowering it to its own loops; the
    previous lowerings are put back on exit. torch 2.9 keeps them in the private dict
    ``torch._inductor.lowering.lowerings``; an op without a lowering there is left alone."""
    from torch._inductor import lowering

    saved = {op: lowering.lowerings[op] for op in ops if op in lowering.lowerings}
    try:
        for op in saved:
            lowering.lowerings[op] = _gated(lowering.fallback_handler(op, add_to_fallback_set=False), saved[op])
        yield
    finally:
        lowering.lowerings.update(saved)


def aten_max_pool_backward_in_inductor():
    """``aten_kernels_in_inductor`` for the max-pool backward: Inductor's lowering is a scalar gather over
    every input position, ATen's kernel a scatter over the outputs (ResNet-18's 16x64x32x32, 3x3 stride 2:
    5.2 ms against 0.24-0.39 ms, one thread)."""
    return aten_kernels_in_inductor([torch.ops.aten.max_pool2d_with_indices_backward.default])


@contextlib.contextmanager
def exact_subgraph_strides():
    """Within the block, Inductor keeps the traced strides at the boundary of every subgraph it
    lowers (``torch.cond``'s branches, ``while_loop``'s bodies). torch 2.9 compiles a branch for its
    operands' traced strides and lets the caller read its outputs in their traced strides, but it
    neither passes the operands in those strides (``Conditional.create`` only realizes them) nor
    writes the outputs in them (a subgraph's ``output`` only matches insignificant strides). An
    operand or output Inductor computes itself (a pointwise op, ``.contiguous()``, a transpose) is
    laid out as Inductor chooses, and the other side reads the wrong elements, silently: a masked
    attention branch gave 2.06 off on a 2x8 batch, a Qwen2 step 0.3% off its first loss
    (test_real_models.py, test_grouped_query_attention_with_a_tokenizer_mask_saved_and_aoti), a step
    whose branch reads a ``.contiguous()`` of a transposed view 49% off its second loss
    (test_load_step.py, test_aoti_hands_cond_branches_operands_in_their_traced_strides). A value
    already in those strides is left alone; the others are copied into them."""
    from torch._inductor import ir
    from torch._inductor.graph import SubgraphLowering
    from torch._inductor.virtualized import V

    def exact(x, val):
        if isinstance(x, ir.IRNode) and isinstance(val, torch.Tensor):
            return ir.ExternKernel.require_exact_strides(x, val.stride())
        return x

    create = ir.Conditional.__dict__["create"]
    output = SubgraphLowering.output

    def create_with_exact_operands(cls, predicate, true_fn, false_fn, operands):
        fx_operands = V.graph.current_node.args[-1]
        operands = [exact(x, getattr(node, "meta", {}).get("val")) for x, node in zip(operands, fx_operands)]
        return create.__func__(cls, predicate, true_fn, false_fn, operands)

    def output_with_exact_strides(self, target, args, kwargs):
        output(self, target, args, kwargs)
        fx_outputs = V.graph.current_node.args[0]
        if not isinstance(fx_outputs, (tuple, list)):
            fx_outputs = (fx_outputs,)
        self.graph_outputs = [exact(x, getattr(node, "meta", {}).get("val"))
                              for x, node in zip(self.graph_outputs, fx_outputs)]

    ir.Conditional.create = classmethod(_gated(create_with_exact_operands,
                                               lambda cls, *a, **k: create.__func__(cls, *a, **k)))
    SubgraphLowering.output = _gated(output_with_exact_strides, output)
    try:
        yield
    finally:
        ir.Conditional.create = create
        SubgraphLowering.output = output


def donating_program(ep: torch.export.ExportedProgram, donated: dict[int, int]) -> torch.export.ExportedProgram:
    """A copy of ``ep`` that writes outputs into its inputs: ``donated`` maps an output index to the
    index of the user input it overwrites (same shape and dtype).

    Those outputs become torch.export input mutations (``USER_INPUT_MUTATION``, listed first, as the
    signature requires); AOTInductor then stores each value straight into the input's memory, after
    the input's last read, instead of allocating a fresh output every call. The remaining outputs
    keep their order. An output that is the input itself (a state entry the step leaves unchanged)
    is dropped: the input already holds it.
    """
    from torch.export.experimental import _copy_graph_module_and_signature
    from torch.export.graph_signature import OutputSpec, TensorArgument

    gm, sig = _copy_graph_module_and_signature(ep)
    out_node = gm.graph.output_node()
    outs = list(out_node.args[0])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_inputs = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    if len(user_inputs) != len(sig.input_specs) or len(outs) != len(sig.output_specs):
        raise NotImplementedError("donating_program: expects a program whose inputs are all user inputs")
    mutations, mutation_specs, kept, kept_specs = [], [], [], []
    for k, (node, spec) in enumerate(zip(outs, sig.output_specs)):
        i = donated.get(k)
        if i is None:
            kept.append(node)
            kept_specs.append(spec)
            continue
        target = placeholders[i]
        want, got = target.meta["val"], node.meta["val"]
        if want.shape != got.shape or want.dtype != got.dtype:
            raise ValueError(f"donating_program: output {k} ({tuple(got.shape)}, {got.dtype}) cannot overwrite input "
                             f"{target.name} ({tuple(want.shape)}, {want.dtype})")
        if node is target:
            continue
        mutations.append(node)
        mutation_specs.append(OutputSpec(OutputKind.USER_INPUT_MUTATION, TensorArgument(name=node.name),
                                         target=target.name))
    out_node.args = (tuple(mutations + kept),)
    sig.output_specs = mutation_specs + kept_specs
    gm.recompile()
    out = ep._update(gm, sig)
    # The calling convention returns the kept outputs only (the mutations land in the inputs).
    root = out.module_call_graph[0]
    assert root.fqn == "" and root.signature is not None
    root.signature.out_spec = torch.utils._pytree.tree_structure(tuple(kept))
    return out


def distinct_inputs(tree):
    """``tree`` with every tensor leaf that shares memory with an earlier leaf replaced by a clone.

    torch.export and make_fx read one tensor passed twice (``(x, x)``, an example batch repeated per
    micro-batch) as one input: every use moves to one placeholder, and the graph then computes with
    that input wherever the others were passed. Example inputs of their own keep the inputs apart."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    seen = set()
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else ("empty", id(t))
        if key in seen:
            leaves[i] = t.clone()
        else:
            seen.add(key)
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def legacy_reparametrization(model: torch.nn.Module, into: str, runs: str) -> str | None:
    """The refusal for a module under torch.nn.utils.weight_norm / spectral_norm (the hook API): the hook
    sets ``module.weight`` as a plain attribute at every forward, which the trace refused as a stored tensor
    of the trace, pointing at activations. torch.nn.utils.parametrizations' versions trace: ``into`` names what
    would hold the traced one ("the program"), ``runs`` how the replacement matches eager ("trains")."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for name, mod in model.named_modules():
        for hook in mod._forward_pre_hooks.values():
            if isinstance(hook, (WeightNorm, SpectralNorm)):
                api = "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
                return (f"module '{name or type(model).__name__}' ({type(mod).__name__}) uses torch.nn.utils.{api}, "
                        f"whose forward pre-hook sets {hook.name!r} as a plain attribute at every forward: {into} "
                        f"would hold the traced one. Use torch.nn.utils.parametrizations.{api}(module) instead, "
                        f"which computes it in the forward and {runs} bit-exact with eager (its state_dict names "
                        f"are parametrizations.{hook.name}.original...)")
    return None


FRONT_ENDS = ("auto", "make_fx", "export")


def trace_for_inference(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                        front_end: str = "auto") -> tuple[torch.export.ExportedProgram, str, str | None]:
    """An inference graph (the reactive engine) of ``module``, with the model families' quirks handled.

    Returns ``(program, front end used, why make_fx was not used or None)``. ``front_end``:
    "export" (torch.export), "make_fx" (``make_fx_program``: the same pre-dispatch ATen graph,
    several times cheaper to trace; raises ``UnsoundTrace`` where it cannot be trusted) or "auto"
    (make_fx, falling back to torch.export whenever make_fx refuses).

    - Hugging Face models return a ``DynamicCache`` (no pytree) unless ``config.use_cache`` is off:
      it is switched off for the export only (the engine never decodes incrementally).
    - State named after Python keywords (TransformerLens 4's ``in`` projections) breaks the code that
      ``run_decompositions()`` generates: the program's state names get a trailing ``_`` (``in_``).
    - TransformerLens hook points leave named markers (see ``strip_hook_points``).

    Traced under the trace patches' lock (``_trace_patches``): one trace at a time in the process.
    """
    from . import _trace_patches

    refuse_cumulative_batch_norm(module, "a graph", "(a ReactiveGraph never writes running statistics, so its "
                                 "outputs do not depend on it), or call model.eval()")
    legacy = legacy_reparametrization(module, "the graph", "runs")
    if legacy is not None:
        raise TypeError(f"ReactiveGraph: {legacy}")
    from . import _module_state

    own = _module_state.OwnGenerators(module)
    writes = _module_state.TracedWrites(module)  # what forward hooks write while traced: put back
    stored: list = []
    try:
        with _trace_patches.patched(*_trace_patches.INFERENCE_TRACE) as got:
            try:
                traced = _trace_for_inference(module, args, kwargs, front_end, lambda: stored.extend(writes.settle()))
            except RuntimeError as e:  # NotImplementedError included
                _refuse_unflattenable_output(module, e)
                refuse_value_as_python(e, module=module)
                refuse_torch_generator(e)
                raise
            except TypeError as e:
                refuse_value_as_python(e, module=module)
                raise
    finally:
        mine = own.drawn()
        own.restore()  # a refused build leaves the user's generators as it found them
        stored.extend(writes.settle())  # (settled already, before the modules' attributes were put back)
    if stored:
        raise ValueError(_module_state.stored_trace_message(
            stored, "the graph", "take activations from the graph instead (rg.run_with_cache, rg.value), or "
            "remove the hook before building"))
    read_back = [w for w in writes.state_writes if w.read]  # (all put back, by settle and _restore_attributes)
    if read_back:
        raise TypeError("ReactiveGraph: " + _module_state.read_back_message(read_back, "the graph"))
    refuse_python_draws(got["python_random_draws"] + mine, "the model", "graph",
                        "every run and every recomputation would reuse them where eager draws anew. Draw noise "
                        "outside the graph and pass it as an input")
    return traced


def refuse_python_draws(drawn: list, who: str, what: str, consequence: str) -> None:
    """Refuses a trace that drew from Python-level random generators (``drawn``: their names), which the
    program would hold as the constants drawn once."""
    if drawn:
        raise TypeError(
            f"{who} draws random numbers from {', '.join(drawn)} while traced: the {what} records the numbers drawn "
            f"once as constants, so {consequence}")


def refuse_torch_generator(e: BaseException, who: str = "ReactiveGraph: the model") -> None:
    """torch.fx's "argument of type: <class 'torch._C.Generator'>" (a random op given ``generator=``, which no
    traced program can take) as a ValueError naming the user's line, as the other random draws are refused;
    returns for any other error."""
    if "argument of type" not in str(e) or "Generator" not in str(e):
        return
    where = _user_frame(e)
    raise ValueError(f"{who} draws random numbers with a torch.Generator (generator=...): a traced program "
                     "cannot take a generator, and patching sweeps need a deterministic model; draw the noise "
                     "outside and pass it as an input" + (f"; at {where}" if where else "")) from e


def refuse_cumulative_batch_norm(model: torch.nn.Module, into: str, way_out: str = "") -> None:
    """A BatchNorm in training mode with momentum=None averages with 1 / num_batches_tracked, a Python float read
    from a buffer: tracing cannot follow it (torch raised a data-dependent guard error that names nothing of ours)."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and mod.training and mod.momentum is None \
                and mod.track_running_stats:
            way_out = f" {way_out}" if way_out else ""
            raise ValueError(f"{name or 'model'}: {type(mod).__name__}(momentum=None) (a cumulative moving "
                             "average, 1 / num_batches_tracked read as a Python number each call) cannot be "
                             f"traced into {into}; give it a momentum (e.g. momentum=0.1){way_out}")


# What Hugging Face T5's attention (and its copies: MT5, LongT5, SwitchTransformers, Pop2Piano, UDOP, Pix2Struct)
# does in forward when its gradient_checkpointing flag is on in training: a flag the step's trace cannot carry
_T5_BIAS_REQUIRES_GRAD = "position_bias.requires_grad = True"
_forward_sources: dict[type, str] = {}


def _forward_source(cls: type) -> str:
    if cls not in _forward_sources:
        try:
            _forward_sources[cls] = inspect.getsource(cls.forward)
        except (TypeError, OSError, AttributeError):
            _forward_sources[cls] = ""
    return _forward_sources[cls]


def _attention_implementation(mod: torch.nn.Module) -> str | None:
    """The attention a Hugging Face attention module runs: its config's where its forward dispatches through
    ALL_ATTENTION_FUNCTIONS, else 'eager' (LongT5's local attentions compute their scores themselves)."""
    if "ALL_ATTENTION_FUNCTIONS" not in _forward_source(type(mod)):
        return "eager"
    return getattr(getattr(mod, "config", None), "_attn_implementation", None)


def _non_reentrant(mod: torch.nn.Module) -> bool:
    """Whether a Hugging Face module's checkpointing function (``_gradient_checkpointing_func``, a
    functools.partial of torch.utils.checkpoint.checkpoint) says use_reentrant=False; anything else counts as
    reentrant."""
    func = getattr(mod, "_gradient_checkpointing_func", None)
    return isinstance(func, functools.partial) and func.keywords.get("use_reentrant", True) is False


def refuse_t5_checkpointing(model: torch.nn.Module, who: str = "make_train_step") -> None:
    """Refuses Hugging Face T5 (an attention whose forward sets ``position_bias.requires_grad = True``) in
    training mode with activation checkpointing on where the step would train a few ulp off eager, silently
    (fuzz_step 36:11, 38:55, 38:39). A reentrant block runs its forward under no_grad, where layer 0's relative
    bias requires no grad: eager's SDPA takes flash there (a float mask that requires grad takes math) and math in
    its recomputation, which the step traces once; with eager attention reentrant differs too (cause not found),
    as does LongT5's local attention. Non-reentrant passes: eager attention (or one computing its own scores,
    LongT5's local ones) trains bit-exact, and so does SDPA on CPU, where ``eager_sdpa_math_choice`` keeps eager's
    math kernel for the zeros bias T5 flags (other devices' choices are not pinned: refused)."""
    t5 = [(n, m) for n, m in model.named_modules() if _T5_BIAS_REQUIRES_GRAD in _forward_source(type(m))]
    if not t5:
        return
    ckpt = [(n, m) for n, m in model.named_modules() if m.training and getattr(m, "gradient_checkpointing", False) is True]
    if not ckpt:
        return
    impls = {_attention_implementation(m) for _, m in t5}
    on_cpu = all(t.device.type == "cpu" for t in itertools.chain(model.parameters(), model.buffers()))
    reentrant = [n for n, m in ckpt if not _non_reentrant(m)]
    if not reentrant and impls <= ({"eager", "sdpa"} if on_cpu else {"eager"}):
        return
    name, mod = t5[0]
    why = (f"is checkpointed reentrantly ({reentrant[0] or 'model'})" if reentrant
           else f"runs {' and '.join(sorted(map(repr, impls)))} attention{'' if on_cpu else ' off the CPU'}")
    raise NotImplementedError(
        f"{who}: {type(mod).__name__} ({name or 'model'}) in training mode with activation checkpointing on "
        f"({ckpt[0][0] or 'model'}: gradient_checkpointing=True) {why}: the step would train a few ulp off eager. "
        "Checkpointed in training, Hugging Face T5 sets position_bias.requires_grad = True on a bias it makes in "
        "forward, and SDPA picks its math kernel for a float mask that requires grad, flash otherwise; a reentrant "
        "block's forward runs under no_grad (eager picks flash there and math in its recomputation, which the step "
        "traces once). Call model.gradient_checkpointing_disable() (the step plans its own memory: "
        "step.compile(plan=True, memory_budget=...)), or checkpoint without reentrance "
        "(model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})) with eager "
        "attention (model.set_attn_implementation('eager')) or, on CPU, SDPA; each trains bit-exact")


VALUE_AS_PYTHON = ("reads a tensor's value to decide Python control flow (`if t.sum() > 0`, `bool(t)`, a size from "
                   "`int(t)`, a number from `float(t.item() > 0)`): one traced program cannot follow a value that "
                   "changes per call. Write it with torch.where or torch.cond")


def _user_frame(e: BaseException) -> str | None:
    """Where ``e`` was raised in code outside torch and torch_ext, as 'File "...", line N, in f'."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and "/torch_ext/" not in f.filename]
    return f'File "{frames[-1].filename}", line {frames[-1].lineno}, in {frames[-1].name}' if frames else None


def _eager_experts_hint(module: torch.nn.Module | None) -> str:
    """The way out where the data-dependent code is a Hugging Face mixture of experts run with
    ``experts_implementation="eager"`` (a Python loop over the experts that received tokens); else ''."""
    if module is None:
        return ""
    for name, sub in module.named_modules():
        cfg = getattr(sub, "config", None)
        if getattr(cfg, "_experts_implementation", None) == "eager":
            return (f". {type(sub).__name__}{f' ({name})' if name else ''} runs its experts with "
                    "experts_implementation='eager', a Python loop over the experts that received tokens: build it "
                    "with experts_implementation='grouped_mm' (transformers' default) or 'batched_mm', which trace")
    return ""


# torch's own code for control flow: an export failing inside it failed on a torch.cond / while_loop the user wrote
_CONTROL_FLOW_FILES = ("/torch/_higher_order_ops/", "/torch/_export/passes/replace_with_hop_pass_util.py",
                       "/torch/_export/passes/replace_autocast_with_hop_pass.py")


def refuse_export_control_flow(e: BaseException, who: str = "the model") -> None:
    """torch's export failing inside its own handling of a torch.cond / while_loop (torch 2.9: a cond nested in
    another cond's branch: its fake tracing cannot prove the inner cond's output strides dense, and under autocast
    its autocast pass loses the inner branch's graph, an AttributeError), as a NotImplementedError naming the
    error and the user's line; returns for any other error (an internal error of ours stays one)."""
    import traceback

    seen, exc = [], e
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    if not any(any(part in f.filename for part in _CONTROL_FLOW_FILES)
               for x in seen for f in traceback.extract_tb(x.__traceback__)):
        return
    first = (str(e).splitlines() or [""])[0][:300]
    # dynamo names the user's line in its message ("from user code:"), the traceback holds only torch's frames
    user = [ln.strip() for ln in str(e).partition("from user code:")[2].splitlines()
            if ln.strip().startswith("File ") and "/torch/" not in ln]
    where = user[-1] if user else _user_frame(e)
    raise NotImplementedError(
        f"torch {torch.__version__}'s export failed inside its handling of a torch.cond / while_loop in {who} "
        f"({type(e).__name__}: {first}){f'; at {where}' if where else ''}. Eager runs it, the step cannot trace it: "
        "torch 2.9's export fails on a cond nested in another cond's branch (and on any control flow it cannot "
        "trace). Lift the inner cond out of the branch (one cond on the combined predicate), or use torch.where") from e


def refuse_value_as_python(e: BaseException, who: str = "the model", module: torch.nn.Module | None = None) -> None:
    """torch's data-dependent guard error, or Python's refusal to turn a traced value into a number (float() of a
    SymBool), as a NotImplementedError naming the user's line (and the way out for a Hugging Face mixture of experts
    run eagerly, when ``module`` is one); returns for any other error."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(e, GuardOnDataDependentSymNode):
        where = str(e).partition("The following call raised this error:")[2].strip()
        where = where.splitlines()[0].strip() if where else _user_frame(e)
    elif isinstance(e, TypeError) and any(f"'{sym}'" in str(e) for sym in ("SymBool", "SymInt", "SymFloat")):
        where = f"{_user_frame(e) or '(unknown)'}: {e}"
    else:
        return
    indexing = _indexing_call(e)
    if indexing is not None:  # no control flow the user wrote: `buf[0, n % 8] = 1.0` with n a 0-dim tensor
        write = indexing == "__setitem__"
        raise NotImplementedError(
            f"{who} uses a tensor's value as an index ({'writes' if write else 'reads'} tensor[..., i]"
            f"{' = v' if write else ''} with i a 0-dim tensor: Python's indexing reads i as an int, and one traced "
            "program cannot follow a position that changes per call). Index with a 1-element tensor instead "
            f"(tensor[..., i.view(1)]{' = v' if write else ''}), which the program computes"
            + (f"; at {where}" if where else "")) from e
    if _raised_in_function(e, "tensor_split_tensor_indices_or_sections_py_impl"):
        # torch's tensor_split decomposition reads a tensor of indices as Python ints (tolist): no control flow
        # the user wrote, so the generic message sent them looking for an `if`.
        raise NotImplementedError(
            f"{who} calls torch.tensor_split with a tensor of split indices (or sections): torch reads its values as "
            "Python numbers to cut the slices, and one traced program cannot follow indices that change per call. "
            "Pass a list of ints (tensor_split(x, [1, 3], dim)), or torch.split with a list of sizes"
            + (f"; at {where}" if where else "")) from e
    raise NotImplementedError(f"{who} {VALUE_AS_PYTHON}" + (f"; at {where}" if where else "")
                              + _eager_experts_hint(module)) from e


def _raised_in_function(e: BaseException, name: str) -> bool:
    """Whether a frame of ``e``'s traceback runs a function called ``name`` (torch's decomposition of an op)."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == name:
            return True
        tb = tb.tb_next
    return False


def _indexing_call(e: BaseException) -> str | None:
    """"__setitem__" or "__getitem__" when ``e`` was raised inside a tensor's indexing (torch's
    ``__torch_function__`` handlers, which hold the call as ``func``), else None."""
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__torch_function__":
            name = getattr(frame.f_locals.get("func"), "__name__", None)
            if name in ("__setitem__", "__getitem__"):
                return name
        tb = tb.tb_next
    return None


def _refuse_unflattenable_output(module: torch.nn.Module, error: RuntimeError) -> None:
    """torch's "Found <class ...> in output, which is not a known type" (an output torch.export cannot flatten,
    e.g. a Hugging Face encoder-decoder's ``EncoderDecoderCache``) as a ValueError that names the type and the
    way out; returns for any other error."""
    import re

    found = re.search(r"Found <class '([^']+)'> in output, which is not a known type", str(error))
    if found is None:
        return
    kind = found.group(1)
    hint = ("pass use_cache=False (example_kwargs={..., 'use_cache': False}, or model.config.use_cache = False): "
            "the key/value cache is for generation, and no activation needs it"
            if kind.startswith("transformers.") and "Cache" in kind else
            "return tensors, or tuples, lists and dicts of them (register the type with "
            "torch.utils._pytree.register_pytree_node if it holds tensors)")
    raise ValueError(f"{type(module).__name__}'s forward returns a {kind}, which torch.export cannot flatten into "
                     f"tensors, so no graph can be traced from it; {hint}") from error


def kv_cache_left_out(module, kwargs: dict | None) -> str | None:
    """Why the graph's output has no ``past_key_values`` where eager's has one (a Hugging Face generation model
    with ``config.use_cache`` on, traced with it off by ``_trace_for_inference``), else None."""
    cfg = getattr(module, "config", None)
    if cfg is None or getattr(cfg, "use_cache", None) is not True or not hasattr(module, "generate") \
            or (kwargs or {}).get("use_cache", True) is not True:
        return None
    return (f"past_key_values (cache): {type(module).__name__}'s key/value cache is not computed by the graph, which is "
            "traced with use_cache=False (the cache is for generation; eager returns it because config.use_cache "
            "is on): read the keys and values as nodes of the graph (rg.nodes(...), rg.value), or compare "
            "against model(..., use_cache=False)")


def _trace_for_inference(module, args, kwargs, front_end, settle=lambda: None):
    """``settle``: called as the trace ends, before the modules' attributes are put back as they were (what
    the forward hooks wrote, read by ``_module_state.TracedWrites``)."""
    import keyword

    import types

    args, kwargs = distinct_inputs((tuple(args), kwargs))

    # TransformerLens 4's TransformerBridge reports the wrapped model's parameter names from
    # named_parameters()/parameters()/state_dict(), which export cannot find in the module tree:
    # use nn.Module's own walk on the instance for the export.
    hook_cls = _transformer_lens_hook_point()
    has_hooks = hook_cls is not None and any(isinstance(m, hook_cls) for m in module.modules())
    if has_hooks:
        # TransformerLens 4 re-wires its blocks when a hook returns a new tensor (as the markers
        # below do), leaving the model unusable afterwards: export a copy, never the user's model.
        import copy

        # Activations a previous run left on the modules (non-leaf tensors) cannot be deep-copied.
        memo = {}
        for m in module.modules():
            for v in vars(m).values():
                items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
                for t in items:
                    if isinstance(t, torch.Tensor) and not t.is_leaf:
                        memo[id(t)] = t.detach()
        # The copy still reaches some of the user's modules through closures its hooks keep (deepcopy
        # does not copy functions): TransformerLens 4 attention stores `_captured_pre_ln_residual`
        # that way, which left export-time tensors on the user's model (it could no longer be
        # deep-copied, and kept the traced graph alive). Snapshot the attributes and put them back.
        # A deep copy of a bridge shares those closures too, so follow them to the modules they reach.
        originals = [(m, dict(vars(m))) for m in _modules_reached(module)]
        module = copy.deepcopy(module, memo)
    unshadowed = []
    if type(module).__module__.startswith("transformer_lens."):
        for meth in ("named_parameters", "parameters", "named_buffers", "buffers", "state_dict"):
            if getattr(type(module), meth) is not getattr(torch.nn.Module, meth) and meth not in vars(module):
                setattr(module, meth, types.MethodType(getattr(torch.nn.Module, meth), module))
                unshadowed.append(meth)
    cfg = getattr(module, "config", None)
    saved_cache = None
    if cfg is not None and getattr(cfg, "use_cache", None) is True and hasattr(module, "generate"):
        saved_cache, cfg.use_cache = cfg.use_cache, False
    saved_forward = None
    if has_hooks:
        # Each HookPoint (an identity module) leaves a named marker node, so that hook names address
        # graph nodes; ReactiveGraph turns the markers back into plain edges (strip_hook_points).
        saved_forward = hook_cls.forward

        def forward(self, x):
            # A "post-hoc" hook (TransformerLens 4 fires it on values the wrapped module already
            # consumed, e.g. attention patterns) cannot change the output: it stays unaddressed.
            frame = sys._getframe(1)
            for _ in range(24):  # through nn.Module.__call__ and the export tracer's frames
                if frame is None:
                    break
                if frame.f_code.co_name == "_fire_post_hoc_hook":
                    return x
                if frame.f_code.co_name == "_hf_autograd_forward_with_hooks":
                    # A norm bridge's observation hooks (hook_scale, hook_normalized): the bridge runs the
                    # wrapped norm itself (rsqrt, HF's numerics) only while each hook hands back the very
                    # tensor it got. A marker is a new tensor, so the trace took the bridge's edit path
                    # (x / sqrt): every value after an RMSNorm differed from eager in the last bits.
                    return x
                frame = frame.f_back
            if isinstance(x, torch.Tensor) and getattr(self, "name", None):
                return torch.ops.torch_ext.hook_point(x, self.name)
            return x

        hook_cls.forward = _gated(forward, saved_forward)
    # Hugging Face decoders get TransformerLens hook names (blocks.<l>.hook_resid_pre, ...) from
    # temporary hooks that leave the same named markers.
    handles = []
    for name, sub, kind in hf_hook_points(module):
        if kind == "pre":
            handles.append(sub.register_forward_pre_hook(_marker_pre(name), with_kwargs=True))
        else:
            handles.append(sub.register_forward_hook(_marker_out(name)))
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    # What the forward does to its buffers and plain tensor attributes, settled inside the trace as the pure
    # step does (_module_state.ForwardWrites): a rebinding becomes a buffer write, a write into a plain
    # tensor attribute (a constant to both front ends: the graph silently kept its old value) is refused.
    from . import _module_state

    pending = []  # one per traced call of the forward (auto traces again with export when make_fx refuses)

    def writes_begin(mod, args, kwargs):
        pending.append(_module_state.ForwardWrites(mod, "the graph"))

    def writes_settle(mod, args, kwargs, out):
        pending.pop().settle()

    handles.append(module.register_forward_pre_hook(writes_begin, with_kwargs=True, prepend=True))
    handles.append(module.register_forward_hook(writes_settle, with_kwargs=True))
    # The trace runs such a write on the real tensor (export keeps constants real): put it back, so that the
    # refused model is left as it was.
    plain = [(t, t._version, t.detach().clone()) for m in torch.nn.Module.modules(module) for t in vars(m).values()
             if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and not t.is_meta]
    used, reason = "export", None
    # Tracing reparametrizes the module with fake tensors; some modules cache views of their
    # parameters (nn.LSTM's _flat_weights) and kept the fakes afterwards: put every attribute back.
    traced_vars = [(m, dict(vars(m))) for m in torch.nn.Module.modules(module)]
    # Hooks the forward registers as it runs go too, with the attributes that mark them: transformers 5 installs its
    # output_hidden_states recorders at the first call and sets model._output_capturing_hooks_installed; with the
    # marker undone and the hooks kept, every later call installed another set (hidden_states twice over).
    hooks_before = _hook_dicts(module)
    try:
        if front_end != "export":
            try:
                ep, used = make_fx_program(module, args, kwargs), "make_fx"
            except UnsoundTrace as e:
                if front_end == "make_fx":
                    raise
                reason = str(e)
                # What the refused attempt did to the modules, undone before export traces them again. A module
                # that sets itself up at its first forward did it there, on make_fx's stand-ins for its submodules
                # (record_module_stack's proxies): TransformerLens 4's blocks register hooks that hold a
                # weakref.proxy to the block and mark themselves wired, so export ran hooks whose block was gone
                # ("ReferenceError: weakly-referenced object no longer exists" on a bridge never run before).
                _restore_hook_dicts(hooks_before)
                _restore_attributes(traced_vars)
        if used == "export":
            ep = torch.export.export(module, args, kwargs or {})
    finally:
        _restore_hook_dicts(hooks_before)  # before the handles' removal: the snapshot holds them
        for h in handles:
            h.remove()
        if saved_forward is not None:
            hook_cls.forward = saved_forward
        if saved_cache is not None:
            cfg.use_cache = saved_cache
        settle()
        _restore_attributes(traced_vars)
        for t, version, saved in plain:
            if t._version != version:
                with torch.no_grad():
                    t.copy_(saved)
        for meth in unshadowed:
            delattr(module, meth)
        if has_hooks:
            _restore_attributes(originals)
    # State names with a keyword component ("blocks.0.mlp.in.weight") break the code that
    # run_decompositions() generates: spell them with a trailing "_" in the program.
    respell = respell_state_name

    if any(respell(k) != k for k in list(ep.state_dict) + list(ep.constants)):
        sig = ep.graph_signature
        for spec in list(sig.input_specs) + list(sig.output_specs):
            if getattr(spec, "target", None):
                spec.target = respell(spec.target)
        ep._state_dict = {respell(k): v for k, v in ep.state_dict.items()}
        ep._constants = {respell(k): v for k, v in ep.constants.items()}
    return ep, used, reason


# Attributes of library objects that hold dicts keyed by id() of tensors from earlier runs (numbers that
# differ per process): the on-disk build cache describes them by their values only (_build_cache).
# TransformerLens 4's attention conversion keeps per-tensor shapes there after every run.
ID_KEYED_STATE = {
    ("transformer_lens.conversion_utils.conversion_steps.attention_auto_conversion", "AttentionAutoConversion"):
        ("_conversion_state",),
}


def respell_state_name(name: str) -> str:
    """A state name as programs spell it: components that are Python keywords get a trailing "_"."""
    import keyword

    return ".".join(p + "_" if keyword.iskeyword(p) else p for p in name.split("."))


class UnsoundTrace(Exception):
    """make_fx_program cannot vouch for its trace (data-dependent code, mutation, a call the importer
    does not take, ...): the caller falls back to torch.export, which handles or refuses these itself."""


def make_fx_program(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> torch.export.ExportedProgram:
    """The graph torch.export builds, traced by ``make_fx`` instead: several times cheaper to build.

    Non-strict torch.export is make_fx(pre_dispatch=True) plus checks and bookkeeping that an inference
    graph of static shapes does not need. Here the parameters and buffers enter as inputs
    (``torch.func.functional_call``) and everything is traced on fake tensors, so the graph holds the
    same pre-dispatch ATen calls and node names as export's, and nothing runs on real data. Whatever
    export would have to handle specially is refused with ``UnsoundTrace`` instead:

    - data-dependent code (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``, boolean masks...): fake
      tensors have no data (and no shape environment), so the trace fails; ops tagged
      ``data_dependent_output`` are refused as well;
    - in-place ops (on inputs, buffers or intermediates): export functionalizes them;
    - tensors the model holds outside its parameters and buffers (get_attr constants), calls that are
      not ATen/custom op overloads (grad-mode switches, higher-order ops), non-tensor inputs or outputs,
      keyword inputs.
    """
    import inspect

    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import (ExportGraphSignature, InputSpec, OutputSpec, TensorArgument)
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx
    import torch.utils._pytree as pytree

    if kwargs:
        raise UnsoundTrace(f"keyword inputs {sorted(kwargs)}")
    flat_args, in_spec = pytree.tree_flatten((tuple(args), {}))
    if len(flat_args) != len(args) or not all(isinstance(a, torch.Tensor) for a in flat_args):
        raise UnsoundTrace("inputs other than a flat tuple of tensors")
    try:
        bound = inspect.signature(module.forward).bind(*args)
    except (TypeError, ValueError) as e:
        raise UnsoundTrace(f"forward's signature: {e}") from None
    arg_names = []
    for name, value in bound.arguments.items():
        if isinstance(value, tuple) and value is not args and name not in ("self",):  # *args
            arg_names += [f"{name}_{i}" for i in range(len(value))]
        else:
            arg_names.append(name)
    if len(arg_names) != len(args):
        raise UnsoundTrace("inputs that do not map one-to-one onto forward's parameters")
    params = dict(torch.nn.Module.named_parameters(module))
    buffers = dict(torch.nn.Module.named_buffers(module))
    persistent = {n for n, _ in _persistent_buffers(module)}
    names = list(params) + list(buffers)
    state = [*params.values(), *buffers.values()]
    out_spec = []

    def flat_forward(*flat):
        out = torch.func.functional_call(module, dict(zip(names, flat[:len(names)])), tuple(flat[len(names):]),
                                         strict=True)
        leaves, spec = pytree.tree_flatten(out)
        out_spec.append(spec)
        return leaves

    flat_forward._orig_mod = module  # make_fx records nn_module_stack (module paths) against this root
    try:
        # Only the traced graph is used (the ExportedProgram below compiles its own module from it): make_fx's
        # GraphModule defers generating and compiling its Python code (as dynamo's are), which it never needs.
        with _use_lazy_graph_module(True):
            gm = make_fx(flat_forward, tracing_mode="fake", pre_dispatch=True, record_module_stack=True)(*state, *args)
    except Exception as e:  # noqa: BLE001  (any failure: torch.export handles or reports it)
        raise UnsoundTrace(f"make_fx failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in graph.nodes:
        if n.op == "get_attr":
            raise UnsoundTrace(f"node {n.name}: a tensor held outside parameters and buffers ({n.target})")
        if n.op in ("call_module", "call_method"):
            raise UnsoundTrace(f"node {n.name}: {n.op} {n.target}")
        if n.op != "call_function" or n.target is GETITEM:
            continue
        if not isinstance(n.target, torch._ops.OpOverload):
            raise UnsoundTrace(f"node {n.name}: {getattr(n.target, '__name__', n.target)} is not an ATen op overload")
        if n.target._schema.is_mutable:
            raise UnsoundTrace(f"node {n.name}: in-place op {n.target}")
        # (An op whose output shape depends on data, nonzero or a boolean mask, already failed on fake
        # tensors; index.Tensor is tagged dynamic_output_shape for its boolean form only.)
        if torch.Tag.data_dependent_output in n.target.tags:
            raise UnsoundTrace(f"node {n.name}: {n.target}'s output depends on data")
    outs = output.args[0]
    if not all(isinstance(o, torch.fx.Node) for o in outs):
        raise UnsoundTrace("non-tensor outputs")
    # export's placeholder names: p_/b_ + the state's name, then forward's parameter names.
    wanted = [("p_" if i < len(params) else "b_") + k.replace(".", "_") for i, k in enumerate(names)] + arg_names
    for node, name in zip(placeholders, wanted):
        node._rename(name)
        node.target = node.name
    input_specs = []
    for i, (node, k) in enumerate(zip(placeholders, names)):
        kind = InputKind.PARAMETER if i < len(params) else InputKind.BUFFER
        input_specs.append(InputSpec(kind, TensorArgument(node.name), k,
                                     persistent=(k in persistent) if kind is InputKind.BUFFER else None))
    input_specs += [InputSpec(InputKind.USER_INPUT, TensorArgument(n.name), None) for n in placeholders[len(names):]]
    output_specs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), None) for o in outs]
    # (No gm.recompile() for the renamed placeholders: ExportedProgram builds its GraphModule from the graph,
    # which generates the code once, with the names as they are now.)
    return torch.export.ExportedProgram(
        root=gm, graph=graph,
        graph_signature=ExportGraphSignature(input_specs, output_specs),
        state_dict={**params, **{k: v for k, v in buffers.items() if k in persistent}},
        range_constraints={},
        module_call_graph=[ModuleCallEntry("", ModuleCallSignature([], [], in_spec, out_spec[0]))],
        constants={k: v for k, v in buffers.items() if k not in persistent},
    )


def _persistent_buffers(module: torch.nn.Module):
    for prefix, m in torch.nn.Module.named_modules(module):
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), b


def _modules_reached(module: torch.nn.Module) -> list:
    """The module tree, plus the modules that its hooks' closures, partials and bound methods reach."""
    import functools

    seen: dict[int, torch.nn.Module] = {}
    todo = [module]
    while todo:
        root = todo.pop()
        for m in torch.nn.Module.modules(root):
            if id(m) in seen:
                continue
            seen[id(m)] = m
            hooks = [h for k, v in vars(m).items() if k.endswith("_hooks") and isinstance(v, dict) for h in v.values()]
            for fn in hooks:
                refs = []
                if isinstance(fn, functools.partial):
                    refs += [fn.func, *fn.args, *fn.keywords.values()]
                for f in [fn, *refs]:
                    refs.append(getattr(f, "__self__", None))
                    refs += [c.cell_contents for c in (getattr(f, "__closure__", None) or ())
                             if c.cell_contents is not None] if _cells_filled(f) else []
                todo += [r for r in refs if isinstance(r, torch.nn.Module) and id(r) not in seen]
    return list(seen.values())


def _cells_filled(f) -> bool:
    try:
        for c in getattr(f, "__closure__", None) or ():
            c.cell_contents  # noqa: B018  (an empty cell raises)
        return True
    except ValueError:
        return False


def _hook_dicts(module: torch.nn.Module) -> list:
    """(dict, its entries) for every hook dict of every module (``_forward_hooks``, ``_forward_pre_hooks``, ...):
    registering a hook adds to the dict in place, which a snapshot of the module's attributes does not undo."""
    return [(d, dict(d)) for m in torch.nn.Module.modules(module) for k, d in vars(m).items()
            if k.startswith(("_forward", "_backward", "_state_dict", "_load_state_dict")) and isinstance(d, dict)]


def _restore_hook_dicts(snapshots) -> None:
    """Puts each hook dict back to the entries ``_hook_dicts`` recorded (hooks registered since are dropped)."""
    for d, before in snapshots:
        if d.keys() != before.keys():
            d.clear()
            d.update(before)


def _restore_attributes(snapshots) -> None:
    """Undoes attribute writes on modules: each module's top-level __dict__ entries as snapshotted."""
    for m, before in snapshots:
        now = vars(m)
        for k in [k for k in now if k not in before]:
            del now[k]
        for k, v in before.items():
            if now.get(k, _MISSING) is not v:
                now[k] = v


_MISSING = object()


def _transformer_lens_hook_point():
    import sys

    mod = sys.modules.get("transformer_lens.hook_points")
    return getattr(mod, "HookPoint", None) if mod is not None else None


@torch.library.custom_op("torch_ext::hook_point", mutates_args=())
def hook_point(x: torch.Tensor, name: str) -> torch.Tensor:
    """A named identity marking a TransformerLens hook point during export; never executed by the engine."""
    return x.clone()


@hook_point.register_fake
def _(x, name):
    return torch.empty_like(x)


def strip_hook_points(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """Removes the hook-point markers from ``ep`` (in place); returns {hook name: node name}.

    A marker whose input has no other reader is dropped and its name addresses the input node.
    Otherwise (the value also feeds other consumers, as the residual stream feeds both ``ln1.hook_in``
    and the residual add) it becomes an ``aten.alias`` node, so that patching the hook changes only
    what reads through it, as in TransformerLens.
    """
    g = ep.graph
    target = torch.ops.torch_ext.hook_point.default
    hooks: dict[str, str] = {}
    renamed: dict[str, str] = {}
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not target:
            continue
        src, name = n.args
        if len(src.users) == 1 and src.op == "call_function":
            n.replace_all_uses_with(src)
            renamed[n.name] = src.name
            hooks[name] = src.name
        else:
            with g.inserting_after(n):
                alias = g.call_function(torch.ops.aten.alias.default, (src,))
            alias.meta = dict(n.meta)
            n.replace_all_uses_with(alias)
            renamed[n.name] = alias.name
            hooks[name] = alias.name
        g.erase_node(n)
    if not renamed:  # no marker: the graph and its code are as they were (a recompile costs ~5 ms per 150 nodes)
        return hooks
    for spec in ep.graph_signature.output_specs:
        arg = getattr(spec, "arg", None)
        while arg is not None and getattr(arg, "name", None) in renamed:
            arg.name = renamed[arg.name]
    ep.graph_module.recompile()
    return hooks


def hook_aliases(module: torch.nn.Module) -> dict[str, str]:
    """TransformerLens hook aliases ({"blocks.0.hook_resid_pre": "blocks.0.hook_in", ...})."""
    hook_cls = _transformer_lens_hook_point()
    hook_dict = getattr(module, "hook_dict", None) if hook_cls is not None else None
    if not isinstance(hook_dict, dict):
        return {}
    return {k: v.name for k, v in hook_dict.items() if isinstance(v, hook_cls) and getattr(v, "name", None)}


def _marker_pre(name: str):
    def hook(mod, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (torch.ops.torch_ext.hook_point(args[0], name),) + tuple(args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = torch.ops.torch_ext.hook_point(kwargs["hidden_states"], name)
            return args, kwargs
        return None

    return hook


def _marker_out(name: str):
    def hook(mod, args, out):
        if isinstance(out, torch.Tensor):
            return torch.ops.torch_ext.hook_point(out, name)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (torch.ops.torch_ext.hook_point(out[0], name),) + out[1:]
        return None

    return hook


def _hf_decoder(module: torch.nn.Module):
    """(layers, n_heads) of a Hugging Face decoder-only LM (GPT-2 or Llama-style), else None. A TransformerLens
    bridge over one (which forwards ``config`` and ``model.layers`` to the wrapped model) is not: its own hook
    points name its activations, as TransformerLens defines them for that architecture."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(module, "generate") or hook_aliases(module):
        return None
    # GPT-2, GPT-J, BLOOM, Falcon, CodeGen; Llama-style; GPT-NeoX; OPT; MPT. What each name is there is proven in
    # the traced graph (_hook_proof), not taken from these module names.
    for path in ("transformer.h", "model.layers", "gpt_neox.layers", "model.decoder.layers", "transformer.blocks"):
        obj = module
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            heads = (getattr(cfg, "n_head", None) or getattr(cfg, "num_attention_heads", None)
                     or getattr(cfg, "n_heads", None))
            return obj, int(heads) if heads else None
    return None


def hf_hook_points(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """TransformerLens hook names on a Hugging Face decoder: (name, submodule, "pre" | "out").

    resid_pre / resid_post: a layer's input / output; attn_out, mlp_out: the attention's and the
    MLP's outputs (with sandwich norms, Gemma 2-4, OLMo 2, GLM-4: their post-norms' outputs, what the
    residual add reads); resid_mid: the second norm's input (as TransformerLens 4's bridge aliases it, so a
    patch there reaches the MLP branch only); attn.hook_z: the attention output projection's input,
    seen as [batch, pos, head, d_head]. A TransformerLens bridge is not handled here (see _hf_decoder).
    """
    found = _hf_decoder(module)
    if found is None:
        return []
    layers, _ = found
    points = []
    for l, layer in enumerate(layers):
        attn = next((getattr(layer, a) for a in ("attn", "self_attn", "attention", "self_attention")
                     if isinstance(getattr(layer, a, None), torch.nn.Module)), None)
        mlp = getattr(layer, "mlp", None) or getattr(layer, "ffn", None)
        ln2 = next((getattr(layer, a) for a in ("ln_2", "post_attention_layernorm", "norm_2", "final_layer_norm")
                    if isinstance(getattr(layer, a, None), torch.nn.Module)), None)
        attn_out, mlp_out = attn, mlp
        post_mlp = getattr(layer, "post_feedforward_layernorm", None) or getattr(layer, "post_mlp_layernorm", None)
        post_attn = getattr(layer, "post_self_attn_layernorm", None)
        if post_attn is None and post_mlp is not None:
            post_attn = getattr(layer, "post_attention_layernorm", None)
        if post_attn is not None or post_mlp is not None:
            # Sandwich norms (Gemma 2-4, OLMo 2/3, GLM-4, AFMoE, EXAONE 4): a norm after the attention and/or the
            # MLP, before the residual add. What each branch adds to the stream is its post-norm's output
            # (TransformerLens's ln1_post / ln2_post), and resid_mid is the input of the norm before the MLP
            # (post_attention_layernorm is that norm only where it is not the attention's post-norm); none is
            # named where the MLP reads the stream unnormalized.
            attn_out, mlp_out = post_attn or attn, post_mlp or mlp
            ln2 = (getattr(layer, "pre_feedforward_layernorm", None) or getattr(layer, "pre_mlp_layernorm", None)
                   or (ln2 if ln2 is not post_attn else None))
        # The output projection, whose input is the heads' outputs side by side: GPT-2's c_proj, Llama's o_proj,
        # GPT-NeoX's, Phi's, Falcon's and BLOOM's dense, GPT-J's and OPT's out_proj.
        proj = next((p for p in (getattr(attn, a, None) for a in ("c_proj", "o_proj", "dense", "out_proj"))
                     if isinstance(p, torch.nn.Module)), None) if attn is not None else None
        points.append((f"blocks.{l}.hook_resid_pre", layer, "pre"))
        for name, sub, kind in ((f"blocks.{l}.hook_attn_out", attn_out, "out"),
                                (f"blocks.{l}.hook_resid_mid", ln2, "pre"),
                                (f"blocks.{l}.hook_mlp_out", mlp_out, "out"), (f"blocks.{l}.attn.hook_z", proj, "pre")):
            if sub is not None:
                points.append((name, sub, kind))
        points.append((f"blocks.{l}.hook_resid_post", layer, "out"))
    return points


class _SplitHeads:
    """[..., n_heads * d_head] seen as [..., n_heads, d_head], as TransformerLens shows hook_z."""

    def __init__(self, n_heads: int):
        self.n_heads = n_heads

    def convert(self, x):
        return x.reshape(*x.shape[:-1], self.n_heads, x.shape[-1] // self.n_heads)

    def revert(self, x):
        return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def hook_conversions(module: torch.nn.Module) -> dict:
    """{hook name: conversion} for TransformerLens hook points that present a reshaped view to hooks
    (``hook_q``/``hook_z`` as [batch, pos, head, d_head]): ``convert`` before a hook, ``revert`` after."""
    found = _hf_decoder(module)
    if found is not None:
        return {f"blocks.{l}.attn.hook_z": _SplitHeads(found[1]) for l in range(len(found[0]))} if found[1] else {}
    hook_cls = _transformer_lens_hook_point()
    hook_dict = getattr(module, "hook_dict", None) if hook_cls is not None else None
    if not isinstance(hook_dict, dict):
        return {}
    return {k: v.hook_conversion for k, v in hook_dict.items()
            if isinstance(v, hook_cls) and getattr(v, "hook_conversion", None) is not None}


def attention_heads(module) -> int | None:
    """Heads per attention layer: TransformerLens ``cfg.n_heads`` or a Hugging Face decoder's config."""
    if module is None:
        return None
    cfg = getattr(module, "cfg", None)
    if cfg is not None and getattr(cfg, "n_heads", None):
        return int(cfg.n_heads)
    found = _hf_decoder(module)
    return int(found[1]) if found is not None and found[1] else None
