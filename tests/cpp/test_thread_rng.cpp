// thread_rng: dropout draws from an explicit generator-state input, chained in graph order.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/thread_rng.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "test_util.h"

#include <functional>
#include <tuple>
#include <vector>

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

const char* kTwoDropouts = R"(graph:
  %x : f32[64] = input()
  %d : (f32[64], b8[64]) = aten::native_dropout.default(%x, 0.5, True)
  %o : f32[64] = getitem(%d, 0)
  %d2 : (f32[64], b8[64]) = aten::native_dropout.default(%o, 0.25, True)
  %o2 : f32[64] = getitem(%d2, 0)
  %m2 : b8[64] = getitem(%d2, 1)
  return (%o2, %m2)
)";

at::Tensor seeded_state(uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return g.get_state();
}

// Runs `draws` (eager ATen calls) on the global CPU generator set to `state`, puts the generator back, and
// returns the state the draws left: what the threaded graph's final state must equal.
at::Tensor eager_from(const at::Tensor& state, const std::function<void()>& draws) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor saved = gen.get_state();
  gen.set_state(state);
  draws();
  const at::Tensor after = gen.get_state();
  gen.set_state(saved);
  return after;
}

// thread_rng on `text` finds nothing to thread: it returns no state and leaves the graph as parsed.
void expect_left_alone(const std::string& text) {
  auto g = ir::parse(text);
  EXPECT_EQ(passes::thread_rng(*g), nullptr);
  EXPECT_EQ(ir::print(*g), text);
}

// thread_rng on `text` refuses with a message holding `msg`, and leaves the graph as parsed.
void expect_refused(const std::string& text, const std::string& msg) {
  auto g = ir::parse(text);
  const std::string got = error_of([&] { passes::thread_rng(*g); });
  EXPECT_NE(got.find(msg), std::string::npos) << got;
  EXPECT_EQ(ir::print(*g), text);
}

// Each of `lines` stands in `printed` (a threaded graph's text).
void expect_has(const std::string& printed, const std::vector<std::string>& lines) {
  for (const std::string& line : lines) EXPECT_NE(printed.find(line), std::string::npos) << line << "\n" << printed;
}

// `text` with its draws threaded through one state by thread_rng, checked by the verifier when threaded.
struct Threaded {
  std::unique_ptr<ir::Graph> graph;
  ir::Node* state = nullptr;  // the state the last draw leaves; null: nothing was threaded
  std::string printed;        // the threaded graph's text
};
Threaded threaded(const std::string& text) {
  Threaded t{ir::parse(text)};
  t.state = passes::thread_rng(*t.graph);
  if (t.state != nullptr) ir::verify(*t.graph);
  t.printed = ir::print(*t.graph);
  return t;
}

// Appends the threaded state to the graph's outputs, so a run returns the state its draws left.
void return_final_state(ir::Graph& g, ir::Node* state) {
  std::vector<ir::Arg> outs = g.output()->args()[0].list;
  outs.push_back(ir::Arg::of_node(state));
  g.set_output(outs);
}

}  // namespace

TEST(ThreadRng, ChainsTheStateThroughEveryDropoutInOrder) {
  const Threaded th = threaded(kTwoDropouts);
  ASSERT_NE(th.state, nullptr);
  expect_has(th.printed, {"%rng_state : u8[5056] = buffer(\"rng\")",
                    "%d_rng : (f32[64], b8[64], u8[5056]) = torch_ext::native_dropout_rng.default(%x, 0.5, True, "
                    "%rng_state)",
                    "%d2_rng : (f32[64], b8[64], u8[5056]) = torch_ext::native_dropout_rng.default(%o, 0.25, True, "
                    "%d_rng_state)"});
  EXPECT_EQ(th.printed.find("aten::native_dropout.default"), std::string::npos) << th.printed;
  EXPECT_EQ(th.state->name(), "d2_rng_state");
}

