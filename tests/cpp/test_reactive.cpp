// Reactive engine: invalidation, demand, overlay restore, graft splicing, cycle rejection,
// and the exact counts of cost-model.md (E7) on text IR.
#include "ir/memory_plan.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "reactive/engine.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <torch/library.h>
#include <gtest/gtest.h>

#include "test_util.h"

#include <algorithm>
#include <functional>
#include <numeric>

using namespace torch_ext;
using torch_ext::testing::error_of;
using torch_ext::testing::out_kernel_chain;
using torch_ext::testing::with_input;

namespace {

// x -> n1 -> ... -> nN, each aten::sin (no fixed points, so every value differs).
std::string chain_text(int n, const std::string& op = "aten::sin.default") {
  std::string t = "graph:\n  %x : f32[4] = input()\n";
  std::string prev = "x";
  for (int i = 1; i <= n; ++i) {
    std::string name = "n" + std::to_string(i);
    t += "  %" + name + " : f32[4] = " + op + "(%" + prev + ")\n";
    prev = name;
  }
  return t + "  return (%" + prev + ")\n";
}

std::unique_ptr<ir::Graph> block_of(int h) {
  std::string t = "graph:\n  %a : f32[4] = input()\n";
  std::string prev = "a";
  for (int i = 1; i <= h; ++i) {
    std::string name = "b" + std::to_string(i);
    t += "  %" + name + " : f32[4] = aten::cos.default(%" + prev + ")\n";
    prev = name;
  }
  return ir::parse(t + "  return (%" + prev + ")\n");
}

int64_t evals_of_demand(reactive::Engine& e) {
  const int64_t before = e.stats().evaluations;
  e.demand();
  e.check_invariants();
  return e.stats().evaluations - before;
}


at::Tensor full_recompute(const ir::Graph& g, const at::Tensor& x) {
  reactive::Engine fresh(g);
  fresh.run({x});
  return fresh.demand()[0].toTensor();
}

}  // namespace

TEST(Reactive, PatchCostsExactlyTheStrictCone) {
  auto g = ir::parse(chain_text(50));
  reactive::Engine e(*g);
  at::Tensor x = at::randn({4});
  e.run({x});
  e.check_invariants();
  EXPECT_EQ(e.stats().evaluations, 50);
  const at::Tensor clean = e.demand()[0].toTensor().clone();
  for (int s : {1, 17, 49, 50}) {
    const std::string site = "n" + std::to_string(s);
    EXPECT_EQ(static_cast<int>(e.cone(site).size()), 50 - s);
    e.patch(site, at::zeros({4}));
    e.check_invariants();
    EXPECT_EQ(evals_of_demand(e), 50 - s);
    const int64_t before = e.stats().evaluations;
    e.restore();
    e.check_invariants();
    EXPECT_EQ(e.stats().evaluations, before) << "restore must not evaluate";
    EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), clean));
    EXPECT_EQ(e.stats().evaluations, before);
  }
}

TEST(Reactive, PatchedOutputsMatchFullRecomputation) {
  // A diamond with a multi-output op: the cone follows every path.
  auto g = ir::parse(R"(graph:
  %x : f32[6] = input()
  %a : f32[6] = aten::sin.default(%x)
  %b : f32[6] = aten::cos.default(%a)
  %c : f32[6] = aten::exp.default(%a)
  %d : f32[6] = aten::mul.Tensor(%b, %c)
  %s : (f32[3], f32[3]) = aten::split.Tensor(%d, 3)
  %s0 : f32[3] = getitem(%s, 0)
  %s1 : f32[3] = getitem(%s, 1)
  %o : f32[3] = aten::add.Tensor(%s0, %s1)
  return (%o, %c)
)");
  reactive::Engine e(*g);
  at::Tensor x = at::randn({6});
  e.run({x});
  EXPECT_EQ(e.cone("b"), (std::vector<std::string>{"d", "s", "s0", "s1", "o"}));
  at::Tensor pb = at::randn({6});
  e.patch("b", pb);
  EXPECT_FALSE(e.is_valid("d"));
  EXPECT_TRUE(e.is_valid("c"));
  EXPECT_EQ(evals_of_demand(e), 5);
  auto out = e.demand();
  at::Tensor d = pb * x.sin().exp();
  EXPECT_TRUE(at::equal(out[0].toTensor(), d.split(3)[0] + d.split(3)[1]));
  EXPECT_TRUE(at::equal(out[1].toTensor(), x.sin().exp()));
  // Demanding one node evaluates only its stale ancestors.
  e.restore();
  e.patch("a", at::randn({6}));
  const int64_t before = e.stats().evaluations;
  e.value("c");
  EXPECT_EQ(e.stats().evaluations - before, 1);
  e.check_invariants();
  EXPECT_EQ(evals_of_demand(e), 6);  // b, d, s, s0, s1, o
}

