"""The training step's build-time checks of the user's model, optimizers and example batch.

Each runs once, when make_train_step builds the step, reads only what the user passed, and raises with a
message naming the culprit; a refused build changes nothing. TrainStep.__init__ calls them in this order:
refuse_non_tensor_batch, check_model_parameters, then per optimizer check_optimizer and, per parameter
of its groups, optimizer_parameter and check_options (via the update read), check_clip_covers,
check_modules, and after the joint export refuse_stale_grads (refuse_loss_without_gradient where the joint
export found a loss that requires no grad). The per-call checks (the model left
unwritten, the optimizer's config unchanged) live on TrainStep.
"""
from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as pytree

from . import _compat, optim


def refuse_non_tensor_batch(example_batch: tuple) -> None:
    """Every leaf of the example batch is a tensor: the program takes tensors only."""
    for path, leaf in pytree.tree_flatten_with_path(example_batch)[0]:
        if not isinstance(leaf, torch.Tensor):  # torch's joint export failed on it: "'float' object has no
            # attribute 'requires_grad'"; a number would be a constant of the program, its next value ignored
            raise TypeError(
                f"batch{pytree.keystr(path)} is {type(leaf).__name__} {leaf!r}, not a tensor: the program takes "
                "tensors only and would hold a Python value as a constant, so a new value at a later call (an "
                "epoch, a loss weight, a flag) would be ignored. Pass it as a tensor (torch.tensor(value)), or "
                "keep it out of the batch (a loss_fn default, or a closure: a change to it is refused by name)")


def check_model_parameters(model: torch.nn.Module) -> None:
    """Refuses torch's legacy reparametrization and parameters that share memory without being one object."""
    legacy = _compat.legacy_reparametrization(model, "the program", "trains")
    if legacy is not None:
        raise TypeError(legacy)
    overlap = overlapping_parameters(model)
    if overlap is not None:
        raise ValueError(f"{overlap[0]} and {overlap[1]} share memory (one is a view of the other, e.g. "
                         "nn.Parameter(w[0])): eager's update of one changes the other, the pure step holds each "
                         "as its own state entry and would train them apart. Tie them as one parameter object, "
                         "or give one its own memory (.clone())")


def overlapping_parameters(model: torch.nn.Module) -> tuple[str, str] | None:
    """Two distinct parameters, or a parameter and a buffer, whose memory overlaps (``nn.Parameter(w[0])``
    shares ``w``'s storage): eager's update of one changes the other, the step's state holds each apart.
    Tied parameters (one object) are one entry and not reported. Disjoint views of one storage pass."""
    def span(t):
        if t.numel() == 0:
            return None
        lo = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st < 0)
        hi = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
        size = t.element_size()
        return lo * size, (hi + 1) * size

    by_storage: dict[tuple, list] = {}
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for n, t in items:
            if t.layout != torch.strided or t.device.type == "meta" or span(t) is None:
                continue
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((f"{kind} '{n}'", t))
    for group in by_storage.values():
        for i, (na, a) in enumerate(group):
            for nb, b in group[i + 1:]:
                if a is b or not (na.startswith("parameter") or nb.startswith("parameter")):
                    continue  # shared buffers are one entry; buffers beside buffers are left alone
                (alo, ahi), (blo, bhi) = span(a), span(b)
                if ahi <= blo or bhi <= alo:
                    continue
                # exact: the element offsets each one covers (interleaved strided views do not overlap)
                if a.element_size() == b.element_size():
                    n = max(ahi, bhi) // a.element_size()
                    base = torch.arange(n)
                    ia = torch.as_strided(base, a.shape, a.stride(), a.storage_offset())
                    ib = torch.as_strided(base, b.shape, b.stride(), b.storage_offset())
                    if not torch.isin(ia.reshape(-1), ib.reshape(-1)).any():
                        continue
                return na, nb
    return None


def check_optimizer(opt: torch.optim.Optimizer) -> None:
    """The optimizer is a supported torch.optim class (TypeError when unsupported) whose step is the base's."""
    optim.registration_for(opt)
    check_subclass(opt)