TEST(ThreadRng, SameStateSameDrawsAndEagerOrder) {
  auto g = ir::parse(kTwoDropouts);
  ir::Node* state = passes::thread_rng(*g);
  return_final_state(*g, state);
  runtime::Executor ex(*g);
  const at::Tensor x = at::randn({64});
  const at::Tensor s0 = seeded_state(11);
  // Placeholders: %x, then the state.
  auto a = ex.run({x, s0});
  auto b = ex.run({x, s0});
  EXPECT_TRUE(at::equal(a[0].toTensor(), b[0].toTensor()));
  EXPECT_TRUE(at::equal(a[2].toTensor(), b[2].toTensor()));
  EXPECT_FALSE(at::equal(a[2].toTensor(), s0));
  // Eager: the two native_dropout calls on a generator starting from the same state.
  at::Tensor o2, m2;
  const at::Tensor after = eager_from(s0, [&] {
    at::Tensor o1 = std::get<0>(at::native_dropout(x, 0.5, true));
    std::tie(o2, m2) = at::native_dropout(o1, 0.25, true);
  });
  EXPECT_TRUE(at::equal(a[0].toTensor(), o2));
  EXPECT_TRUE(at::equal(a[1].toTensor(), m2));
  EXPECT_TRUE(at::equal(a[2].toTensor(), after));
}

TEST(ThreadRng, NoRandomOpsLeavesTheGraphAlone) {
  const char* text = R"(graph:
  %x : f32[4] = input()
  %y : f32[4] = aten::relu.default(%x)
  return (%y)
)";
  expect_left_alone(text);
}

TEST(ThreadRng, OtherRandomOpsAreRefusedAndTheGraphIsUnchanged) {
  const char* text = R"(graph:
  %x : f32[4] = input()
  %d : (f32[4], b8[4]) = aten::native_dropout.default(%x, 0.5, True)
  %o : f32[4] = getitem(%d, 0)
  %n : f32[4] = aten::bernoulli.default(%o)
  return (%n)
)";
  expect_refused(text, "node %n (aten::bernoulli.default) draws from the global random generator");
}

// An RReLU in eval mode (training=False) applies the mean slope and draws nothing: left alone. In training
// mode it draws, and is refused by name with the graph unchanged.
TEST(ThreadRng, RreluDrawsOnlyInTrainingMode) {
  const char* eval = R"(graph:
  %x : f32[4] = input()
  %z : f32[4] = aten::empty_like.default(%x)
  %r : (f32[4], f32[4]) = aten::rrelu_with_noise_functional.default(%x, %z, 0.125, 0.375, False)
  %o : f32[4] = getitem(%r, 0)
  return (%o)
)";
  expect_left_alone(eval);
  const std::string train = std::string(eval).replace(std::string(eval).find("False"), 5, "True");
  expect_refused(train, "node %r (aten::rrelu_with_noise_functional.default) draws from the global random generator");
}

// A VAE's reparameterisation: noise like a tensor. randn_like / rand_like draw from the threaded state
// (after the dropout before them), exactly as eager's randn_like / rand_like do from the same state.
TEST(ThreadRng, NoiseLikeATensorDrawsFromTheStateAsEagerDoes) {
  const char* text = R"(graph:
  %x : f32[4,6] = input()
  %d : (f32[4,6], b8[4,6]) = aten::native_dropout.default(%x, 0.5, True)
  %o : f32[4,6] = getitem(%d, 0)
  %t : f32[6,4]{1,6} = aten::t.default(%o)
  %n : f32[6,4]{1,6} = aten::randn_like.default(%t)
  %u : f32[4,6] = aten::rand_like.default(%x)
  return (%o, %n, %u)
)";
  const Threaded th = threaded(text);
  ASSERT_NE(th.state, nullptr);
  expect_has(th.printed, {"%n_rng : (f32[6,4]{1,6}, u8[5056]) = torch_ext::randn_like_rng.default(%t, %d_rng_state)",
                       "%u_rng : (f32[4,6], u8[5056]) = torch_ext::rand_like_rng.default(%x, %n_rng_state)"});
  EXPECT_EQ(th.state->name(), "u_rng_state");
  return_final_state(*th.graph, th.state);
  runtime::Executor ex(*th.graph);
  const at::Tensor x = at::randn({4, 6});
  const at::Tensor s0 = seeded_state(5);
  auto a = ex.run({x, s0});
  auto b = ex.run({x, s0});
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(a[i].toTensor(), b[i].toTensor())) << i;
  at::Tensor n, u;
  const at::Tensor after = eager_from(s0, [&] {
    n = at::randn_like(std::get<0>(at::native_dropout(x, 0.5, true)).t());
    u = at::rand_like(x);
  });
  EXPECT_TRUE(at::equal(a[1].toTensor(), n));
  EXPECT_EQ(a[1].toTensor().strides(), n.strides());
  EXPECT_TRUE(at::equal(a[2].toTensor(), u));
  EXPECT_TRUE(at::equal(a[3].toTensor(), after));
}

