"""Shared fixtures for the torch_ext Python tests."""
from __future__ import annotations

import os
import random
import shutil
import tempfile

import pytest
import torch

from torch_ext._compat import export_joint

from zoo import ZOO

SEED = 0


def pytest_configure(config):
    # The on-disk build cache (torch_ext._disk_cache) of this run goes to a temporary folder, never the
    # user's ~/.cache/torch_ext; subprocesses that tests start (CLI, README blocks) inherit it.
    global _CACHE_DIR
    _CACHE_DIR = tempfile.mkdtemp(prefix="torch_ext_test_cache_")
    os.environ["TORCH_EXT_CACHE_DIR"] = _CACHE_DIR
    config.addinivalue_line(
        "markers", "internals: drives torch_ext._C or a private attribute (._g, ._engine) directly: a test of the "
        "C++ internals rather than of the public API (`-m 'not internals'` leaves them out)")


_CACHE_DIR: str | None = None


def pytest_unconfigure(config):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state (models, inputs, dropout-free but seeded anyway)."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    yield


class ExportCache:
    """Exports each zoo model once per session; hands out programs with their initial state.

    ``ep.module()`` aliases ``ep.state_dict`` (and both alias the eager model), so running a
    train-mode program mutates the cached program's buffers. ``get`` therefore copies the
    state captured at export time back in place before returning, so tests do not leak
    buffer updates into each other.
    """

    def __init__(self):
        self._cache: dict[tuple[str, bool], tuple] = {}

    def get(self, name: str, decomposed: bool = False):
        """(ep, model, inputs) for zoo entry ``name``; ``decomposed`` runs run_decompositions()."""
        key = (name, decomposed)
        if key not in self._cache:
            entry = ZOO[name]
            torch.manual_seed(SEED)
            model, inputs = entry.build()
            ep = torch.export.export(model, inputs)
            if entry.joint:
                ep = export_joint(ep)
            elif decomposed:
                ep = ep.run_decompositions()
            snapshot = {k: v.detach().clone() for k, v in {**ep.state_dict, **ep.constants}.items()
                        if isinstance(v, torch.Tensor)}
            self._cache[key] = (ep, model, inputs, snapshot)
        ep, model, inputs, snapshot = self._cache[key]
        with torch.no_grad():
            for k, v in {**ep.state_dict, **ep.constants}.items():
                if isinstance(v, torch.Tensor):
                    v.copy_(snapshot[k])
        return ep, model, tuple(x.clone() for x in inputs)


@pytest.fixture(scope="session")
def export_cache() -> ExportCache:
    return ExportCache()
