"""An on-disk cache of the graphs ReactiveGraph builds, so that a fresh process does not trace again.

An entry holds what the engine needs and nothing of the model's data: the graph in torch_ext's text IR
(csrc/ir printer and parser), how each graph input maps to the module (a user input, or a parameter or
buffer by name, bound to the module's own tensor at every use: values are never stored), the output
kinds and the input/output pytree specs, the hook-name table and which front end traced it. Programs
that read other tensors (constants made in ``forward``, tensor attributes) are not stored.

It is keyed by ``_build_cache.fingerprint(..., portable=True)``: the in-process key's coverage (code
and the globals it reads, module state, shapes, dtypes, devices, training flag, options), made
process-independent, plus Python's, torch's and torch_ext's identity. A key that cannot be computed
soundly means no disk caching.

Where: ``$TORCH_EXT_CACHE_DIR``, else ``$XDG_CACHE_HOME/torch_ext``, else ``~/.cache/torch_ext``, in
``graphs-v<FORMAT>/``. Off with ``TORCH_EXT_CACHE=0`` (``TORCH_EXT_BUILD_CACHE=0`` or
``ReactiveGraph(..., cache=False)`` turn off every build cache). Files are written to a temporary name
and renamed into place (atomic on POSIX), so concurrent processes read a whole entry or none; an entry
that cannot be read, parsed or checked is ignored (and rebuilt), never fatal. At most ``MAX_ENTRIES``
entries are kept; the least recently used go first.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

FORMAT = 1
MAX_ENTRIES = 256
_counters = {"hits": 0, "misses": 0, "stores": 0, "corrupt": 0, "store_errors": 0}


def enabled() -> bool:
    return os.environ.get("TORCH_EXT_CACHE", "1").lower() not in ("0", "false", "off", "no", "")


def directory() -> str:
    root = os.environ.get("TORCH_EXT_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache"), "torch_ext")
    return os.path.join(root, f"graphs-v{FORMAT}")


def info() -> dict:
    return {"directory": directory(), **_counters}


def _path(key: str) -> str:
    return os.path.join(directory(), f"{key}.json")


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def load(key: str) -> dict | None:
    """The stored entry of ``key`` (its JSON body), or None when absent, unreadable or corrupt."""
    path = _path(key)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        body = doc["body"]
        if doc.get("format") != FORMAT or doc.get("key") != key or doc.get("checksum") != _checksum(body):
            raise ValueError("format, key or checksum mismatch")
    except FileNotFoundError:
        _counters["misses"] += 1
        return None
    except (OSError, ValueError, KeyError, TypeError):
        _counters["corrupt"] += 1
        return None
    try:
        os.utime(path)  # least recently used goes first
    except OSError:
        pass
    _counters["hits"] += 1
    return body


def corrupt(key: str) -> None:
    """An entry read but refused by its user (it did not parse or bind): counted, and removed."""
    _counters["hits"] -= 1
    _counters["corrupt"] += 1
    try:
        os.remove(_path(key))
    except OSError:
        pass


def store(key: str, body: dict) -> bool:
    """Writes ``body`` (JSON-serialisable) as the entry of ``key``; False if it could not be written."""
    folder = directory()
    try:
        os.makedirs(folder, exist_ok=True)
        text = json.dumps({"format": FORMAT, "key": key, "checksum": _checksum(body), "body": body})
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, _path(key))
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
    except (OSError, TypeError, ValueError):
        _counters["store_errors"] += 1
        return False
    _counters["stores"] += 1
    _evict(folder)
    return True


def _evict(folder: str) -> None:
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".json")]
        if len(names) <= MAX_ENTRIES:
            return
        aged = []
        for n in names:
            try:
                aged.append((os.stat(os.path.join(folder, n)).st_mtime_ns, n))
            except OSError:
                pass
        aged.sort()
        for _, n in aged[: len(aged) - MAX_ENTRIES]:
            try:
                os.remove(os.path.join(folder, n))
            except OSError:
                pass
    except OSError:
        pass


def clear() -> None:
    """Removes every entry of this format (the folder itself stays)."""
    folder = directory()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for n in names:
        if n.endswith(".json"):
            try:
                os.remove(os.path.join(folder, n))
            except OSError:
                pass
