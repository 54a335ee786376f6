// The optimizer registry (optim/descriptor.h): generated schemas, lookups, state names, and the
// checks of the one generated kernel; then append_update driven by the descriptor, golden text.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/schema.h"
#include "ir/verifier.h"
#include "optim/descriptor.h"
#include "passes/append_update.h"
#include "passes/lift_optimizer_state.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

std::vector<std::string> kinds() {
  std::vector<std::string> out;
  for (const optim::Descriptor* d : optim::all()) out.push_back(d->kind);
  return out;
}

// The registered schema of torch_ext::`name`, as the dispatcher prints it.
std::string registered_schema(const std::string& name, const std::string& overload = "") {
  auto op = c10::Dispatcher::singleton().findSchema({"torch_ext::" + name, overload});
  if (!op.has_value()) return "<none>";
  std::stringstream s;
  s << op->schema();
  return s.str();
}

}  // namespace

TEST(OptimRegistry, EveryBuiltInKindIsRegisteredSorted) {
  const auto k = kinds();
  for (const char* kind : {"adadelta", "adagrad", "adam", "adam_amsgrad", "adamax", "muon", "nadam", "radam", "rmsprop",
                           "rprop", "sgd", "sgd_momentum"})
    EXPECT_NE(std::find(k.begin(), k.end(), kind), k.end()) << kind;
  EXPECT_TRUE(std::is_sorted(k.begin(), k.end()));
}

TEST(OptimRegistry, SchemasAreGeneratedFromTheDescriptor) {
  EXPECT_EQ(optim::get("adam").schema(),
            "adam_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor step, Tensor lr, "
            "float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool maximize) "
            "-> (Tensor, Tensor, Tensor, Tensor)");
  EXPECT_EQ(optim::get("adam").inplace_schema(),
            "adam_update_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) step, "
            "Tensor lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool maximize) -> ()");
  EXPECT_EQ(optim::get("sgd").schema(),
            "sgd_update(Tensor param, Tensor grad, Tensor lr, float weight_decay, bool maximize) -> Tensor");
  EXPECT_NE(optim::get("muon").schema().find("int ns_steps"), std::string::npos);
  // The scheduled overload: the schedulable scalars are tensors, fed per step as lr is.
  EXPECT_EQ(optim::get("sgd_momentum").schema(true),
            "sgd_momentum_update.scheduled(Tensor param, Tensor grad, Tensor momentum_buffer, Tensor step, Tensor lr, "
            "Tensor momentum, float dampening, float weight_decay, bool nesterov, bool maximize) -> (Tensor, Tensor, "
            "Tensor)");
  EXPECT_FALSE(optim::get("sgd").has_schedulable());
  // ... and they are what the dispatcher holds, for every kind.
  for (const optim::Descriptor* d : optim::all()) {
    EXPECT_EQ(registered_schema(d->op_name()), "torch_ext::" + d->schema());
    EXPECT_EQ(registered_schema(d->inplace_op_name()), "torch_ext::" + d->inplace_schema());
    if (!d->has_schedulable()) continue;
    EXPECT_EQ(registered_schema(d->op_name(), optim::kScheduledOverload), "torch_ext::" + d->schema(true));
    EXPECT_EQ(registered_schema(d->inplace_op_name(), optim::kScheduledOverload),
              "torch_ext::" + d->inplace_schema(true));
  }
}

TEST(OptimRegistry, StepCountersAndElementwise) {
  const auto& sgd_m = optim::get("sgd_momentum");
  ASSERT_EQ(sgd_m.slots.size(), 2u);
  EXPECT_FALSE(sgd_m.slots[0].is_step());
  EXPECT_TRUE(sgd_m.slots[1].is_step());
  // NAdam's mu_product: a scalar slot (whole in blocks and shards) that is not the step counter.
  const auto& nadam = optim::get("nadam");
  ASSERT_EQ(nadam.slots.size(), 4u);
  EXPECT_EQ(nadam.slots[2].name, "mu_product");
  EXPECT_TRUE(nadam.slots[2].is_scalar());
  EXPECT_FALSE(nadam.slots[2].is_step());
  EXPECT_TRUE(nadam.slots[3].is_scalar());
  EXPECT_FALSE(nadam.slots[0].is_scalar());
  EXPECT_FALSE(optim::get("muon").elementwise);
  EXPECT_TRUE(optim::get("adam").elementwise);
}

TEST(OptimRegistry, UnknownKindIsNamedWithTheKnownOnes) {
  const std::string e = error_of([] { optim::get("lamb"); });
  EXPECT_NE(e.find("unknown update kind 'lamb' (expected one of: adadelta, adafactor, adafactor_vector, adagrad, adam, "),
            std::string::npos)
      << e;
  EXPECT_EQ(optim::find("lamb"), nullptr);
  EXPECT_EQ(optim::find_by_op("adam_update_"), nullptr);  // the in-place variant is not the functional op
  EXPECT_EQ(optim::find_by_op("adam_update"), &optim::get("adam"));
}

