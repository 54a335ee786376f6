// batch_cone pass: text IR in, golden text out; each stacked chunk equals the small graph patched
// with that variant; ops that would mix dim 0 are refused, naming the node.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/batch_cone.h"
#include "reactive/engine.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {
// %s is the site. %e is outside its cone and read by %m elementwise (lined up with dim 0: tiled),
// %w / %b are read whole by the linear, %pos broadcasts, %v spells out dim 0, %c stays outside.
const char* kSmall = R"(graph:
  %w : f32[6,4] = param("fc.weight")
  %b : f32[6] = param("fc.bias")
  %pos : f32[3,4] = param("pos")
  %x : f32[2,3,4] = input()
  %e : f32[2,3,4] = aten::add.Tensor(%x, %pos)
  %s : f32[2,3,4] = aten::sin.default(%e)
  %m : f32[2,3,4] = aten::mul.Tensor(%s, %e)
  %a : f32[2,3,4] = aten::add.Tensor(%m, %pos)
  %l : f32[2,3,6] = aten::linear.default(%a, %w, %b)
  %t : f32[2,6,3]{18,1,6} = aten::transpose.int(%l, 1, 2)
  %sm : f32[2,6,3]{18,3,1} = aten::_softmax.default(%t, -1, False)
  %v : f32[2,18] = aten::view.default(%sm, [2, 18])
  %c : f32[2,3,4] = aten::cos.default(%e)
  return (%v, %c)
)";

std::string with_op(const std::string& line) {
  return "graph:\n  %x : f32[2,3,4] = input()\n  %s : f32[2,3,4] = aten::sin.default(%x)\n" + line +
         "  return (%r)\n";
}

// Batch normalisation of the site over channels (dim 1), `training` True or False.
std::string with_batch_norm(const std::string& training) {
  return "graph:\n  %m : f32[3] = param(\"bn.running_mean\")\n  %x : f32[2,3,4] = input()\n"
         "  %s : f32[2,3,4] = aten::sin.default(%x)\n"
         "  %r : f32[2,3,4] = aten::batch_norm.default(%s, %m, %m, %m, %m, " +
         training + ", 0.1, 1e-05, False)\n  return (%r)\n";
}
}  // namespace

TEST(BatchCone, OnlyTheConeIsStackedAndExternalsAreReadOrTiled) {
  auto g = ir::parse(kSmall);
  const std::string before = ir::print(*g);
  auto r = passes::batch_cone(*g, "s", 3);
  ir::verify(*r.graph);
  EXPECT_EQ(ir::print(*g), before);  // the input graph is only read
  EXPECT_EQ(ir::print(*r.graph), R"(graph:
  %e_tiled : f32[6,3,4] = const()
  %pos : f32[3,4] = param("pos")
  %w : f32[6,4] = param("fc.weight")
  %b : f32[6] = param("fc.bias")
  %c : f32[2,3,4] = const()
  %s : f32[6,3,4] = input()
  %m : f32[6,3,4] = aten::mul.Tensor(%s, %e_tiled)
  %a : f32[6,3,4] = aten::add.Tensor(%m, %pos)
  %l : f32[6,3,6] = aten::linear.default(%a, %w, %b)
  %t : f32[6,6,3]{18,1,6} = aten::transpose.int(%l, 1, 2)
  %sm : f32[6,6,3] = aten::_softmax.default(%t, -1, False)
  %v : f32[6,18] = aten::view.default(%sm, [6, 18])
  return (%v, %c)
)");
  EXPECT_EQ(r.num_calls, 6);
  EXPECT_EQ(r.output_batched, (std::vector<bool>{true, false}));
  ASSERT_EQ(r.externals.size(), 5u);
  EXPECT_EQ(r.externals[0].source, "e");
  EXPECT_TRUE(r.externals[0].tiled);
  EXPECT_EQ(r.externals[4].placeholder, "c");
  EXPECT_FALSE(r.externals[4].tiled);
}

