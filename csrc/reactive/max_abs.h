// The largest |x| of a tensor, for the row path's attention overflow check (rows.cpp): asked for q, k
// and v of every causal SDPA a row-path site recomputes, so it is on the batched sweep's hot path.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace torch_ext::reactive {

/// max |x| over t's elements: NaN when t holds a NaN, 0 when it is empty or not floating point. A CPU
/// float or double tensor whose innermost dim is contiguous is read in place, run by run (no temporary,
/// no dispatch; float runs with AVX2 where the CPU has it); any other tensor takes abs().amax().
double max_abs(const at::Tensor& t);

/// The same, with the portable loop even where the CPU has AVX2 (tests compare the two).
double max_abs_portable(const at::Tensor& t);

// One kernel call: `count` runs of `run` contiguous floats, `stride` elements apart; folds their max |x|
// into *m and a NaN into *nan. max_abs_avx2.cpp (compiled with -mavx2); call only where the CPU has AVX2.
void max_abs_runs_f32_avx2(const float* p, int64_t run, int64_t count, int64_t stride, float* m, bool* nan);

}  // namespace torch_ext::reactive