TEST(Reactive, RejectedMutationsChangeNothing) {
  auto g = ir::parse(chain_text(10));
  reactive::Engine e(*g);
  e.run({at::randn({4})});
  const std::string before = ir::print(e.graph());
  EXPECT_NE(error_of([&] { e.patch("nope", at::zeros({4})); }).find("unknown node 'nope'"), std::string::npos);
  EXPECT_NE(error_of([&] { e.patch("n3", at::zeros({5})); }).find("patch %n3: expected shape [4], got [5]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { e.patch("n3", at::zeros({4}, at::kDouble)); }).find("expected dtype torch.float32"),
            std::string::npos);
  auto block = block_of(3);
  EXPECT_NE(error_of([&] { e.graft("n5", "n3", *block, {}); }).find("would create a cycle"), std::string::npos);
  EXPECT_NE(error_of([&] { e.graft("n5", "n5", *block, {}); }).find("would create a cycle"), std::string::npos);
  EXPECT_NE(error_of([&] { e.graft("n3", "n7", *block, {}); }).find("no edge %n3 -> %n7"), std::string::npos);
  EXPECT_NE(error_of([&] { e.graft("n3", "zz", *block, {}); }).find("unknown node 'zz'"), std::string::npos);
  auto wrong = ir::parse("graph:\n  %a : f32[4] = input()\n  %s : f32[] = aten::sum.default(%a)\n  return (%s)\n");
  EXPECT_NE(error_of([&] { e.graft("n3", "n4", *wrong, {}); }).find("block output type f32[] differs"),
            std::string::npos);
  EXPECT_EQ(ir::print(e.graph()), before);
  EXPECT_EQ(e.num_dirty(), 0);
  EXPECT_EQ(e.stats().evaluations, 10);
  EXPECT_TRUE(e.pinned().empty());
  e.check_invariants();
}

TEST(Reactive, RefusesMutatingAndDropsDeadCode) {
  auto mut = ir::parse("graph:\n  %x : f32[4] = input()\n  %y : f32[4] = aten::relu_.default(%x)\n  return (%y)\n");
  EXPECT_NE(error_of([&] { reactive::Engine e(*mut); }).find("mutates its inputs"), std::string::npos);
  // Side-effect-free nodes that reach no output (export's _assert_tensor_metadata) are dropped, never evaluated.
  auto dead = ir::parse("graph:\n  %x : f32[4] = input()\n  %y : f32[4] = aten::sin.default(%x)\n  return (%x)\n");
  reactive::Engine e(*dead);
  EXPECT_EQ(e.num_countable(), 0);
  EXPECT_EQ(e.graph().find("y"), nullptr);
  at::Tensor x = at::randn({4});
  e.run({x});
  EXPECT_TRUE(e.demand()[0].toTensor().equal(x));
  EXPECT_EQ(e.stats().evaluations, 0);
}

// E7 of cost-model.md: a 400-node chain, 6 sites, blocks of 20 nodes, exact per-graft counts.
class E7 : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(E7, InterleavedGraftCountsAreExact) {
  const std::vector<int> sites = {57, 114, 171, 229, 286, 343};
  const std::vector<int> order = GetParam();
  auto g = ir::parse(chain_text(400));
  reactive::Engine e(*g);
  at::Tensor x = at::randn({4});
  e.run({x});
  auto block = block_of(20);
  std::vector<int64_t> measured;
  std::vector<int> done;
  for (int k : order) {
    const int site = sites[k - 1];
    const std::string u = "n" + std::to_string(site);
    const std::string w = "n" + std::to_string(site + 1);
    auto names = e.graft(u, w, *block, {});
    EXPECT_EQ(names.size(), 20u);
    e.check_invariants();
    measured.push_back(evals_of_demand(e));
    // Closed form: h + |D0(w)| + sum of h over earlier grafts whose site lies in D0(w).
    int64_t predicted = 20 + (400 - site);
    for (int j : done)
      if (sites[j - 1] > site) predicted += 20;
    EXPECT_EQ(measured.back(), predicted);
    done.push_back(k);
  }
  // Bit-identical to recomputing the grafted graph from scratch.
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full_recompute(e.graph(), x)));
  if (order == std::vector<int>{1, 2, 3, 4, 5, 6})
    EXPECT_EQ(measured, (std::vector<int64_t>{363, 306, 249, 191, 134, 77}));
  if (order == std::vector<int>{6, 5, 4, 3, 2, 1})
    EXPECT_EQ(measured, (std::vector<int64_t>{77, 154, 231, 309, 386, 463}));
  if (order == std::vector<int>{3, 4, 1, 6, 5, 2})
    EXPECT_EQ(measured, (std::vector<int64_t>{249, 191, 403, 77, 154, 386}));
}

TEST_P(E7, BatchedGraftsCost463InAnyOrder) {
  const std::vector<int> sites = {57, 114, 171, 229, 286, 343};
  auto g = ir::parse(chain_text(400));
  reactive::Engine e(*g);
  at::Tensor x = at::randn({4});
  e.run({x});
  auto block = block_of(20);
  e.begin_batch();
  for (int k : GetParam()) {
    const int site = sites[k - 1];
    e.graft("n" + std::to_string(site), "n" + std::to_string(site + 1), *block, {});
    e.check_invariants();
  }
  e.end_batch();
  EXPECT_EQ(evals_of_demand(e), 463);
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full_recompute(e.graph(), x)));
}

INSTANTIATE_TEST_SUITE_P(Orders, E7,
                         ::testing::Values(std::vector<int>{1, 2, 3, 4, 5, 6}, std::vector<int>{6, 5, 4, 3, 2, 1},
                                           std::vector<int>{3, 4, 1, 6, 5, 2}));

TEST(Reactive, NodeFormGraftReroutesEveryConsumer) {
  auto g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %a : f32[4] = aten::sin.default(%x)
  %b : f32[4] = aten::cos.default(%a)
  %c : f32[4] = aten::exp.default(%a)
  %d : f32[4] = aten::add.Tensor(%b, %c)
  return (%d)
)");
  reactive::Engine e(*g);
  at::Tensor x = at::randn({4});
  e.run({x});
  auto names = e.graft("a", "", *block_of(2), {});
  EXPECT_EQ(names, (std::vector<std::string>{"graft0_b1", "graft0_b2"}));
  EXPECT_EQ(evals_of_demand(e), 2 + 3);  // h + |V+(a)|
  at::Tensor a2 = x.sin().cos().cos();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), a2.cos() + a2.exp()));
}

TEST(Reactive, GraftUnderAPatchRestoresToTheNewBaseline) {
  auto g = ir::parse(chain_text(6));
  reactive::Engine e(*g);
  at::Tensor x = at::randn({4});
  e.run({x});
  e.patch("n2", at::ones({4}));
  e.demand();
  e.graft("n4", "n5", *block_of(1), {});
  e.check_invariants();
  e.demand();
  e.restore();
  e.check_invariants();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full_recompute(e.graph(), x)));
  // Graft, then patch inside one batch, then restore: the graft's cone is still recomputed.
  e.begin_batch();
  e.graft("n1", "n2", *block_of(1), {});
  e.patch("n3", at::ones({4}));
  e.end_batch();
  e.restore();
  e.check_invariants();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full_recompute(e.graph(), x)));
}

TEST(Reactive, PartialRestoreAndEarlyCutoff) {
  auto g = ir::parse(chain_text(8, "aten::relu.default"));
  reactive::Engine e(*g);
  at::Tensor x = at::rand({4}) + 1;  // positive, so relu is the identity
  e.run({x});
  e.patch("n2", at::ones({4}));
  e.patch("n6", at::ones({4}) * 2);
  e.demand();
  e.restore("n2");  // n6 stays pinned: D(n2) up to n6 is recomputed
  e.check_invariants();
  EXPECT_EQ(evals_of_demand(e), 4);  // n2..n5
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), at::ones({4}) * 2));
  e.restore();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), x));
  // With cutoff, a value that does not change stops propagation.
  e.set_cutoff(true);
  e.reset_stats();
  e.patch("n3", x.clone());
  EXPECT_EQ(evals_of_demand(e), 1);  // n4 recomputes to the same value; n5..n8 are cut off
  EXPECT_EQ(e.stats().cutoffs, 4);
}