TEST(BatchCone, EachChunkIsTheSmallGraphPatchedWithThatVariant) {
  auto g = ir::parse(kSmall);
  auto r = passes::batch_cone(*g, "s", 3);
  at::manual_seed(0);
  const at::Tensor w = at::randn({6, 4}), b = at::randn({6}), pos = at::randn({3, 4}), x = at::randn({2, 3, 4});
  reactive::Engine small(*g);
  small.run({w, b, pos, x});
  const at::Tensor e = small.value("e").toTensor();
  std::vector<at::Tensor> variants;
  for (int i = 0; i < 3; ++i) variants.push_back(at::randn({2, 3, 4}));
  runtime::Executor big(*r.graph);
  const auto outs = big.run({e.repeat({3, 1, 1}), pos, w, b, small.value("c").toTensor(), at::cat(variants)});
  const auto chunks = outs.at(0).toTensor().chunk(3);
  for (int i = 0; i < 3; ++i) {
    small.patch("s", variants[i]);
    const auto want = small.demand();
    EXPECT_TRUE(at::equal(chunks[i], want.at(0).toTensor())) << "variant " << i;
    small.restore();
  }
  EXPECT_TRUE(outs.at(1).toTensor().is_same(small.value("c").toTensor()));
}

TEST(BatchCone, StopNodesCutTheConeAndDeadCallsAreDropped) {
  auto g = ir::parse(kSmall);
  auto r = passes::batch_cone(*g, "s", 2, {"m"});
  EXPECT_EQ(r.num_calls, 0);
  EXPECT_EQ(r.output_batched, (std::vector<bool>{false, false}));
  ir::verify(*r.graph);
  // A stop below the linear: %l is read as the pinned value, the rest of the cone is gone.
  auto r2 = passes::batch_cone(*g, "s", 2, {"l"});
  EXPECT_EQ(r2.num_calls, 0);
  auto r3 = passes::batch_cone(*g, "s", 2, {"t"});
  EXPECT_EQ(r3.num_calls, 0);
  auto r4 = passes::batch_cone(*g, "m", 2, {"t", "m"});  // the site itself is never a stop
  EXPECT_EQ(r4.num_calls, 0);
}

TEST(BatchCone, OpsThatMixEveryDimAreRefusedByName) {
  const auto refused = [](const std::string& line) {
    auto g = ir::parse(with_op(line));
    return error_of([&] { passes::batch_cone(*g, "s", 2); });
  };
  // Softmaxes along dims 0, 1 and 2 in turn: no dim of the site keeps the copies apart; each try names
  // the node that mixes it.
  const std::string every = refused(
      "  %a : f32[2,3,4] = aten::_softmax.default(%s, 0, False)\n"
      "  %b : f32[2,3,4] = aten::_softmax.default(%a, 1, False)\n"
      "  %r : f32[2,3,4] = aten::_softmax.default(%b, 2, False)\n");
  EXPECT_NE(every.find("%a (aten::_softmax.default) works along dim 0, where the stacked sites are"), std::string::npos)
      << every;
  EXPECT_NE(every.find("along dim 1 instead: %b (aten::_softmax.default) works along dim 1"), std::string::npos) << every;
  EXPECT_NE(every.find("along dim 2 instead: %r (aten::_softmax.default) works along dim 2"), std::string::npos) << every;
  EXPECT_NE(refused("  %r : f32[] = aten::sum.default(%s)\n").find("reduces over every dim"), std::string::npos);
  EXPECT_NE(refused("  %r : i64[2,3,4] = aten::argsort.default(%s, 0, False)\n").find("is not an op the pass can prove"),
            std::string::npos);
  // Batch normalisation with batch statistics (training mode) mixes dim 0; eval mode is kept (below).
  EXPECT_NE(error_of([&] {
              auto g = ir::parse(with_batch_norm("True"));
              passes::batch_cone(*g, "s", 2);
            }).find("%r (aten::batch_norm.default) normalises with batch statistics"),
            std::string::npos);
  // A linear whose *weight* comes from the cone mixes its rows.
  EXPECT_NE(refused("  %r : f32[2,3,2] = aten::linear.default(%x, %s)\n").find("reads %s (of the patched cone) as argument 1"),
            std::string::npos);
  // Along dim 0 the softmax mixes; along dim 1 the view [3, 2] splits the copies of [2, 3] across rows.
  auto g = ir::parse(R"(graph:
  %x : f32[2,3] = input()
  %s : f32[2,3] = aten::sin.default(%x)
  %a : f32[2,3] = aten::_softmax.default(%s, 0, False)
  %r : f32[3,2] = aten::view.default(%a, [3, 2])
  return (%r)
)");
  const std::string split = error_of([&] { passes::batch_cone(*g, "s", 2); });
  EXPECT_NE(split.find("along dim 1 instead: %r (aten::view.default) reshapes dim 1, where the stacked sites are"),
            std::string::npos)
      << split;
  // Two stacked inputs with their copies in different places do not line up.
  auto g2 = ir::parse(R"(graph:
  %x : f32[3,3] = input()
  %s : f32[3,3] = aten::sin.default(%x)
  %t : f32[3,3]{1,3} = aten::transpose.int(%s, 0, 1)
  %r : f32[3,3] = aten::add.Tensor(%s, %t)
  return (%r)
)");
  const std::string apart = error_of([&] { passes::batch_cone(*g2, "s", 2); });
  EXPECT_NE(apart.find("%r (aten::add.Tensor) reads %s with its stacked sites on dim 0 and %t with them on dim 1"),
            std::string::npos)
      << apart;
}