TEST(OptimRegistry, RefusesADuplicateKindOrAMissingKernel) {
  EXPECT_NE(error_of([] { optim::detail::add(optim::Descriptor{"adam", "Adam", {}, {}, optim::get("sgd").kernel}); })
                .find("optimizer kind 'adam' is registered twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { optim::detail::add(optim::Descriptor{"nokernel", "X", {}, {}, nullptr}); })
                .find("optimizer kind 'nokernel' has no kernel"),
            std::string::npos);
  EXPECT_EQ(optim::find("nokernel"), nullptr);
}

TEST(OptimRegistry, StateNamesRoundTrip) {
  EXPECT_EQ(optim::state_name("model.fc.weight", "exp_avg"), "opt:model.fc.weight:exp_avg");
  EXPECT_EQ(optim::lr_name(3), "opt:lr:group3");
  auto s = optim::parse_state_name("opt:model.a:b.weight:exp_avg_sq");
  ASSERT_TRUE(s.has_value());
  EXPECT_FALSE(s->group.has_value());
  EXPECT_EQ(s->param, "model.a:b.weight");
  EXPECT_EQ(s->slot, "exp_avg_sq");
  auto lr = optim::parse_state_name(optim::lr_name(12));
  ASSERT_TRUE(lr.has_value() && lr->is_lr());
  EXPECT_EQ(*lr->group, 12);
  EXPECT_EQ(optim::group_input_name("momentum", 2), "opt:momentum:group2");
  auto m = optim::parse_state_name("opt:momentum:group2");
  ASSERT_TRUE(m.has_value() && m->group.has_value() && !m->is_lr());
  EXPECT_EQ(m->hyper, "momentum");
  EXPECT_EQ(*m->group, 2);
  auto slot = optim::parse_state_name("opt:model.w:group2");  // a parameter (it holds a '.'), not a group input
  ASSERT_TRUE(slot.has_value());
  EXPECT_FALSE(slot->group.has_value());
  for (const char* other : {"model.fc.weight", "rng", "opt:", "opt:x", "opt:x:", "batch:0"})
    EXPECT_FALSE(optim::parse_state_name(other).has_value()) << other;
}

TEST(OptimKernel, ChecksNameTheArgumentAndValues) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("torch_ext::adam_update", "");
  const at::Tensor p = at::zeros({4, 3}), lr = at::full({}, 0.1, at::kDouble);
  auto call = [&](at::Tensor m, at::Tensor step, at::Tensor l) {
    std::vector<c10::IValue> stack{p, at::ones({4, 3}), m, at::zeros({4, 3}), step, l, 0.9, 0.999, 1e-8, 0.0,
                                   false, false};
    op.callBoxed(stack);
    return stack;
  };
  EXPECT_NE(error_of([&] { call(at::zeros({3}), at::zeros({}), lr); })
                .find("exp_avg has shape [3] but the parameter has shape [4, 3]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { call(at::zeros({4, 3}), at::zeros({2}), lr); })
                .find("step must be a 1-element tensor, got shape [2]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { call(at::zeros({4, 3}), at::zeros({}), at::zeros({2})); })
                .find("lr must be a 1-element tensor, got shape [2]"),
            std::string::npos);
  // The functional op returns fresh tensors and leaves its inputs alone.
  const at::Tensor m = at::zeros({4, 3});
  auto out = call(m, at::zeros({}), lr);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_TRUE(at::equal(m, at::zeros({4, 3})));
  EXPECT_EQ(out[3].toTensor().item<float>(), 1.0f);
}

TEST(OptimIr, UpdateOpsAreFoundInTheRegistry) {
  auto g = ir::parse(R"(graph:
  %w : f32[3] = param("w")
  %m : f32[3] = optstate("opt:w:momentum_buffer")
  %s : f32[] = optstate("opt:w:step")
  %lr : f64[] = optstate("opt:lr:group0")
  %g : f32[3] = aten::ones_like.default(%w)
  %u : (f32[3], f32[3], f32[]) = torch_ext::sgd_momentum_update.default(%w, %g, %m, %s, %lr, 0.9, 0.0, 0.0, False, False)
  %u0 : f32[3] = getitem(%u, 0)
  return (%u0)
)");
  EXPECT_TRUE(ir::is_update_op(*g->find("u")));
  EXPECT_FALSE(ir::is_update_op(*g->find("g")));
  EXPECT_EQ(ir::update_replaced_args(*g->find("u")), (std::vector<size_t>{0, 2, 3}));
}

// Adafactor's factored second moment: slots whose shapes the descriptor derives from the parameter's.
TEST(OptimRegistry, AdafactorSlotsAreFactoredAndNotElementwise) {
  const auto& d = optim::get("adafactor");
  ASSERT_EQ(d.slots.size(), 3u);
  EXPECT_TRUE(d.slots[0].is_factored() && d.slots[1].is_factored());
  EXPECT_FALSE(d.slots[0].is_scalar() || d.slots[2].is_factored());
  EXPECT_EQ(d.slots[0].shape({4, 2, 3, 5}), (std::vector<int64_t>{4, 2, 3, 1}));
  EXPECT_EQ(d.slots[1].shape({4, 2, 3, 5}), (std::vector<int64_t>{4, 2, 1, 5}));
  EXPECT_EQ(d.slots[2].shape({4, 2}), (std::vector<int64_t>{}));
  EXPECT_EQ(optim::get("adafactor_vector").slots[0].shape({7}), (std::vector<int64_t>{7}));
  EXPECT_NE(error_of([&] { d.slots[1].shape({7}); })
                .find("optimizer slot 'col_var' is factored over dim -2 and needs a parameter of 2 or more dims, got "
                      "shape [7]"),
            std::string::npos);
  EXPECT_FALSE(d.elementwise);
  EXPECT_FALSE(optim::get("adafactor_vector").elementwise);
  // A factored slot in an elementwise kind (which ZeRO-1 would shard and blocked runs slice) is refused.
  EXPECT_NE(error_of([] {
              optim::detail::add(optim::Descriptor{"factored_elementwise", "X",
                                                   {{"r", optim::SlotInit::Factored, -1}}, {}, optim::get("sgd").kernel});
            }).find("slot 'r' is factored (not shaped like the parameter), so the kind cannot be elementwise"),
            std::string::npos);
  EXPECT_EQ(optim::find("factored_elementwise"), nullptr);
}

namespace {
const char* kAdafactorJoint = R"(graph:
  %w : f32[2,3,4] = param("w")
  %b : f32[4] = param("b")
  %gw : f32[2,3,4] = aten::ones_like.default(%w)
  %gb : f32[4] = aten::ones_like.default(%b)
  return (%gw, %gb)
)";

passes::TrainStepSpec adafactor_spec(const std::string& bias_kind) {
  passes::TrainStepSpec s;
  s.num_groups = 1;
  const std::map<std::string, double> hyper{
      {"beta2_decay", -0.8}, {"eps1", 1e-30}, {"eps2", 1e-3}, {"d", 1.0}, {"weight_decay", 0.0}};
  s.updates = {{"w", "adafactor", 0, hyper, {{"maximize", false}}}, {"b", bias_kind, 0, hyper, {{"maximize", false}}}};
  return s;
}
}  // namespace

TEST(OptimIr, LiftTypesFactoredSlotsAndAppendUpdateReturnsThem) {
  auto g = ir::parse(kAdafactorJoint);
  auto lifted = passes::lift_optimizer_state(*g, adafactor_spec("adafactor_vector"));
  auto updated = passes::append_update(*g, adafactor_spec("adafactor_vector"),
                                       {{"w", g->find("gw")}, {"b", g->find("gb")}}, lifted);
  ir::verify(*g);
  const std::string text = ir::print(*g);
  for (const char* line : {"%opt_w_row_var : f32[2,3,1] = optstate(\"opt:w:row_var\")",
                           "%opt_w_col_var : f32[2,1,4] = optstate(\"opt:w:col_var\")",
                           "%opt_b_variance : f32[4] = optstate(\"opt:b:variance\")"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  std::map<std::string, std::vector<int64_t>> sizes;
  for (const auto& [name, node] : updated) sizes[name] = node->type().tensor.sizes;
  EXPECT_EQ(sizes.at("opt:w:row_var"), (std::vector<int64_t>{2, 3, 1}));
  EXPECT_EQ(sizes.at("opt:w:col_var"), (std::vector<int64_t>{2, 1, 4}));
  EXPECT_EQ(sizes.at("w"), (std::vector<int64_t>{2, 3, 4}));
}

TEST(OptimIr, LiftRefusesAFactoredSlotForAVectorAndLeavesTheGraph) {
  auto g = ir::parse(kAdafactorJoint);
  const std::string before = ir::print(*g);
  const std::string e = error_of([&] { passes::lift_optimizer_state(*g, adafactor_spec("adafactor")); });
  EXPECT_NE(e.find("lift_optimizer_state: parameter 'b' (adafactor) has shape [4] but Adafactor's slot 'row_var' is "
                   "factored over its last two dims and needs 2 or more"),
            std::string::npos)
      << e;
  EXPECT_EQ(ir::print(*g), before);
}