TEST(Reactive, CutoffComparesBitsSoASignedZeroPropagates) {
  // -0.0 == 0.0 numerically, so cutoff used to stop at %a (recomputed as -0.0 where it held 0.0) and
  // %b kept +inf where 1/-0.0 is -inf. Cutoff now needs the same bits; equal bits still cut off
  // (NaNs included, which `==` never finds equal).
  auto g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %s : f32[4] = aten::relu.default(%x)
  %a : f32[4] = aten::mul.Tensor(%s, 1.0)
  %b : f32[4] = aten::reciprocal.default(%a)
  return (%b)
)");
  reactive::Engine e(*g);
  e.set_cutoff(true);
  e.run({at::tensor({-1.0f, 2.0f, -3.0f, 4.0f})});
  const at::Tensor patched = at::tensor({-0.0f, 2.0f, -0.0f, 4.0f});
  e.patch("s", patched);
  const at::Tensor out = e.demand()[0].toTensor();
  EXPECT_TRUE(at::equal(at::signbit(out), at::signbit(at::reciprocal(patched)))) << out;
  EXPECT_EQ(e.stats().cutoffs, 0);
  e.check_invariants();
  e.restore();
  const at::Tensor nan = at::tensor({NAN, 1.0f, NAN, 2.0f});
  e.run({nan});
  e.reset_stats();
  e.patch("s", at::relu(nan));  // the same bits as the cached value: %a and %b are cut off
  e.demand();
  EXPECT_EQ(e.stats().evaluations, 1);
  EXPECT_EQ(e.stats().cutoffs, 1);
  e.check_invariants();
}

TEST(Reactive, HundredThousandMutationsWithoutDrift) {
  auto g = ir::parse(chain_text(20));
  reactive::Engine e(*g);
  e.run({at::randn({4})});
  e.reset_stats();
  int64_t predicted = 0;
  uint32_t state = 12345;
  for (int i = 0; i < 100000; ++i) {
    state = state * 1664525u + 1013904223u;
    const int site = 1 + static_cast<int>((state >> 8) % 20);
    e.patch("n" + std::to_string(site), at::zeros({4}));
    if (i % 2 == 0) {
      e.demand();
      predicted += 20 - site;
    }
    e.restore();
  }
  EXPECT_EQ(e.stats().evaluations, predicted);
  e.check_invariants();
}

// Reaches the engine's private sets, so that each invariant of engine.h can be broken on purpose.
namespace torch_ext::reactive {
struct EngineTestPeer {
  static auto& dirty(Engine& e) { return e.dirty_; }
  static auto& structural_dirty(Engine& e) { return e.structural_dirty_; }
  static auto& baseline_stale(Engine& e) { return e.baseline_stale_; }
  static auto& overlay(Engine& e) { return e.overlay_; }
  static auto& pinned(Engine& e) { return e.pinned_; }
  static auto& revision(Engine& e) { return e.revision_; }
  static auto& grafts(Engine& e) { return e.grafts_; }
  static auto& stats(Engine& e) { return e.stats_; }
  static auto& batch_depth(Engine& e) { return e.batch_depth_; }
  static int64_t id(const Engine& e, const std::string& name) { return e.id_of(name); }
};
}  // namespace torch_ext::reactive

namespace {

using Peer = reactive::EngineTestPeer;

// A 6-node chain that has run, with n2 patched and demanded when `patched`; `corrupt` breaks one set,
// and check_invariants must then name it.
std::string violation(bool patched, const std::function<void(reactive::Engine&)>& corrupt) {
  auto g = ir::parse(chain_text(6));
  reactive::Engine e(*g);
  e.run({at::randn({4})});
  if (patched) {
    e.patch("n2", at::zeros({4}));
    e.demand();
  }
  e.check_invariants();
  corrupt(e);
  return error_of([&] { e.check_invariants(); });
}

}  // namespace

TEST(ReactiveInvariants, EverySetIsChecked) {
  auto has = [](const std::string& msg, const std::string& what) {
    return msg.find(what) != std::string::npos ? ::testing::AssertionSuccess()
                                               : ::testing::AssertionFailure() << "'" << msg << "' lacks " << what;
  };
  // I2: a valid node's entry in the dirty set, or an invalid node missing from it.
  EXPECT_TRUE(has(violation(false, [](auto& e) { Peer::dirty(e).insert({3, Peer::id(e, "n2")}); }), "I2 dirty"));
  EXPECT_TRUE(has(violation(false,
                            [](auto& e) {
                              e.patch("n1", at::ones({4}));
                              Peer::dirty(e).clear();
                            }),
                  "I2 dirty"));
  // I11: a valid node in structural_dirty_ would be revived by restore() with its old function's value.
  EXPECT_TRUE(has(violation(false, [](auto& e) { Peer::structural_dirty(e).insert(Peer::id(e, "n4")); }),
                  "I11 structural_dirty node %n4 is valid"));
  // I12: baseline_stale_ with no patch active, or holding no node.
  EXPECT_TRUE(has(violation(false, [](auto& e) { Peer::baseline_stale(e).insert(Peer::id(e, "n4")); }),
                  "I12 baseline_stale holds 1 nodes with no patch active"));
  EXPECT_TRUE(has(violation(true, [](auto& e) { Peer::baseline_stale(e).insert(99); }),
                  "I12 baseline_stale holds 99, which is no node"));
  // I6 / I10: the overlay and the pin list.
  EXPECT_TRUE(has(violation(false, [](auto& e) { Peer::overlay(e)[Peer::id(e, "n3")]; }), "I6 overlay"));
  EXPECT_TRUE(has(violation(true, [](auto& e) { Peer::overlay(e).erase(Peer::id(e, "n2")); }),
                  "I10 pinned invariant violated at %n2"));
  EXPECT_TRUE(has(violation(true, [](auto& e) { Peer::pinned(e).push_back(Peer::id(e, "n2")); }),
                  "I10 pinned list out of sync"));
  // I13: revisions and the graft record.
  EXPECT_TRUE(has(violation(true, [](auto& e) { Peer::revision(e) = 0; }), "I13 revision"));
  EXPECT_TRUE(has(violation(false, [](auto& e) { Peer::grafts(e).push_back({{Peer::id(e, "x")}, 1}); }),
                  "I13 grafts"));
  // I7 and I14: the ledger and the batch depth.
  EXPECT_TRUE(has(violation(false, [](auto& e) { ++Peer::stats(e).evaluations; }), "I7 ledger"));
  EXPECT_TRUE(has(violation(false, [](auto& e) { Peer::batch_depth(e) = -1; }), "I14 pending"));
}