TEST(BatchCone, OpsAlongDimZeroStackTheSitesAlongAnotherDim) {
  // A softmax over dim 0 keeps copies stacked along dim 1 apart: the site placeholder (whole chunks of
  // dim 0, as it is bound) is moved to dim 1 and the output back to dim 0.
  auto g = ir::parse(with_op("  %r : f32[2,3,4] = aten::_softmax.default(%s, 0, False)\n"));
  auto r = passes::batch_cone(*g, "s", 2);
  ir::verify(*r.graph);
  EXPECT_EQ(ir::print(*r.graph), R"(graph:
  %s : f32[4,3,4] = input()
  %s_dim1_split : f32[2,2,3,4] = aten::reshape.default(%s, [2, 2, 3, 4])
  %s_dim1_moved : f32[2,2,3,4]{12,24,4,1} = aten::permute.default(%s_dim1_split, [1, 0, 2, 3])
  %s_dim1 : f32[2,6,4] = aten::reshape.default(%s_dim1_moved, [2, 6, 4])
  %r : f32[2,6,4] = aten::_softmax.default(%s_dim1, 0, False)
  %r_chunks_split : f32[2,2,3,4] = aten::reshape.default(%r, [2, 2, 3, 4])
  %r_chunks_moved : f32[2,2,3,4]{12,24,4,1} = aten::permute.default(%r_chunks_split, [1, 0, 2, 3])
  %r_chunks : f32[4,3,4] = aten::reshape.default(%r_chunks_moved, [4, 3, 4])
  return (%r_chunks)
)");
  EXPECT_EQ(r.num_calls, 7);
  const auto golden = [](const std::string& line) {
    auto g = ir::parse(with_op(line));
    auto r = passes::batch_cone(*g, "s", 2);
    ir::verify(*r.graph);
    return ir::print(*r.graph);
  };
  // transpose / permute / unsqueeze move the stacked dim with them (the output goes back to dim 0).
  EXPECT_NE(golden("  %r : f32[3,2,4]{4,12,1} = aten::transpose.int(%s, 0, 1)\n").find(
                "%r : f32[3,4,4]{4,12,1} = aten::transpose.int(%s, 0, 1)\n  %r_chunks_split : f32[3,2,2,4]{4,24,12,1} = "
                "aten::reshape.default(%r, [3, 2, 2, 4])"),
            std::string::npos);
  EXPECT_NE(golden("  %r : f32[4,3,2]{1,4,12} = aten::permute.default(%s, [2, 1, 0])\n").find(
                "%r : f32[4,3,4]{1,4,12} = aten::permute.default(%s, [2, 1, 0])"),
            std::string::npos);
  EXPECT_NE(golden("  %r : f32[1,2,3,4] = aten::unsqueeze.default(%s, 0)\n").find(
                "%r : f32[1,4,3,4] = aten::unsqueeze.default(%s, 0)\n  %r_chunks_split : f32[1,2,2,3,4]"),
            std::string::npos);
  // A reduction over dim 0 with the copies on dim 1: the output's dim 0 is the old dim 1.
  EXPECT_NE(golden("  %r : f32[3,4] = aten::sum.dim_IntList(%s, [0])\n").find("%r : f32[6,4] = aten::sum.dim_IntList(%s_dim1, [0])\n  return (%r)"),
            std::string::npos);
  // A full flatten: the copies stay outermost of the one dim.
  EXPECT_NE(golden("  %r : f32[24] = aten::flatten.using_ints(%s)\n").find("%r : f32[48] = aten::flatten.using_ints(%s)\n  return (%r)"),
            std::string::npos);
}

