"""Data-parallel pure steps over torch.distributed (issue 14).

``make_train_step(..., process_group=pg)`` builds, on each rank, a program whose gradients are
averaged inside the graph with functional collectives (csrc/passes/all_reduce_grads.h), as
DistributedDataParallel averages them; ``shard_optimizer_state=True`` adds ZeRO-1
(csrc/passes/shard_optimizer_state.h): each rank keeps and updates one shard of the optimizer state
and the parameters are all-gathered inside the same graph.

Shard layout (flatten-and-slice per parameter): a parameter of N elements is flattened and
zero-padded to S * world elements, S = ceil(N / world); rank r owns elements [r*S, (r+1)*S). Each
optimizer-state slot of the parameter's shape is stored as that 1-D shard; scalar slots (the step
count) stay whole on every rank.
"""
from __future__ import annotations

import hashlib

import torch

_SHARDED_STEPS: dict[int, object] = {}  # TrainStep id -> process group, for steps with ZeRO-1 state
# TrainStep id -> the state entries each rank keeps its own: tensors the model or loss_fn captured
# or made (lifted constants, kept with the buffers), which eager DDP never broadcasts either.
_RANK_OWN: dict[int, frozenset] = {}


def data_parallel_spec(process_group, shard_optimizer_state) -> dict | None:
    """The C++ spec's data_parallel entry, after checking the arguments (None: one process)."""
    if not isinstance(shard_optimizer_state, bool):
        raise TypeError(f"shard_optimizer_state must be True or False, got {shard_optimizer_state!r}")
    if process_group is None:
        if shard_optimizer_state:
            raise ValueError("shard_optimizer_state=True needs process_group= (the ranks that share the state)")
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group given but torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD), "
                        f"got {type(process_group).__name__}")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    return dict(group_name=process_group.group_name, world_size=dist.get_world_size(process_group), rank=rank,
                shard_optimizer_state=shard_optimizer_state)


def shard_size(numel: int, world: int) -> int:
    return -(-numel // world)


def shard_tensor(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's 1-D shard of ``t`` (flattened, zero-padded to a multiple of world)."""
    s = shard_size(t.numel(), world)
    flat = torch.nn.functional.pad(t.detach().reshape(-1), (0, s * world - t.numel()))
    return flat[rank * s:(rank + 1) * s].clone()


def unshard_tensor(shard: torch.Tensor, like: torch.Tensor, process_group) -> torch.Tensor:
    """All ranks' shards gathered back into a tensor shaped like ``like`` (a collective)."""
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    full = shard.new_empty(shard.numel() * world)
    dist.all_gather_into_tensor(full, shard.contiguous(), group=process_group)
    return full[:like.numel()].view(like.shape).clone()


def _is_collective(n) -> bool:
    return n.kind == "call" and n.target.startswith("_c10d_functional::") and "wait_tensor" not in n.target


def _collective_targets(nodes: dict, state_names) -> dict[str, str]:
    """Per collective node, the state entries it serves: the program outputs (named by
    ``state_names``, output 0 being the loss) nearest to it along its users. A gradient's
    all-reduce reaches its own parameter's update first (clipping reaches every parameter, but
    further away), a buffer's broadcast its buffer, a ZeRO-1 all-gather its parameter."""
    out = next(n for n in nodes.values() if n.kind == "output")
    outputs: dict[str, list[str]] = {}
    for ref, state in zip(list(out.args[0])[1:], state_names):
        if isinstance(ref, _C_NodeRef()):
            outputs.setdefault(ref.name, []).append(state)
    targets = {}
    for name, n in nodes.items():
        if not _is_collective(n):
            continue
        frontier, seen = [name], {name}
        while frontier:
            hit = sorted(s for f in frontier for s in outputs.get(f, ()))
            if hit:
                targets[name] = ", ".join(hit)
                break
            frontier = [u for f in frontier for u in nodes[f].users if u not in seen and not seen.add(u)]
    return targets


def _C_NodeRef():
    from . import _C

    return _C.NodeRef


def collective_sequence(graph, order=None, state_names=None) -> list[str]:
    """The collectives one run of ``graph`` (a torch_ext.ir.Graph) issues, in the order it issues them:
    ``order`` (node names, e.g. a memory plan's order) or else graph order. One entry per
    _c10d_functional call other than wait_tensor: its op and the type it produces, and with
    ``state_names`` (the program's state outputs, in order) the state entries it serves: two
    gradients of one shape are told apart by their parameters."""
    nodes = {n.name: n for n in graph.nodes()}
    names = order if order is not None else [n.name for n in graph.nodes()]
    targets = _collective_targets(nodes, state_names) if state_names is not None else {}
    out = []
    for name in names:
        n = nodes[name]
        if _is_collective(n):
            out.append(f"{n.target} -> {n.type}" + (f" for {targets[name]}" if name in targets else ""))
    return out


def check_collective_order(graph, order, process_group, where: str, state_names=None) -> None:
    """Raises RuntimeError unless every rank of ``process_group`` issues the same collectives in the
    same order (a collective: every rank calls it). Ranks that issue collectives in different
    orders pair up unrelated tensors: gloo and NCCL then hang, or write a buffer with another
    tensor's bytes. Scheduling and memory planning run on each rank on its own, so this is checked
    before a plan runs, not assumed.

    With ``state_names`` (the program's state outputs) each collective is also named by the state
    entries it serves, so ranks that reduce gradients of one shape for different parameters (a
    forward that branches on the batch size, ranks with different batch sizes) are refused too:
    their all-reduces would add one parameter's gradient to another's.

    Also raises if an all-gather would run while another collective is in flight: gloo corrupts
    the heap then (csrc/passes/serialize_collectives.h), so the passes never emit such an order."""
    import torch.distributed as dist

    from . import _C

    overlap = _C.collective_overlap(graph._g, order)
    if overlap:
        raise RuntimeError(f"{where}: {overlap}; an all-gather must run alone (see serialize_collectives.h)")
    mine = collective_sequence(graph, order, state_names)
    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)
    if all(seq == everyone[0] for seq in everyone):
        return
    for rank, seq in enumerate(everyone):
        if seq != everyone[0]:
            at = next((i for i, (a, b) in enumerate(zip(everyone[0], seq)) if a != b), min(len(seq), len(everyone[0])))
            first = lambda s: s[at] if at < len(s) else "nothing (it issues fewer)"  # noqa: E731
            raise RuntimeError(
                f"{where}: the ranks would issue different collectives: collective #{at} is {first(everyone[0])} on "
                f"rank 0 but {first(seq)} on rank {rank} ({len(everyone[0])} and {len(seq)} collectives in all). "
                "Every rank must build the same program: same model, optimizer, batch shapes and options")


def _collective_device(process_group) -> torch.device:
    """Where a collective of ``process_group`` takes its tensors: the current CUDA device under NCCL (which
    refuses CPU tensors), the CPU under gloo; torch's own rule for object collectives (all_gather_object)."""
    from torch.distributed import distributed_c10d as c10d

    kind = c10d._get_object_coll_device(process_group) if hasattr(c10d, "_get_object_coll_device") else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    return torch.device(kind, module.current_device()) if hasattr(module, "current_device") else torch.device(kind)


def ranks_where(mine: bool, process_group) -> list[int]:
    """The ranks of ``process_group`` whose flag ``mine`` is True (a collective: every rank calls it)."""
    import torch.distributed as dist

    flags = torch.zeros(dist.get_world_size(process_group), dtype=torch.int32, device=_collective_device(process_group))
    flags[dist.get_rank(process_group)] = int(mine)
    dist.all_reduce(flags, group=process_group)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                                           if t.numel() else b"").hexdigest()


