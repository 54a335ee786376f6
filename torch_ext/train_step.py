"""make_train_step: one training iteration as one pure graph, (loss, S') = F(batch, S).

The Python side reads the model and the torch.optim optimizer into a plain spec, exports the joint
forward/backward graph, and hands both to the C++ pipeline (csrc/passes/build_train_step.h). It
performs no graph transformation itself.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import json
import operator
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from . import _C, _compat, _env_reads, _model_checks, _module_state, _reentrant_grads, _trace_patches, optim
from .ir import Graph

_MODEL_PREFIX = "model."
_VERSION = operator.attrgetter("_version")
_DATA_PTR = operator.methodcaller("data_ptr")

_ids = itertools.count()


@dataclass
class TrainState:
    """Everything a step reads and writes: parameters, buffers, RNG and optimizer state.

    ``params`` and ``buffers`` are keyed "model.<name>" (a tied parameter or shared buffer appears
    once, under its first name; tensor constants lifted from ``forward`` are kept with the
    buffers). ``opt`` maps "opt:<param>:<slot>" to a tensor (and, under a scheduler that cycles
    momentum, "opt:<momentum or beta1>:group<g>" to a float64 0-d tensor, fed per step as the lr),
    ``lr`` holds one float64 tensor per param group (a schedule changes them without re-export).
    ``rng`` is the CPU generator state
    (torch.get_rng_state() layout) when the step draws random numbers (dropout), else None; each
    step returns it advanced. ``sched_epoch`` is the scheduler's epoch (its steps taken). A state belongs to
    the step that made it.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt: dict[str, torch.Tensor]
    lr: list[torch.Tensor]
    step_id: int = field(default=-1, repr=False)
    rng: torch.Tensor | None = field(default=None, repr=False)
    sched_epoch: int = field(default=0, repr=False)
    # Set when a donating compiled step consumed this state (its tensors were overwritten in place):
    # says which call did it, so reuse fails loudly instead of computing on the updated weights.
    consumed_by: str | None = field(default=None, repr=False, compare=False)
    # Where this state came from ("init_state() of TrainStep 0", "call 3 of TrainStep 0"), for errors.
    origin: str = field(default="", repr=False, compare=False)
    # TrainStep.fingerprint of the program that made it; checked by load_state_dict, in any process.
    fingerprint: str = field(default="", repr=False)
    # The parameters (state names) eager's optimizer held no state for when init_state took this state, and
    # that no call has updated since: write_back leaves them without an entry, as torch.optim creates its state
    # on the first step. Lion's and Muon's slots count no steps, so their values cannot tell.
    unstepped: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def state_dict(self) -> dict:
        """Plain tensors, lists and strings: saves with torch.save, loads with torch.load(weights_only=True);
        ``step.load_state_dict(d)`` turns it back into a state of a step with the same program."""
        self._refuse_if_consumed("state_dict()")
        return {"params": dict(self.params), "buffers": dict(self.buffers), "opt": dict(self.opt),
                "lr": list(self.lr), "rng": self.rng, "sched_epoch": int(self.sched_epoch),
                "fingerprint": self.fingerprint, "unstepped": list(self.unstepped)}

    def _refuse_if_consumed(self, what: str) -> None:
        if self.consumed_by is not None:  # the tensors hold the next step's values now
            raise ValueError(f"{what}: {self.describe()} was donated to {self.consumed_by} and its tensors were "
                             "updated in place; use the state that call returned (or compile(donate=False))")

    def lookup(self, name: str) -> torch.Tensor:
        if name == _RNG:
            if self.rng is None:
                raise KeyError(f"{self.describe()} has no RNG state but the step draws random numbers; "
                               "use step.init_state(seed=...)")
            return self.rng
        parsed = optim.parse_state_name(name)
        if parsed is not None:
            return self.lr[parsed[1]] if parsed[0] == "lr" else self.opt[name]
        if name in self.params:
            return self.params[name]
        return self.buffers[name]

    def replace(self, updates: dict[str, torch.Tensor]) -> "TrainState":
        params, buffers, opt, rng = dict(self.params), dict(self.buffers), dict(self.opt), self.rng
        for k, v in updates.items():
            if k == _RNG:
                rng = v
            elif optim.parse_state_name(k) is not None:
                opt[k] = v
            elif k in params:
                params[k] = v
            else:
                buffers[k] = v
        return TrainState(params, buffers, opt, list(self.lr), self.step_id, rng, self.sched_epoch,
                          fingerprint=self.fingerprint)

    def describe(self) -> str:
        return f"TrainState({self.origin or 'made by hand'})"

    def set_lr(self, lr: float | Sequence[float]) -> None:
        """Sets the learning rate of every group (or each group) for the next calls."""
        values = [lr] * len(self.lr) if isinstance(lr, (int, float)) else list(lr)
        if len(values) != len(self.lr):
            raise ValueError(f"set_lr: expected {len(self.lr)} values, got {len(values)}")
        self.lr = [torch.tensor(float(v), dtype=torch.float64) for v in values]


_RNG = "rng"  # the state name of the generator state (csrc/passes/thread_rng.h)


def _flatten_state(s: TrainState):
    # A pytree round trip (tree_map, tree_flatten) drops consumed_by: a copy of a donated state would
    # pair its updated tensors with its old lr, scheduler epoch and RNG, and train on silently.
    s._refuse_if_consumed("flattening it as a pytree (tree_map, tree_flatten)")
    keys = (sorted(s.params), sorted(s.buffers), sorted(s.opt))
    leaves = [s.params[k] for k in keys[0]] + [s.buffers[k] for k in keys[1]] + [s.opt[k] for k in keys[2]] + list(s.lr)
    if s.rng is not None:
        leaves.append(s.rng)
    return leaves, (keys, len(s.lr), s.step_id, s.rng is not None, s.sched_epoch, s.fingerprint, tuple(s.unstepped))


def _unflatten_state(leaves, ctx):
    (pk, bk, ok), n_lr, step_id, has_rng, sched_epoch, fingerprint, unstepped = ctx
    it = iter(leaves)
    params = {k: next(it) for k in pk}
    buffers = {k: next(it) for k in bk}
    opt = {k: next(it) for k in ok}
    lr = [next(it) for _ in range(n_lr)]
    return TrainState(params, buffers, opt, lr, step_id, next(it) if has_rng else None, sched_epoch,
                      fingerprint=fingerprint, unstepped=unstepped)


pytree.register_pytree_node(TrainState, _flatten_state, _unflatten_state)
# torch.load(weights_only=True) may rebuild a pickled TrainState (its fields are tensors, dicts,
# lists, ints and strings).
torch.serialization.add_safe_globals([TrainState])


def _placeholder(ep, name: str) -> torch.fx.Node:
    return next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name)


_STORED_INSTEAD = ("take activations from the program's outputs instead (a loss_fn returning (loss, aux), or a "
                   "ReactiveGraph's run_with_cache / value), or remove the hook before building")


class _LossModule(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn


    def forward(self, *batch):
        writes = _module_state.ForwardWrites(self.model, "the step's state")
        out = self._loss_fn(self.model, *batch)
        _compat.replay_checkpoint_writes()  # what eager's backward recomputation writes again
        _compat.name_data_reads(self.model, _MODEL_PREFIX)  # t.data read: which t (export's own tensors now)
        writes.settle()  # buffers rebound, plain tensor attributes written (shared with inference tracing)
        if not isinstance(out, (tuple, list)):
            return out
        if len(out) != 2:
            raise ValueError(f"loss_fn must return a scalar loss or a pair (loss, aux), got a {type(out).__name__} "
                             f"of {len(out)} items")
        loss, aux = out
        for path, leaf in pytree.tree_flatten_with_path(aux)[0]:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"loss_fn's aux must be a pytree of tensors; aux{pytree.keystr(path)} is a "
                                f"{type(leaf).__name__}")
        # aux is reported, not differentiated: detached, it is a plain output of the joint program.
        return loss, pytree.tree_map(torch.Tensor.detach, aux)


def _update_for(opt, group: dict, param: torch.Tensor, gi: int) -> dict:
    _model_checks.check_options(opt, group, gi)
    return optim.registration_for(opt).read(opt, group, param, gi)