namespace {
// nn.MultiheadAttention's sequence-first [seq 2, batch 3, d 4] path, two heads: unflatten of the packed
// projection, views that split dim 1 into batch x heads, a transpose to [batch * heads, seq, d], a
// softmax over seq, then back: transpose, a view to [seq * batch, d] (the copies sit inside dim 0, every
// 3 rows), a linear on those rows, and a view back to [seq, batch, d].
const char* kSeqFirst = R"(graph:
  %w : f32[8,4] = param("in_proj.weight")
  %wo : f32[4,4] = param("out_proj.weight")
  %x : f32[2,3,4] = input()
  %s : f32[2,3,4] = aten::sin.default(%x)
  %p : f32[2,3,8] = aten::linear.default(%s, %w)
  %u : f32[2,3,2,4] = aten::unflatten.int(%p, -1, [2, 4])
  %q : f32[2,3,4]{24,8,1} = aten::select.int(%u, 2, 0)
  %qc : f32[2,3,4] = aten::contiguous.default(%q)
  %v : f32[2,6,2] = aten::view.default(%qc, [2, 6, 2])
  %t : f32[6,2,2]{2,12,1} = aten::transpose.int(%v, 0, 1)
  %a : f32[6,2,2] = aten::_softmax.default(%t, 1, False)
  %b : f32[2,6,2]{2,4,1} = aten::transpose.int(%a, 0, 1)
  %c : f32[2,6,2] = aten::contiguous.default(%b)
  %f : f32[6,4] = aten::view.default(%c, [6, 4])
  %o : f32[6,4] = aten::linear.default(%f, %wo)
  %back : f32[2,3,4] = aten::view.default(%o, [2, 3, 4])
  %r : f32[2,3,4] = aten::add.Tensor(%x, %back)
  return (%r)
)";
}  // namespace

TEST(BatchCone, SequenceFirstAttentionStacksTheSitesAlongTheBatchDim) {
  auto g = ir::parse(kSeqFirst);
  auto r = passes::batch_cone(*g, "s", 2);
  ir::verify(*r.graph);
  // Along dim 0 (seq) the softmax over seq would mix the copies; along dim 1 (batch) they stay apart:
  // %s moves to dim 1, %v splits batch x heads (the copies outermost), %f = [seq * batch, d] holds them
  // every 3 rows of dim 0, %back puts them on batch again, %x is tiled onto dim 1, %r goes back to dim 0.
  EXPECT_EQ(ir::print(*r.graph), R"(graph:
  %w : f32[8,4] = param("in_proj.weight")
  %wo : f32[4,4] = param("out_proj.weight")
  %x_tiled : f32[4,3,4] = const()
  %s : f32[4,3,4] = input()
  %s_dim1_split : f32[2,2,3,4] = aten::reshape.default(%s, [2, 2, 3, 4])
  %s_dim1_moved : f32[2,2,3,4]{12,24,4,1} = aten::permute.default(%s_dim1_split, [1, 0, 2, 3])
  %s_dim1 : f32[2,6,4] = aten::reshape.default(%s_dim1_moved, [2, 6, 4])
  %p : f32[2,6,8] = aten::linear.default(%s_dim1, %w)
  %u : f32[2,6,2,4] = aten::unflatten.int(%p, -1, [2, 4])
  %q : f32[2,6,4]{48,8,1} = aten::select.int(%u, 2, 0)
  %qc : f32[2,6,4] = aten::contiguous.default(%q)
  %v : f32[2,12,2] = aten::view.default(%qc, [2, 12, 2])
  %t : f32[12,2,2]{2,24,1} = aten::transpose.int(%v, 0, 1)
  %a : f32[12,2,2] = aten::_softmax.default(%t, 1, False)
  %b : f32[2,12,2]{2,4,1} = aten::transpose.int(%a, 0, 1)
  %c : f32[2,12,2] = aten::contiguous.default(%b)
  %f : f32[12,4] = aten::view.default(%c, [12, 4])
  %o : f32[12,4] = aten::linear.default(%f, %wo)
  %back : f32[2,6,4] = aten::view.default(%o, [2, 6, 4])
  %x_dim1_split : f32[2,2,3,4] = aten::reshape.default(%x_tiled, [2, 2, 3, 4])
  %x_dim1_moved : f32[2,2,3,4]{12,24,4,1} = aten::permute.default(%x_dim1_split, [1, 0, 2, 3])
  %x_dim1 : f32[2,6,4] = aten::reshape.default(%x_dim1_moved, [2, 6, 4])
  %r : f32[2,6,4] = aten::add.Tensor(%x_dim1, %back)
  %r_chunks_split : f32[2,2,3,4] = aten::reshape.default(%r, [2, 2, 3, 4])
  %r_chunks_moved : f32[2,2,3,4]{12,24,4,1} = aten::permute.default(%r_chunks_split, [1, 0, 2, 3])
  %r_chunks : f32[4,3,4] = aten::reshape.default(%r_chunks_moved, [4, 3, 4])
  return (%r_chunks)
)");
  EXPECT_EQ(r.num_calls, 22);
  ASSERT_EQ(r.externals.size(), 3u);
  EXPECT_EQ(r.externals[2].source, "x");
  EXPECT_TRUE(r.externals[2].tiled);
}

