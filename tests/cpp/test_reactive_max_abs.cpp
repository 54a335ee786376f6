// max |x| behind the row path's attention overflow check: equal to abs().amax() (exactly: a maximum
// does not depend on the order it is taken in) for every layout the kernels walk, NaN where the tensor
// holds one, with the AVX2 kernel (where the CPU has it) and the portable loop alike.
#include "reactive/max_abs.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

using torch_ext::reactive::max_abs;
using torch_ext::reactive::max_abs_portable;

namespace {

double reference(const at::Tensor& t) { return t.numel() == 0 ? 0.0 : t.abs().amax().item<double>(); }

// Layouts of the row path: contiguous, q/k/v views of a qkv projection (runs of one head), transposes,
// slices with a tail shorter than a vector, a single element.
std::vector<at::Tensor> layouts(at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (int64_t dh : {1, 3, 8, 16, 23, 32, 40}) {
    at::Tensor qkv = at::randn({2, 5, 3, 4, dh}, at::TensorOptions().dtype(dtype)) * 3;
    for (int64_t j = 0; j < 3; ++j) out.push_back(qkv.select(2, j).transpose(1, 2));  // [B, H, T, dh] views
  }
  at::Tensor w = at::randn({37, 29}, at::TensorOptions().dtype(dtype));
  out.push_back(w);
  out.push_back(w.t());                             // innermost dim strided: abs().amax()
  out.push_back(w.narrow(1, 3, 21));                // runs of 21 at stride 29
  out.push_back(w.narrow(0, 5, 1));                 // one row
  out.push_back(at::randn({1}, at::TensorOptions().dtype(dtype)));
  out.push_back(at::randn({4, 1, 1000}, at::TensorOptions().dtype(dtype)).expand({4, 3, 1000}));  // stride 0
  return out;
}

}  // namespace

TEST(ReactiveMaxAbs, EqualsAbsAmaxOnEveryLayout) {
  at::manual_seed(0);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (const at::Tensor& t : layouts(dtype)) {
      const double want = reference(t);
      EXPECT_EQ(max_abs(t), want) << t.sizes() << " strides " << t.strides();
      EXPECT_EQ(max_abs_portable(t), want) << t.sizes() << " strides " << t.strides();
    }
  }
}

TEST(ReactiveMaxAbs, TheLargestMagnitudeAnywhereIsFound) {
  // One element much larger than the rest (negative: |x| counts), at every position of a head-wide view:
  // in a vector body, in a scalar tail, in the first and last run.
  at::Tensor qkv = at::randn({2, 3, 3, 2, 21});
  at::Tensor k = qkv.select(2, 1).transpose(1, 2);
  for (int64_t i = 0; i < k.numel(); ++i) {
    at::Tensor flat_index = at::tensor({i});
    at::Tensor copy = k.clone();
    const float old = k.flatten().index_select(0, flat_index).item<float>();
    // Write through the view into qkv (k is not contiguous): unravel i.
    int64_t rest = i;
    std::vector<int64_t> idx(4);
    for (int64_t d = 3; d >= 0; --d) {
      idx[d] = rest % k.size(d);
      rest /= k.size(d);
    }
    auto elem = k[idx[0]][idx[1]][idx[2]][idx[3]];
    elem.fill_(-1e6);
    EXPECT_EQ(max_abs(k), 1e6) << "element " << i;
    EXPECT_EQ(max_abs_portable(k), 1e6) << "element " << i;
    elem.fill_(old);
    EXPECT_TRUE(at::equal(k, copy));
  }
}

TEST(ReactiveMaxAbs, NanAnywhereGivesNanInfGivesInf) {
  at::Tensor qkv = at::randn({2, 3, 3, 2, 19});
  at::Tensor v = qkv.select(2, 2).transpose(1, 2);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (int64_t pos : {int64_t{0}, int64_t{7}, int64_t{16}, int64_t{18}}) {  // vector body and tail of a run
      auto elem = v[1][0][2][pos];
      const float old = elem.item<float>();
      elem.fill_(bad);
      for (double got : {max_abs(v), max_abs_portable(v)}) {
        if (std::isnan(bad))
          EXPECT_TRUE(std::isnan(got)) << "NaN at " << pos << " gave " << got;
        else
          EXPECT_EQ(got, std::numeric_limits<double>::infinity()) << "inf at " << pos;
      }
      elem.fill_(old);
    }
  }
  // A NaN beside an infinity is still NaN; -0.0 is 0; empty and integer tensors are 0.
  at::Tensor t = at::zeros({40});
  t[3] = std::numeric_limits<float>::infinity();
  t[30] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(max_abs(t)));
  EXPECT_EQ(max_abs(at::full({17}, -0.0)), 0.0);
  EXPECT_EQ(max_abs(at::empty({0, 4})), 0.0);
  EXPECT_EQ(max_abs(at::ones({5}, at::kInt)), 0.0);
}
