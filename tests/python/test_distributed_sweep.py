"""Sharded sweeps (issue 14): sweep(..., distributed=True) on 2 gloo ranks (CPU, one machine) equals
the single-process table exactly, each rank measuring only its share."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_ext

from helpers import ResidTanh, position_patch


def _sites(rg):
    return [(n, p) for n in rg.nodes("tanh*") for p in range(5)]


_patch = position_patch(0.25)


def _metric(out):
    return out[:, -1].sum()


def _worker(rank, world, init_file, out_dir, batch_sites):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(1)
        x = torch.randn(2, 5, 8)
        rg = torch_ext.ReactiveGraph(ResidTanh(4).eval(), (x,))
        result = torch_ext.sweep(rg, _sites(rg), _patch, _metric, progress=False, batch_sites=batch_sites,
                                 distributed=True)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump((result.metrics, result.extra, result.measured_evaluations, result.predicted_evaluations), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("batch_sites", [False, True, 2])
def test_sharded_sweep_equals_single_process(tmp_path, batch_sites):
    world = 2
    mp.start_processes(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), batch_sites), nprocs=world,
                       join=True, start_method="spawn")
    torch.manual_seed(1)
    x = torch.randn(2, 5, 8)
    rg = torch_ext.ReactiveGraph(ResidTanh(4).eval(), (x,))
    single = torch_ext.sweep(rg, _sites(rg), _patch, _metric, progress=False, batch_sites=batch_sites)
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            metrics, extra, measured, predicted = pickle.load(f)
        assert list(metrics) == list(single.metrics)  # the caller's order on every rank
        assert metrics == single.metrics  # exactly
        assert extra["ranks"] == world and sum(extra["rank_sites"]) == len(single.metrics)
        # Both ranks measured something, where there is more than one unit of work: batch_sites=True plans
        # the units as one process would (here one chained unit of all 20 sites), and ranks claim units.
        if batch_sites is not True or single.groups >= world:
            assert all(n > 0 for n in extra["rank_sites"])
        assert measured == predicted
        assert predicted == single.predicted_evaluations


def test_distributed_sweep_needs_a_process_group():
    rg = torch_ext.ReactiveGraph(ResidTanh(4).eval(), (torch.randn(2, 5, 8),))
    with pytest.raises(RuntimeError, match="init_process_group"):
        torch_ext.sweep(rg, _sites(rg), _patch, _metric, progress=False, distributed=True)


def _mismatched_worker(rank, world, init_file, out_dir, how):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model = ResidTanh(4).eval()
        if how == "other weights" and rank == 1:  # as a model initialised without a common seed
            with torch.no_grad():
                model.fc[2].weight[0, 0] += 1e-3
        torch.manual_seed(1)
        x = torch.randn(2, 5, 8)
        if how == "other inputs" and rank == 1:
            x = x + 1
        rg = torch_ext.ReactiveGraph(model, (x,))
        sites = _sites(rg)
        if how == "patch on one rank" and rank == 1:
            rg.patch(rg.nodes("tanh*")[0], lambda v: v * 0.5)
        if how == "other sites" and rank == 1:
            sites = sites[:-1]
        try:
            torch_ext.sweep(rg, sites, _patch, _metric, progress=False, distributed=True)
            outcome = "answered"
        except RuntimeError as e:
            outcome = str(e)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(outcome)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how, what", [("other weights", "clean outputs"), ("other inputs", "clean outputs"),
                                       ("patch on one rank", "standing patches"), ("other sites", "sites")])
def test_ranks_that_differ_are_refused_not_merged(tmp_path, how, what):
    # Under torchrun every rank builds its own model: without a common seed each answered for its
    # own weights, and the merged table mixed two models without a word.
    world = 2
    mp.start_processes(_mismatched_worker, args=(world, str(tmp_path / "init"), str(tmp_path), how), nprocs=world,
                       join=True, start_method="spawn")
    for rank in range(world):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert outcome.startswith(f"sweep(distributed=True): rank(s) [1] hold other {what}"), outcome


_FREED_AT_DESTROY = r'''
import gc, os, sys, tempfile
import torch_ext  # before the group, as a script imports it
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from helpers import ResidTanh, position_patch

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
before = threads()
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0, world_size=1)
rg = torch_ext.ReactiveGraph(ResidTanh(4).eval(), (torch.randn(2, 5, 8),), cache=False)  # traced with the group alive
sites = [(n, p) for n in rg.nodes("tanh*") for p in range(5)]
torch_ext.sweep(rg, sites, position_patch(0.25), lambda out: out[:, -1].sum(), progress=False, distributed=True)
dist.destroy_process_group()
gc.collect()
print(before, threads())
'''


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_destroy_process_group_frees_gloo_threads_after_a_traced_sweep(tmp_path):
    # torch 2.9's torch.distributed.nn, first imported by a trace (through dynamo) while the group was alive,
    # kept the group past destroy_process_group (default arguments group=group.WORLD): gloo's worker threads
    # lived into interpreter exit, where one releasing a Python tensor aborted the process now and then
    # (SIGABRT, "terminate called without an active exception").
    import subprocess
    import sys

    script = tmp_path / "freed.py"
    script.write_text(_FREED_AT_DESTROY)
    run = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TORCH_EXT_CACHE": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    before, after = map(int, run.stdout.strip().splitlines()[-1].split())
    assert after == before, f"{after - before} threads left after destroy_process_group"
