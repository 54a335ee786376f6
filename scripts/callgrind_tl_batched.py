"""The batched TransformerLens-style sweep (bench_sweep.py part 2, d_model D, batch 8, 64 resid_pre x position
sites, batch_sites=True) under callgrind: deterministic instruction counts where thread time on a shared 2-core
machine cannot settle a few percent.

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=starmap_next \\
        /root/.pyenv/versions/3.11.7/bin/python scripts/callgrind_tl_batched.py 128 3 {real,stub}

Collection is on only inside itertools.starmap, i.e. around the measured sweeps (the import, the build and two
warm-up sweeps are not counted); divide `Collected` by the sweeps. `stub`: the batched engines' evaluations
replaced by their first outputs (the same every time), which leaves the driver and the user's callbacks.
Use the real python (the pyenv shim is a script, which valgrind would follow instead).
"""
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
import torch_ext  # noqa: E402

from _bench_util import resid_pre_cache  # noqa: E402
from bench_sweep import metric, resid_pos_sites, tl_setup  # noqa: E402


class _Stub:
    """A batched engine whose evaluation returns its first outputs again (the driver alone is measured)."""

    def __init__(self, engine):
        self._e, self._out = engine, None

    def __getattr__(self, name):
        return getattr(self._e, name)

    def evaluate_patched_rows(self, node, value, *rest):
        if self._out is None:
            self._out = [o.clone() for o in self._e.evaluate_patched_rows(node, value, *rest)]
        return list(self._out)


def main() -> int:
    d, n, arm = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    model, clean, corrupt = tl_setup(d=d, B=8)
    T, L = clean.shape[1], len(model.blocks)
    cache = resid_pre_cache(model, corrupt)
    rg = torch_ext.ReactiveGraph(model, (clean,))
    resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(L - 1)]
    sites, patch = resid_pos_sites(cache, resid, T)

    def run():
        return torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)

    with torch.no_grad():
        run()
        if arm == "stub":
            for bc in rg._batched.values():
                if bc.engine is not None:
                    bc.engine = _Stub(bc.engine)
        first = run()
        run()
        list(itertools.starmap(run, [()] * n))
        assert run().metrics == first.metrics
    print("ok", len(first.metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
