// max_abs's float kernel built for AVX2 (this file alone is compiled with -mavx2: CMakeLists.txt);
// max_abs.cpp calls it only where the CPU has AVX2, so the library still runs on any x86-64.
#ifdef __AVX2__
#include "reactive/max_abs.h"

#include <immintrin.h>

#include <cmath>

namespace torch_ext::reactive {

void max_abs_runs_f32_avx2(const float* p, int64_t run, int64_t count, int64_t stride, float* m, bool* nan) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  float ms = *m;
  bool nan_s = false;
  for (int64_t c = 0; c < count; ++c, p += stride) {
    int64_t i = 0;
    for (; i + 16 <= run; i += 16) {
      const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i));
      const __m256 b = _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i + 8));
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));  // all ones where a or b is NaN
      m0 = _mm256_max_ps(m0, a);  // a NaN lane may drop out here: `bad` has seen it
      m1 = _mm256_max_ps(m1, b);
    }
    for (; i + 8 <= run; i += 8) {
      const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i));
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      m0 = _mm256_max_ps(m0, a);
    }
    for (; i < run; ++i) {
      const float a = std::abs(p[i]);
      nan_s |= a != a;
      ms = a > ms ? a : ms;
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (float a : lanes) ms = a > ms ? a : ms;
  *m = ms;
  *nan = *nan || nan_s || _mm256_movemask_ps(bad) != 0;
}

}  // namespace torch_ext::reactive

#endif  // __AVX2__
