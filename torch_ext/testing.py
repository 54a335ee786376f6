"""Helpers for users' own tests: pure-step parity with eager torch.optim, and a memory budget."""
from __future__ import annotations

import copy
import math
from typing import Callable, Iterable, Sequence

import torch


class ParityError(AssertionError):
    pass


def step_parity(model, optimizer, loss_fn: Callable, batches: Sequence, *, unroll: int = 1, seed: int = 0) -> dict:
    """Runs the pure step and the eager loop side by side on copies; returns the largest differences.

    Both sides start from one RNG state: the step from ``init_state(seed=seed)``, the eager loop
    after ``torch.manual_seed(seed)``, so dropout draws the same masks. ``unroll=N`` builds the
    step with ``unroll=N`` and feeds it N batches per call (``len(batches)`` a multiple of N). The
    caller's model, optimizer and global RNG state are not touched. ``nonfinite_state`` names the first
    state entry (parameter, buffer, optimizer slot) that was finite before training and is not after it.
    """
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise ValueError(f"step_parity: unroll must be an int >= 1, got {unroll!r}")
    if len(batches) % unroll:
        raise ValueError(f"step_parity: unroll={unroll} takes the batches {unroll} per call, got {len(batches)} "
                         "batches (not a multiple)")
    with torch.random.fork_rng(devices=[]):
        return _step_parity(model, optimizer, loss_fn, batches, seed, unroll)


def _step_parity(model, optimizer, loss_fn, batches, seed, unroll=1):
    from .train_step import make_train_step

    batches = [tuple(b) for b in batches]
    if not batches:
        raise ValueError("step_parity needs at least one batch")
    from . import _compat

    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    model = _compat.uncompiled(model)  # named as the step names them (no "_orig_mod." of a torch.compile wrapper)
    pure_model, pure_opts = copy.deepcopy((model, opts))
    ref_model, ref_opts = copy.deepcopy((model, opts))
    step = make_train_step(pure_model, pure_opts if len(pure_opts) > 1 else pure_opts[0], loss_fn, batches[0],
                           unroll=unroll)
    state = step.init_state(seed=seed)
    # What was finite before training must stay finite: an update that turns the weights NaN with every loss
    # still finite (the last step's, or a NaN learning rate) matches eager NaN for NaN, so parity alone passes it.
    # A buffer that starts non-finite (a -inf attention mask) is left out.
    finite_before = {name: bool(torch.isfinite(state.lookup(name)).all()) for name in step.state_names
                     if state.lookup(name).is_floating_point()}
    torch.manual_seed(seed)  # the eager loop's generator; the pure step reads only its own state
    worst = {"loss": 0.0, "state": 0.0, "worst_entry": "", "steps": 0, "nonfinite": False, "losses": [],
             "nonfinite_state": ""}
    pending = []  # this call's losses, one per unrolled step
    for i, batch in enumerate(batches):
        if i % unroll == 0:
            group = [x for b in batches[i:i + unroll] for x in b]
            losses, state = step(state, *group)[:2]
            pending = list(losses.reshape(-1)) if unroll > 1 else [losses]
        loss = pending[i % unroll]
        for o in ref_opts:
            o.zero_grad()
        ref_loss = loss_fn(ref_model, *batch)
        if isinstance(ref_loss, (tuple, list)):  # (loss, aux)
            ref_loss = ref_loss[0]
        ref_loss.backward()
        for o in ref_opts:
            o.step()
        worst["losses"].append(float(loss))
        if not torch.isfinite(loss).all() or not torch.isfinite(ref_loss).all():
            worst["nonfinite"] = True
            worst["steps"] = i + 1
            return worst
        worst["loss"] = max(worst["loss"], _rel(loss, ref_loss.detach()))
        worst["steps"] = i + 1
    for name, was_finite in finite_before.items():
        # An entry the state lacks is the parity comparison's to name (below: "(missing)").
        if was_finite and _has_entry(state, name) and not bool(torch.isfinite(state.lookup(name)).all()):
            worst["nonfinite_state"] = name
            break
    for n, p in ref_model.named_parameters():
        d = _rel(state.params["model." + n], p.detach())
        if d > worst["state"]:
            worst["state"], worst["worst_entry"] = d, "param " + n
    for n, b in ref_model.named_buffers():
        d = _rel(state.buffers["model." + n], b)
        if d > worst["state"]:
            worst["state"], worst["worst_entry"] = d, "buffer " + n
    # The optimizer state too (momentum, Adam moments, step counts): a wrong moment can leave this
    # call's parameters right and the next ones wrong. Slots are matched by torch.optim's own names.
    from . import optim

    name_of = {id(p): n for n, p in ref_model.named_parameters()}
    for o in ref_opts:
        for p, slots in o.state.items():
            if id(p) not in name_of:
                continue
            for slot, value in slots.items():
                key = optim.state_name("model." + name_of[id(p)], slot)
                if not isinstance(value, torch.Tensor):
                    continue
                if key not in state.opt:  # eager keeps a slot the pure step does not: never a pass
                    worst["state"], worst["worst_entry"] = math.inf, f"optimizer {slot} of {name_of[id(p)]} (missing)"
                    continue
                ours = state.opt[key]
                d = _rel(ours.to(value.dtype) if ours.shape == value.shape else ours, value)
                if d > worst["state"]:
                    worst["state"], worst["worst_entry"] = d, f"optimizer {slot} of {name_of[id(p)]}"
    return worst


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (b's finite elements). Elements equal on both sides (equal infinities
    included) or NaN on both count as equal; a NaN or an infinity on one side only gives inf, never a
    NaN that every ``> rtol`` comparison would let pass."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if not a.numel():
        return 0.0
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    if not bool(torch.isfinite(diff).all()):
        return math.inf
    finite = b[torch.isfinite(b)]
    denom = float(finite.abs().max()) if finite.numel() else 0.0
    return float(diff.max()) / max(denom, 1e-12)


