// The shared run loop (runtime/run_loop.h): what its hooks see and what a skipped step leaves.
#include "ir/parser.h"
#include "runtime/run_loop.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

#include <string>
#include <vector>

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

// x -> a = sin(x) -> b = cos(a) -> c = exp(b); slots are node positions (x 0, a 1, b 2, c 3).
struct Chain {
  std::unique_ptr<ir::Graph> g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %a : f32[4] = aten::sin.default(%x)
  %b : f32[4] = aten::cos.default(%a)
  %c : f32[4] = aten::exp.default(%b)
  return (%c)
)");
  std::vector<runtime::BoundKernel> kernels;
  std::vector<runtime::Step> steps;
  Chain() {
    for (const char* n : {"a", "b", "c"}) kernels.push_back(runtime::BoundKernel::bind(*g->find(n)));
    for (size_t i = 0; i < kernels.size(); ++i) {
      runtime::Step s;
      s.kernel = &kernels[i];
      s.out = static_cast<int64_t>(i) + 1;
      steps.push_back(s);
    }
  }
};

struct Recording : runtime::NoHooks {
  size_t skip = 99;
  std::vector<std::string> events;
  std::vector<at::Tensor> replaced;  // per store: the value the step's result replaced
  bool before(size_t i, const c10::IValue& current) {
    events.push_back("before " + std::to_string(i) + (current.isNone() ? " empty" : " held"));
    return i != skip;
  }
  void store(size_t i, c10::IValue& slot, c10::IValue&& v) {
    events.push_back("store " + std::to_string(i));
    replaced.push_back(slot.isTensor() ? slot.toTensor() : at::Tensor());
    slot = std::move(v);
  }
  void after(size_t i) { events.push_back("after " + std::to_string(i)); }
};

}  // namespace

TEST(RunLoop, HooksSeeTheReplacedValueAndASkippedStepKeepsItsValue) {
  Chain ch;
  const at::Tensor x = at::randn({4});
  const at::Tensor held_b = at::full({4}, 7.0f);  // b's value before the run: the skipped step keeps it
  runtime::ValueSlots values(ch.g->size());
  values[0] = x;
  values[2] = held_b;
  ch.steps[1].release = {0};  // the skipped step still releases what dies there
  ch.steps[2].release = {1};
  std::vector<c10::IValue> stack;
  Recording hooks;
  hooks.skip = 1;
  runtime::run_steps(
      ch.steps, values, stack, [](size_t, const std::exception&) { FAIL() << "no kernel fails here"; }, hooks);
  EXPECT_EQ(hooks.events, (std::vector<std::string>{"before 0 empty", "store 0", "after 0", "before 1 held",
                                                    "before 2 empty", "store 2", "after 2"}));
  ASSERT_EQ(hooks.replaced.size(), 2u);
  EXPECT_FALSE(hooks.replaced[0].defined());
  EXPECT_FALSE(hooks.replaced[1].defined());
  EXPECT_TRUE(values[0].isNone()) << "released by the skipped step";
  EXPECT_TRUE(values[1].isNone()) << "released by its last reader";
  EXPECT_TRUE(values[2].toTensor().is_same(held_b));
  EXPECT_TRUE(at::equal(values[3].toTensor(), at::exp(held_b)));
}

TEST(RunLoop, StoreSeesTheValueItReplaces) {
  Chain ch;
  const at::Tensor old_c = at::zeros({4});
  runtime::ValueSlots values(ch.g->size());
  values[0] = at::randn({4});
  values[3] = old_c;
  std::vector<c10::IValue> stack;
  Recording hooks;
  runtime::run_steps(ch.steps, values, stack, [](size_t, const std::exception&) { FAIL(); }, hooks);
  ASSERT_EQ(hooks.replaced.size(), 3u);
  EXPECT_TRUE(hooks.replaced[2].is_same(old_c));
  EXPECT_TRUE(at::equal(values[3].toTensor(), at::exp(at::cos(at::sin(values[0].toTensor())))));
}

TEST(RunLoop, AFailingKernelStopsTheLoopAfterOnError) {
  Chain ch;
  runtime::ValueSlots values(ch.g->size());
  values[0] = c10::IValue(int64_t{1});  // sin of an int: the kernel of %a throws
  std::vector<c10::IValue> stack;
  Recording hooks;
  size_t failed = 99;
  const std::string msg = error_of([&] {
    runtime::run_steps(
        ch.steps, values, stack,
        [&](size_t i, const std::exception& e) {
          failed = i;
          runtime::rethrow_executing(*ch.steps[i].kernel, e);
        },
        hooks);
  });
  EXPECT_EQ(failed, 0u);
  EXPECT_NE(msg.find("while executing node %a"), std::string::npos) << msg;
  EXPECT_EQ(hooks.events, (std::vector<std::string>{"before 0 empty"}));
  EXPECT_TRUE(values[1].isNone());
}