class _LrSchedule:
    """The lr of every param group after k scheduler steps: a pure function of k; and so are the
    ``fed`` scalars (a momentum or beta1 a scheduler cycles), read from the replayed groups.

    The user's schedulers are replayed on private copies (sharing no tensors' storage changes:
    schedulers only write group hyperparameters), k steps deep, and the lrs cached. Eager training
    reads ``group["lr"]`` (a Python float) in ``opt.step()`` and then calls ``sched.step()``; the
    step reads the same float from a float64 tensor, so the updates match bit for bit.
    """

    def __init__(self, schedulers: list, optimizers: list, fed: dict[int, list[str]] | None = None):
        """``fed``: per param group (the optimizers' groups in order), the scalars the program takes as
        inputs per step besides the lr (see _cycled_momentum); their values come from the replay too."""
        from torch.optim import lr_scheduler

        for i, sch in enumerate(schedulers):
            if isinstance(sch, lr_scheduler.ReduceLROnPlateau):
                raise TypeError(f"scheduler[{i}]: ReduceLROnPlateau steps on a metric, so its lr is not a function of "
                                "the step count; set state.set_lr(...) from your own metric loop instead")
            if not isinstance(sch, lr_scheduler.LRScheduler):
                raise TypeError(f"scheduler[{i}] must be a torch.optim.lr_scheduler.LRScheduler, got "
                                f"{type(sch).__name__}")
            if not any(sch.optimizer is o for o in optimizers):
                raise ValueError(f"scheduler[{i}] ({type(sch).__name__}) drives an optimizer that is not one of the "
                                 "step's optimizers")
        owners = [next(j for j, o in enumerate(optimizers) if sch.optimizer is o) for sch in schedulers]
        if len(set(owners)) != len(owners):
            raise ValueError("two schedulers drive the same optimizer; chain them with ChainedScheduler or SequentialLR")
        self._originals = schedulers
        # A scheduler restored from a checkpoint (sched.load_state_dict) past epoch 0 whose optimizer was not
        # (opt.load_state_dict): the optimizer's lr is not the scheduler's last lr, so the replay (which steps
        # on from the optimizer's lr) disagrees with a saved state's lr. Kept to name that cause in check_state.
        self._restored_alone = None
        for sch, j in zip(schedulers, owners):
            last = getattr(sch, "_last_lr", None)
            now = [float(g["lr"]) for g in optimizers[j].param_groups]
            if _sched_epoch(sch) > 0 and last is not None and [float(v) for v in last] != now:
                self._restored_alone = (type(sch).__name__, _sched_epoch(sch), [float(v) for v in last], now)
                break
        # A state's sched_epoch is the scheduler's own epoch (last_epoch), so a step built with a
        # scheduler restored from a checkpoint reads a saved state's epoch the same way as one built
        # with a fresh scheduler; the replay starts at the build's epoch.
        self.base = _sched_epoch(schedulers[0])
        # Copy schedulers with their optimizers, sharing every tensor (the copies only touch group
        # hyperparameters), so replaying them never changes the user's objects.
        memo: dict[int, Any] = {}
        for o in optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    memo[id(p)] = p
            for st in o.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        memo[id(v)] = v
        self._memo = memo
        self._pristine = copy.deepcopy((schedulers, optimizers), dict(memo))  # replayed again by write_back
        self._user_opts = optimizers
        self._seen = copy.deepcopy([sch.state_dict() for sch in schedulers])  # check_unchanged's last look
        # Steps past the build where the step last put or found the user's schedulers (the build,
        # init_state, write_back): a call refuses them anywhere else but at the state's own epoch.
        self._placed = 0
        self.fed = dict(fed or {})
        self._where = _fed_locations(optimizers, self.fed)
        self._seen_lrs = self._user_lrs()
        self._scheds, self._opts = copy.deepcopy(self._pristine, dict(memo))
        self._baked = self._hyper(self._opts)
        self._lrs: list[list[float]] = []
        self._fed_values: list[dict[str, float]] = []  # per step k: group input name -> value
        self._record()
        self.lrs(1)  # fail now, not mid-training, when the scheduler also changes baked hyperparameters
        # ... but forget that look-ahead: eager computes step 1's lr at the first call's sched.step(), from
        # what the schedule reads then (a LambdaLR's function reading a factor the script sets after the build).
        self._scheds, self._opts = copy.deepcopy(self._pristine, dict(memo))
        del self._lrs[1:], self._fed_values[1:]

    def _hyper(self, opts) -> list[dict]:
        # Every group option but the lr and the fed scalars: the program bakes them all in (a fixed
        # list of names missed RMSprop's alpha and Adagrad's lr_decay). Keys a scheduler adds later
        # are not options.
        groups = [g for o in opts for g in o.param_groups]
        return [copy.deepcopy(_baked_options(g, self._where.get(gi, {}))) for gi, g in enumerate(groups)]

    def _record(self) -> None:
        self._lrs.append([float(g["lr"]) for o in self._opts for g in o.param_groups])
        self._fed_values.append(self._fed_of(self._opts))

    def _fed_of(self, opts) -> dict[str, float]:
        """The fed scalars' values in ``opts``' groups, as the optimizer reads them (betas[0] for beta1)."""
        groups = [g for o in opts for g in o.param_groups]
        return {optim.group_input_name(n, gi): _fed_value(groups[gi], where[n])
                for gi, where in self._where.items() for n in where}

    @staticmethod
    def _step_all(scheds) -> None:
        with warnings.catch_warnings():
            # The copies never run opt.step(); torch warns about that order on the first step.
            warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)", category=UserWarning)
            for sch in scheds:
                sch.step()

    def lrs(self, k: int) -> list[float]:
        while len(self._lrs) <= k:
            self._step_all(self._scheds)
            owners = [o for o in self._opts for _ in o.param_groups]
            empty = [not g["params"] for o in self._opts for g in o.param_groups]
            for gi, (a, b) in enumerate(zip(self._baked, self._hyper(self._opts))):
                if empty[gi]:
                    continue  # a group with no parameters: what a scheduler does to its options updates nothing
                changed = sorted(key for key in a if not _same_option(a[key], b.get(key, _MISSING)))
                if changed:
                    fed = ", ".join(self.fed.get(gi, ())) or "none"
                    raise ValueError(f"the scheduler changes {', '.join(repr(c) for c in changed)} of "
                                     f"{type(owners[gi]).__name__} param group {gi} at step {len(self._lrs)}; the pure "
                                     "step feeds per step only the lr and the hyperparameters a scheduler that cycles "
                                     "momentum (cycle_momentum=True) drives and the optimizer can take as inputs (SGD, "
                                     "RMSprop and Muon momentum, Adam/AdamW, Lion, Adamax, NAdam and RAdam betas[0]; here: "
                                     f"{fed}); anything else it bakes in")
            self._record()
        return self._lrs[k]

    def fed_at(self, epoch: int) -> dict[str, float]:
        """The fed scalars' values at scheduler epoch ``epoch``, by group input name."""
        self.at(epoch)
        return self._fed_values[epoch - self.base]

    def check_unchanged(self) -> None:
        """Refuses a user's scheduler edited after the build (``sched.gamma = ...``): eager training would
        follow the edit, the replay would not. Stepping it (eagerly, or by write_back) is no edit. The
        common case, nothing changed since the last look, is one state_dict comparison per scheduler."""
        now = [sch.state_dict() for sch in self._originals]
        lrs = self._user_lrs()
        if lrs == self._seen_lrs and all(_same_tree(a, b) for a, b in zip(now, self._seen)):
            return
        self.position("this step")
        self._seen, self._seen_lrs = copy.deepcopy(now), lrs

    def _user_lrs(self) -> list:
        """The user's optimizers' lrs, and their fed scalars when there are any."""
        lrs = [float(g["lr"]) for o in self._user_opts for g in o.param_groups]
        return [lrs, self._fed_of(self._user_opts)] if self.fed else lrs

    def _values(self, k: int) -> list:
        """What _user_lrs should read after k steps."""
        return [self.lrs(k), self._fed_values[k]] if self.fed else self.lrs(k)

    def position(self, who: str = "init_state") -> int:
        """How many steps the user's schedulers stand past the build's copy of them: init_state starts
        the schedule there, as eager training would continue from a scheduler stepped eagerly after the
        build, or placed by write_back. A scheduler the replay does not reach that way is refused."""
        counts = [_sched_epoch(now) - _sched_epoch(built) for now, built in zip(self._originals, self._pristine[0])]
        k = max(counts)
        scheds, _ = copy.deepcopy(self._pristine, dict(self._memo))
        for _ in range(max(k, 0)):
            self._step_all(scheds)
        for i, (now, replay) in enumerate(zip(self._originals, scheds)):
            if counts[i] != k or not _same_tree(now.state_dict(), replay.state_dict()):
                raise ValueError(f"{who}: scheduler[{i}] ({type(now).__name__}) is not where the step's copy of "
                                 f"it is after {k} steps (its epoch moved by {counts[i]} since the build): it was "
                                 "changed or loaded other than by stepping it (eager training would follow that, "
                                 "the step's replay would not); undo the change or build a new step with it")
        # An lr set on the optimizer by hand (a manual drop): eager trains with it, and a chainable
        # scheduler (StepLR, ExponentialLR) continues from it; the replay would not.
        if self._user_lrs() != self._values(k):
            raise ValueError(f"{who}: the optimizers' lr is {self._user_lrs()}, but the scheduler gives {self._values(k)} "
                             f"after {k} steps: an lr set on the optimizer by hand is not followed by a step built "
                             "with scheduler= (eager training would use it); undo it, or build the step without "
                             "scheduler= and set the lr per call with state.set_lr")
        return k

    def at(self, epoch: int) -> list[float]:
        """The lrs at scheduler epoch ``epoch`` (a state's sched_epoch)."""
        if epoch < self.base:
            raise ValueError(f"the state is at scheduler epoch {epoch}, but this step's scheduler was at epoch "
                             f"{self.base} when the step was built: the replay cannot go back; build the step with "
                             "a fresh scheduler (or one restored at or before the state's epoch)")
        return self.lrs(epoch - self.base)

    def check_state(self, state, who: str) -> None:
        """Refuses a state whose lr is not the scheduler's at its epoch (a hand-set lr: state.set_lr),
        or a scheduler edited since the last look. An eager scheduler may continue from a hand-set lr
        (StepLR, ExponentialLR: chainable) or override it (LambdaLR), so no one answer matches eager."""
        self.check_unchanged()
        self._check_stepped_outside(state, who)
        want = self.at(state.sched_epoch)
        have = [float(t) for t in state.lr]
        fed_want = self.fed_at(state.sched_epoch)
        fed_have = {n: float(state.opt[n]) for n in fed_want if n in state.opt}
        if fed_have != fed_want:
            raise ValueError(f"{state.describe()} has {fed_have}, but {who}'s scheduler gives {fed_want} after "
                             f"{state.sched_epoch} steps: these inputs follow the scheduler, so values set by hand "
                             "are refused")
        if have != want:
            names = ", ".join(type(s).__name__ for s in self._originals)
            if self._restored_alone is not None:
                name, epoch, last, now = self._restored_alone
                raise ValueError(f"{state.describe()} has lr {have}, but {who}'s scheduler ({names}) gives {want} "
                                 f"after {state.sched_epoch} steps: its {name} was restored at epoch {epoch} (last lr "
                                 f"{last}), but its optimizer was not (its lr is {now}), so the replay steps on from "
                                 "the wrong lr. Restore the optimizer's state too (opt.load_state_dict(...) with "
                                 "sched.load_state_dict(...)) before building the step")
            raise ValueError(f"{state.describe()} has lr {have}, but {who}'s scheduler ({names}) gives {want} "
                             f"after {state.sched_epoch} steps: the lr of a step run with a scheduler follows the "
                             "scheduler, so a hand-set lr (state.set_lr) is refused; run it without the scheduler "
                             "to set the lr per call, or change the scheduler")

    def _user_steps(self) -> int:
        return max(_sched_epoch(now) - _sched_epoch(built) for now, built in zip(self._originals, self._pristine[0]))

    def _check_stepped_outside(self, state, who: str) -> None:
        """Refuses the user's schedulers stepped since the step last placed them (build, init_state,
        write_back) to anywhere but the state's epoch: eager training would take that lr (a sched.step()
        before the first call, or twice per call), the step takes the state's. Stepped in lockstep with the
        calls (once per call after it) they stand at the state's epoch, as eager's would."""
        k = self._user_steps()
        if k == self._placed or self.base + k == state.sched_epoch:
            return
        names = ", ".join(type(s).__name__ for s in self._originals)
        raise ValueError(f"{who}: the user's scheduler ({names}) was stepped outside the step to epoch {self.base + k} "
                         f"(epoch {self.base + self._placed} when the step last placed it), but {state.describe()} is "
                         f"at scheduler epoch {state.sched_epoch}: eager training would take the lr of epoch "
                         f"{self.base + k}, the step takes the state's. A step built with scheduler= steps the "
                         "schedule itself, once per call: drop the extra sched.step() (or step it once per call, "
                         "after the call), or build the step without scheduler= and set the lr per call with "
                         "state.set_lr")

    def advance(self, new_state, epoch: int) -> None:
        """The scheduler's epoch and lr in a call's result: what eager sched.step() leaves."""
        new_state.sched_epoch = epoch
        new_state.lr = [torch.tensor(v, dtype=torch.float64) for v in self.at(epoch)]
        if self.fed:
            new_state.opt = {**new_state.opt, **self.fed_tensors(epoch)}

    def fed_tensors(self, epoch: int) -> dict[str, torch.Tensor]:
        """The fed scalars at ``epoch`` as the state holds them: float64 0-d tensors, as lr."""
        return {n: torch.tensor(v, dtype=torch.float64) for n, v in self.fed_at(epoch).items()}

    def write_back(self, epoch: int) -> None:
        """Puts the user's schedulers where eager training would be at ``epoch`` (replayed afresh,
        so no per-step snapshot is kept), and the fed scalars into their groups, as eager's
        sched.step() leaves them (the lr is the state's: the caller writes it)."""
        self.at(epoch)
        k = epoch - self.base
        scheds, opts = copy.deepcopy(self._pristine, dict(self._memo))
        for _ in range(k):
            self._step_all(scheds)
        for sch, replay in zip(self._originals, scheds):
            sch.load_state_dict(replay.state_dict())
        user = [g for o in self._user_opts for g in o.param_groups]
        replayed = [g for o in opts for g in o.param_groups]
        for gi, where in self._where.items():
            for key, _ in where.values():
                user[gi][key] = copy.deepcopy(replayed[gi][key])
        for u, r in zip(user, replayed):
            if not u["params"]:  # a group with no parameters is neither fed nor baked: eager holds the replay's options
                for key, v in r.items():
                    if key != "params" and key not in _LR_KEYS:
                        u[key] = copy.deepcopy(v)
        self._seen = copy.deepcopy([sch.state_dict() for sch in self._originals])  # placed by us: no edit
        self._placed = k
        self._seen_lrs = self._values(k)  # what the groups hold unless the written state's lr was set by hand


def _cycled_momentum(schedulers) -> set[int]:
    """The ids of the optimizers whose momentum (or betas[0]) a scheduler changes every step: those a
    scheduler with cycle_momentum=True drives (OneCycleLR, CyclicLR; also inside ChainedScheduler or
    SequentialLR). Their schedulable scalars are fed per step; a change by any other scheduler is
    found by the replay and refused."""
    out, todo = set(), list(schedulers)
    while todo:
        sch = todo.pop()
        todo.extend(getattr(sch, "_schedulers", None) or ())
        if getattr(sch, "cycle_momentum", False):
            out.add(id(sch.optimizer))
    return out


def _fed_locations(optimizers, fed: dict[int, list[str]]) -> dict[int, dict[str, tuple[str, int | None]]]:
    """Per fed param group (the optimizers' groups in order), where each fed scalar lives in the group
    (its registration's ``scheduled``: ("momentum", None), ("betas", 0))."""
    owners = [o for o in optimizers for _ in o.param_groups]
    out = {}
    for gi, names in fed.items():
        if gi >= len(owners):
            raise ValueError(f"the program takes {names} of param group {gi}, but the optimizers have {len(owners)} "
                             "param groups")
        where = optim.registration_for(owners[gi]).scheduled
        missing = [n for n in names if n not in where]
        if missing:
            raise ValueError(f"the program takes {missing} of param group {gi} per step, which "
                             f"{type(owners[gi]).__name__} does not have (it has: {sorted(where) or 'none'}); pass "
                             "the schedulers of the step's own optimizers, in its order")
        out[gi] = {n: where[n] for n in names}
    return out


def _fed_value(group: dict, where: tuple[str, int | None]) -> float:
    key, index = where
    return float(group[key] if index is None else group[key][index])


def _baked_options(group: dict, where: dict[str, tuple[str, int | None]]) -> dict:
    """A group's options that the program bakes in: all but the lr and the fed scalars at ``where``
    (betas[0] fed: betas[1:] stays baked)."""
    opts = {k: v for k, v in group.items() if k not in _LR_KEYS}
    for key, index in where.values():
        if index is None:
            opts.pop(key, None)
        else:
            opts[key] = tuple(v for i, v in enumerate(opts[key]) if i != index)
    return opts


def _sched_epoch(sch) -> int:
    # ChainedScheduler keeps no count of its own: its members do.
    while not hasattr(sch, "last_epoch") and getattr(sch, "_schedulers", None):
        sch = sch._schedulers[0]
    return int(sch.last_epoch)