def _has_entry(state, name: str) -> bool:
    try:
        state.lookup(name)
    except KeyError:
        return False
    return True


def assert_step_matches_eager(model, optimizer, loss_fn: Callable, batches: Iterable, rtol: float = 0.0, *,
                              seed: int = 0) -> dict:
    """Fails unless the pure step tracks the eager loop within ``rtol`` (relative, max-norm); both
    sides draw dropout from one seed. The default 0 is bit-exact: the step runs eager's kernels, so a
    difference of even 1 ulp per step is a defect (the former default 1e-5 let such a drift pass)."""
    result = step_parity(model, optimizer, loss_fn, list(batches), seed=seed)
    if result["nonfinite"]:
        raise ParityError(f"non-finite loss at step {result['steps']}: {result['losses'][-1]}")
    # A difference from eager first: it names the entry and the size; a non-finite state that eager shares
    # (NaN for NaN, which parity counts as equal) is what the second check is for.
    if result["loss"] > rtol or result["state"] > rtol:
        raise ParityError(f"pure step differs from eager over {result['steps']} steps: loss rel {result['loss']:.3g}, "
                          f"state rel {result['state']:.3g} ({result['worst_entry']}), rtol {rtol:g}")
    if result["nonfinite_state"]:
        raise ParityError(f"{result['nonfinite_state']} holds non-finite values after {result['steps']} steps, "
                          "every loss finite (it was finite before training)")
    return result


def assert_peak_below(step, batch, max_bytes: int):
    """Fails unless the planned step's peak (arena + state) stays within ``max_bytes``; returns the report."""
    from .memory import memory_report

    report = memory_report(step, batch)
    if report.merged_planned > max_bytes:
        raise AssertionError(f"planned peak {report.merged_planned} bytes exceeds the budget of {max_bytes} bytes\n{report}")
    return report