TEST(ThreadRng, NoiseOfAnotherDtypeIsRefused) {
  const char* text = R"(graph:
  %x : f32[4] = input()
  %n : f64[4] = aten::randn_like.default(%x, dtype=torch.float64)
  return (%n)
)";
  expect_refused(text, "draws noise only like its input");
}

// The state is the CPU generator's: a draw on CUDA (eager's Philox stream) is refused by name at build time,
// naming the device, for dropout, noise like a tensor and bernoulli alike; the graph is left as parsed.
TEST(ThreadRng, DrawsOffTheCpuAreRefusedNamingTheDevice) {
  expect_refused(R"(graph:
  %x : f32[64]@cuda:0 = input()
  %d : (f32[64]@cuda:0, b8[64]@cuda:0) = aten::native_dropout.default(%x, 0.5, True)
  %o : f32[64]@cuda:0 = getitem(%d, 0)
  return (%o)
)",
                 "thread_rng: node %d (aten::native_dropout.default) draws on cuda:0; the pure step's RNG state is "
                 "the CPU generator's");
  expect_refused(R"(graph:
  %x : f32[4]@cuda:0 = input()
  %n : f32[4]@cuda:0 = aten::randn_like.default(%x)
  return (%n)
)",
                 "node %n (aten::randn_like.default) draws on cuda:0");
  expect_refused(R"(graph:
  %x : f32[4]@cuda:0 = input()
  %k : f32[4]@cuda:0 = aten::bernoulli.p(%x, 0.25)
  return (%k)
)",
                 "node %k (aten::bernoulli.p) draws on cuda:0");
  // A CPU draw in a graph that also holds CUDA values is threaded as before.
  auto g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %y : f32[4]@cuda:0 = input()
  %n : f32[4] = aten::randn_like.default(%x)
  return (%n, %y)
)");
  EXPECT_NE(passes::thread_rng(*g), nullptr);
}

// Random factories (a diffusion step's timesteps and noise) and bernoulli(x, p) (in-place dropout,
// stochastic depth): sizes and dtypes from the node's type, drawn in graph order as eager draws them.
TEST(ThreadRng, FactoriesAndBernoulliDrawFromTheStateAsEagerDoes) {
  const char* text = R"(graph:
  %x : f32[4,3] = input()
  %t : i64[4] = aten::randint.low(2, 9, [4], device=device("cpu"), pin_memory=False)
  %n : f32[4,3] = aten::randn.default([4, 3], device=device("cpu"), pin_memory=False)
  %k : f32[4,3] = aten::bernoulli.p(%x, 0.25)
  return (%t, %n, %k)
)";
  const Threaded th = threaded(text);
  ASSERT_NE(th.state, nullptr);
  expect_has(th.printed, {"%t_rng : (i64[4], u8[5056]) = torch_ext::randint_rng.default(2, 9, [4], torch.int64, %rng_state)",
                       "%n_rng : (f32[4,3], u8[5056]) = torch_ext::randn_rng.default([4, 3], torch.float32, "
                       "%t_rng_state)",
                       "%k_rng : (f32[4,3], u8[5056]) = torch_ext::bernoulli_p_rng.default(%x, 0.25, %n_rng_state)"});
  return_final_state(*th.graph, th.state);
  runtime::Executor ex(*th.graph);
  const at::Tensor x = at::rand({4, 3});
  const at::Tensor s0 = seeded_state(8);
  auto a = ex.run({x, s0});
  at::Tensor t, n, k;
  const at::Tensor after = eager_from(s0, [&] {
    t = at::randint(2, 9, {4});
    n = at::randn({4, 3});
    k = at::bernoulli(x, 0.25);
  });
  EXPECT_TRUE(at::equal(a[0].toTensor(), t));
  EXPECT_TRUE(at::equal(a[1].toTensor(), n));
  EXPECT_TRUE(at::equal(a[2].toTensor(), k));
  EXPECT_TRUE(at::equal(a[3].toTensor(), after));
}