def check_subclass(opt: torch.optim.Optimizer) -> None:
    """Refuses optimizers whose update is not torch.optim's: the pure step replays the base class's math.

    A subclass is accepted when its ``step`` is the supported base class's (it may add attributes,
    defaults or helper methods); one that overrides ``step`` would silently run the base update,
    so it is refused. Step hooks run Python code the program cannot contain, so they are refused too.
    """
    cls = type(opt)
    base = optim.registration_for(opt).optimizer
    # torch.optim wraps a class's step in a profiling hook on first construction; compare the
    # functions underneath the wrappers.
    if inspect.unwrap(cls.step) is not inspect.unwrap(base.step):
        owner = next((k for k in cls.__mro__ if "step" in vars(k) and inspect.unwrap(vars(k)["step"])
                      is not inspect.unwrap(base.step)), cls)
        raise TypeError(f"optimizer {cls.__qualname__} overrides step() (in {owner.__qualname__}); the pure step only "
                        f"replays torch.optim.{base.__name__}'s update and would silently ignore the override. "
                        f"Use {base.__name__} itself or a subclass that keeps its step()")
    hooks = _compat.optimizer_step_hooks(opt)
    if hooks:
        raise TypeError(f"optimizer {cls.__qualname__} has step hooks ({', '.join(hooks)}); the pure step cannot "
                        "run them. Remove the hooks or train eagerly")


def check_options(opt: torch.optim.Optimizer, group: dict, gi: int) -> None:
    """Refuses param-group options the pure step does not follow (foreach where inexact, fused, capturable,
    differentiable) and a differentiable tensor hyperparameter."""
    name = type(opt).__name__
    bad = []
    # torch.optim's foreach (multi-tensor) path computes the same numbers as the single-tensor path
    # the update ops replay, for these optimizers (bit for bit over 100 steps on CPU, see
    # tests/python/test_train_step_optimizers.py); fused kernels do not.
    if group.get("foreach") and not optim.registration_for(opt).foreach_exact:
        bad.append("foreach=True")
    elif group.get("foreach"):
        # In half precision the foreach path differs from the single-tensor one (its _foreach_mul_(list, beta)
        # runs mul_.Scalar, which rounds beta to bfloat16 first): Adam's exp_avg_sq, SGD's momentum, RMSprop's
        # square_avg move by an ulp (eager foreach=True against foreach=False, 3 steps).
        half = [(i, p.dtype) for i, p in enumerate(group["params"]) if p.dtype in (torch.bfloat16, torch.float16)]
        if half:
            i, dt = half[0]
            raise ValueError(f"{name} param group {gi}: foreach=True with {len(half)} {str(dt)[6:]} parameter(s) "
                             f"(params[{i}] of shape {tuple(group['params'][i].shape)}): torch.optim's foreach path "
                             "rounds differently from the single-tensor path the pure step replays in half "
                             "precision; pass foreach=False")
    if group.get("fused"):
        bad.append("fused=True")
    for key in ("capturable", "differentiable"):
        if group.get(key):
            bad.append(f"{key}=True")
    if bad:
        raise ValueError(f"{name} param group {gi}: option(s) {', '.join(bad)} are not supported by the pure step "
                         "(it follows torch.optim's single-tensor path); leave them at their defaults")
    for key in ("lr", "weight_decay", "momentum", "eps"):
        if isinstance(group.get(key), torch.Tensor) and group[key].requires_grad:
            raise ValueError(f"{name} param group {gi}: a differentiable tensor '{key}' is not supported")


def optimizer_parameter(opt: torch.optim.Optimizer, gi: int, p: torch.Tensor, names: dict[int, str],
                        seen: dict[int, str]) -> str:
    """The model's name of parameter ``p`` of ``opt``'s param group ``gi`` (``names``: id -> name). Refuses a
    tensor that is not the model's, one already in a group (``seen``: id -> name), and a complex parameter."""
    if id(p) not in names:
        raise ValueError(f"{type(opt).__name__} param group {gi} holds a parameter of shape "
                         f"{tuple(p.shape)} that is not a parameter of the model")
    if id(p) in seen:
        raise ValueError(f"parameter '{names[id(p)]}' appears in more than one param group/optimizer")
    name = names[id(p)]
    if p.is_complex():  # the executor failed at the first call: "parameter must be floating point"
        raise TypeError(f"parameter '{name}' is {p.dtype}: torch.optim updates a complex parameter as "
                        "torch.view_as_real(p), the step's update kernels take real parameters. Hold "
                        "it as a real parameter with a trailing dimension of 2 and read it with "
                        "torch.view_as_complex(p) in forward (the same update, element by element)")
    return name


def check_clip_covers(model: torch.nn.Module, clip_grad_norm, seen: dict[int, str]) -> None:
    """With clip_grad_norm, every parameter that requires grad is in an optimizer (``seen``: id -> name)."""
    if clip_grad_norm is not None:
        # Eager clip_grad_norm_(model.parameters(), c) counts this parameter's gradient; the program
        # clips over the optimizers' parameters only, so the two norms would differ.
        outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
        if outside:
            raise ValueError(f"clip_grad_norm={clip_grad_norm}: parameter '{outside[0]}' requires grad but is in "
                             f"no optimizer ({len(outside)} such): eager clip_grad_norm_(model.parameters()) "
                             "would count its gradient in the norm, the step clips over the optimizers' "
                             "parameters; freeze it with requires_grad_(False) or give it to an optimizer")


