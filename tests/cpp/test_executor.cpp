// The dispatcher executor on hand-written text IR.
#include "ir/out_variant.h"
#include "ir/parser.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;


TEST(Executor, RunsMlpWithDefaultsKwargsAndMultiOutputs) {
  auto g = ir::parse(R"(graph:
  %x : f32[8,16] = input()
  %w : f32[4,16] = param("fc.weight")
  %b : f32[4] = param("fc.bias")
  %linear : f32[8,4] = aten::linear.default(%x, %w, %b)
  %relu : f32[8,4] = aten::relu.default(%linear)
  %topk : (f32[8,2], i64[8,2]) = aten::topk.default(%relu, 2, dim=-1)
  %values : f32[8,2] = getitem(%topk, 0)
  %indices : i64[8,2] = getitem(%topk, 1)
  %split : (f32[8,2]{4,1}, f32[8,2]{4,1}) = aten::split.Tensor(%relu, 2, 1)
  %second : f32[8,2]{4,1} = getitem(%split, 1)
  %cat : f32[8,4] = aten::cat.default([%values, %second], 1)
  %scaled : f32[8,4] = aten::add.Tensor(%cat, 1.5)
  return (%scaled, %indices)
)");
  runtime::Executor ex(*g);
  at::manual_seed(0);
  at::Tensor x = at::randn({8, 16}), w = at::randn({4, 16}), b = at::randn({4});
  auto out = ex.run({x, w, b});
  ASSERT_EQ(out.size(), 2u);
  at::Tensor relu = at::relu(at::linear(x, w, b));
  auto [v, i] = at::topk(relu, 2, -1);
  at::Tensor expect = at::cat({v, relu.split(2, 1)[1]}, 1) + 1.5;
  EXPECT_TRUE(at::equal(out[0].toTensor(), expect));
  EXPECT_TRUE(at::equal(out[1].toTensor(), i));
}

TEST(Executor, InPlaceOpsMutateTheGivenInput) {
  auto g = ir::parse(R"(graph:
  %count : i64[] = buffer("bn.num_batches_tracked")
  %x : f32[3] = input()
  %add_ : i64[] = aten::add_.Tensor(%count, 1)
  %y : f32[3] = aten::mul.Tensor(%x, 2)
  return (%y)
)");
  runtime::Executor ex(*g);
  at::Tensor count = at::zeros({}, at::kLong);
  ex.run({count, at::ones({3})});
  ex.run({count, at::ones({3})});
  EXPECT_EQ(count.item<int64_t>(), 2);
}