// cost-model.md, batch mode (issue #10's case): five 3-node blocks grafted after nodes 220, 95, 260, 40
// and 150 of a 300-node chain, in that order, inside one batch. Nothing is invalidated before the batch
// ends; then one demand costs |U D0(w_k)| + sum h_k = |D0(n41)| + 15 = 260 + 15.
TEST(Reactive, BatchDefersInvalidationAndCostsTheBatchFormula) {
  const at::Tensor x = at::randn({4});
  const auto block = block_of(3);
  auto g = ir::parse(chain_text(300));
  reactive::Engine e(*g);
  e.run({x});
  e.begin_batch();
  for (int site : {220, 95, 260, 40, 150})
    e.graft("n" + std::to_string(site), "n" + std::to_string(site + 1), *block, {});
  EXPECT_EQ(e.num_pending(), 5);
  EXPECT_TRUE(Peer::dirty(e).empty()) << "invalidation waits for the end of the batch";
  e.end_batch();
  EXPECT_EQ(e.num_pending(), 0);
  EXPECT_EQ(e.num_dirty(), 260 + 15);
  EXPECT_EQ(evals_of_demand(e), 260 + 5 * 3);
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full_recompute(e.graph(), x)));
}

TEST(Reactive, AReadInsideABatchSettlesIt) {
  auto g = ir::parse(chain_text(10));
  reactive::Engine e(*g);
  e.run({at::randn({4})});
  e.begin_batch();
  e.begin_batch();  // batches nest: only the outermost end settles
  e.patch("n7", at::zeros({4}));
  e.graft("n2", "n3", *block_of(1), {});
  EXPECT_EQ(e.num_pending(), 2);
  EXPECT_FALSE(e.is_valid("n9"));  // a read sees the state of the mutations applied one by one
  EXPECT_EQ(e.num_pending(), 0);
  EXPECT_EQ(e.num_dirty(), 1 + 4 + 3);  // the block, n3..n6, n8..n10 (n7 is pinned)
  e.patch("n1", at::ones({4}));
  e.end_batch();
  EXPECT_EQ(e.num_pending(), 1);
  e.end_batch();
  EXPECT_EQ(e.num_pending(), 0);
  EXPECT_NE(error_of([&] { e.end_batch(); }).find("end_batch without begin_batch"), std::string::npos);
  e.check_invariants();
  EXPECT_EQ(evals_of_demand(e), 1 + 1 + 4 + 3);  // n2 too, below n1's patch
}

// A cone node with no out= kernel (relu) overwrites its one input in place when that input is a cone
// intermediate its own kernel allocated, dying there, no output and aliased by nothing: the bits
// equal a full Executor run, the site's value and every cached value are left as they were, and an
// input read again later, an output, the site's value or a view is never overwritten.
TEST(Reactive, InplaceStepsOverwriteOnlyDyingConeIntermediates) {
  const char* text = R"(graph:
  %x : f32[6,5] = input()
  %a : f32[6,5] = aten::relu.default(%x)
  %b : f32[6,5] = aten::relu.default(%a)
  %c : f32[6,5] = aten::relu.default(%b)
  %d : f32[6,5] = aten::relu.default(%c)
  %e : f32[6,5] = aten::add.Tensor(%d, %c)
  %f : f32[6,5] = aten::relu.default(%e)
  %v : f32[30] = aten::view.default(%f, [30])
  %g : f32[30] = aten::relu.default(%v)
  %h : f32[6,5] = aten::relu.default(%f)
  %k : f32[6,5] = aten::relu.default(%h)
  return (%g, %h, %k)
)";
  auto g = ir::parse(text);
  const at::Tensor x = at::randn({6, 5});
  reactive::Engine e(*g);
  e.run({x});
  const std::vector<at::Tensor> cached = {e.value("a").toTensor().clone(), e.value("c").toTensor().clone(),
                                          e.value("f").toTensor().clone(), e.value("h").toTensor().clone()};
  // Patching %a: %b reads the site (never written); %c overwrites %b; %d reads %c, which %e reads
  // later; %e has two inputs (and add.out writes it into the scratch), so %f allocates; %g reads a
  // view; %h overwrites %f (its view %v is dead by then: %g read it); %k reads %h, an output.
  EXPECT_EQ(e.inplace_steps("a"), 2);
  // The same graph with %a read from an input: a full recompute.
  runtime::Executor full(*ir::parse(with_input(text, "a")));
  for (int round = 0; round < 3; ++round) {
    const at::Tensor p = at::randn({6, 5});
    const at::Tensor p_copy = p.clone();
    const auto ref = full.run({x, p});
    const auto out = e.evaluate_patched("a", p);
    for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(out[k].toTensor(), ref[k].toTensor())) << round << " " << k;
    EXPECT_TRUE(at::equal(p, p_copy));  // the site's value is the caller's: never written
  }
  EXPECT_TRUE(at::equal(e.value("a").toTensor(), cached[0]));
  EXPECT_TRUE(at::equal(e.value("c").toTensor(), cached[1]));
  EXPECT_TRUE(at::equal(e.value("f").toTensor(), cached[2]));
  EXPECT_TRUE(at::equal(e.value("h").toTensor(), cached[3]));
  e.set_scratch(false);  // off: every step allocates, same bits
  const at::Tensor p = at::randn({6, 5});
  const auto ref = full.run({x, p});
  const auto out = e.evaluate_patched("a", p);
  for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(out[k].toTensor(), ref[k].toTensor())) << k;
  e.set_scratch(true);
  // Patching the graph input: %a's input is the site; %b overwrites %a.
  EXPECT_EQ(e.inplace_steps("x"), 3);
  const auto out_x = e.evaluate_patched("x", p);
  const auto ref_x = runtime::Executor(*g).run({p});
  for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(out_x[k].toTensor(), ref_x[k].toTensor())) << k;
  EXPECT_TRUE(at::equal(e.demand()[1].toTensor(), runtime::Executor(*g).run({x})[1].toTensor()));
  e.check_invariants();
}

// An op whose schema declares a fresh result may still hand back its input's tensor:
// aten::dropout with train=False returns its input, aten::type_as its self when the dtype already
// matches (torch.export's default IR keeps both). Such a "cone intermediate" is the caller's patch
// value, or a cached value from outside the cone, so overwriting it in place changes the caller's
// tensor, the cache, and every later reader of them. Composite ops like these are taken as aliasing
// (scratch.cpp); an op with a kernel of its own that does the same (torch_ext_test::pass_through
// below, registered here) is caught at run time: the step runs in place only on a tensor nothing
// else references. These graphs give the Executor's bits, leave the patch value and the cache as
// they were, and still run in place where the input is owned by the cone alone.
TORCH_LIBRARY_FRAGMENT(torch_ext_test, m) {
  m.def("pass_through(Tensor x, Tensor other) -> Tensor");  // returns x itself
  m.impl("pass_through", c10::DispatchKey::CPU, [](const at::Tensor& x, const at::Tensor&) { return x; });
  m.impl("pass_through", c10::DispatchKey::Meta,
         [](const at::Tensor& x, const at::Tensor&) { return at::empty_like(x); });
}