TEST(BatchCone, SequenceFirstChunksAreTheSmallGraphPatched) {
  auto g = ir::parse(kSeqFirst);
  auto r = passes::batch_cone(*g, "s", 3);
  at::manual_seed(0);
  const at::Tensor w = at::randn({8, 4}), wo = at::randn({4, 4}), x = at::randn({2, 3, 4});
  reactive::Engine small(*g);
  small.run({w, wo, x});
  std::vector<at::Tensor> variants;
  for (int i = 0; i < 3; ++i) variants.push_back(at::randn({2, 3, 4}));
  std::vector<c10::IValue> bound;
  for (const auto& e : r.externals) {
    const at::Tensor v = small.value(e.source).toTensor();
    std::vector<int64_t> times(v.dim(), 1);
    times[0] = e.copies;
    bound.emplace_back(e.tiled ? v.repeat(times) : v);
  }
  bound.push_back(at::cat(variants));
  runtime::Executor big(*r.graph);
  const auto outs = big.run(bound);
  const auto chunks = outs.at(0).toTensor().chunk(3);
  for (int i = 0; i < 3; ++i) {
    small.patch("s", variants[i]);
    const at::Tensor want = small.demand().at(0).toTensor();
    // The batched linears run on other row counts (other GEMM blocking): ulps apart, at the batched sweep
    // tests' tolerance; a copy mixed with another would be off by O(1).
    EXPECT_TRUE(at::allclose(chunks[i], want, 1e-5, 1e-6)) << "variant " << i << ": " << (chunks[i] - want).abs().max();
    EXPECT_FALSE(at::allclose(chunks[i], chunks[(i + 1) % 3], 1e-2, 1e-2)) << "variant " << i;
    small.restore();
  }
}

TEST(BatchCone, FullSliceOfDimZeroAndKeptOpsPass) {
  auto g = ir::parse(with_op("  %q : f32[2,3,4] = aten::slice.Tensor(%s, 0, 0, 9223372036854775807)\n"
                             "  %r : f32[2,3,4] = aten::_softmax.default(%q, 1, False)\n"));
  auto r = passes::batch_cone(*g, "s", 4);
  ir::verify(*r.graph);
  EXPECT_NE(ir::print(*r.graph).find("%r : f32[8,3,4] = aten::_softmax.default(%q, 1, False)"), std::string::npos);
  EXPECT_NE(error_of([&] { passes::batch_cone(*g, "nope", 2); }).find("no node named '%nope'"), std::string::npos);
  // Eval-mode batch normalisation reads running statistics, element by element along dim 1.
  auto flat = ir::parse(with_op("  %r : f32[2,12] = aten::flatten.using_ints(%s, 1)\n"));
  EXPECT_NE(ir::print(*passes::batch_cone(*flat, "s", 3).graph).find("%r : f32[6,12] = aten::flatten.using_ints(%s, 1)"),
            std::string::npos);
  auto bn = ir::parse(with_batch_norm("False"));
  auto rb = passes::batch_cone(*bn, "s", 4);
  ir::verify(*rb.graph);
  EXPECT_NE(ir::print(*rb.graph).find("%r : f32[8,3,4] = aten::batch_norm.default("), std::string::npos);
  EXPECT_NE(error_of([&] { passes::batch_cone(*g, "s", 0); }).find("k must be >= 1"), std::string::npos);
}