TEST(Executor, RejectsBadInputsByName) {
  auto g = ir::parse("graph:\n  %x : f32[2,3] = input()\n  %y : f32[2,3] = aten::neg.default(%x)\n  return (%y)\n");
  runtime::Executor ex(*g);
  EXPECT_NE(error_of([&] { ex.run({}); }).find("expected 1 inputs, got 0"), std::string::npos);
  EXPECT_NE(error_of([&] { ex.run({at::ones({2, 4})}); }).find("input #0 ('x'): expected shape [2, 3], got [2, 4]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ex.run({at::ones({2, 3}, at::kDouble)}); }).find("expected dtype torch.float32"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ex.run({c10::IValue(3)}); }).find("expected a tensor"), std::string::npos);
}

TEST(Executor, TakesAnInputLaidOutOtherwiseInItsTracedStrides) {
  // A state entry in other strides than traced (an AOTInductor package's channels-last weights) runs
  // as a copy in the traced strides: the caller's tensor is untouched and the kernels see the layout
  // the program was traced on (neg keeps its input's strides, so its result shows which it got).
  auto g = ir::parse(R"(graph:
  %w : f32[4,6] = param("w")
  %e : f32[4,1,6]{6,1,1} = param("e")
  %y : f32[4,6] = aten::neg.default(%w)
  %z : f32[4,1,6]{6,1,1} = aten::neg.default(%e)
  return (%y, %z)
)");
  runtime::Executor ex(*g);
  at::Tensor w = at::arange(24, at::kFloat).reshape({6, 4}).t();  // strides (1, 4)
  at::Tensor e = at::arange(24, at::kFloat).reshape({4, 1, 6});   // (6, 6, 1): differs only where the size is 1
  auto out = ex.run({w, e});
  EXPECT_EQ(out[0].toTensor().strides(), c10::IntArrayRef({6, 1}));
  EXPECT_TRUE(at::equal(out[0].toTensor(), -w));
  EXPECT_EQ(w.strides(), c10::IntArrayRef({1, 4}));
  EXPECT_EQ(out[1].toTensor().strides(), e.strides());  // taken as it is: no copy
  // a wrong shape is still refused by name before any copy
  EXPECT_NE(error_of([&] { ex.run({w.t(), e}); }).find("input #0 ('w'): expected shape [4, 6], got [6, 4]"),
            std::string::npos);
}

TEST(Executor, LeavesAnInputWrittenInPlaceInTheCallersLayout) {
  // The write must reach the caller's tensor: a placeholder an in-place op writes is never copied.
  auto g = ir::parse(R"(graph:
  %b : f32[4,6] = buffer("b")
  %add_ : f32[4,6] = aten::add_.Tensor(%b, 1)
  %y : f32[4,6] = aten::mul.Tensor(%b, 2)
  return (%y)
)");
  runtime::Executor ex(*g);
  at::Tensor b = at::zeros({6, 4}).t();
  ex.run({b});
  EXPECT_TRUE(at::equal(b, at::ones({4, 6})));
}

TEST(Executor, RefusesUnsupportedGraphsAtConstruction) {
  auto bad = ir::parse("graph:\n  %x : f32[2] = input()\n  %y : f32[2] = aten::nope.default(%x)\n  return (%y)\n");
  EXPECT_NE(error_of([&] { runtime::Executor ex(*bad); }).find("unknown operator"), std::string::npos);
  auto wrong = ir::parse("graph:\n  %x : f32[2] = input()\n  %y : f32[2] = aten::mul.Scalar(%x, \"a\")\n  return (%y)\n");
  EXPECT_NE(error_of([&] { runtime::Executor ex(*wrong); }).find("node %y (aten::mul.Scalar): argument 'other'"),
            std::string::npos);
}

// A pointwise step whose input dies there runs its in-place variant (relu_, add_), with the bits of
// the functional kernel; the graph's own input and an output are never overwritten.
TEST(Executor, PointwiseStepsOverwriteInputsThatDieThere) {
  auto g = ir::parse(R"(graph:
  %x : f32[4,8] = input()
  %b : f32[8] = input()
  %a : f32[4,8] = aten::mul.Tensor(%x, 3)
  %r : f32[4,8] = aten::relu.default(%a)
  %s : f32[4,8] = aten::add.Tensor(%r, %b, alpha=2)
  %t : f32[4,8] = aten::tanh.default(%x)
  return (%s, %t)
)");
  runtime::Executor ex(*g);
  EXPECT_EQ(ex.inplace_steps(), 2u);  // relu on %a, add on %r; not tanh on the input %x
  at::manual_seed(0);
  at::Tensor x = at::randn({4, 8}), b = at::randn({8});
  const at::Tensor x_before = x.clone();
  auto out = ex.run({x, b});
  EXPECT_TRUE(at::equal(out[0].toTensor(), at::add(at::relu(x * 3), b, 2)));
  EXPECT_TRUE(at::equal(out[1].toTensor(), at::tanh(x)));
  EXPECT_TRUE(at::equal(x, x_before));
}

// torch's mul_.Scalar rounds the scalar to a float16/bfloat16 tensor's dtype first (0.9 -> 0.8984375 in
// bfloat16), mul.Scalar does not: a dying input of a half-precision mul.Scalar is never overwritten through it
// (ir::find_overwrite), whether the node came from text, an import or a C++ pass. Before, the executor ran
// %m through mul_.Scalar on %y's buffer and 1,300 of 4,096 bfloat16 elements (650 float16) differed.
// add.Scalar and float32's mul.Scalar still run in place.
TEST(Executor, HalfPrecisionMulScalarIsNotRunThroughTheRoundingInplaceVariant) {
  for (const auto& [name, dtype] : {std::pair{"bf16", at::kBFloat16}, {"f16", at::kHalf}, {"f32", at::kFloat}}) {
    const std::string t = std::string(name) + "[4096]";
    auto g = ir::parse("graph:\n  %x : " + t + " = input()\n  %y : " + t + " = aten::add.Tensor(%x, %x)\n  %m : " + t +
                       " = aten::mul.Scalar(%y, 0.9)\n  %z : " + t + " = aten::add.Tensor(%x, %x)\n  %a : " + t +
                       " = aten::add.Scalar(%z, 0.9)\n  return (%m, %a)\n");
    runtime::Executor ex(*g);
    const bool half = dtype != at::kFloat;
    EXPECT_EQ(ex.inplace_steps(), half ? 1u : 2u) << name;  // add.Scalar on %z; mul.Scalar on %y in float32 only
    for (const auto& node : g->nodes())
      if (node->name() == "m") EXPECT_EQ(ir::find_overwrite(*node).has_value(), !half) << name;
    at::manual_seed(0);
    const at::Tensor x = (at::randn({4096}) * 3).to(dtype);
    auto out = ex.run({x});
    EXPECT_TRUE(at::equal(out[0].toTensor(), at::mul(x + x, at::Scalar(0.9)))) << name;
    EXPECT_TRUE(at::equal(out[1].toTensor(), at::add(x + x, at::Scalar(0.9)))) << name;
  }
}

// The plan only says the input is read for the last time by its node; a view of it read later
// shares its storage, so the step must run functionally (else %v would read relu's result).
TEST(Executor, PointwiseStepsLeaveInputsThatAViewStillReads) {
  auto g = ir::parse(R"(graph:
  %x : f32[4,8] = input()
  %a : f32[4,8] = aten::sub.Tensor(%x, 0.5)
  %v : f32[32] = aten::view.default(%a, [32])
  %r : f32[4,8] = aten::relu.default(%a)
  %w : f32[4,8] = aten::view.default(%v, [4, 8])
  %s : f32[4,8] = aten::add.Tensor(%w, %r)
  return (%s)
)");
  runtime::Executor ex(*g);
  EXPECT_EQ(ex.inplace_steps(), 2u);  // relu on %a may, by the plan; add on %w too
  at::manual_seed(0);
  at::Tensor x = at::randn({4, 8});
  const at::Tensor a = x - 0.5;
  EXPECT_TRUE(at::equal(ex.run({x})[0].toTensor(), a + at::relu(a)));
}

// Kernel results of a run come from the executor's CallPool: a second run
// reuses the blocks the first one freed, and results the caller keeps stay valid after the executor.
TEST(Executor, KernelResultsReuseThePoolsBlocksAcrossRuns) {
  auto g = ir::parse(R"(graph:
  %x : f32[256,256] = input()
  %a : f32[256,256] = aten::mm.default(%x, %x)
  %b : f32[256,256] = aten::exp.default(%x)
  %c : f32[256,256] = aten::add.Tensor(%a, %b)
  %s : f32[] = aten::sum.default(%c)
  return (%s, %a)
)");
  at::manual_seed(0);
  at::Tensor x = at::randn({256, 256}) * 0.01;
  at::Tensor kept;
  {
    runtime::Executor ex(*g);
    auto first = ex.run({x});
    const int64_t reused_before = ex.call_pool().reused_blocks();
    first.clear();  // the caller drops the first results: their blocks go back to the pool
    auto second = ex.run({x});
    EXPECT_GT(ex.call_pool().reused_blocks(), reused_before);
    EXPECT_TRUE(at::equal(second[1].toTensor(), at::mm(x, x)));
    kept = second[1].toTensor();
  }
  EXPECT_TRUE(at::equal(kept, at::mm(x, x)));  // outlives the executor and its pool
}
