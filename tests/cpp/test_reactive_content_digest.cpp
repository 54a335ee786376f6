// The content digest behind the reactive graph's check for writes that move no version counter:
// the reference XXH3 values, every byte read (a one-bit flip anywhere changes it), layout-independent.
#include "reactive/content_digest.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>

using torch_ext::reactive::content_digest;
using torch_ext::reactive::content_digests;

TEST(ReactiveContentDigest, MatchesReferenceXxh3) {
  // XXH3_64bits(b"torch_ext") from the reference implementation (the Python xxhash package).
  const char text[] = "torch_ext";
  at::Tensor t = at::empty({9}, at::kByte);
  std::memcpy(t.data_ptr(), text, 9);
  EXPECT_EQ(*content_digest(t), 0x0f52751df393d26cULL);
}

TEST(ReactiveContentDigest, EveryByteCounts) {
  // Sizes straddle XXH3's short, medium and long (striped, AVX2) paths; flip one bit at each end and inside.
  for (int64_t n : {1, 16, 17, 128, 129, 240, 241, 1024, 100003, 1 << 20}) {
    at::Tensor t = at::arange(n, at::kInt).to(at::kByte);
    const uint64_t clean = *content_digest(t);
    for (int64_t i : {int64_t{0}, n / 2, n - 1}) {
      auto* p = t.data_ptr<uint8_t>() + i;
      *p ^= 0x10;
      EXPECT_NE(*content_digest(t), clean) << "n=" << n << " byte " << i;
      *p ^= 0x10;
    }
    EXPECT_EQ(*content_digest(t), clean);
  }
}

TEST(ReactiveContentDigest, SwappedRowsDiffer) {
  at::Tensor w = at::randn({64, 48});
  const uint64_t clean = *content_digest(w);
  at::Tensor swapped = w.index_select(0, at::arange(63, -1, -1, at::kLong));
  EXPECT_NE(*content_digest(swapped), clean);
}

TEST(ReactiveContentDigest, LayoutAndNoBytes) {
  at::Tensor w = at::randn({30, 40});
  EXPECT_EQ(*content_digest(w.t()), *content_digest(w.t().contiguous()));
  EXPECT_FALSE(content_digest(at::empty({3}, at::TensorOptions().device(at::kMeta))).has_value());
  EXPECT_FALSE(content_digest(at::eye(3).to_sparse()).has_value());
  auto both = content_digests({w, at::empty({0})});
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(*both[0], *content_digest(w));
  EXPECT_EQ(*both[1], 0u);
}