namespace {
// A chain with two entries: %s (the first) and %t, in %s's cone. %x is read lined up (tiled per reader),
// %v reads %s again below %t's entry, so %s is padded with its clean value for %t's copy.
const char* kChain = R"(graph:
  %w : f32[4,4] = param("fc.weight")
  %x : f32[2,3,4] = input()
  %s : f32[2,3,4] = aten::sin.default(%x)
  %l : f32[2,3,4] = aten::linear.default(%s, %w)
  %t : f32[2,3,4] = aten::add.Tensor(%l, %s)
  %u : f32[2,3,4] = aten::mul.Tensor(%t, %x)
  %v : f32[2,3,4] = aten::add.Tensor(%u, %s)
  return (%v)
)";
}  // namespace

TEST(BatchCone, EntriesAlongAChainGrowTheBatchAtEachEntry) {
  auto g = ir::parse(kChain);
  const std::string before = ir::print(*g);
  auto r = passes::batch_cone(*g, std::vector<passes::BatchConeEntry>{{"s", 2}, {"t", 1}});
  ir::verify(*r.graph);
  EXPECT_EQ(ir::print(*g), before);
  EXPECT_EQ(ir::print(*r.graph), R"(graph:
  %w : f32[4,4] = param("fc.weight")
  %x_tiled : f32[6,3,4] = const()
  %s_tiled1 : f32[2,3,4] = const()
  %s : f32[6,3,4] = input()
  %s_copies : f32[4,3,4] = aten::slice.Tensor(%s, 0, 0, 4, 1)
  %l : f32[4,3,4] = aten::linear.default(%s_copies, %w)
  %t : f32[4,3,4] = aten::add.Tensor(%l, %s_copies)
  %t_copies : f32[2,3,4] = aten::slice.Tensor(%s, 0, 4, 6, 1)
  %t_joined : f32[6,3,4] = aten::cat.default([%t, %t_copies], 0)
  %u : f32[6,3,4] = aten::mul.Tensor(%t_joined, %x_tiled)
  %s_pad3 : f32[6,3,4] = aten::cat.default([%s_copies, %s_tiled1], 0)
  %v : f32[6,3,4] = aten::add.Tensor(%u, %s_pad3)
  return (%v)
)");
  EXPECT_EQ(r.num_calls, 8);  // the cone's 4 calls, 2 entry slices, 1 join, 1 pad
  EXPECT_EQ(r.output_batched, (std::vector<bool>{true}));
  ASSERT_EQ(r.externals.size(), 3u);
  EXPECT_EQ(r.externals[1].source, "x");
  EXPECT_EQ(r.externals[1].copies, 3);
  EXPECT_EQ(r.externals[2].source, "s");
  EXPECT_EQ(r.externals[2].copies, 1);
  // One entry is the single-site form, text for text.
  EXPECT_EQ(ir::print(*passes::batch_cone(*g, std::vector<passes::BatchConeEntry>{{"s", 3}}).graph),
            ir::print(*passes::batch_cone(*g, "s", 3).graph));
}

TEST(BatchCone, EachEntrysCopyIsTheSmallGraphPatchedAtItsOwnNode) {
  auto g = ir::parse(kChain);
  auto r = passes::batch_cone(*g, std::vector<passes::BatchConeEntry>{{"s", 2}, {"t", 1}});
  at::manual_seed(0);
  const at::Tensor w = at::randn({4, 4}), x = at::randn({2, 3, 4});
  reactive::Engine small(*g);
  small.run({w, x});
  const at::Tensor s = small.value("s").toTensor(), t = small.value("t").toTensor();
  const std::vector<at::Tensor> variants = {at::randn({2, 3, 4}), at::randn({2, 3, 4}), at::randn({2, 3, 4})};
  runtime::Executor big(*r.graph);
  const auto outs = big.run({w, x.repeat({3, 1, 1}), s, at::cat(variants)});
  const auto chunks = outs.at(0).toTensor().chunk(3);
  const char* at_node[] = {"s", "s", "t"};
  for (int i = 0; i < 3; ++i) {
    small.patch(at_node[i], variants[i]);
    const auto want = small.demand();
    EXPECT_TRUE(at::equal(chunks[i], want.at(0).toTensor())) << "copy " << i << " entering at %" << at_node[i];
    small.restore();
    // The same value entering at the other node gives another answer: the test tells the entries apart.
    small.patch(i < 2 ? "t" : "s", variants[i]);
    EXPECT_FALSE(at::allclose(chunks[i], small.demand().at(0).toTensor())) << "copy " << i;
    small.restore();
  }
}