def _same_tree(a, b) -> bool:
    """Equality of two scheduler state_dicts (nested dicts, lists, floats, maybe tensors)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return _same_option(a, b)


# Param group entries that are not baked into the program: the parameters (checked by identity) and
# the lr (state: init_state reads it, schedulers and set_lr change it).
_LR_KEYS = ("params", "lr", "initial_lr")
_MISSING = object()


def _same_option(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an option without equality: only the same object is the same
        return False


def in_layout_of(t: torch.Tensor, example: torch.Tensor, name: str = "a batch tensor") -> torch.Tensor:
    """``t`` in ``example``'s strides: a copy (same values) when they differ in a dimension of size > 1.
    The program was traced on the example's layout and its views rely on it: an expanded or sliced batch
    of the same shape failed in the executor with "view size is not compatible". A dense batch in another
    memory layout (channels-last, permuted) is refused: eager's kernels take their path from it (a
    channels-last convolution rounds otherwise), so the copy trained 1 ulp off eager, silently."""
    if all(a == b for a, b, n in zip(t.stride(), example.stride(), t.shape) if n > 1):
        return t
    from torch._prims_common import is_non_overlapping_and_dense

    if not is_non_overlapping_and_dense(example):  # an expanded example: no layout to copy into
        return t.contiguous()
    if is_non_overlapping_and_dense(t):
        raise ValueError(f"{name}: strides {tuple(t.stride())} (shape {tuple(t.shape)}), a memory layout other than "
                         f"the example batch's strides {tuple(example.stride())}, which the program was traced with: "
                         "eager's kernels take their path from the layout (a channels-last convolution rounds "
                         "otherwise), so a copy would not train as eager. Pass it in the example's layout "
                         "(.contiguous(), or .contiguous(memory_format=torch.channels_last)), or build the step on "
                         "an example batch in this layout")
    return torch.empty_strided(example.shape, example.stride(), dtype=t.dtype, device=t.device).copy_(t)


def batch_leaves(batch, spec, paths) -> list:
    """The leaves of ``batch`` in the order of the example batch whose structure is ``spec`` and whose
    leaves sit at ``paths`` (pytree key paths). A dict (or BatchEncoding) may list its keys in another
    order than the example's, as a data loader's collate function may: its leaves are matched by key,
    not by position (positionally, {"labels", "input_ids", ...} fed the labels to input_ids, silently).
    Keys that differ from the example's are refused, naming them; any other difference in structure
    (a list for a tuple) keeps the positional order, and the count, shape and dtype checks apply."""
    leaves = _compat.leaves_by_key(batch, spec, paths)
    if leaves is not None:
        return leaves
    with_paths = pytree.tree_flatten_with_path(batch)[0]
    by_path = dict(with_paths)
    keyed = lambda ps: {pytree.keystr(p) for p in ps if any(isinstance(k, pytree.MappingKey) for k in p)}  # noqa: E731
    missing, extra = sorted(keyed(paths) - keyed(by_path)), sorted(keyed(by_path) - keyed(paths))
    if missing or extra:
        raise ValueError(f"the batch's keys differ from the example batch's: missing {', '.join(missing) or 'none'}; "
                         f"not in the example: {', '.join(extra) or 'none'} (pytree key paths of the positional "
                         "batch arguments; with unroll or accumulate, one batch after another)")
    return [leaf for _, leaf in with_paths]


def _written_placeholders(node: torch.fx.Node):
    """The placeholders an op node writes in place (its schema's written arguments), directly or through views
    of them (a view of a view ...)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return
    values = list(node.args) + [node.kwargs.get(a.name) for a in schema.arguments[len(node.args):]]
    for arg, v in zip(schema.arguments, values):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        while isinstance(v, torch.fx.Node) and v.op == "call_function" and v.args:
            vs = getattr(v.target, "_schema", None)
            if vs is None or not vs.arguments or vs.arguments[0].alias_info is None:
                break
            v = v.args[0]
        if isinstance(v, torch.fx.Node) and v.op == "placeholder":
            yield v


def _written_constants(ep, snapshots) -> list[tuple[str, str]]:
    """(what, op) for each in-place write of the forward program into a lifted constant tensor (a tensor
    the code reads from a module-level name, a closure or a plain module attribute), directly or through
    views of it; ``what`` names it by the snapshots' identity entries when one holds it."""
    consts = {s.arg.name: s.target for s in ep.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"}
    if not consts:
        return []
    found = []
    for node in ep.graph.nodes:
        for v in _written_placeholders(node):
            if v.name in consts:
                const = ep.constants.get(consts[v.name])
                what = None
                for snap in snapshots:
                    if snap:
                        what = what or next((_module_state.describe(p, k) for p, k, o in zip(snap[4], snap[6], snap[7])
                                             if o is const), None)
                shape = list(const.shape) if isinstance(const, torch.Tensor) else "?"
                found.append((what or f"a tensor of shape {shape} the traced code reads ({consts[v.name]})",
                              str(node.target)))
    return found


def _state_writes(ep, named: dict) -> list[tuple[str, str, bool, str, str]]:
    """(name, op, through_data, kind, where) for each in-place write of the forward program into a parameter or
    buffer of ``named`` (name -> tensor), directly or through views of it, at the top level or inside a region
    export keeps as a higher-order op (a ``torch.no_grad()`` block: ``wrap_with_set_grad_enabled``), whose
    operands are followed into its subgraph. A write through ``t.data`` (a detached alias export lifts as a
    constant) is matched to the tensor it was read from (_compat.data_source). ``kind`` is "parameter" or
    "buffer"; ``where`` the user's line from the node's stack trace, or ''."""
    roots = {}
    for s in ep.graph_signature.input_specs:
        if s.kind.name in ("PARAMETER", "BUFFER") and s.target in named:
            roots[s.arg.name] = (s.target, False, s.kind.name.lower())
        elif s.kind.name == "CONSTANT_TENSOR":
            name = _compat.data_source(ep.constants.get(s.target))
            if name in named:
                kind = "parameter" if isinstance(named[name], torch.nn.Parameter) else "buffer"
                roots[s.arg.name] = (name, True, kind)
    found = []

    def walk(gm, env):  # env: placeholder name -> root of ``roots``
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if isinstance(node.target, torch._ops.HigherOrderOperator):
                subs = [i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                        and isinstance(getattr(gm, a.target, None), torch.fx.GraphModule)]
                if len(subs) == 1:  # wrap_with_set_grad_enabled, wrap_with_autocast: (..., submod, *operands)
                    sub = getattr(gm, node.args[subs[0]].target)
                    inner = [n.name for n in sub.graph.nodes if n.op == "placeholder"]
                    operands = node.args[subs[0] + 1:]
                    walk(sub, {i: env[o.name] for i, o in zip(inner, operands)
                               if isinstance(o, torch.fx.Node) and o.name in env})
                continue
            for v in _written_placeholders(node):
                if v.name in env:
                    name, through_data, kind = env[v.name]
                    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
                    where = next((t.strip() for t in reversed(trace) if t.strip().startswith("File ")), "")
                    m = re.match(r'File "(.*)", line (\d+)', where)
                    found.append((name, str(node.target), through_data, kind, f"{m[1]}:{m[2]}" if m else ""))

    walk(ep.graph_module, dict(roots))
    return found


class TrainStep:
    """A pure training step. ``loss, new_state = step(state, *batch)`` never mutates ``state``."""

    def __init__(self, model, optimizers, loss_fn, example_batch, clip_grad_norm, unroll, schedulers=(), accumulate=1,
                 batch_shapes="fixed", process_group=None, shard_optimizer_state=False, fed=None):
        from . import distributed

        _compat.register_batch_containers()
        self.model = model
        self.process_group = process_group
        self.shard_optimizer_state = shard_optimizer_state
        self._dp = distributed.data_parallel_spec(process_group, shard_optimizer_state)
        self.optimizers = optimizers
        self.loss_fn = loss_fn
        self.unroll = int(unroll)
        self.accumulate = int(accumulate)
        self.clip_grad_norm = clip_grad_norm
        self._id = next(_ids)
        self._example_batch = tuple(example_batch)
        _model_checks.refuse_non_tensor_batch(self._example_batch)
        self._batch_spec = pytree.tree_structure(self._example_batch)
        self.batch_shapes = batch_shapes
        self._variants: dict[tuple, TrainStep] = {}  # batch shapes -> step built for them (batch_shapes="cache")
        # checked on every call: one batch per unrolled step or micro-batch
        self._example_leaves = pytree.tree_leaves(self._example_batch) * self.unroll * self.accumulate
        # What a call's batch is matched against, by key (batch_leaves): every unrolled or accumulated batch
        call_example = self._example_batch * (self.unroll * self.accumulate)
        self._call_spec = pytree.tree_structure(call_example)
        self.batch_paths = [path for path, _ in pytree.tree_flatten_with_path(call_example)[0]]
        self.last_nonfinite = False

        names = {id(p): n for n, p in model.named_parameters()}
        _model_checks.check_model_parameters(model)
        self._param_of: dict[str, torch.Tensor] = {}
        self._updates: list[dict] = []
        self._groups: list[tuple[torch.optim.Optimizer, dict]] = []
        seen: dict[int, str] = {}
        for opt in optimizers:
            _model_checks.check_optimizer(opt)
            for group in opt.param_groups:
                gi = len(self._groups)
                self._groups.append((opt, group))
                for p in group["params"]:
                    name = _model_checks.optimizer_parameter(opt, gi, p, names, seen)
                    seen[id(p)] = name
                    self._param_of[name] = p
                    u = _update_for(opt, group, p, gi)
                    if shard_optimizer_state and not optim.descriptor(u["kind"])["elementwise"]:
                        title = optim.descriptor(u["kind"])["title"]
                        raise ValueError(f"shard_optimizer_state: parameter '{name}' uses {title}, whose update reads "
                                         "the whole tensor (a matrix's Newton-Schulz step, a factored second moment's "
                                         "row and column means); ZeRO-1 supports the element-wise optimizers only")
                    u.update(param=_MODEL_PREFIX + name, group=gi)
                    self._updates.append(u)

        _model_checks.check_clip_covers(model, clip_grad_norm, seen)
        if schedulers and self.unroll > 1:
            raise ValueError(f"scheduler= needs unroll=1 (the unrolled program uses one lr for its {self.unroll} steps)")
        # `fed` is given for a batch-shape variant: the same inputs as the step it serves.
        self._fed = self._scheduled_scalars(schedulers) if fed is None else fed
        self._fed_where = _fed_locations(optimizers, self._fed)
        for u in self._updates:
            schedulable = optim.descriptor(u["kind"])["schedulable"]
            u["scheduled"] = bool(schedulable) and set(schedulable) <= set(self._fed.get(u["group"], ()))
        self._schedule = _LrSchedule(list(schedulers), optimizers, self._fed) if schedulers else None
        # Options are copied: one mutated in place (a list) must not compare equal to itself.
        self._built_config = [[(params, grads, copy.deepcopy(options)) for params, grads, options in groups]
                              for groups in self._config()]
        self._seen_lrs = self._group_lrs()  # the optimizer's lrs as this step last read or wrote them

        wrapper = _LossModule(model, loss_fn)
        # Tied parameters and shared buffers: export gives each name its own placeholder; fold every
        # alias into the first name's, so the state has one entry that gets the gradients of all uses.
        first: dict[int, str] = {}
        canonical = {n: first.setdefault(id(t), n) for n, t in itertools.chain(
            wrapper.named_parameters(remove_duplicate=False), wrapper.named_buffers(remove_duplicate=False))}
        self.aliases = {n[len(_MODEL_PREFIX):]: c[len(_MODEL_PREFIX):] for n, c in canonical.items() if n != c}

        _model_checks.check_modules(model)

        env_reads: dict = {}  # environment variables the forward read while traced: the program bakes them in

        def export():
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

            # Everything the export runs inside, so it traces what eager computes (_trace_patches.STEP_EXPORT):
            # the code tracing cannot record (backward_only_code), Python draws, environment reads, eager's
            # attention masks, checkpoints inlined, inference_mode as no_grad, gradients in forward refused.
            own = _module_state.OwnGenerators(model, (loss_fn,))  # the user's own random.Random, numpy Generator
            writes = _module_state.TracedWrites(model, (loss_fn,))  # what hooks and loss_fn write while traced
            state_writes.append(writes.state_writes)  # what forward wrote on the user's modules (filled by settle)
            mine: list = []
            stored: list = []
            with contextlib.ExitStack() as restoring, _trace_patches.patched(*_trace_patches.STEP_EXPORT) as got:
                restoring.callback(own.restore)  # a refused build leaves the user's generators as it found them
                restoring.callback(lambda: mine.extend(own.drawn()))
                restoring.callback(lambda: stored.extend(writes.settle()))  # put back, also when the trace raises
                found, drawn, env = got["backward_only_code"], got["python_random_draws"], got["env_reads"]
                try:
                    with _reentrant_grads.marking(model):
                        ep = torch.export.export(wrapper, _compat.distinct_inputs(self._example_batch))  # (x, x): two inputs
                        _reentrant_grads.mark_hop_reads(ep)  # a cond's parameter operands inside a reentrant block
                        _reentrant_grads.order_views(ep)  # closure views: at the block's start, as eager made them
                        _reentrant_grads.check_closures(ep)  # what a reentrant block reads by closure: exact or refused
                except (GuardOnDataDependentSymNode, TypeError) as e:  # TypeError: float(t.item() > 0)
                    _compat.refuse_value_as_python(e, "the model or loss_fn", model)
                    raise
                except NotImplementedError as e:
                    if "torch._C.Generator" not in str(e):
                        raise
                    raise NotImplementedError(
                        "the model or loss_fn passes its own torch.Generator to a random op (generator=...): torch "
                        f"{torch.__version__}'s export cannot trace a generator object, and the step threads only "
                        "torch's default generator as state (init_state(seed=...)). Draw from the default generator") from e
                except torch._subclasses.fake_tensor.DynamicOutputShapeException as e:
                    raise NotImplementedError(
                        f"torch {torch.__version__}'s export cannot trace {e.func}: the shape of its result depends on "
                        "the values of its inputs, and the pure step is one program of static shapes. Compute this "
                        "part of the loss outside the step, or with ops whose result shapes follow their inputs' "
                        "shapes") from e
                except Exception as e:  # noqa: BLE001 - torch's own failure on a cond / while_loop, named
                    _compat.refuse_export_control_flow(e, "the model or loss_fn")
                    raise
            for name, value in env.items():
                env_reads.setdefault(name, value)
            if stored:
                raise ValueError(_module_state.stored_trace_message(stored, "the program", _STORED_INSTEAD))
            _compat.refuse_python_draws(
                drawn + mine, "the model or loss_fn", "program",
                "every step would reuse them where eager draws anew (a layer dropped or kept forever, the same noise "
                "every step). Draw them with torch (torch.rand, torch.randn, torch.bernoulli): the step threads "
                "torch's generator as state (init_state(seed=...))")
            if found:
                raise TypeError(f"the model or loss_fn uses {'; '.join(found)}: tracing records the forward only, "
                                "and the step would differentiate that forward, never running this backward code "
                                "(a gradient hook on an activation would silently train differently from eager). "
                                "Remove it (clip with clip_grad_norm=), or train eagerly")
            return _compat.merge_aliased_inputs(ep, canonical) if self.aliases else ep

        state_writes: list = []  # per export: _module_state.StateWrite of forward's writes on the user's modules

        def read_back() -> list:
            # Values forward wrote and read (a lazy first-call path, a counter a branch reads) that the module
            # snapshot does not compare (new attributes, names starting with '_'): put back already.
            return [w for w in state_writes[-1] if w.read and not w.snapshot_covers]

        before = _module_state.attributes(model)
        ep = export()
        changed = _module_state.traced_changes(model, before)  # put back as they were
        own = read_back()
        if own and not changed:
            # As a public first-call setting below: accepted when the trace from the values it left writes
            # nothing more and records the same program (every later eager call then takes that path).
            for w in own:
                w.put(new=True)
            settled = _module_state.attributes(model)  # (a new public attribute is one of the snapshot's now)
            again_ep = export()
            if not read_back() and not _module_state.traced_changes(model, settled) \
                    and again_ep.graph_module.code == ep.graph_module.code:
                ep, own = again_ep, []
            else:
                for w in own:
                    w.put(new=False)
        if own:
            raise TypeError(_module_state.read_back_message(own, "the pure step"))
        if changed:
            # A first-call initialisation (Hugging Face's *ForSequenceClassification sets config.problem_type
            # in its first forward and reads it in the same call): eager's first call computes with the value
            # it sets, as every later call does. Accepted when forward, traced again from the values it left,
            # changes nothing more and records the same program; the model keeps those values, as after
            # eager's first forward. Anything else (a call counter) is refused below.
            _module_state.put(before, changed, new=True)
            settled = _module_state.attributes(model)
            again_ep = export()
            if not _module_state.traced_changes(model, settled) and again_ep.graph_module.code == ep.graph_module.code:
                ep, changed = again_ep, []
            else:
                _module_state.put(before, changed, new=False)
        self._module_snapshot = _module_state.attributes(model)  # what the program was traced with
        # The Python values the forward's and loss_fn's code read (module-level names, loss_fn's closure and
        # partial arguments): the trace holds each as a constant.
        self._read_snapshot = _module_state.joined(_module_state.callable_reads([("fn loss_fn", loss_fn)]),
                                                   _module_state.global_reads(model, (loss_fn,)))
        self._env_reads = env_reads
        self._hook_snapshot = _module_state.Hooks(model, gradients=True, optimizers=optimizers)
        if changed:  # forward changed Python state: eager sees it change every call, the program never
            raise TypeError("forward changes module attributes the program would bake in once: "
                            + ", ".join(f"{_module_state.describe(p, k)} {a!r} -> {b!r}" for p, k, a, b in changed[:4])
                            + ". Eager training sees a new value every call, the pure step would not; keep such "
                            "state in a buffer (register_buffer) or outside the model")
        named = dict(wrapper.named_parameters())
        named.update(wrapper.named_buffers())
        for name, op, through_data, kind, at in _state_writes(ep, named):
            at = f" at {at}" if at else ""
            if kind == "buffer" and through_data:
                raise ValueError(
                    f"the model or loss_fn writes in place into buffer {self._strip(name)!r} ({op}) through .data{at}: "
                    "the trace sees .data as a detached tensor of its own, so the program would not write the buffer "
                    "where eager does. Write the buffer itself under torch.no_grad() (self.ema.mul_(0.9).add_(x))")
            if kind == "parameter":  # torch's joint export failed on it, or crashed the process (through .data)
                what = (f"a tensor that requires grad (parameter {self._strip(name)!r}, {op})"
                        if named[name].requires_grad else f"frozen parameter {self._strip(name)!r} ({op})")
                raise ValueError(
                    f"the model or loss_fn writes in place into {what}"
                    f"{' through .data' if through_data else ''}{at} during forward, under no_grad too (an EMA teacher "
                    "updated in forward, a momentum encoder); a pure step cannot express it: a parameter is an input "
                    "of the program, never written by it. Write the update with torch.no_grad() outside the step (on "
                    "the state between calls), or make the tensor a buffer")
        written = _written_constants(ep, (self._read_snapshot, self._module_snapshot))
        if written:  # torch's joint export failed on it with a bare AssertionError (exit 3 in the CLI)
            raise ValueError(
                f"the forward or loss_fn writes in place ({written[0][1]}) into {written[0][0]}: a tensor that is "
                "neither a parameter, a buffer nor a batch input, so the program holds it as a constant; eager "
                "training changes it at every call, the pure step could not. Register it as a buffer "
                "(register_buffer) or pass it in the batch")
        out_spec = ep.call_spec.out_spec  # a leaf (the loss), or (loss, aux)
        self._aux_spec = out_spec.children_specs[1] if out_spec.num_children == 2 else None
        loss_val = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0].meta.get("val")
        if not isinstance(loss_val, torch.Tensor) or loss_val.dim() != 0:
            shape = tuple(loss_val.shape) if isinstance(loss_val, torch.Tensor) else type(loss_val).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape} (or return a pair (loss, aux))")
        # A trainable parameter the loss never reads gets no gradient (torch.optim then skips it), but
        # the joint export insists on one: re-export with those parameters hidden from autograd.
        params = dict(wrapper.named_parameters())
        unused = [params[s.target] for s in ep.graph_signature.input_specs
                  if s.kind.name == "PARAMETER" and s.target in params and params[s.target].requires_grad
                  and not _placeholder(ep, s.arg.name).users]
        try:
            for p in unused:
                p.requires_grad_(False)
            if unused:
                ep = export()
            try:
                joint = _compat.export_joint(ep)
            except AssertionError as e:
                # A parameter the forward reads only through .detach() or under torch.no_grad() gets no
                # gradient either (torch.optim skips it): found on the forward program, hidden the same way.
                if "did not receive a gradient" not in str(e):
                    raise
                # (a frozen one is listed too: it stays as it is, and is not unfrozen by the finally below)
                no_grad = [params[t] for t in _compat.parameters_without_gradient(ep)
                           if t in params and params[t].requires_grad]
                if not no_grad:
                    raise
                unused += no_grad
                for p in no_grad:
                    p.requires_grad_(False)
                ep = export()
                joint = _compat.export_joint(ep)
            self._forward_program = ep
        except Exception as e:  # noqa: BLE001 - re-raised with the op and the torch version named
            hops = sorted({getattr(n.target, "__name__", str(n.target)) for n in ep.graph.nodes
                           if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)})
            if "marked as the loss, but it does not require gradients" in str(e):
                _model_checks.refuse_loss_without_gradient(self._groups, names, e)
            if "requires gradients, and received a mutation" in str(e):
                raise ValueError(
                    "the model or loss_fn writes in place into a tensor that requires grad (a parameter) during "
                    "forward, under no_grad too (an EMA teacher updated in forward); a pure step cannot express it: "
                    "a parameter is an input of the program, never written by it. Write the update with "
                    "torch.no_grad() outside the step (on the state between calls), or make the tensor a buffer") \
                    from e
            if hops:
                raise NotImplementedError(
                    f"torch {torch.__version__} cannot build the joint forward/backward graph through "
                    f"{', '.join(hops)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
            raise
        finally:
            for p in unused:
                p.requires_grad_(True)
        _compat.refuse_onednn_rnn_dtypes(joint, "make_train_step")
        # Parameters read inside a reentrant checkpoint: their gradients as sums of eager's separate additions
        grad_events = _reentrant_grads.split_events(joint)
        _reentrant_grads.strip_reads(self._forward_program)
        out_node = [n for n in joint.graph.nodes if n.op == "output"][0]
        out_args = out_node.args[0]
        spec = dict(loss_output=-1, buffer_mutations=[], grads=[], updates=self._updates, aux_outputs=[],
                    num_groups=len(self._groups), clip_max_norm=None if clip_grad_norm is None else float(clip_grad_norm),
                    clip_norm_type=2.0)
        for i, s in enumerate(joint.graph_signature.output_specs):
            kind = s.kind.name
            if kind == "LOSS_OUTPUT":
                spec["loss_output"] = i
            elif kind == "BUFFER_MUTATION":
                spec["buffer_mutations"].append((i, canonical.get(s.target, s.target)))
            elif kind == "GRADIENT_TO_PARAMETER":
                if isinstance(out_args[i], torch.fx.Node):
                    spec["grads"].append((i, s.target))
            elif kind == "USER_OUTPUT":
                spec["aux_outputs"].append(i)
            elif kind == "USER_INPUT_MUTATION":
                users = [a.arg.name for a in joint.graph_signature.input_specs if a.kind.name == "USER_INPUT"]
                paths = [torch.utils._pytree.keystr(k) for k, _ in
                         torch.utils._pytree.tree_flatten_with_path(tuple(self._example_batch))[0]]
                leaf = users.index(s.target) if s.target in users else None
                where = f"{leaf} (batch{paths[leaf]})" if leaf is not None and leaf < len(paths) else repr(s.target)
                raise ValueError(
                    f"the model or loss_fn writes in place into batch input {where}, which the pure step "
                    "never writes: eager changes the caller's batch tensor at every call (a batch used twice is "
                    "read changed the second time), the step would leave it as it is. Write out of place "
                    "(x = x * 2 instead of x.mul_(2)), or clone the input first")
            else:
                raise NotImplementedError(f"joint program output kind {kind} is not supported")
        with_grad = {t for _, t in spec["grads"]}
        self._with_grad = with_grad  # the parameters the step updates: write_back creates torch state for no other
        _model_checks.refuse_stale_grads([(self._strip(u["param"]), self._param_of[self._strip(u["param"])])
                                          for u in self._updates if u["param"] not in with_grad])
        if self._aux_spec is not None and (self.unroll > 1 or self.accumulate > 1):
            raise ValueError(f"loss_fn returns (loss, aux), which needs unroll=1 and accumulate=1 (got unroll="
                             f"{self.unroll}, accumulate={self.accumulate})")
        spec["accumulate"] = self.accumulate
        spec["grad_events"] = grad_events
        spec["data_parallel"] = self._dp
        # Tensor constants made in forward (torch.tensor(0.5)) are lifted by export; they ride in the state.
        self._constants = {s.target: joint.constants[s.target].detach().clone()
                           for s in joint.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"}
        # A tensor the loss function or forward captured (class weights) is the caller's own object:
        # eager follows an in-place change to it, the program reads the value it was built with.
        self._constant_sources = [(name, joint.constants[name], joint.constants[name]._version)
                                  for name in self._constants if not joint.constants[name].is_inference()]
        # A write through .data or .numpy() (m.scale.data.fill_(4)) leaves the version counter as it was: the
        # contents tell (a 64-bit digest at memory bandwidth; constants are small next to a step).
        self._constant_digests = _module_state.contents_digest([t for _, t, _ in self._constant_sources])
        if self._dp is not None:  # each rank's own captured tensors: neither broadcast nor compared
            distributed._RANK_OWN[self._id] = frozenset(self._constants)
        self.joint_graph = Graph.from_exported(joint)
        cgraph, self._state_names, self._num_user = _C.build_train_step(self.joint_graph._g, spec, self.unroll)
        self.graph = Graph(cgraph)
        self._inputs = [(n.state_name, n.role) for n in self.graph.nodes() if n.kind == "placeholder"]
        self._num_aux = len(spec["aux_outputs"])
        self._executor = _C.Executor(cgraph)
        if self._dp is not None:  # the executor issues the collectives in graph order
            distributed.check_collective_order(self.graph, None, process_group, "make_train_step", self._state_names)
        self._program = None
        self._fingerprint = None
        self._calls = 0
        self._buffer_names = [n for n, _ in model.named_buffers()]
        self._record_model()

    def _scheduled_scalars(self, schedulers) -> dict[int, list[str]]:
        """Per param group whose momentum a scheduler cycles, its kinds' schedulable scalars: the
        program takes them as inputs ("opt:<scalar>:group<g>"), fed per step from the replay as lr is."""
        cycled = _cycled_momentum(schedulers)
        fed: dict[int, list[str]] = {}
        for u in self._updates:
            opt = self._groups[u["group"]][0]
            if id(opt) in cycled:
                names = fed.setdefault(u["group"], [])
                schedulable = optim.descriptor(u["kind"])["schedulable"]
                # The "scheduled" overload takes all of them as inputs: each needs a place in the group.
                if all(n in optim.registration_for(opt).scheduled for n in schedulable):
                    names += [n for n in schedulable if n not in names]
        return {gi: names for gi, names in fed.items() if names}

    # ---- state
    @staticmethod
    def _slot_names(u: dict) -> list[str]:
        """The state entries of update ``u``'s optimizer slots, in the descriptor's order."""
        return [optim.state_name(u["param"], slot) for slot, _ in optim.descriptor(u["kind"])["slots"]]

    @staticmethod
    def _strip(name: str) -> str:
        return name[len(_MODEL_PREFIX):] if name.startswith(_MODEL_PREFIX) else name

    @property
    def draws_random(self) -> bool:
        """True when the program takes and returns an RNG state (the model uses dropout)."""
        return _RNG in self._state_names

    def init_state(self, seed: int | None = None) -> TrainState:
        """Copies parameters, buffers and optimizer state (if any) out of the model and optimizers.

        When the step draws random numbers, its RNG state is that of ``torch.manual_seed(seed)``, or
        a copy of the global generator's current state when ``seed`` is None: an eager loop started
        from the same generator state draws the same dropout masks.

        A data-parallel step (``process_group=``) starts every rank from rank 0's state, as
        DistributedDataParallel's constructor broadcasts rank 0's parameters and buffers: the
        program keeps the states identical only if they start so. It is then a collective: every
        rank calls it. The RNG state is not broadcast: each rank draws its dropout masks from its own
        generator state (``seed`` or the global generator on that rank), as each rank of an eager
        DDP loop does, so ``init_state(seed=base + rank)`` gives the ranks different masks.
        """
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"init_state: seed must be an int or None, got {type(seed).__name__}")
        state = self._fresh_state(seed, place_schedule=True)
        self._record_model()  # the model and optimizers as this state took them
        if self.process_group is not None:
            from .distributed import broadcast_state_

            broadcast_state_(state, self.process_group, self.shard_optimizer_state, own=set(self._constants))
        return state

    def _fresh_state(self, seed: int | None = None, place_schedule: bool = False) -> TrainState:
        """init_state on this rank alone (no broadcast): for shapes and layouts."""
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        opt: dict[str, torch.Tensor] = {}
        unstepped = []
        for u in self._updates:
            p = self._param_of[self._strip(u["param"])]
            owner, group = self._groups[u["group"]]
            initial = optim.registration_for(owner).initial_state(u["kind"], owner.state.get(p, {}), p, group)
            opt.update({optim.state_name(u["param"], slot): v for slot, v in initial.items()})
            if not owner.state.get(p):
                unstepped.append(u["param"])
        if self.shard_optimizer_state:  # ZeRO-1: this rank's shard of each slot shaped like its parameter
            from .distributed import _SHARDED_STEPS, shard_tensor

            _SHARDED_STEPS[self._id] = self.process_group
            for u in self._updates:
                p = self._param_of[self._strip(u["param"])]
                for k in self._slot_names(u):
                    if opt[k].shape == p.shape and opt[k].dim() > 0:
                        opt[k] = shard_tensor(opt[k], self._dp["world_size"], self._dp["rank"])
        # The schedule continues from where the user's schedulers stand now (eager steps, write_back).
        sched_epoch = 0
        if self._schedule is not None:
            sched_epoch = self._schedule.base
            if place_schedule:  # init_state: the schedule continues from where the user's scheduler stands
                self._schedule._placed = self._schedule.position()
                sched_epoch += self._schedule._placed
        lrs = self._schedule.at(sched_epoch) if self._schedule is not None else [float(g["lr"]) for _, g in self._groups]
        self._seen_lrs = self._group_lrs()
        lr = [torch.tensor(v, dtype=torch.float64) for v in lrs]
        if self._schedule is not None:
            opt.update(self._schedule.fed_tensors(sched_epoch))
        rng = None
        if self.draws_random:
            rng = torch.Generator().manual_seed(seed).get_state() if seed is not None else torch.get_rng_state()
        buffers = {_MODEL_PREFIX + k: v for k, v in buffers.items()}
        # Lifted tensor constants under the program's own names: "model.<...>" when made in forward,
        # unprefixed when the loss function made or captured them (cross_entropy(..., weight=w)).
        buffers.update({k: v.clone() for k, v in self._constants.items()})
        state = TrainState({_MODEL_PREFIX + k: v for k, v in params.items()}, buffers, opt, lr, self._id, rng,
                           sched_epoch, unstepped=tuple(unstepped))
        state.origin = f"init_state() of TrainStep {self._id}"
        state.fingerprint = self.fingerprint
        return state

    @property
    def fingerprint(self) -> str:
        """A hash of the program (its IR text, batch shapes left out, and flat input/output layout):
        equal for steps built the same way, in any process, also on batches of other shapes (a
        state does not depend on them: _program_text), and different when the model, the state's
        shapes or dtypes, optimizer options or passes differ, and with ZeRO-1 per rank."""
        if self._fingerprint is None:
            import hashlib

            from ._program_text import shape_free_text

            zero1 = [f"ZeRO-1 rank {self._dp['rank']} of {self._dp['world_size']}"] if self.shard_optimizer_state else []
            text = "\n".join([shape_free_text(self.graph), repr(self._inputs), repr(self._state_names),
                              repr(self._aux_spec)] + zero1)
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._fingerprint

    def load_state_dict(self, d) -> TrainState:
        """A TrainState of this step from ``state.state_dict()`` (or a TrainState, e.g. one
        ``torch.load`` returned), after checking the fingerprint and every entry's shape and dtype."""
        if isinstance(d, TrainState):
            d = d.state_dict()
        if not isinstance(d, dict):
            raise TypeError(f"load_state_dict expects a dict from state.state_dict(), got {type(d).__name__}")
        missing = [k for k in ("params", "buffers", "opt", "lr", "rng", "sched_epoch", "fingerprint") if k not in d]
        if missing:
            raise ValueError(f"load_state_dict: missing key(s) {missing}")
        if d["fingerprint"] != self.fingerprint:
            raise ValueError(f"load_state_dict: the state was made by a different program (fingerprint "
                             f"{d['fingerprint']!r}, this step's is {self.fingerprint!r}); the model, optimizer "
                             "options, state shapes or dtypes, or torch_ext version differ (batch shapes may differ)"
                             + ("; with shard_optimizer_state=True the fingerprint also names the rank, whose shard of "
                                "the optimizer state the state holds: load each rank's own"
                                if self.shard_optimizer_state else ""))
        ref = self._fresh_state()
        loaded = TrainState(dict(d["params"]), dict(d["buffers"]), dict(d["opt"]), list(d["lr"]), self._id, d["rng"],
                            int(d["sched_epoch"]), fingerprint=self.fingerprint, unstepped=tuple(d.get("unstepped", ())))
        for part in ("params", "buffers", "opt"):
            want, got = getattr(ref, part), getattr(loaded, part)
            if set(want) != set(got):
                raise ValueError(f"load_state_dict: {part} entries differ: missing {sorted(set(want) - set(got))}, "
                                 f"unexpected {sorted(set(got) - set(want))}")
            for k, v in want.items():
                t = got[k]
                if not isinstance(t, torch.Tensor) or t.shape != v.shape or t.dtype != v.dtype:
                    what = f"shape {tuple(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
                    raise ValueError(f"load_state_dict: {part}[{k!r}] should have shape {tuple(v.shape)} and dtype "
                                     f"{v.dtype}, got {what}")
        if len(loaded.lr) != len(ref.lr):
            raise ValueError(f"load_state_dict: expected {len(ref.lr)} lr values, got {len(loaded.lr)}")
        loaded.lr = [torch.as_tensor(v, dtype=torch.float64).clone() for v in loaded.lr]
        if (ref.rng is None) != (loaded.rng is None):
            raise ValueError("load_state_dict: rng state " + ("missing" if loaded.rng is None else "unexpected"))
        loaded.origin = f"load_state_dict() of TrainStep {self._id}"
        return loaded

    def _config(self) -> list:
        """What the program bakes in from the model and optimizers, as they stand: per optimizer, per
        param group, its parameters with their requires_grad flags and its options (lr aside: it is
        state, read by init_state and set by set_lr)."""
        groups = iter(range(len(self._groups)))
        return [[(tuple(group["params"]), tuple(p.requires_grad for p in group["params"]),
                  _baked_options(group, self._fed_where.get(next(groups, None), {})))
                 for group in opt.param_groups] for opt in self.optimizers]

    def _group_lrs(self) -> list[float]:
        return [float(g["lr"]) for _, g in self._groups]

    def _check_lr(self, state: TrainState) -> None:
        """Refuses an lr set on the optimizer (``group["lr"] = ...``, or a scheduler stepped outside the
        step) after this step last read it: the step takes the lr from the state, so eager training would
        follow the change and the step would silently not. An lr equal to the state's is accepted."""
        if self._schedule is not None:  # the lr follows the scheduler replay (_check_schedule)
            return
        now = self._group_lrs()
        if now == self._seen_lrs:
            return
        for gi, ((opt, _), lr, seen, have) in enumerate(zip(self._groups, now, self._seen_lrs, state.lr)):
            if lr != seen and lr != float(have):
                raise ValueError(f"{type(opt).__name__} param group {gi}: lr is {lr!r} on the optimizer now, {seen!r} "
                                 f"when this step last read it, and {float(have)!r} in {state.describe()}: the step "
                                 "trains with the state's lr, so the optimizer's would be silently ignored. Set it "
                                 "with state.set_lr(...), pass the scheduler as make_train_step(..., scheduler=), or "
                                 "start from a new init_state()")

    def _config_unchanged(self) -> bool:
        """The common case of _check_config, compared in place without building a snapshot (it runs on
        every call: rebuilding the snapshot cost 59 us per call at 150 parameters). A key added to a
        group after the build is not compared: every option the optimizer reads existed at the build
        (add_param_group fills in its defaults), and schedulers such as OneCycleLR add their own keys."""
        gi = 0
        for opt, built in zip(self.optimizers, self._built_config):
            groups = opt.param_groups
            if len(groups) != len(built):
                return False
            for group, (params, grads, options) in zip(groups, built):
                where, gi = self._fed_where.get(gi), gi + 1
                if where:
                    group = {**_baked_options(group, where), "params": group["params"]}
                now = group["params"]
                if len(now) != len(params):
                    return False
                for p, q, was in zip(now, params, grads):
                    if p is not q or p.requires_grad != was:
                        return False
                if not params:
                    continue  # the options of a group with no parameters update nothing (a scheduler cycles them)
                for key, value in options.items():
                    if not _same_option(value, group.get(key, _MISSING)):
                        return False
        return True

    def _check_config(self) -> None:
        """Refuses to run after a change eager training would follow but the program cannot: a
        parameter frozen or unfrozen, a param group added or removed, a baked-in option changed."""
        for name, tensor, version in self._constant_sources:
            if tensor._version != version:
                raise ValueError(f"the tensor captured as constant {name!r} (shape {tuple(tensor.shape)}) was changed in "
                                 "place after make_train_step; eager training would use its new value, the program "
                                 "bakes in the value it was built with: build a new step (make_train_step) after "
                                 "changing it")
        if self._constant_sources:
            now = _module_state.contents_digest([t for _, t, _ in self._constant_sources])
            for (name, tensor, _), was, is_ in zip(self._constant_sources, self._constant_digests, now):
                if was != is_:
                    raise ValueError(f"the tensor captured as constant {name!r} (shape {tuple(tensor.shape)}) was changed "
                                     "in place after make_train_step, through .data or .numpy() (its version counter did "
                                     "not move; its contents did); eager training would use its new value, the program "
                                     "bakes in the value it was built with: build a new step (make_train_step) after "
                                     "changing it")
        env = _env_reads.changed(self._env_reads)
        if env:
            raise ValueError(f"{_env_reads.message(env, 'the step was built')}: eager training would follow it; build "
                             "a new step (make_train_step) after changing it, or change it back")
        hook_change = self._hook_snapshot.message("the step was built")
        if hook_change:
            raise ValueError(f"{hook_change}: build a new step (make_train_step) after changing hooks, or change "
                             "them back")
        changed = _module_state.changed(self._module_snapshot) or _module_state.changed(self._read_snapshot)
        if changed:
            raise ValueError(f"{_module_state.change_message(changed, 'the step was built')}; eager training would follow the change, the program bakes in the value it was traced "
                             "with: build a new step (make_train_step) after changing it, or change it back")
        if self._config_unchanged():
            return
        now = self._config()
        names = {id(p): n for n, p in self._param_of.items()}
        for opt, built, current in zip(self.optimizers, self._built_config, now):
            title = type(opt).__name__
            if len(built) != len(current):
                raise ValueError(f"{title} has {len(current)} param groups now, {len(built)} when the step was built; "
                                 "the program updates the parameters it was built with: build a new step "
                                 "(make_train_step)")
            for gi, ((params, grads, options), (params_now, grads_now, options_now)) in enumerate(zip(built, current)):
                if len(params) != len(params_now) or any(a is not b for a, b in zip(params, params_now)):
                    raise ValueError(f"{title} param group {gi} holds other parameters than when the step was built; "
                                     "build a new step (make_train_step)")
                for p, was, is_now in zip(params, grads, grads_now):
                    if was != is_now:
                        how = "trainable now but was frozen" if is_now else "frozen now but was trainable"
                        raise ValueError(f"parameter '{names.get(id(p), '?')}' is {how} (requires_grad={was}) when the "
                                         "step was built, and the program bakes that in; build a new step "
                                         "(make_train_step) after freezing or unfreezing")
                for key, value in (options.items() if params else ()):
                    if not _same_option(value, options_now.get(key, _MISSING)):
                        raise ValueError(f"{title} param group {gi}: {key!r} is {options_now.get(key, 'gone')!r} now, "
                                         f"{value!r} when the step was built, and the program bakes it in; build a "
                                         "new step (make_train_step)")

    def _record_model(self) -> None:
        """Notes the model's parameters and buffers (their version counters) and the optimizers' state
        dicts as this step last read or wrote them: the build, ``init_state``, ``write_back``."""
        named = [*self.model.named_parameters(), *self.model.named_buffers()]
        self._model_tensors = [t for _, t in named]
        self._model_names = [n for n, _ in named]
        self._num_model_params = sum(1 for _ in self.model.parameters())
        self._model_versions = list(map(_VERSION, self._model_tensors))
        # A write the version counters miss: `p.data = t` gives the same Parameter new storage.
        self._model_ptrs = list(map(_DATA_PTR, self._model_tensors))
        self._model_signature = _C.write_signature(self._model_tensors)
        self._opt_states = [(opt.state, len(opt.state)) for opt in self.optimizers]

    def _check_model_unwritten(self, state: TrainState) -> None:
        """Refuses a call after the model's parameters or buffers were written in place to other values than
        ``state`` holds, or an optimizer's state replaced, since this step last read or wrote them
        (``nn.init.zeros_(layer.weight)``, ``model.load_state_dict(ckpt)``, ``opt.load_state_dict(ckpt)``, an eager
        ``opt.step()``, an eager forward that updates BatchNorm statistics): eager training continues from the
        written values, the step from its TrainState, so the write was silently ignored. A write that leaves the
        values the state holds (an eager loop run in lockstep with the step after ``write_back``) ignores
        nothing and is accepted. Version counters and storage addresses tell
        (``p.data = t`` moves the address), hashed in one C++ call; a write in place through
        ``.data`` moves neither and is not seen."""
        if (_C.write_signature(self._model_tensors) == self._model_signature
                and all(opt.state is st and len(opt.state) == n for opt, (st, n) in zip(self.optimizers, self._opt_states))):
            return
        versions = list(map(_VERSION, self._model_tensors))
        how = ("take a new state from the model and optimizers as they stand: state = step.init_state() (to keep the "
               "optimizer state and schedule of your TrainState with an edit, call step.write_back(state) before "
               "editing, then init_state()); or discard the edit with step.write_back(state)")
        ptrs = list(map(_DATA_PTR, self._model_tensors))
        changed = [i for i, (was, now, p0, p1) in enumerate(zip(self._model_versions, versions, self._model_ptrs, ptrs))
                   if was != now or p0 != p1]
        if changed:
            # Written to the values the state holds (an eager loop in lockstep) ignores nothing. The whole model is
            # compared: some writes move no version counter (BatchNorm's kernel writes its running statistics).
            differ = [i for i, t in enumerate(self._model_tensors) if not self._held_by(state, i, t)]
            if differ:
                i = next((j for j in changed if j in differ), changed[0])
                other = "" if i in differ else f" ({self._model_names[differ[0]]!r} among them)"
                how_written = (f"given new storage (.data = ...; data_ptr {self._model_ptrs[i]:#x} -> "
                               f"{ptrs[i]:#x})" if self._model_ptrs[i] != ptrs[i] else
                               f"written in place (version {self._model_versions[i]} -> {versions[i]})")
                raise ValueError(
                    f"the model's {'parameter' if i < self._num_model_params else 'buffer'} {self._model_names[i]!r} "
                    f"was {how_written} after this step last "
                    "read or wrote the model (the build, init_state or write_back), and the model holds other values "
                    f"than the TrainState's{other}: the step trains the parameters and buffers in its TrainState, "
                    "eager training would continue from the written values, so the write would be silently ignored. "
                    f"To train from it, {how}")
        for opt, (st, n) in zip(self.optimizers, self._opt_states):
            if (opt.state is not st or len(opt.state) != n) and not self._opt_state_held(opt, state):
                raise ValueError(f"{type(opt).__name__}'s state was replaced or changed (opt.load_state_dict, "
                                 f"opt.state.clear(); {len(opt.state)} entries now, {n} then) after this step last "
                                 "read or wrote it (the build, init_state or write_back): the step trains with the "
                                 "optimizer state in its TrainState, so the change would be silently ignored. To "
                                 f"train from it, {how}")
        self._model_versions = versions
        self._model_ptrs = ptrs
        self._model_signature = _C.write_signature(self._model_tensors)
        self._opt_states = [(opt.state, len(opt.state)) for opt in self.optimizers]

    def _held_by(self, state: TrainState, i: int, t: torch.Tensor) -> bool:
        """Whether the model's i-th tensor (parameters, then buffers) equals what ``state`` holds for it."""
        held = (state.params if i < self._num_model_params else state.buffers).get(_MODEL_PREFIX + self._model_names[i])
        return (held is not None and held.shape == t.shape and held.dtype == t.dtype and held.device == t.device
                and torch.equal(held, t))

    def _opt_state_held(self, opt, state: TrainState) -> bool:
        """Whether ``opt``'s state, read as ``init_state`` reads it, equals what ``state`` holds."""
        for u in self._updates:
            owner, group = self._groups[u["group"]]
            if owner is not opt:
                continue
            p = self._param_of[self._strip(u["param"])]
            initial = optim.registration_for(owner).initial_state(u["kind"], owner.state.get(p, {}), p, group)
            for slot, v in initial.items():
                held = state.opt.get(optim.state_name(u["param"], slot))
                if held is None or held.shape != v.shape or held.dtype != v.dtype or not torch.equal(held, v):
                    return False
        return True

    def _check_state(self, state) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a TrainState from step.init_state(), got {type(state).__name__}")
        if state.consumed_by is not None:
            # As JAX refuses a deleted (donated) buffer: the tensors now hold the next step's values.
            raise ValueError(f"{state.describe()} was donated to {state.consumed_by} and its tensors were "
                             "updated in place; use the state that call returned (or compile(donate=False))")
        if state.step_id != self._id:
            raise ValueError("this TrainState was made by another TrainStep (step_id "
                             f"{state.step_id}, this step is {self._id}); use this step's init_state(), or "
                             "step.load_state_dict(state) for a saved one")
        if state.fingerprint and state.fingerprint != self.fingerprint:
            # step_id counts steps per process: a state pickled by another process (torch.save of a
            # TrainState, torch.load on every rank) can carry this step's id but another program's
            # layout. With ZeRO-1 the fingerprint names the rank: rank 0's shards on rank 1 would
            # update rank 1's slice with rank 0's optimizer state.
            hint = (" (with shard_optimizer_state=True each rank's state holds that rank's shard of the optimizer "
                    "state: save and load every rank's own state, or write_back and save the model and optimizer)"
                    if self.shard_optimizer_state else "")
            raise ValueError(f"{state.describe()} was made by a different program (fingerprint {state.fingerprint!r}, "
                             f"this step's is {self.fingerprint!r}){hint}")
        # Entries are looked up by name: a missing one would surface as a bare KeyError, and an extra
        # one (a renamed or misspelt key) would be silently ignored while the real entry is missing.
        expected = self.__dict__.get("_entry_names")  # fixed by the program: computed once, not per call
        if expected is None:
            expected = self._entry_names = {name for name, role in self._inputs if role != "input" and name != _RNG
                                            and (optim.parse_state_name(name) or ("",))[0] != "lr"}
        present = set(state.params) | set(state.buffers) | set(state.opt)
        if present != expected:
            missing, extra = sorted(expected - present), sorted(present - expected)
            raise ValueError(f"{state.describe()} does not match this step's state entries: "
                             f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                             f"unknown {extra[:5]}{' ...' if len(extra) > 5 else ''}")

    def _check_schedule(self, state: TrainState) -> None:
        """With scheduler=, the lr a call trains with must be the scheduler's at the state's epoch. A state
        whose lr was set by hand (set_lr) is refused: the next lr would be the scheduler's replay, whereas
        an eager scheduler may continue from the hand-set lr (StepLR, ExponentialLR: chainable) or
        override it (LambdaLR), so no one answer matches eager training."""
        if self._schedule is not None:
            self._schedule.check_state(state, "this step")

    def flat_inputs(self, state: TrainState, *batch) -> list:
        """The program's flat positional inputs: state entries, then the batch (or the batches when
        unrolled, or the micro-batches when accumulating, one after the other)."""
        self._check_call(state)
        return self._checked_inputs(state, self._check_batch(batch))

    def _check_call(self, state: TrainState) -> None:
        """What every call checks before its batch: the state, its schedule, the optimizers' options and lr."""
        self._check_state(state)
        self._check_schedule(state)
        self._check_config()
        self._check_model_unwritten(state)
        self._check_lr(state)

    def _checked_inputs(self, state: TrainState, flat_batch: list) -> list:
        for i, (t, ex) in enumerate(zip(flat_batch, self._example_leaves)):
            if t.shape != ex.shape or t.dtype != ex.dtype:
                hint = "" if self.batch_shapes == "cache" else "; build the step with batch_shapes='cache' to accept it"
                raise ValueError(f"batch[{i}]: expected shape {tuple(ex.shape)} and dtype {ex.dtype} as in the "
                                 f"example batch, got shape {tuple(t.shape)} and dtype {t.dtype}{hint}")
        return self._gather(state, [in_layout_of(t, ex, f"batch[{i}]")
                                    for i, (t, ex) in enumerate(zip(flat_batch, self._example_leaves))])

    def _check_batch(self, batch) -> list:
        flat_batch = batch_leaves(batch, self._call_spec, self.batch_paths)
        n = self.unroll * self.accumulate
        if len(flat_batch) != self._num_user * self.unroll:
            what = "micro-batches" if self.accumulate > 1 else "batches"
            raise ValueError(f"expected {self._num_user * self.unroll} batch tensors"
                             f"{f' ({n} {what})' if n > 1 else ''}, got {len(flat_batch)}")
        for i, t in enumerate(flat_batch):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"batch[{i}]: expected a tensor, got {type(t).__name__}")
        return flat_batch

    def _gather(self, state: TrainState, flat_batch: list) -> list:
        it = iter(flat_batch)
        # Data-parallel: the tensors the model or loss_fn captured are this rank's own, as eager DDP
        # reads them; a state saved on rank 0 and loaded on every rank holds rank 0's copies.
        own = self._constants if self._dp is not None else {}
        # A state entry in other strides than traced (the channels-last state of an AOTInductor package)
        # is the executor's to copy into the traced ones (runtime::to_traced_layout, after its input
        # check names a wrong shape or dtype): no per-call Python loop over the entries.
        return [next(it) if role == "input" else own[name] if name in own else state.lookup(name)
                for name, role in self._inputs]

    def _agree_on_builds(self, building: bool, program: "TrainStep | None" = None) -> None:
        """batch_shapes='cache' under process_group= (a collective on every call): building a program
        checks its collective order with every rank (check_collective_order), so when any rank meets
        new batch shapes the others take part in that check with the program they run now. Without
        it, a rank building a program while the others train paired its check with their gradient
        all-reduces: the ranks hung until gloo's timeout (30 minutes)."""
        if self.batch_shapes != "cache" or self.process_group is None:
            return
        from . import distributed

        builders = distributed.ranks_where(building, self.process_group)
        if builders and not building:
            distributed.check_collective_order(program.graph, None, self.process_group,
                                               f"make_train_step (rank {builders[0]} met new batch shapes)",
                                               program._state_names)

    def _program_for(self, flat_batch: list) -> "TrainStep":
        """This step, or (batch_shapes='cache') the step built for these batch shapes."""
        if self.batch_shapes != "cache" or all(t.shape == ex.shape for t, ex in zip(flat_batch, self._example_leaves)):
            self._agree_on_builds(False, self)
            return self
        for i, (t, ex) in enumerate(zip(flat_batch, self._example_leaves)):
            if t.dtype != ex.dtype or t.dim() != ex.dim():
                raise ValueError(f"batch[{i}]: expected dtype {ex.dtype} and rank {ex.dim()} as in the example batch, "
                                 f"got dtype {t.dtype} and rank {t.dim()}")
        per_step = len(flat_batch) // (self.unroll * self.accumulate)
        shapes = [tuple(t.shape) for t in flat_batch]
        if any(shapes[i] != shapes[i % per_step] for i in range(len(shapes))):
            raise ValueError(f"batch shapes {shapes}: the batches of one unrolled/accumulated call must share shapes")
        key = tuple(shapes[:per_step])
        variant = self._variants.get(key)
        if variant is None:
            self._agree_on_builds(True)
            example = pytree.tree_unflatten(list(flat_batch[:per_step]), self._batch_spec)
            variant = TrainStep(self.model, self.optimizers, self.loss_fn, example, self.clip_grad_norm, self.unroll,
                                (), self.accumulate, process_group=self.process_group,
                                shard_optimizer_state=self.shard_optimizer_state, fed=self._fed)
            if variant._state_names != self._state_names:
                # A Python branch on the batch size (a parameter used by full batches only): its
                # optimizer state would be in one program and not the other.
                a, b = set(self._state_names), set(variant._state_names)
                raise ValueError(f"batch shapes {key}: the program built for them has other state entries than the "
                                 f"example's (state entries differ: only in the example's {sorted(a - b)[:4]}, only "
                                 f"in this one's {sorted(b - a)[:4]}); the forward or loss_fn uses other parameters "
                                 "at this batch size (a branch on x.shape?); keep the parameters used at every size, "
                                 "or pad the batch to the example's shape")
            if variant._aux_spec != self._aux_spec:
                raise ValueError(f"batch shapes {key}: loss_fn returns other aux outputs at this batch size "
                                 f"({variant._aux_spec} vs {self._aux_spec})")
            self._variants[key] = variant
        else:
            self._agree_on_builds(False, variant)
        return variant

    def cache_info(self) -> dict:
        """Which batch shapes have a program: the example's, and with batch_shapes='cache' one per new shape."""
        per_step = len(self._example_leaves) // (self.unroll * self.accumulate)
        shapes = [tuple(tuple(t.shape) for t in self._example_leaves[:per_step])] + list(self._variants)
        return {"batch_shapes": self.batch_shapes, "programs": len(shapes), "shapes": shapes}

    def __call__(self, state: TrainState, *batch, skip_nonfinite: bool = False):
        """``loss, new_state = step(state, *batch)``; ``loss, new_state, aux`` when loss_fn returns (loss, aux)."""
        self._check_call(state)
        flat_batch = self._check_batch(batch)
        program = self._program_for(flat_batch)
        if program is self:
            inputs = self._checked_inputs(state, flat_batch)
        else:  # same state layout, its own program and input order
            inputs = program._gather(state, flat_batch)
        return self._finish(state, program._executor.run(inputs), skip_nonfinite=skip_nonfinite)

    def _finish(self, state: TrainState, outs: list, *, skip_nonfinite: bool = False, donated_to: str | None = None):
        """Builds the call's result from the program's flat outputs (shared by every runtime)."""
        self._calls += 1
        n = len(self._state_names)
        loss = outs[0]
        new_state = state.replace(dict(zip(self._state_names, outs[1:1 + n])))
        new_state.origin = f"output of call {self._calls} of TrainStep {self._id}"
        if self._schedule is not None:
            self._schedule.advance(new_state, state.sched_epoch + self.unroll)
        if donated_to is not None:
            state.consumed_by = f"{donated_to} (call {self._calls} of TrainStep {self._id})"
        result = (loss, new_state)
        if self._aux_spec is not None:
            result = (loss, new_state, pytree.tree_unflatten(list(outs[1 + n:]), self._aux_spec))
        self.last_nonfinite = not bool(torch.isfinite(loss).all())
        if skip_nonfinite and donated_to is None and self.process_group is not None:
            # Each rank's loss is its own, but the gradients were averaged: one rank's non-finite loss
            # makes every rank's update non-finite. Skip on every rank or on none (a collective).
            from .distributed import ranks_where

            anywhere = ranks_where(self.last_nonfinite, self.process_group)
            if anywhere and not self.last_nonfinite:
                self.last_nonfinite = True
                warnings.warn(f"non-finite loss on rank {anywhere[0]} (this rank's: {loss.tolist()}): the averaged "
                              "gradients are non-finite on every rank; step skipped, state kept", RuntimeWarning,
                              stacklevel=3)
                return (loss, state) + result[2:]
        if self.last_nonfinite:
            if skip_nonfinite and donated_to is None:
                warnings.warn(f"non-finite loss {loss.tolist()}: step skipped, state kept", RuntimeWarning, stacklevel=3)
                return (loss, state) + result[2:]
            warnings.warn(f"non-finite loss {loss.tolist()}: propagated into the new state "
                          "(pass skip_nonfinite=True to keep the old state)", RuntimeWarning, stacklevel=3)
        return result

    def write_back(self, state: TrainState) -> None:
        """Loads ``state`` into the model and the optimizers, so eager training can continue."""
        self._check_state(state)
        if self.shard_optimizer_state:  # gather every rank's shard first (a collective)
            from .distributed import unshard_tensor

            opt = dict(state.opt)
            for u in self._updates:
                p = self._param_of[self._strip(u["param"])]
                for k in self._slot_names(u):
                    if opt[k].dim() > 0:  # every non-scalar slot is a shard (step counts are scalars)
                        opt[k] = unshard_tensor(opt[k], p, self.process_group)
            state = TrainState(state.params, state.buffers, opt, state.lr, state.step_id, state.rng, state.sched_epoch,
                               fingerprint=state.fingerprint, unstepped=state.unstepped)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(state.params[_MODEL_PREFIX + n])
            for n, b in self.model.named_buffers():
                b.copy_(state.buffers[_MODEL_PREFIX + n])
        for (opt, group), lr in zip(self._groups, state.lr):
            if isinstance(group["lr"], torch.Tensor):  # a tensor lr stays the user's tensor, as schedulers keep it
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = float(lr)
        self._seen_lrs = self._group_lrs()
        if self._schedule is not None:
            self._schedule.write_back(state.sched_epoch)
        if state.rng is not None:  # eager continues the same random stream
            torch.set_rng_state(state.rng)
        for u in self._updates:
            p = self._param_of[self._strip(u["param"])]
            opt, group = self._groups[u["group"]]
            if u["param"] in state.unstepped:
                # Not updated yet (a state straight from init_state, taken when eager held no state for it): eager
                # has none. A kind whose slots count no steps (Lion's exp_avg, Muon's momentum_buffer) cannot tell
                # so from its values; an entry a later write_back left goes, as the state holds none.
                opt.state.pop(p, None)
                continue
            if u["param"] not in self._with_grad and not opt.state.get(p):
                continue  # never updated by the step, as torch.optim skips a .grad of None: eager has no state for it
            slots = [slot for slot, _ in optim.descriptor(u["kind"])["slots"]]
            values = {slot: state.opt[optim.state_name(u["param"], slot)] for slot in slots}
            entries = optim.registration_for(opt).torch_state(u["kind"], values, group)
            if entries:  # opt.state is a defaultdict: touch it only to store something
                opt.state[p].update(entries)
        self._record_model()  # the model and optimizers now hold this state

    def lr_schedule(self, state: TrainState, calls: int) -> list[list[float]]:
        """The lr of every param group (the state's ``lr`` order) for each of the next ``calls`` calls
        from ``state``: what this step feeds its program, for a runner with no Python (the C++
        runner's ``--lrs``: ``torch.save(step.lr_schedule(state, n), "lrs.pt")``). Without a
        scheduler, the state's lr every call."""
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise ValueError(f"lr_schedule: calls must be an int >= 0, got {calls!r}")
        self._check_state(state)
        if self._schedule is None:
            return [[float(t) for t in state.lr] for _ in range(calls)]
        self._schedule.check_state(state, "lr_schedule")
        return [list(self._schedule.at(state.sched_epoch + i * self.unroll)) for i in range(calls)]

    def input_schedule(self, state: TrainState, calls: int) -> list[dict[str, float]]:
        """For each of the next ``calls`` calls from ``state``, the value of every input the step sets
        per call, by input name: each group's lr ("opt:lr:group<k>") and, when a scheduler cycles
        momentum, the scheduled hyperparameters ("opt:momentum:group<k>", "opt:beta1:group<k>"). The
        C++ runner's ``--lrs`` takes it (``torch.save(step.input_schedule(state, n), "lrs.pt")``)."""
        lrs = self.lr_schedule(state, calls)
        out = []
        for i, row in enumerate(lrs):
            values = {optim.lr_name(k): v for k, v in enumerate(row)}
            if self._schedule is not None:
                values.update(self._schedule.fed_at(state.sched_epoch + i * self.unroll))
            out.append(values)
        return out

    def to_onnx(self, path: str) -> str:
        """Exports this pure step, the update included, to ONNX (see torch_ext.onnx); a plain
        onnxruntime session then trains with ``torch_ext.onnx.load_onnx_step(path)``."""
        if self.process_group is not None:
            raise ValueError("to_onnx: this step is data-parallel (process_group=): ONNX has no collectives to "
                             "all-reduce its gradients; export a step built without process_group")
        from .onnx import to_onnx

        return to_onnx(self, path)

    def compile(self, plan: bool = True, donate: bool = True, memory_budget: int | float | None = None):
        """The step scheduled for the lowest peak and run inside one arena (see torch_ext.memory.PlannedStep).
        ``memory_budget`` (bytes, or a float fraction of the measured eager peak) recomputes forward
        activations in the backward until the planned peak (``.peak_bytes``) fits, else ValueError."""
        for name, value in (("plan", plan), ("donate", donate)):
            if not isinstance(value, bool):  # donate="no" is truthy: it would consume the caller's state
                raise TypeError(f"compile: {name} must be True or False, got {value!r}")
        from .memory import PlannedStep

        return PlannedStep(self, plan=plan, donate=donate, memory_budget=memory_budget)

    # ---- deployment
    @property
    def state_names(self) -> list[str]:
        """State entries in the order of the program's first inputs and of outputs 1.."""
        return list(self._state_names)

    @property
    def program(self) -> torch.export.ExportedProgram:
        """The pure step as an ExportedProgram over flat inputs (state entries, then the batch)."""
        if self._program is None:
            gm = self.graph.to_graph_module()
            fresh = self._fresh_state()
            example = self.flat_inputs(fresh, *(self._example_batch * self.unroll * self.accumulate))
            # An expanded example batch (stride 0) is traced dense: its strides are what AOTInductor
            # compiles the input for, and every later batch is given dense (in_layout_of); compiled
            # for stride 0, the package read each call's batch as copies of its first row, silently.
            from torch._prims_common import is_non_overlapping_and_dense

            example = [t.contiguous() if isinstance(t, torch.Tensor) and not is_non_overlapping_and_dense(t) else t
                       for t in example]
            # The example batch repeated per micro-batch or unrolled call: distinct_inputs keeps export
            # from reading the copies as one input (every micro-batch would read the last one).
            # Batch norm's results traced in its CPU kernels' layout, as the step's graph has them (a retrace with
            # the meta kernels' layout disagreed with the graph's and a loaded program failed verification).
            with _trace_patches.patched("eager_batch_norm_layouts"):
                self._program = torch.export.export(gm, _compat.distinct_inputs(tuple(example)), strict=False)
            # The flat layout rides in the artifact: torch.export.save serializes meta["custom"].
            from .deploy import LAYOUT_KEY, example_digest, layout_of

            layout = layout_of(self)
            # The example inputs' scheduler epoch, which no input carries (LoadedStep.example_state).
            layout["example_sched_epoch"] = {"epoch": fresh.sched_epoch,
                                             "digest": example_digest(layout["inputs"], list(example))}
            self._program.graph_module.meta.setdefault("custom", {})[LAYOUT_KEY] = json.dumps(layout)
        return self._program

    def to_aoti(self, path: str, donate: bool = False, channels_last: bool | str = "auto",
                conv_taps: bool = True) -> str:
        """Compiles ``program`` with AOTInductor into the package ``path`` (a minute or more), with the
        flat layout in its metadata; ``torch_ext.load_step(path)`` runs it on TrainStates. The
        optimizer updates are compiled from their ATen form (torch_ext.optim.aten_updates), fused
        with the rest, so the package agrees with the executor to float32 rounding, not bitwise; not a
        parameter whose gradient is rounding noise (a Linear bias right before a training-mode BatchNorm:
        0.012-0.027 off after a few AdamW steps at lr 1e-2, Adam scaling the noise to a full step).
        Dropout draws a counter-based hash stream (vectorised, fused with the mask), keyed by one
        draw from the state's ``rng`` (torch_ext/_aoti.py): pure, but another stream than the executor's.

        ``donate=True`` compiles a package that writes the new state into the input state's tensors
        (AOTInductor stores each updated entry in place, after its last read), as
        ``compile(donate=True)`` does: no state-sized output is allocated per call, and the state
        passed in is consumed (reusing it raises). Its layout lists those entries under ``donated``
        and only the loss and aux under ``outputs``.

        ``channels_last`` picks which convolution weights (and their optimizer slots) the package is
        compiled to hold channels-last (same values; the layout's ``input_strides`` records every
        input's), so ATen runs those convolutions channels-last: ``"auto"`` (the default) those whose
        input has at least 64 positions (H * W, _aoti.CHANNELS_LAST_MIN_POSITIONS), ``True`` every
        4-D convolution weight, ``False`` none. A model without convolutions compiles the same either
        way. Under "auto" a smaller convolution reads a contiguous copy of its input, so it runs
        contiguous, where oneDNN is faster on this CPU and ATen's backward copies no weight gradient.
        ResNet-18 (one thread, batch 16, 64x64, profiled): the convolution calls take 79 ms a step
        under "auto", 94 ms all contiguous (False), 96 ms all channels-last (True; 5 ms of it weight
        gradient copies). ``load_step`` copies a state given in other strides (``init_state()``'s
        contiguous one) into these on its first call; the new state keeps them. The executor takes
        such a state as a copy in the strides it was traced with (bit-exact with the eager model)."""
        from .deploy import LAYOUT_KEY, aoti_metadata

        if not isinstance(donate, bool):
            raise TypeError(f"to_aoti: donate must be a bool, got {type(donate).__name__} {donate!r}")
        if not isinstance(conv_taps, bool):
            raise TypeError(f"to_aoti: conv_taps must be a bool, got {type(conv_taps).__name__} {conv_taps!r}")
        if not (isinstance(channels_last, bool) or (isinstance(channels_last, str) and channels_last == "auto")):
            raise TypeError(f"to_aoti: channels_last must be a bool or 'auto', got {type(channels_last).__name__} "
                            f"{channels_last!r}")
        from ._aoti import (CHANNELS_LAST_MIN_POSITIONS, aoti_decompositions, conv_weight_entries,
                            fuse_cross_entropy_program, has_higher_order_ops, with_input_layout, with_slots)

        layout_json = self.program.graph_module.meta["custom"][LAYOUT_KEY]
        # The update ops as ATen math and dropout as a counter-based hash keyed from the state,
        # which Inductor fuses (opaque C++ kernels otherwise; see torch_ext/_aoti.py).
        # (for_aot_inductor last: the retrace of run_decompositions turns its reshapes back into views.)
        # Batch norm's results retraced in its CPU kernels' layout, as the program declares them (with the meta
        # kernels' layout the compiled graph took another layout than the executor's after a transposed
        # BatchNorm1d, or the program's, whichever fake tensors' cache held).
        with _trace_patches.patched("eager_batch_norm_layouts"):
            decomposed = self.program.run_decompositions(aoti_decompositions())
        program = _compat.for_aot_inductor(decomposed)
        # Cross-entropy as pointwise math over the logits and their logsumexp (torch_ext/_aoti.py).
        program = fuse_cross_entropy_program(program)
        layout = json.loads(layout_json)
        tap_major = set()
        if conv_taps:
            from ._conv_taps import conv_to_tap_gemms_program

            # Convolutions smaller than their kernel as tap GEMMs, their weights held tap-major
            # (torch_ext/_conv_taps.py).
            program, tap_weights = conv_to_tap_gemms_program(program, layout["inputs"])
            tap_major = set(with_slots(program, layout["inputs"], set(tap_weights)))
        min_positions = 0 if channels_last is True else CHANNELS_LAST_MIN_POSITIONS
        chosen = set(conv_weight_entries(program, layout["inputs"], min_positions)) if channels_last else set()
        if chosen and has_higher_order_ops(program):
            # with_input_layout infers every value's strides again op by op; a subgraph call (torch.cond,
            # a while loop) would need that inside its subgraphs too.
            if channels_last is True:
                raise NotImplementedError("to_aoti(channels_last=True): the step calls subgraphs (torch.cond or "
                                          "another higher-order op), whose strides are not inferred again; use "
                                          "channels_last=False")
            chosen = set()
        if tap_major and has_higher_order_ops(program):
            tap_major = set()  # (the same stride inference; the rewritten convolutions still run, contiguous)
        if chosen or tap_major:
            # The strides the package is compiled for, per input (contiguous without them): load_step
            # copies an entry given in others into them (AOTInductor would index it with these unchecked).
            program, layout["input_strides"] = with_input_layout(program, layout["inputs"], chosen - tap_major,
                                                                 tap_major)
        if "input_strides" not in layout:
            # AOTInductor compiles for the strides of the placeholders, which keep the example batch's:
            # a channels-last (or transposed) example batch is read in those strides, unchecked, and
            # load_step and the C++ runner fed it contiguous, training silently on permuted values.
            # Recorded whenever an input is not contiguous, so that both copy a batch into them.
            values = [n.meta["val"] for n in program.graph_module.graph.nodes if n.op == "placeholder"]
            if len(values) == len(layout["inputs"]) and not all(v.is_contiguous() for v in values):
                layout["input_strides"] = [list(v.stride()) for v in values]
        layout_json = json.dumps(layout)
        if donate:
            position = {name: i for i, name in enumerate(layout["inputs"])}
            donated = {1 + j: position[name] for j, name in enumerate(layout["state_names"]) if name in position}
            program = _compat.donating_program(program, donated)
            layout["donated"] = [layout["state_names"][k - 1] for k in sorted(donated)]
            layout["outputs"] = [o for k, o in enumerate(layout["outputs"]) if k not in donated]
            layout_json = json.dumps(layout)
        # No Inductor layout optimisation: it converted contiguous weights and their gradients every
        # call (ResNet-18, one thread: 3.61 steps/s with it, 4.32 without; not measured with
        # channels_last=True).
        configs = {"aot_inductor.metadata": aoti_metadata(layout_json), "layout_optimization": False}
        # Inductor's max-pool backward is a scalar gather over every input position, ATen's a
        # scatter over the outputs: ResNet-18's (16x64x32x32, 3x3 stride 2) takes 5.2 ms there
        # against 0.24-0.39 ms in ATen (one thread), so the package calls ATen's.
        with _trace_patches.patched(*_trace_patches.AOTI_COMPILE):
            try:
                return torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
            except AssertionError as e:
                # torch 2.9's C++ wrapper asserts on a complex Python scalar it makes itself (complex zeros in
                # the lowering of the backward of torch.fft's ops): a bare AssertionError from Inductor.
                complex_ops = sorted({str(n.target) for n in program.graph.nodes if n.op == "call_function"
                                      and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()})
                if not complex_ops:
                    raise
                raise NotImplementedError(
                    f"to_aoti: torch {torch.__version__}'s AOTInductor failed on this step's complex-valued ops "
                    f"({', '.join(complex_ops[:6])}{' ...' if len(complex_ops) > 6 else ''}; torch.fft and its "
                    "backward): run the step with the executor (step(state, *batch), step.compile()) or save it as "
                    "a .pt2 (torch_ext.load_step runs it)") from e


