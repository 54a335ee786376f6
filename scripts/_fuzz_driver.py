"""What scripts/fuzz_step.py and scripts/fuzz_sweep.py share."""
from __future__ import annotations

import functools


def one_intra_op_thread(run):
    """``run`` on one intra-op thread, the thread count restored after it: the tests replay cases in-process
    (pytest-xdist runs other files on the same worker next), and a count left at 1 made test_deploy's C++
    runner differ from load_step."""
    @functools.wraps(run)
    def scoped(*args, **kwargs):
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return scoped