def check_modules(model: torch.nn.Module) -> None:
    """Refuses modules the pure step cannot express: cumulative batch norm, Hugging Face T5 checkpointed in a way
    the step cannot reproduce, a trained Embedding with max_norm or sparse=True, and gradient hooks."""
    _compat.refuse_cumulative_batch_norm(model, "the pure step")
    _compat.refuse_t5_checkpointing(model)
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.weight.requires_grad:
            # max_norm renormalises the looked-up rows of the weight in place in forward, and a sparse
            # gradient is not the dense one every update op takes: name the module, not torch's internals.
            if mod.max_norm is not None:
                raise ValueError(f"{name or 'model'}: {type(mod).__name__}(max_norm={mod.max_norm}) writes into its "
                                 "weight in place during forward (embedding_renorm_), which a pure step cannot "
                                 "express: a parameter is an input of the program, never written by it. Drop "
                                 "max_norm, or renormalise explicitly between steps")
            if mod.sparse:
                raise ValueError(f"{name or 'model'}: {type(mod).__name__}(sparse=True) gives a sparse gradient; the "
                                 "pure step's update ops take dense gradients. Build it with sparse=False (the "
                                 "dense gradient holds the same values)")

    hooks = _compat.gradient_hooks(model)
    if hooks:
        raise TypeError(f"the model has gradient hooks the pure step cannot run: {'; '.join(hooks[:4])}"
                        f"{f' and {len(hooks) - 4} more' if len(hooks) > 4 else ''}. The step computes the "
                        "gradients inside its program, so eager training and the step would differ; remove the "
                        "hooks (clip with clip_grad_norm=) or train eagerly")


def refuse_stale_grads(without_gradient: list[tuple[str, torch.Tensor]]) -> None:
    """A parameter the loss gives no gradient (unused, frozen, read under no_grad) is skipped, as torch.optim
    skips a .grad of None. One that holds a .grad tensor (zero_grad(set_to_none=False)) eager keeps
    updating with that zero gradient at every step (weight decay, momentum, step count): ambiguous.
    ``without_gradient``: (name, parameter) of the optimizers' parameters the joint program gives no
    gradient, in update order."""
    stale = [n for n, p in without_gradient if p.grad is not None]
    if stale:
        raise ValueError(
            f"parameter{'s' if len(stale) > 1 else ''} {', '.join(repr(n) for n in stale[:4])}"
            f"{f' (and {len(stale) - 4} more)' if len(stale) > 4 else ''} get no gradient from loss_fn but hold a "
            ".grad tensor (left by zero_grad(set_to_none=False)): eager's opt.step() would update them with that "
            "gradient at every call (weight decay, momentum, step count), the pure step skips them as for a .grad "
            "of None. Set their .grad to None first (opt.zero_grad(), set_to_none=True by default)")


def refuse_loss_without_gradient(groups: list, names: dict[int, str], error: BaseException) -> None:
    """The loss requires no gradient (torch's joint export raised ``error``: "marked as the loss, but it does not
    require gradients"): every parameter of the optimizers is frozen, or none the loss reads requires grad. Eager's
    ``loss.backward()`` raises too. ``groups``: (optimizer, param group) in the step's order."""
    trainable = [names.get(id(p), "?") for _, g in groups for p in g["params"] if p.requires_grad]
    if trainable:
        detail = (f"the optimizers' parameters that require grad ({', '.join(repr(n) for n in trainable[:4])}"
                  f"{f' and {len(trainable) - 4} more' if len(trainable) > 4 else ''}) do not reach the loss "
                  "(unread, or read only through .detach() or under torch.no_grad())")
    else:
        parts = []
        for gi, (opt, g) in enumerate(groups):
            frozen = [names.get(id(p), "?") for p in g["params"]]
            parts.append(f"{type(opt).__name__} param group {gi}: "
                         + (f"{', '.join(repr(n) for n in frozen[:4])}{' ...' if len(frozen) > 4 else ''} "
                            "(requires_grad=False)" if frozen else "no parameters"))
        detail = "no parameter of the optimizers requires grad (" + "; ".join(parts) + ")"
    raise ValueError(
        f"make_train_step: the loss does not require grad, so there is nothing to train: {detail}. Eager's "
        "loss.backward() raises too. " + ("Let loss_fn's result depend on them" if trainable else
                                          "Unfreeze the parameters to train (p.requires_grad_(True)) before building "
                                          "the step")) from error