TEST(Reactive, InplaceStepNeverWritesATensorAnOpPassedThrough) {
  const char* text = R"(graph:
  %x : f32[6,5] = input()
  %a : f32[6,5] = aten::sin.default(%x)
  %c : f32[6,5] = aten::cos.default(%x)
  %t : f32[6,5] = aten::type_as.default(%c, %a)
  %r : f32[6,5] = aten::relu.default(%t)
  %o : f32[6,5] = aten::add.Tensor(%r, %c)
  %d : f32[6,5] = aten::dropout.default(%a, 0.5, False)
  %s : f32[6,5] = aten::relu.default(%d)
  %q : f32[6,5] = aten::add.Tensor(%s, %a)
  %k : f32[6,5] = torch_ext_test::pass_through.default(%a, %x)
  %m : f32[6,5] = aten::relu.default(%k)
  %n : f32[6,5] = aten::add.Tensor(%m, %a)
  %l : f32[6,5] = aten::pow.Tensor_Scalar(%x, 2)
  %j : f32[6,5] = torch_ext_test::pass_through.default(%l, %a)
  %z : f32[6,5] = aten::relu.default(%j)
  %zz : f32[6,5] = aten::add.Tensor(%z, %l)
  %e : f32[6,5] = aten::relu.default(%q)
  %f : f32[6,5] = torch_ext_test::pass_through.default(%e, %x)
  %g : f32[6,5] = aten::relu.default(%f)
  %h : f32[6,5] = aten::neg.default(%g)
  return (%o, %q, %n, %zz, %h)
)";
  auto g = ir::parse(text);
  const at::Tensor x = at::randn({6, 5});
  reactive::Engine e(*g);
  e.run({x});
  const at::Tensor cached_c = e.value("c").toTensor().clone();
  const at::Tensor cached_l = e.value("l").toTensor().clone();
  runtime::Executor full(*ir::parse(with_input(text, "a")));
  // Planned in place: %m, %z and %g (after pass_through, so checked at run time: %k is the patch
  // value, %j the cached %l, %f is %e's tensor, which only the cone holds), %h, and %r, %s, whose
  // inputs come from composite ops planned as fresh results (type_as hands back the cached %c, dropout
  // in eval mode the patch value: the run-time check sees another holder and runs the functional relu).
  EXPECT_EQ(e.inplace_steps("a"), 6);
  for (int round = 0; round < 3; ++round) {
    const at::Tensor p = at::randn({6, 5});
    const at::Tensor p_copy = p.clone();
    const auto ref = full.run({x, p});
    const auto out = e.evaluate_patched("a", p);
    for (size_t k = 0; k < 5; ++k) EXPECT_TRUE(at::equal(out[k].toTensor(), ref[k].toTensor())) << round << " " << k;
    EXPECT_TRUE(at::equal(p, p_copy)) << round;  // the caller's patch value: never written
    EXPECT_TRUE(at::equal(e.value("c").toTensor(), cached_c)) << round;  // cached values: never written
    EXPECT_TRUE(at::equal(e.value("l").toTensor(), cached_l)) << round;
    // %g overwrote %e's tensor and %h overwrote %g: the output %h is that tensor, written twice.
    EXPECT_EQ(out[4].toTensor()._version(), 2) << round;
  }
  const auto again = e.evaluate_patched("a", e.value("a"));
  const auto clean = runtime::Executor(*g).run({x});
  for (size_t k = 0; k < 5; ++k) EXPECT_TRUE(at::equal(again[k].toTensor(), clean[k].toTensor())) << k;
  e.check_invariants();
}

// A node that reads its dying input through two arguments cannot overwrite it: the in-place
// variant would read what it has already written (aten::index_put_ refuses the overlap, where the
// functional index_put computes the value). Such a node allocates, and gives the Executor's bits.
TEST(Reactive, InplaceStepNeedsItsInputInOneArgument) {
  const char* text = R"(graph:
  %x : i64[5] = input()
  %a : i64[5] = aten::neg.default(%x)
  %b : i64[5] = aten::relu.default(%a)
  %c : i64[5] = aten::index_put.default(%b, [%b], %b)
  %d : i64[5] = aten::relu.default(%c)
  return (%d)
)";
  auto g = ir::parse(text);
  reactive::Engine e(*g);
  e.run({at::tensor({-1, 0, -2, -4, -3}, at::kLong)});
  const at::Tensor p = at::tensor({2, 0, 1, 4, 3}, at::kLong);  // a permutation: %b is p
  const auto ref = runtime::Executor(*ir::parse(with_input(text, "a"))).run({at::zeros({5}, at::kLong), p});
  EXPECT_EQ(e.inplace_steps("a"), 1);  // %d overwrites %c; %c allocates
  const auto out = e.evaluate_patched("a", p);
  EXPECT_TRUE(at::equal(out[0].toTensor(), ref[0].toTensor()));
  e.check_invariants();
}

// A pointwise step whose one input is a scratch value that dies there runs its in-place variant on
// that input's buffer (the executor's rule, ir::find_overwrite), instead of writing its out= overload
// into a buffer of its own; the buffer then lives as long as the step's value. A value read later, a
// value handed out (an output) and the site's value are never written: each keeps its own memory.
TEST(Reactive, InplaceStepOnADyingScratchInputTakesItsBuffer) {
  const char* text = R"(graph:
  %x : f32[33,65] = input()
  %a : f32[33,65] = aten::sin.default(%x)
  %b : f32[33,65] = aten::sin.default(%a)
  %c : f32[33,65] = aten::sin.default(%b)
  %d : f32[33,65] = aten::cos.default(%c)
  %e : f32[33,65] = aten::tanh.default(%d)
  %f : f32[33,65] = aten::add.Tensor(%e, %b)
  %g : f32[33,65] = aten::exp.default(%f)
  %h : f32[33,65] = aten::neg.default(%g)
  %k : f32[33,65] = aten::sigmoid.default(%h)
  %m : f32[33,65] = aten::tanh.default(%f)
  return (%k, %e, %m)
)";
  auto g = ir::parse(text);
  const at::Tensor x = at::randn({33, 65});
  reactive::Engine e(*g);
  e.run({x});
  std::vector<at::Tensor> cached;
  for (const char* n : {"b", "c", "d", "e", "f", "g", "h"}) cached.push_back(e.value(n).toTensor().clone());
  // Patching %a: %b reads the site (out=, never writes it); %c reads %b, which %f reads later (out=);
  // %d overwrites %c; %e is an output (allocated by its kernel, never in the scratch); %f has two inputs
  // (out=); %g cannot overwrite %f, which %m reads later; %h overwrites %g; %k and %m are outputs.
  EXPECT_EQ(e.inplace_steps("a"), 2);
  std::string full_text = text;
  const std::string a_line = "  %a : f32[33,65] = aten::sin.default(%x)\n";
  full_text.replace(full_text.find(a_line), a_line.size(), "  %a : f32[33,65] = input()\n");
  runtime::Executor full(*ir::parse(full_text));
  std::vector<at::Tensor> held;  // outputs of earlier calls: no later call may write them
  std::vector<at::Tensor> held_copies;
  for (int round = 0; round < 3; ++round) {
    const at::Tensor p = at::randn({33, 65});
    const at::Tensor p_copy = p.clone();
    const auto ref = full.run({x, p});
    const auto out = e.evaluate_patched("a", p);
    for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(out[k].toTensor(), ref[k].toTensor())) << round << " " << k;
    EXPECT_TRUE(at::equal(p, p_copy)) << round;  // the site's value: never written
    for (size_t k = 0; k < 3; ++k) {
      held.push_back(out[k].toTensor());
      held_copies.push_back(out[k].toTensor().clone());
    }
  }
  for (size_t k = 0; k < held.size(); ++k) EXPECT_TRUE(at::equal(held[k], held_copies[k])) << k;
  const char* names[] = {"b", "c", "d", "e", "f", "g", "h"};
  for (size_t k = 0; k < cached.size(); ++k)
    EXPECT_TRUE(at::equal(e.value(names[k]).toTensor(), cached[k])) << names[k];
  // Buffers: %b [b, f]; %c's, taken over by %d [c, e]; %f's, taken over by %h [f, k]: two at once
  // (%b with %c, %b with %f). Out of place, %b, %c and %d were live at once.
  EXPECT_EQ(e.scratch_bytes(), 2 * ir::align_up(33 * 65 * 4));
  // The same bits with the scratch off (every step its functional kernel, fresh memory).
  const at::Tensor p = at::randn({33, 65});
  const auto on = e.evaluate_patched("a", p);
  e.set_scratch(false);
  const auto off = e.evaluate_patched("a", p);
  for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(on[k].toTensor(), off[k].toTensor())) << k;
  e.set_scratch(true);
  e.check_invariants();
}