TEST(BatchCone, EntriesOffOneChainAreRefused) {
  auto g = ir::parse(kChain);
  using E = std::vector<passes::BatchConeEntry>;
  EXPECT_NE(error_of([&] { passes::batch_cone(*g, E{{"t", 1}, {"s", 1}}); })
                .find("entry %s is not in the cone of the entry before it, %t"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::batch_cone(*g, E{{"s", 1}, {"s", 1}}); }).find("entry %s is given twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::batch_cone(*g, E{{"s", 1}, {"t", 0}}); }).find("k must be >= 1, got 0 for entry %t"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::batch_cone(*g, E{{"s", 1}, {"t", 1}}, {"t"}); }).find("entry %t is pinned"),
            std::string::npos);
  auto wide = ir::parse(R"(graph:
  %x : f32[2,3,4] = input()
  %s : f32[2,3,4] = aten::sin.default(%x)
  %t : f32[2,3] = aten::sum.dim_IntList(%s, [2])
  %r : f32[2,3] = aten::cos.default(%t)
  return (%r)
)");
  EXPECT_NE(error_of([&] { passes::batch_cone(*wide, E{{"s", 1}, {"t", 1}}); }).find("one placeholder holds every entry's copies"),
            std::string::npos);
}

namespace {
// Runs the batched graph of `g` at site %s with k variants and compares each output chunk with the small
// graph patched with that variant (the externals bound as sweep binds them: tiled along dim 0).
void expect_chunks_are_the_small_graph_patched(const ir::Graph& g, int64_t k) {
  auto r = passes::batch_cone(g, "s", k);
  at::manual_seed(3);
  reactive::Engine small(g);
  std::vector<c10::IValue> inputs;
  for (const ir::Node* p : g.placeholders()) inputs.emplace_back(at::randn(p->type().tensor.sizes));
  small.run(inputs);
  const at::Tensor clean = small.value("s").toTensor();
  std::vector<at::Tensor> variants;
  for (int64_t i = 0; i < k; ++i) variants.push_back(at::randn(clean.sizes()));
  std::vector<c10::IValue> bound;
  for (const auto& e : r.externals) {
    const at::Tensor v = small.value(e.source).toTensor();
    std::vector<int64_t> times(v.dim(), 1);
    if (e.tiled) times[0] = e.copies;
    bound.emplace_back(e.tiled ? v.repeat(times) : v);
  }
  bound.emplace_back(at::cat(variants));
  const auto outs = runtime::Executor(*r.graph).run(bound);
  const auto chunks = outs.at(0).toTensor().chunk(k);
  for (int64_t i = 0; i < k; ++i) {
    small.patch("s", variants[i]);
    const at::Tensor want = small.demand().at(0).toTensor();
    EXPECT_TRUE(at::allclose(chunks[i], want, 1e-5, 1e-6)) << ir::print(*r.graph) << "variant " << i;
    small.restore();
  }
}
}  // namespace