def make_train_step(model: torch.nn.Module, optimizer, loss_fn: Callable, example_batch: Sequence, *,
                    clip_grad_norm: float | None = None, unroll: int = 1, scheduler=None,
                    accumulate: int = 1, batch_shapes: str = "fixed", process_group=None,
                    shard_optimizer_state: bool = False) -> TrainStep:
    """Builds the pure step ``(loss, new_state) = step(state, *batch)`` for ``model`` and ``optimizer``.

    ``loss_fn(model, *batch)`` returns a scalar. ``optimizer`` is a torch.optim optimizer (SGD,
    Adam, AdamW, Muon, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, Rprop, Adafactor, torch_ext.optim.Lion:
    every class registered in torch_ext.optim; foreach=True accepted except for Muon, whose update has no foreach path,
    and NAdam, RAdam and Adafactor, whose foreach path rounds differently) or a
    list of them over disjoint parameters; it is read as it stands, param
    groups and existing state included. ``clip_grad_norm`` clips the global 2-norm as
    ``torch.nn.utils.clip_grad_norm_``; ``unroll=N`` makes one graph of N steps over N batches.

    ``loss_fn`` may return ``(loss, aux)`` with aux any pytree of tensors (logits, accuracy); the
    step then returns ``(loss, new_state, aux)``. ``scheduler`` is a torch.optim.lr_scheduler (or a
    list, one per optimizer) stepped once per call, as ``opt.step(); sched.step()`` would: the state
    counts the scheduler steps and carries the next lr (a state whose lr was set by hand with
    ``set_lr`` is refused: eager schedulers disagree on what follows a hand-set lr). Dropout draws from an RNG state carried in
    the state (``init_state(seed=...)``), so the step stays a pure function.

    ``accumulate=N`` takes N micro-batches per call (``step(state, *mb1, *mb2, ...)``) and does one
    update with their summed gradients, as the eager loop ``(loss_fn(model, *mb) / N).backward()``
    over the micro-batches followed by one ``opt.step()``; the loss returned is the N micro-batch
    losses. Clipping applies to the summed gradients.

    ``batch_shapes="cache"`` lets ``step(...)`` take batches whose shapes differ from the example's
    (a last partial batch): the first call with new shapes builds and caches a program for them,
    over the same state (``step.cache_info()`` lists them). With "fixed" (the default) another shape
    is refused. The planned arena (``compile``) and ``program`` serve the example's shapes.

    ``process_group=pg`` (a torch.distributed group, e.g. ``torch.distributed.group.WORLD``) makes
    a data-parallel step: each rank calls it on its own batch, and the program averages the
    gradients across the group inside the graph (functional all_reduce, as DistributedDataParallel)
    and keeps rank 0's buffers, so the states stay identical on every rank
    (``torch_ext.distributed.assert_states_in_sync``). ``shard_optimizer_state=True`` adds ZeRO-1:
    each rank keeps and updates only its shard of the optimizer state (see torch_ext.distributed)
    and the new parameters are all-gathered inside the same graph.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    model = _compat.uncompiled(model)  # torch.compile(model): the step compiles the model itself
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("optimizer must be a torch.optim.Optimizer or a list of them")
    if not isinstance(example_batch, (list, tuple)):
        raise TypeError("example_batch must be a tuple of the loss_fn's batch arguments")
    for name, value in (("unroll", unroll), ("accumulate", accumulate)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if batch_shapes not in ("fixed", "cache"):
        raise ValueError(f"batch_shapes must be 'fixed' or 'cache', got {batch_shapes!r}")
    if unroll > 1 and accumulate > 1:
        raise ValueError(f"unroll ({unroll}) and accumulate ({accumulate}) cannot be combined")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float))):
        raise TypeError(f"clip_grad_norm must be a number or None, got {type(clip_grad_norm).__name__} "
                        f"{clip_grad_norm!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be positive, got {clip_grad_norm}")
    schedulers = [] if scheduler is None else list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
    return TrainStep(model, optimizers, loss_fn, example_batch, clip_grad_norm, unroll, schedulers, accumulate,
                     batch_shapes, process_group=process_group, shard_optimizer_state=shard_optimizer_state)
