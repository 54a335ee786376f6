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


# Process-wide torch settings a test may change only for its own duration: under pytest-xdist the next
# file on the same worker inherits whatever is left (a C++ runner at 2 threads against load_step at 1
# made test_deploy flaky). Each entry: (name, read, restore).
_GLOBAL_SETTINGS = (
    ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("(torch.are_deterministic_algorithms_enabled(), warn_only)",
     lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
)


def _settings() -> list:
    return [read() for _, read, _ in _GLOBAL_SETTINGS]


def _check_settings_restored(before: list, who: str) -> None:
    """Fails ``who`` naming each setting it left changed, after putting that setting back (so one leak
    does not fail every later test on the worker)."""
    changed = []
    for (name, _, restore), b, a in zip(_GLOBAL_SETTINGS, before, _settings()):
        if a != b:
            changed.append(f"{name} was {b} before and {a} after")
            restore(b)
    if changed:
        pytest.fail(f"{who} left process-global settings changed (scope the change: try/finally or a fixture "
                    f"that restores): " + "; ".join(changed), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test file that changes a setting at import (module level) is a collection error naming it."""
    before = _settings()
    outcome = yield
    try:
        _check_settings_restored(before, f"importing {collector.nodeid or collector.name}")
    except pytest.fail.Exception as e:
        report = outcome.get_result()
        report.outcome, report.longrepr = "failed", str(e)


@pytest.fixture(autouse=True)
def _global_settings_guard(request):
    before = _settings()
    yield
    _check_settings_restored(before, request.node.nodeid)


@pytest.fixture(autouse=True, scope="module")
def _module_settings_guard(request):
    """The same over a module, for module-scoped fixtures (test_real_models' one thread) that must restore."""
    before = _settings()
    yield
    _check_settings_restored(before, f"module {request.node.nodeid}")


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