TEST(BatchCone, EachRuleMovesTheStackedDimWithTheOp) {
  // %a softmaxes over dim 0, so the copies go to dim 1 ([2, 6, 4] at k = 2); each op below moves them.
  const std::string pre =
      "graph:\n  %x : f32[2,3,4] = input()\n  %s : f32[2,3,4] = aten::sin.default(%x)\n"
      "  %a : f32[2,3,4] = aten::_softmax.default(%s, 0, False)\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"  %r : f32[3,4] = aten::select.int(%a, 0, 1)\n", "%r : f32[6,4] = aten::select.int(%a, 0, 1)"},
      {"  %u : f32[1,2,3,4] = aten::unsqueeze.default(%a, 0)\n  %r : f32[2,3,4] = aten::squeeze.dim(%u, 0)\n",
       "%r : f32[2,6,4] = aten::squeeze.dim(%u, 0)"},
      {"  %r : f32[2,2,3,4] = aten::stack.default([%a, %a])\n", "%r : f32[2,2,6,4] = aten::stack.default([%a, %a])"},
      {"  %u : f32[1,2,3,4] = aten::unsqueeze.default(%a, 0)\n"
       "  %r : f32[5,2,3,4]{0,12,4,1} = aten::expand.default(%u, [5, -1, -1, -1])\n",
       "%r : f32[5,2,6,4]{0,24,4,1} = aten::expand.default(%u, [5, 2, 6, 4])"},
      {"  %r : f32[2,12] = aten::flatten.using_ints(%a, 1)\n", "%r : f32[2,24] = aten::flatten.using_ints(%a, 1)"},
      {"  %r : f32[4,3,4] = aten::cat.default([%a, %a])\n", "%r : f32[4,6,4] = aten::cat.default([%a, %a])"},
      {"  %r : f32[2,3,4] = aten::slice.Tensor(%a, 1, 0, 9223372036854775807)\n",
       "%r : f32[2,6,4] = aten::slice.Tensor(%a, 1, 0, 9223372036854775807)"},
      {"  %t : (f32[3,4], f32[3,4]) = aten::unbind.int(%a)\n  %r : f32[3,4] = getitem(%t, 1)\n",
       "%t : (f32[6,4], f32[6,4]) = aten::unbind.int(%a)"},
      {"  %r : f32[3,4] = aten::sum.dim_IntList(%a, [0])\n", "%r : f32[6,4] = aten::sum.dim_IntList(%a, [0])"},
      // Only the left matrix stacked: its rows (dim 1) are rows of the product.
      {"  %xt : f32[2,4,3]{12,1,4} = aten::transpose.int(%x, 1, 2)\n"
       "  %r : f32[2,3,3] = aten::matmul.default(%a, %xt)\n",
       "%r : f32[2,6,3] = aten::matmul.default(%a, %xt)"},
  };
  for (const auto& [line, want] : cases) {
    auto g = ir::parse(pre + line + "  return (%r)\n");
    auto r = passes::batch_cone(*g, "s", 2);
    ir::verify(*r.graph);
    const std::string text = ir::print(*r.graph);
    EXPECT_NE(text.find("%a : f32[2,6,4] = aten::_softmax.default(%s_dim1, 0, False)"), std::string::npos) << text;
    EXPECT_NE(text.find(want), std::string::npos) << text;
    expect_chunks_are_the_small_graph_patched(*g, 3);
  }
  // Both matrices stacked (copy i must meet copy i): only along a batch dim; here refused.
  auto both = ir::parse(pre + "  %at : f32[2,4,3]{12,1,4} = aten::transpose.int(%a, 1, 2)\n"
                              "  %r : f32[2,3,3] = aten::matmul.default(%a, %at)\n  return (%r)\n");
  EXPECT_NE(error_of([&] { passes::batch_cone(*both, "s", 2); })
                .find("along dim 1 instead: %r (aten::matmul.default) reads %a with its stacked sites on dim 1 and %at with "
                      "them on dim 2, which do not line up"),
            std::string::npos);
}

TEST(BatchCone, SequenceFirstAttentionChunksAtSeqEqualToBatch) {
  // [seq 3, batch 3]: the sizes cannot tell seq from batch; the ops do.
  std::string text = kSeqFirst;
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"[2,3,", "[3,3,"}, {"[2, 6, 2]", "[3, 6, 2]"}, {"[2,6,2]", "[3,6,2]"}, {"[6,2,2]", "[6,3,2]"},
           {"{2,4,1}", "{2,6,1}"}, {"[6,4]", "[9,4]"}, {"[6, 4]", "[9, 4]"}, {"[2, 3, 4]", "[3, 3, 4]"}}) {
    for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
      text.replace(at, from.size(), to);
  }
  auto g = ir::parse(text);
  EXPECT_NE(ir::print(*passes::batch_cone(*g, "s", 2).graph).find("%s_dim1 : f32[3,6,4]"), std::string::npos);
  expect_chunks_are_the_small_graph_patched(*g, 3);
}