def broadcast_state_(state, process_group, sharded: bool, own=()) -> None:
    """Overwrites this rank's state with rank 0's, as DistributedDataParallel's constructor does
    with the module's parameters and buffers: parameters, buffers and the optimizer state (except
    ZeRO-1 shards, which are each rank's own). The RNG state stays this rank's own, as each rank of
    an eager DDP loop draws its dropout masks from its own generator (seeded per rank or not), and
    so do the entries named in ``own``: tensors the model or loss_fn captured (per-rank class
    weights), which DDP leaves alone. A collective: every rank calls it."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    src = dist.get_global_rank(group, 0)
    device = _collective_device(group)
    for part in (state.params, state.buffers, state.opt):
        for name in sorted(part):  # the same order on every rank
            t = part[name]
            if (part is state.opt and sharded and t.dim() > 0) or name in own:
                continue
            if t.device.type == device.type:
                dist.broadcast(t, src=src, group=group)
            else:  # a step counter, which stays on the CPU, under NCCL: through the group's device
                carried = t.to(device)
                dist.broadcast(carried, src=src, group=group)
                t.copy_(carried)


def assert_states_in_sync(state, process_group=None) -> None:
    """Raises AssertionError naming every state entry that differs between the ranks of
    ``process_group`` (default: the world), bit for bit: parameters, buffers, lr and optimizer
    state. With ZeRO-1 (``shard_optimizer_state=True``) each rank holds its own shard, so only the
    optimizer state's scalar slots (step counts) are compared. The RNG state is each rank's own (its
    dropout masks, as in eager DDP) and is not compared, nor are tensors the model or loss_fn
    captured (kept with the buffers: each rank's own, as in eager DDP). A collective: every rank
    calls it."""
    import torch.distributed as dist

    from .train_step import TrainState

    if not isinstance(state, TrainState):
        raise TypeError(f"assert_states_in_sync expects a TrainState, got {type(state).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("assert_states_in_sync: torch.distributed is not initialized")
    group = process_group if process_group is not None else dist.group.WORLD
    sharded = state.step_id in _SHARDED_STEPS
    digests = {f"params[{k!r}]": _digest(v) for k, v in state.params.items()}
    own = _RANK_OWN.get(state.step_id, frozenset())
    digests.update({f"buffers[{k!r}]": _digest(v) for k, v in state.buffers.items() if k not in own})
    digests.update({f"opt[{k!r}]": _digest(v) for k, v in state.opt.items() if not sharded or v.dim() == 0})
    digests.update({f"lr[{i}]": _digest(v) for i, v in enumerate(state.lr)})
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digests, group=group)
    bad = sorted(k for k in set().union(*everyone) if len({d.get(k) for d in everyone}) > 1)
    if bad:
        raise AssertionError(f"state entries differ across the {len(everyone)} ranks: {', '.join(bad[:10])}"
                             f"{f' (and {len(bad) - 10} more)' if len(bad) > 10 else ''}")