// Running a pointwise op in place is exact: its in-place variant gives the bits of its functional
// kernel and of its out= overload, on every length (vectorised body and scalar tail) and dtype. The
// executor and the sweep's scratch rely on it (ir::find_overwrite).
TEST(Reactive, PointwiseInplaceVariantsGiveTheFunctionalBits) {
  using Fn = std::function<at::Tensor(const at::Tensor&)>;
  using InplaceFn = std::function<void(at::Tensor&)>;
  using OutFn = std::function<void(at::Tensor&, const at::Tensor&)>;
  struct Op {
    const char* name;
    Fn functional;
    InplaceFn inplace;
    OutFn out;
  };
  const std::vector<Op> ops = {
      {"sin", [](const at::Tensor& t) { return at::sin(t); }, [](at::Tensor& t) { t.sin_(); },
       [](at::Tensor& o, const at::Tensor& t) { at::sin_out(o, t); }},
      {"cos", [](const at::Tensor& t) { return at::cos(t); }, [](at::Tensor& t) { t.cos_(); },
       [](at::Tensor& o, const at::Tensor& t) { at::cos_out(o, t); }},
      {"tanh", [](const at::Tensor& t) { return at::tanh(t); }, [](at::Tensor& t) { t.tanh_(); },
       [](at::Tensor& o, const at::Tensor& t) { at::tanh_out(o, t); }},
      {"exp", [](const at::Tensor& t) { return at::exp(t); }, [](at::Tensor& t) { t.exp_(); },
       [](at::Tensor& o, const at::Tensor& t) { at::exp_out(o, t); }},
      {"sigmoid", [](const at::Tensor& t) { return at::sigmoid(t); }, [](at::Tensor& t) { t.sigmoid_(); },
       [](at::Tensor& o, const at::Tensor& t) { at::sigmoid_out(o, t); }},
      {"neg", [](const at::Tensor& t) { return at::neg(t); }, [](at::Tensor& t) { t.neg_(); },
       [](at::Tensor& o, const at::Tensor& t) { at::neg_out(o, t); }},
      {"gelu", [](const at::Tensor& t) { return at::gelu(t); }, [](at::Tensor& t) { at::gelu_(t); },
       [](at::Tensor& o, const at::Tensor& t) { at::gelu_out(o, t); }},
      {"silu", [](const at::Tensor& t) { return at::silu(t); }, [](at::Tensor& t) { at::silu_(t); },
       [](at::Tensor& o, const at::Tensor& t) { at::silu_out(o, t); }},
      {"relu", [](const at::Tensor& t) { return at::relu(t); }, [](at::Tensor& t) { t.relu_(); }, nullptr},
      {"erf", [](const at::Tensor& t) { return at::erf(t); }, [](at::Tensor& t) { t.erf_(); },
       [](at::Tensor& o, const at::Tensor& t) { at::erf_out(o, t); }},
  };
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    const at::ScalarType bits = dtype == at::kFloat ? at::kInt : dtype == at::kDouble ? at::kLong : at::kShort;
    for (const int64_t n : {1, 7, 31, 4096, 4099, 147456}) {
      const at::Tensor x = (at::randn({n}) * 4).to(dtype);
      for (const Op& op : ops) {
        const at::Tensor ref = op.functional(x);
        at::Tensor in_place = x.clone();
        op.inplace(in_place);
        EXPECT_TRUE(at::equal(in_place.view(bits), ref.view(bits))) << op.name << " " << dtype << " " << n;
        if (!op.out) continue;
        at::Tensor out = at::empty_like(x);
        op.out(out, x);
        EXPECT_TRUE(at::equal(out.view(bits), ref.view(bits))) << op.name << " " << dtype << " " << n;
      }
    }
  }
}

// A composite op may hand back its input although its schema declares a fresh result
// (aten::dropout with train=False, kept by torch.export in eval mode). Its input's scratch buffer
// must then live as long as the op's result: here %b's bytes were planned free after %d, %e was
// written over them, and %f read exp(a) + exp(a) for cos(a) + exp(a), silently.
TEST(Reactive, ScratchKeepsAPassedThroughBufferAliveWhileItsReaderIs) {
  const char* text = R"(graph:
  %x : f32[8] = input()
  %a : f32[8] = aten::sin.default(%x)
  %b : f32[8] = aten::cos.default(%a)
  %d : f32[8] = aten::dropout.default(%b, 0.5, False)
  %e : f32[8] = aten::exp.default(%a)
  %f : f32[8] = aten::add.Tensor(%d, %e)
  %t : f32[8] = aten::tanh.default(%a)
  %u : f32[8] = aten::type_as.default(%t, %a)
  %v : f32[8] = aten::sigmoid.default(%a)
  %w : f32[8] = aten::mul.Tensor(%u, %v)
  return (%f, %w, %d)
)";
  auto g = ir::parse(text);
  reactive::Engine e(*g);
  e.run({at::randn({8})});
  runtime::Executor full(*ir::parse(with_input(text, "a")));
  std::vector<c10::IValue> first;
  std::vector<at::Tensor> first_copy;
  for (int round = 0; round < 3; ++round) {
    const at::Tensor p = at::randn({8});
    const auto ref = full.run({at::zeros({8}), p});
    const auto out = e.evaluate_patched("a", p);
    for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(out[k].toTensor(), ref[k].toTensor())) << round << " " << k;
    if (round == 0)
      for (const auto& v : out) {
        first.push_back(v);
        first_copy.push_back(v.toTensor().clone());
      }
  }
  // %t's buffer lives until %w read %u; %b reaches an output through %d, so it is never scratch:
  // the outputs a caller keeps are not overwritten by the next sites.
  for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(first[k].toTensor(), first_copy[k])) << k;
  e.check_invariants();
}

