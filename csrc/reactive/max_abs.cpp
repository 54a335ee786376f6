#include "reactive/max_abs.h"

#include <ATen/Dispatch.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

namespace torch_ext::reactive {
namespace {

// Four independent maxima per run (a plain loop); a NaN is seen by x != x.
template <typename scalar_t>
void runs_portable(const scalar_t* p, int64_t run, int64_t count, int64_t stride, scalar_t* m, bool* nan) {
  for (int64_t c = 0; c < count; ++c, p += stride) {
    int64_t i = 0;
    for (; i + 4 <= run; i += 4)
      for (int j = 0; j < 4; ++j) {
        const scalar_t a = std::abs(p[i + j]);
        *nan |= a != a;
        m[j] = a > m[j] ? a : m[j];
      }
    for (; i < run; ++i) {
      const scalar_t a = std::abs(p[i]);
      *nan |= a != a;
      m[0] = a > m[0] ? a : m[0];
    }
  }
}

#if defined(__x86_64__) && defined(TORCH_EXT_MAX_ABS_AVX2)
bool cpu_has_avx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

void runs(const float* p, int64_t run, int64_t count, int64_t stride, float* m, bool* nan, bool avx2) {
  if (avx2)
    max_abs_runs_f32_avx2(p, run, count, stride, m, nan);
  else
    runs_portable(p, run, count, stride, m, nan);
}
#else
bool cpu_has_avx2() { return false; }

void runs(const float* p, int64_t run, int64_t count, int64_t stride, float* m, bool* nan, bool) {
  runs_portable(p, run, count, stride, m, nan);
}
#endif

void runs(const double* p, int64_t run, int64_t count, int64_t stride, double* m, bool* nan, bool) {
  runs_portable(p, run, count, stride, m, nan);
}

double max_abs_impl(const at::Tensor& t, bool avx2) {
  if (t.numel() == 0 || !at::isFloatingType(t.scalar_type())) return 0.0;
  if (t.is_cpu() && !t.is_neg() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble)) {
    // Dims by stride, outermost first; the innermost ones merge into one contiguous run.
    c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;  // (stride, size)
    for (int64_t d = 0; d < t.dim(); ++d)
      if (t.size(d) != 1) dims.emplace_back(t.stride(d), t.size(d));
    std::sort(dims.begin(), dims.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    int64_t run = 1;
    while (!dims.empty() && dims.back().first == run) {
      run *= dims.back().second;
      dims.pop_back();
    }
    if (run > 1 || t.numel() == 1) {
      // The innermost remaining dim goes to the kernel whole (`count` runs `stride` apart: q, k and v of a
      // qkv projection have runs of one head's width, so a call per run cost more than the reading); an
      // odometer walks the rest.
      int64_t count = 1, stride = 0;
      if (!dims.empty()) {
        std::tie(stride, count) = dims.back();
        dims.pop_back();
      }
      return AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "max_abs", [&] {
        scalar_t m[4] = {0, 0, 0, 0};
        bool nan = false;
        const scalar_t* p = t.const_data_ptr<scalar_t>();
        c10::SmallVector<int64_t, 8> index(dims.size(), 0);
        while (true) {
          runs(p, run, count, stride, m, &nan, avx2);
          int64_t d = static_cast<int64_t>(dims.size()) - 1;  // odometer over the outer dims
          for (; d >= 0; --d) {
            p += dims[d].first;
            if (++index[d] < dims[d].second) break;
            p -= dims[d].first * dims[d].second;
            index[d] = 0;
          }
          if (d < 0) break;
        }
        if (nan) return std::numeric_limits<double>::quiet_NaN();
        return static_cast<double>(std::max(std::max(m[0], m[1]), std::max(m[2], m[3])));
      });
    }
  }
  return t.abs().amax().item<double>();
}

}  // namespace

double max_abs(const at::Tensor& t) { return max_abs_impl(t, cpu_has_avx2()); }

double max_abs_portable(const at::Tensor& t) { return max_abs_impl(t, false); }

}  // namespace torch_ext::reactive
