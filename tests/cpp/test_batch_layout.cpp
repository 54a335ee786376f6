// batch_layout, alone: where a view puts the copies (kept, split, refused), how ops move them, and the
// reshape / permute / reshape that moves them to a layout and back, checked on real tensors.
#include "ir/parser.h"
#include "passes/batch_layout.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using passes::batch_layout::Layout;
using torch_ext::testing::error_of;

namespace {
std::vector<Layout> views(const std::vector<int64_t>& in, Layout l, const std::vector<int64_t>& out) {
  return passes::batch_layout::view_layouts(in, l, out, "%v (aten::view.default)");
}

// The layouts of out_layout for node %r of `text` whose stacked input has its copies on `l`; `offered`
// collects what a view offered to choose from (the first option is taken).
Layout moved(const std::string& text, Layout l, std::vector<std::vector<Layout>>* offered = nullptr) {
  auto g = ir::parse(text);
  const ir::Node* r = g->find("r");
  const ir::Node* x = g->find("x");
  return passes::batch_layout::out_layout(
      *r, r->target().name, l, x->type().tensor.sizes, static_cast<int64_t>(r->type().tensor.sizes.size()), false, 1,
      "%r", [&](const std::vector<Layout>& options) {
        if (offered != nullptr) offered->push_back(options);
        return options.front();
      });
}

std::string one_op(const std::string& x, const std::string& r) {
  return "graph:\n  %x : " + x + " = input()\n  %r : " + r + "\n  return (%r)\n";
}
}  // namespace

TEST(BatchLayout, ViewKeepingTheStackedDimKeepsItFirst) {
  // [seq, batch, d] with the copies as whole chunks of dim 1, viewed with dims 0..1 kept.
  const auto got = views({5, 2, 8}, {1, 2}, {5, 2, 4, 2});
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.front(), (Layout{1, 2}));
}

TEST(BatchLayout, ViewMergingTheStackedDimSplitsItsCopies) {
  // [5, 2K, 8] viewed as [10K, 8]: the copies sit inside dim 0, every 2 rows.
  EXPECT_EQ(views({5, 2, 8}, {1, 2}, {10, 8}), (std::vector<Layout>{{0, 2}}));
  // And back to [5, 2, 8]: whole chunks of dim 1 first, then every row of dim 0 (size-1 copies inside).
  EXPECT_EQ(views({10, 8}, {0, 2}, {5, 2, 8}), (std::vector<Layout>{{1, 2}, {0, 1}}));
}

TEST(BatchLayout, ViewLeavingTheCopiesInNoOneDimIsRefused) {
  // Chunks of 6 elements do not fit rows of 4.
  const std::string msg = error_of([] { views({4, 6}, {1, 6}, {6, 4}); });
  EXPECT_NE(msg.find("%v (aten::view.default) reshapes dim 1, where the stacked sites are"), std::string::npos) << msg;
  const std::string empty = error_of([] { views({4, 6}, {0, 4}, {0, 24}); });
  EXPECT_NE(empty.find("%v (aten::view.default) has an empty output"), std::string::npos) << empty;
}

TEST(BatchLayout, OpsMoveTheStackedDim) {
  EXPECT_EQ(moved(one_op("f32[3,4,5]", "f32[4,3,5]{5,20,1} = aten::transpose.int(%x, 0, 1)"), {0, 3}),
            (Layout{1, 3}));
  EXPECT_EQ(moved(one_op("f32[3,4,5]", "f32[5,3,4]{1,20,5} = aten::permute.default(%x, [2, 0, 1])"), {1, 4}),
            (Layout{2, 4}));
  EXPECT_EQ(moved(one_op("f32[3,4,5]", "f32[4,5] = aten::select.int(%x, 0, 1)"), {1, 4}), (Layout{0, 4}));
  EXPECT_EQ(moved(one_op("f32[3,4,5]", "f32[3,1,4,5] = aten::unsqueeze.default(%x, 1)"), {1, 4}), (Layout{2, 4}));
  EXPECT_EQ(moved(one_op("f32[3,4,5]", "f32[3,20] = aten::flatten.using_ints(%x, 1, 2)"), {1, 4}), (Layout{1, 20}));
  std::vector<std::vector<Layout>> offered;
  EXPECT_EQ(moved(one_op("f32[10,8]", "f32[5,2,8] = aten::view.default(%x, [5, 2, 8])"), {0, 2}, &offered),
            (Layout{1, 2}));
  EXPECT_EQ(offered, (std::vector<std::vector<Layout>>{{{1, 2}, {0, 1}}}));
  const std::string msg = error_of([] { moved(one_op("f32[3,4]", "f32[3,6] = aten::linear.default(%x, %x)"), {1, 4}); });
  EXPECT_NE(msg.find("%r has the stacked sites on dim 1, which it contracts"), std::string::npos) << msg;
}

TEST(BatchLayout, MovesPutEachCopyWhereTheLayoutSaysAndBack) {
  const std::vector<int64_t> n{3, 4, 2};
  const int64_t c = 3;
  const at::Tensor chunks = at::arange(c * 3 * 4 * 2, at::kFloat).reshape({c * 3, 4, 2});
  for (const Layout to : {Layout{1, 2}, Layout{1, 4}, Layout{2, 1}, Layout{0, 3}}) {
    const auto there = passes::batch_layout::move_from_chunks(n, to, c);
    const at::Tensor y = chunks.reshape(there.split).permute(there.perm).reshape(there.sizes_after);
    // Original element j of copy i along dim b sits at (j / in) * c * in + i * in + j % in.
    for (int64_t i = 0; i < c; ++i) {
      const at::Tensor copy = chunks.chunk(c, 0)[i];
      for (int64_t j = 0; j < n[to.b]; ++j) {
        const int64_t at = (j / to.in) * c * to.in + i * to.in + j % to.in;
        EXPECT_TRUE(at::equal(y.select(to.b, at), copy.select(to.b, j))) << "b " << to.b << " in " << to.in;
      }
    }
    const auto back = passes::batch_layout::move_to_chunks(n, to, c);
    EXPECT_TRUE(at::equal(y.reshape(back.split).permute(back.perm).reshape(back.sizes_after), chunks))
        << "b " << to.b << " in " << to.in;
  }
}