// The sweep fast path writes cone intermediates into planned scratch memory (scratch.cpp): its
// outputs equal those of the functional kernels bit for bit, with the scratch on or off and
// against a full Executor run; a view that reaches an output keeps its own storage, so outputs
// handed out survive the next call; and each patched node's plan is built once and reused.
TEST(Reactive, ScratchFastPathIsExactAndPlannedOnce) {
  const char* text = R"(graph:
  %x : f32[8,8] = input()
  %w : f32[8,8] = input()
  %b : f32[8] = input()
  %a : f32[8,8] = aten::sin.default(%x)
  %l : f32[8,8] = aten::linear.default(%a, %w, %b)
  %g : f32[8,8] = aten::gelu.default(%l)
  %s : f32[8,8] = aten::sin.default(%g)
  %m : f32[8,8] = aten::mul.Tensor(%s, %g)
  %v : f32[64] = aten::view.default(%m, [64])
  %c : f32[64] = aten::cos.default(%v)
  %e : f32[8,8] = aten::exp.default(%s)
  %t : f32[8,8]{1,8} = aten::t.default(%e)
  return (%c, %t)
)";
  auto g = ir::parse(text);
  const at::Tensor x = at::randn({8, 8});
  const at::Tensor w = at::randn({8, 8});
  const at::Tensor bias = at::randn({8});
  reactive::Engine e(*g);
  e.run({x, w, bias});
  // The same graph with %a read from an input (after %x, %w, %b): a full recompute of the patched graph.
  runtime::Executor full(*ir::parse(with_input(text, "a")));
  const at::Tensor p1 = at::randn({8, 8});
  const at::Tensor p2 = at::randn({8, 8});
  const auto ref1 = full.run({x, w, bias, p1});
  const auto ref2 = full.run({x, w, bias, p2});
  const auto out1 = e.evaluate_patched("a", p1);
  EXPECT_EQ(e.plans_built(), 1);
  EXPECT_GT(e.scratch_bytes(), 0);  // l, g, s, m (through the view, freed after %c), e
  const at::Tensor keep_c = out1[0].toTensor().clone();
  const at::Tensor keep_t = out1[1].toTensor().clone();
  const auto out2 = e.evaluate_patched("a", p2);
  EXPECT_EQ(e.plans_built(), 1);  // reused
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_TRUE(at::equal(out1[k].toTensor(), ref1[k].toTensor())) << k;
    EXPECT_TRUE(at::equal(out2[k].toTensor(), ref2[k].toTensor())) << k;
  }
  // %t is a view of %e: %e must not live in the scratch, or the second call would have overwritten it.
  EXPECT_TRUE(at::equal(out1[0].toTensor(), keep_c));
  EXPECT_TRUE(at::equal(out1[1].toTensor(), keep_t));
  e.set_scratch(false);
  EXPECT_EQ(e.scratch_bytes(), 0);
  const auto out3 = e.evaluate_patched("a", p2);
  for (size_t k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(out3[k].toTensor(), ref2[k].toTensor())) << k;
  e.set_scratch(true);
  const auto out4 = e.evaluate_patched("a", p1);
  for (size_t k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(out4[k].toTensor(), ref1[k].toTensor())) << k;
  EXPECT_EQ(e.plans_built(), 1);
  // A larger cone grows the shared scratch; the first plan rebinds and stays exact.
  e.evaluate_patched("x", at::randn({8, 8}));
  EXPECT_EQ(e.plans_built(), 2);
  const auto out5 = e.evaluate_patched("a", p2);
  for (size_t k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(out5[k].toTensor(), ref2[k].toTensor())) << k;
  // Everything was put back: the cached values are the unpatched ones, and the ledger is exact.
  EXPECT_TRUE(at::equal(e.demand()[1].toTensor(), at::gelu(at::linear(x.sin(), w, bias)).sin().exp().t()));
  EXPECT_EQ(e.stats().evaluations, 9 + 5 * 8 + 9);
  e.check_invariants();
}

// Demand runs through the shared loop (runtime/run_loop.h): a kernel failing in the middle names the
// node, counts what ran before it, leaves it and every later node stale (I2), and a corrected patch
// then evaluates exactly those, with the values of a full recompute. Inside a transaction, rollback
// undoes the nodes that did run.
TEST(Reactive, AFailingNodeInDemandIsNamedAndLeavesTheRestStale) {
  const std::string text = R"(graph:
  %w : f32[10,4] = input()
  %i : i64[3] = input()
  %j : i64[3] = aten::clone.default(%i)
  %k : i64[3] = aten::add.Scalar(%j, 0)
  %e : f32[3,4] = aten::embedding.default(%w, %k)
  %o : f32[3,4] = aten::relu.default(%e)
  return (%o)
)";
  auto g = ir::parse(text);
  const at::Tensor w = at::randn({10, 4});
  const auto idx = [](std::vector<int64_t> v) { return at::tensor(v, at::kLong); };
  for (bool txn : {false, true}) {
    reactive::Engine e(*g);
    e.run({w, idx({1, 2, 3})});
    const at::Tensor clean = e.demand()[0].toTensor();
    e.reset_stats();
    if (txn) e.begin_transaction();
    e.patch("j", idx({1, 2, 99}));
    const std::string msg = error_of([&] { e.demand(); });
    EXPECT_NE(msg.find("while evaluating node %e: "), std::string::npos) << msg;
    EXPECT_NE(msg.find("out of range"), std::string::npos) << msg;
    e.check_invariants();
    EXPECT_EQ(e.stats().evaluations, 1);  // %k ran
    EXPECT_TRUE(e.is_valid("k"));
    EXPECT_FALSE(e.is_valid("e"));
    EXPECT_FALSE(e.is_valid("o"));
    if (txn) {
      e.rollback();
      e.check_invariants();
      EXPECT_TRUE(e.is_valid("k") && e.is_valid("e") && e.is_valid("o"));
      EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), clean));
      EXPECT_EQ(e.stats().evaluations, 1);
      continue;
    }
    e.patch("j", idx({4, 0, 9}));  // k, e and o again
    EXPECT_EQ(evals_of_demand(e), 3);
    reactive::Engine fresh(*g);
    fresh.run({w, idx({4, 0, 9})});
    EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), fresh.demand()[0].toTensor()));
    e.restore();
    EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), clean));
    EXPECT_EQ(e.stats().evaluations, 4);
    e.check_invariants();
  }
}

