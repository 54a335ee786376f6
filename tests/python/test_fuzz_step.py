"""scripts/fuzz_step.py replays its findings: generated training setups that differed from eager, now bit-exact
(each case is trained 3 steps by the step and by eager PyTorch and compared with torch.equal)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fuzz_step  # noqa: E402

# (seed, case): dropout after a transposed BatchNorm (conv front + BatchNorm2d + flatten/transpose, or a
# BatchNorm1d over features) with SGD, Muon, Adamax, Adadelta, NAdam, Adam and Lion, through the executor, the
# planned and donated arena and a memory budget; native_dropout_backward was restrided to the traced layout.
# Seed 1 (172, 199, 272): BatchNorm1d on a transposed stream before a Linear, whose layout tracing took from the
# meta kernels (the input's) where the CPU kernels return contiguous results (_compat.eager_batch_norm_layouts).
FIXED = [(0, 54), (0, 83), (0, 108), (0, 111), (0, 211), (0, 247), (0, 357), (1, 172), (1, 199), (1, 272)]


@pytest.mark.parametrize("seed, case", FIXED, ids=[f"{s}:{c}" for s, c in FIXED])
def test_fuzz_step_finding_is_bit_exact(seed, case):
    spec = fuzz_step.case_spec(seed, case)
    assert fuzz_step.run_case(spec) == [], spec
