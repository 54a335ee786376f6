// sole_fresh: the sweep loop hands the metric a cone's output without a copy only where nothing else can
// reach that tensor or its memory. Every other owner (a second reference, a view's base, a tensor sharing
// the storage, the row buffer pool, the engine's cache), autograd history and memory that is not the
// storage's own allocation (copy on write, from_blob) make it false; a fresh tensor held once is true.
#include "ir/parser.h"
#include "reactive/engine.h"
#include "reactive/row_buffers.h"
#include "reactive/sole_fresh.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

using torch_ext::reactive::sole_fresh;

TEST(SoleFresh, AFreshTensorHeldOnceIs) {
  EXPECT_TRUE(sole_fresh(c10::IValue(at::randn({4, 3}))));
  EXPECT_TRUE(sole_fresh(c10::IValue(at::empty({0}))));  // no elements: still its storage's one owner
}

TEST(SoleFresh, NotATensorOrUndefinedIsNot) {
  EXPECT_FALSE(sole_fresh(c10::IValue()));
  EXPECT_FALSE(sole_fresh(c10::IValue(1.5)));
  EXPECT_FALSE(sole_fresh(c10::IValue(at::Tensor())));
}

TEST(SoleFresh, ATensorWithAnotherOwnerIsNot) {
  at::Tensor t = at::randn({4});
  const at::Tensor kept = t;  // the user, the cache: a second reference to the same TensorImpl
  const c10::IValue v(std::move(t));
  EXPECT_FALSE(sole_fresh(v));
}

TEST(SoleFresh, AViewWhoseBaseIsHeldIsNot) {
  const at::Tensor base = at::randn({4, 3});
  EXPECT_FALSE(sole_fresh(c10::IValue(base.select(0, 1))));
  EXPECT_FALSE(sole_fresh(c10::IValue(base.view({12}))));
  EXPECT_FALSE(sole_fresh(c10::IValue(base.t())));
}

TEST(SoleFresh, ABaseWithALiveViewIsNot) {
  at::Tensor base = at::randn({4, 3});
  const at::Tensor row = base.select(0, 2);  // held elsewhere: a write into base reaches it
  EXPECT_FALSE(sole_fresh(c10::IValue(std::move(base))));
}

TEST(SoleFresh, ATensorSharingItsStorageIsNot) {
  const at::Tensor owner = at::randn({6});
  // Another TensorImpl on the same StorageImpl (no view relation): its own use count is 1.
  at::Tensor other = at::empty({0}).set_(owner.storage(), 0, {6}, {1});
  ASSERT_EQ(other.use_count(), 1u);
  EXPECT_FALSE(sole_fresh(c10::IValue(std::move(other))));
}

TEST(SoleFresh, ATensorRequiringGradIsNot) {
  at::Tensor t = at::randn({4});
  t.requires_grad_();
  ASSERT_EQ(t.use_count(), 1u);
  ASSERT_EQ(t.storage().use_count(), 1u);
  EXPECT_FALSE(sole_fresh(c10::IValue(std::move(t))));
}

TEST(SoleFresh, APooledRowBufferIsNot) {
  torch_ext::reactive::RowBufferPool pool;
  const int64_t n = torch_ext::reactive::RowBufferPool::kMinBytes / 4;
  at::Tensor t = pool.take({n}, at::TensorOptions().dtype(at::kFloat));
  ASSERT_EQ(t.use_count(), 1u);
  EXPECT_FALSE(sole_fresh(c10::IValue(std::move(t))));  // the pool keeps its storage for the next unit
}

TEST(SoleFresh, CopyOnWriteOrBorrowedMemoryIsNot) {
  const at::Tensor cached = at::randn({8});
  // A lazy copy shares the cached tensor's memory until one side writes.
  EXPECT_FALSE(sole_fresh(c10::IValue(at::_lazy_clone(cached))));
  // Still copy-on-write memory once the other side is gone: not the storage's plain allocation.
  at::Tensor lazy = at::_lazy_clone(at::randn({8}));
  ASSERT_EQ(lazy.use_count(), 1u);
  ASSERT_EQ(lazy.storage().use_count(), 1u);
  EXPECT_FALSE(sole_fresh(c10::IValue(std::move(lazy))));
  // Memory owned by someone else (numpy, a from_blob owner).
  std::vector<float> memory(8, 1.0f);
  EXPECT_FALSE(sole_fresh(c10::IValue(at::from_blob(memory.data(), {8}, at::TensorOptions().dtype(at::kFloat)))));
  EXPECT_FALSE(sole_fresh(c10::IValue(at::from_blob(memory.data(), {8}, [](void*) {},
                                                    at::TensorOptions().dtype(at::kFloat)))));
}

// What the sweep loop meets: a patched cone's fresh output is sole-fresh; an output outside the cone (the
// engine's cached value) and one that is the patch value itself are not.
TEST(SoleFresh, APatchedConesOutputs) {
  auto g = torch_ext::ir::parse(R"(graph:
  %x : f32[4] = input()
  %a : f32[4] = aten::sin.default(%x)
  %b : f32[4] = aten::cos.default(%a)
  %c : f32[4] = aten::relu.default(%x)
  return (%b, %c, %a)
)");
  torch_ext::reactive::Engine e(*g);
  e.run({at::randn({4})});
  ASSERT_TRUE(e.can_evaluate_patched());
  const at::Tensor p = at::randn({4});
  std::vector<c10::IValue> out = e.evaluate_patched("a", p);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(sole_fresh(out[0]));   // %b: computed from the patch value, held by the loop alone
  EXPECT_FALSE(sole_fresh(out[1]));  // %c: outside the cone, the cached value
  EXPECT_FALSE(sole_fresh(out[2]));  // %a: the caller's patch value
  // The unpatched outputs are all cached values.
  for (const auto& v : e.demand()) EXPECT_FALSE(sole_fresh(v));
}