// Early cutoff through the shared loop's skip hook, and a cached input written in place: the demand
// refuses it naming the written node, leaves the reader stale, and recomputes the written one next.
TEST(Reactive, DemandChecksInputsBeforeCutoffSkipsANode) {
  auto g = ir::parse(chain_text(6, "aten::relu.default"));
  reactive::Engine e(*g);
  e.set_cutoff(true);
  const at::Tensor x = at::rand({4}) + 1;
  e.run({x});
  e.reset_stats();
  e.patch("n2", e.value("n2").toTensor().clone());  // same bits: n3 runs, n4..n6 are cut off
  EXPECT_EQ(evals_of_demand(e), 1);
  EXPECT_EQ(e.stats().cutoffs, 3);
  e.restore();
  e.patch("n2", at::ones({4}));
  e.value("n3").toTensor().add_(1);  // written in place under its reader n4
  const std::string msg = error_of([&] { e.demand(); });
  EXPECT_NE(msg.find("cached value of %n3 was modified in place"), std::string::npos) << msg;
  e.check_invariants();
  EXPECT_FALSE(e.is_valid("n3"));
  EXPECT_FALSE(e.is_valid("n4"));
  const int64_t before = e.stats().evaluations;
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), at::ones({4})));
  EXPECT_EQ(e.stats().evaluations - before, 4);  // n3..n6
  e.check_invariants();
}

// I15: a weight written in place (model.W.mul_(2), a weight edit) is an edit of that input. Before, the
// outputs computed from the old weight stayed valid and demand() returned them silently.
TEST(Reactive, AnInputWrittenInPlaceIsAnEditOfThatInput) {
  auto g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %w : f32[4] = param("w")
  %a : f32[4] = aten::sin.default(%x)
  %b : f32[4] = aten::mul.Tensor(%a, %w)
  %c : f32[4] = aten::cos.default(%b)
  %d : f32[4] = aten::exp.default(%a)
  return (%c, %d)
)");
  const at::Tensor x = at::rand({4});
  const at::Tensor w = at::rand({4});
  const auto full = [&] {
    reactive::Engine fresh(*g);
    fresh.run({x.clone(), w.clone()});
    return fresh.demand();
  };
  reactive::Engine e(*g);
  e.run({x, w});
  e.reset_stats();

  w.mul_(2);  // the user's tensor, held by the engine: no API call
  EXPECT_EQ(evals_of_demand(e), 2);  // V+(w) = {b, c}; a and d stand
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full()[0].toTensor()));
  EXPECT_EQ(e.input_edits(), 1);
  EXPECT_EQ(evals_of_demand(e), 0);  // taken once

  // Under a patch: the current values follow the edit, and restore() gives the new baseline, never the
  // one computed from the old weight.
  e.patch("a", at::ones({4}));
  e.demand();
  w.add_(1);
  e.demand();
  e.check_invariants();
  e.restore();
  auto after = e.demand();
  EXPECT_TRUE(at::equal(after[0].toTensor(), full()[0].toTensor()));
  EXPECT_TRUE(at::equal(after[1].toTensor(), full()[1].toTensor()));
  e.check_invariants();

  // A patched input's baseline (the user's tensor) written while the patch stands: restore() puts the
  // edited tensor back and recomputes its cone.
  e.patch("w", at::zeros({4}));
  e.demand();
  w.sub_(0.5);
  e.demand();
  e.restore();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full()[0].toTensor()));
  e.check_invariants();

  // Inside a transaction (a sweep's patch function or metric wrote into the model): refused, and the
  // edit is taken after the rollback.
  e.begin_transaction();
  e.patch("a", at::ones({4}));
  w.mul_(3);
  std::string msg = error_of([&] { e.demand(); });
  EXPECT_NE(msg.find("input %w of the graph"), std::string::npos) << msg;
  e.rollback();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full()[0].toTensor()));
  e.check_invariants();

  // While frozen (a sweep), and on the fast path (its patch function ran since the last read): refused.
  e.set_inputs_frozen(true);
  w.add_(1);
  msg = error_of([&] { e.demand(); });
  EXPECT_NE(msg.find("sweep: input %w"), std::string::npos) << msg;
  e.set_inputs_frozen(false);
  e.demand();
  w.add_(1);
  msg = error_of([&] { e.evaluate_patched("a", at::ones({4})); });
  EXPECT_NE(msg.find("evaluate_patched: input %w"), std::string::npos) << msg;
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), full()[0].toTensor()));
  e.check_invariants();
}

// The sweep's scratch checks every out= call as the arena does (runtime/arena_executor.h): an out= kernel that
// uses `out` as scratch of another shape (it threw "Trying to resize storage that is not resizable" out of
// evaluate_patched) or re-points it runs its functional kernel instead, from that call on, with the same bits;
// later plans leave the operator to its kernel. The ops are tests/cpp/test_out_kernel_ops.cpp's.
TEST(Reactive, ScratchOutKernelThatResizesOrRepointsItsResultFallsBack) {
  for (const char* op : {"scratch_sq_sum_resizing", "scratch_sq_sum_repointing"}) {
    const std::string text = out_kernel_chain(op);
    auto g = ir::parse(text);
    reactive::Engine e(*g);
    e.run({at::randn({16})});
    runtime::Executor full(*ir::parse(with_input(text, "a")));
    for (int round = 0; round < 3; ++round) {
      const at::Tensor p = at::randn({16});
      const auto out = e.evaluate_patched("a", p);
      EXPECT_TRUE(at::equal(out[0].toTensor(), full.run({at::zeros({16}), p})[0].toTensor())) << op << " " << round;
      EXPECT_EQ(e.scratch_fallbacks(), std::vector<std::string>{"l"}) << op << " " << round;  // once, from the first call
    }
    // Another plan (patching %x) leaves %l to its kernel: no failed first call, no second fallback.
    const at::Tensor x = at::randn({16});
    const auto out = e.evaluate_patched("x", x);
    const at::Tensor a = x.sin();
    EXPECT_TRUE(at::equal(out[0].toTensor(), at::cos(a * (a * a).sum()))) << op;
    EXPECT_EQ(e.scratch_fallbacks(), std::vector<std::string>{"l"}) << op;
    e.check_invariants();
  }
}
