#include "passes/build_train_step.h"

#include "ir/verifier.h"
#include "optim/descriptor.h"
#include "passes/accumulate.h"
#include "passes/all_reduce_grads.h"
#include "passes/append_update.h"
#include "passes/check_pure.h"
#include "passes/clip_grad_norm.h"
#include "passes/eliminate_dead_code.h"
#include "passes/grad_layout.h"
#include "passes/lift_optimizer_state.h"
#include "passes/pass_manager.h"
#include "passes/recompose_activation_backward.h"
#include "passes/rewire_outputs.h"
#include "passes/serialize_collectives.h"
#include "passes/shard_optimizer_state.h"
#include "passes/thread_rng.h"
#include "passes/unroll.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>

namespace torch_ext::passes {
namespace {

// Each pass keeps its own file and function, which its tests call; the adapters below bind those
// functions to the context. They live here, beside the list, because they are the one place that
// knows which context fields each existing pass reads and writes, and so the pass files (some of
// them rewritten for the optimizer descriptors) keep their signatures. A new pass is written
// against PassContext directly and needs no adapter (see pass.h).

ir::Node* output_node(const ir::Graph& g, int64_t index, const char* what) {
  const auto& outs = g.output()->args()[0].list;
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(outs.size()), "build_train_step: ", what, " output index ",
              index, " out of range (", outs.size(), " outputs)");
  TORCH_CHECK(outs[index].kind == ir::Arg::Kind::Node, "build_train_step: ", what, " output #", index,
              " is not a graph value");
  return outs[index].node;
}

std::vector<ir::Node*> nodes_of(const NamedValues& values) {
  std::vector<ir::Node*> out;
  for (const auto& v : values) out.push_back(v.second);
  return out;
}

void set_nodes(NamedValues& values, const std::vector<ir::Node*>& nodes) {
  TORCH_INTERNAL_ASSERT(values.size() == nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) values[i].second = nodes[i];
}

bool sharded(const PassContext& ctx) {
  return ctx.spec.data_parallel.has_value() && ctx.spec.data_parallel->shard_optimizer_state;
}

PassResult run_accumulate(ir::Graph& g, PassContext& ctx) {
  return PassResult::replaced(accumulate(g, ctx.spec, ctx.spec.accumulate));
}

// The loss, gradients, buffer updates and aux outputs, from the joint's outputs by spec index.
PassResult run_read_outputs(ir::Graph& g, PassContext& ctx) {
  ctx.loss = output_node(g, ctx.spec.loss_output, "loss");
  for (const auto& [idx, name] : ctx.spec.buffer_mutations) ctx.buffers.emplace_back(name, output_node(g, idx, "buffer"));
  for (int64_t idx : ctx.spec.aux_outputs) ctx.aux.push_back(output_node(g, idx, "aux"));
  TORCH_CHECK(ctx.aux.empty() || ctx.unroll_steps == 1,
              "build_train_step: auxiliary outputs need unroll == 1, got unroll ", ctx.unroll_steps);
  for (const auto& [idx, name] : ctx.spec.grads) {
    ir::Node* grad = output_node(g, idx, "gradient");
    // A parameter named twice keeps its first position and its last gradient.
    auto it = std::find_if(ctx.grads.begin(), ctx.grads.end(), [&](const auto& e) { return e.first == name; });
    if (it != ctx.grads.end()) it->second = grad;
    else ctx.grads.emplace_back(name, grad);
  }
  // .grad as eager's AccumulateGrad lays it out (grad_layout.h): clipping and the update read it so.
  bool changed = false;
  for (auto& [name, grad] : ctx.grads) {
    const ir::Node* param = nullptr;
    for (const ir::Node* p : g.placeholders())
      if (p->role() == ir::InputRole::Parameter && p->state_name() == name) param = p;
    if (param == nullptr || !param->type().is_tensor() || !grad->type().is_tensor()) continue;
    ir::Node* laid_out = obey_grad_layout(g, grad, param->type().tensor);
    changed = changed || laid_out != grad;
    grad = laid_out;
  }
  return changed ? PassResult::changed() : PassResult::unchanged();
}

PassResult run_lift_optimizer_state(ir::Graph& g, PassContext& ctx) {
  ctx.lifted = lift_optimizer_state(g, ctx.spec);
  return PassResult::changed();
}

PassResult run_all_reduce_grads(ir::Graph& g, PassContext& ctx) {
  auto synced = all_reduce_grads(g, *ctx.spec.data_parallel, nodes_of(ctx.grads), nodes_of(ctx.buffers));
  set_nodes(ctx.grads, synced.grads);
  set_nodes(ctx.buffers, synced.buffers);
  return PassResult::changed();
}

PassResult run_clip_grad_norm(ir::Graph& g, PassContext& ctx) {
  set_nodes(ctx.grads, clip_grad_norm(g, nodes_of(ctx.grads), *ctx.spec.clip_max_norm, ctx.spec.clip_norm_type));
  return PassResult::changed();
}

PassResult run_shard_optimizer_state(ir::Graph& g, PassContext& ctx) {
  ctx.updated = shard_optimizer_state(g, ctx.spec, *ctx.spec.data_parallel, ctx.grad_map(), ctx.lifted);
  return PassResult::changed();
}

PassResult run_append_update(ir::Graph& g, PassContext& ctx) {
  ctx.updated = append_update(g, ctx.spec, ctx.grad_map(), ctx.lifted);
  return PassResult::changed();
}

PassResult run_recompose_activation_backward(ir::Graph& g, PassContext&) {
  return recompose_activation_backward(g) > 0 ? PassResult::changed() : PassResult::unchanged();
}

PassResult run_thread_rng(ir::Graph& g, PassContext& ctx) {
  ctx.rng = thread_rng(g);
  return ctx.rng != nullptr ? PassResult::changed() : PassResult::unchanged();
}

// Output order: new parameters, new buffers, "rng", new optimizer state; then the aux outputs.
PassResult run_rewire_outputs(ir::Graph& g, PassContext& ctx) {
  const auto is_opt = [](const std::string& name) { return optim::parse_state_name(name).has_value(); };
  NamedValues state;
  for (const auto& e : ctx.updated)
    if (!is_opt(e.first)) state.push_back(e);
  state.insert(state.end(), ctx.buffers.begin(), ctx.buffers.end());
  if (ctx.rng != nullptr) state.emplace_back("rng", ctx.rng);
  for (const auto& e : ctx.updated)
    if (is_opt(e.first)) state.push_back(e);
  rewire_outputs(g, ctx.loss, state);
  if (!ctx.aux.empty()) {
    std::vector<ir::Arg> outs = g.output()->args()[0].list;
    for (ir::Node*& a : ctx.aux) {
      // An aux that is a batch input, a parameter or a view of one (loss_fn returning x, or
      // model.weight to log it) would alias an input of the pure program: it is returned as a
      // copy, the value loss_fn saw.
      if (a->type().kind == ir::Type::Kind::Tensor && aliased_input(a) != nullptr) {
        ir::TensorMeta m = a->type().tensor;
        m.strides = ir::TensorMeta::contiguous_strides(m.sizes);
        a = g.create_call(g.unique_name(a->name() + "_copy"), ir::Target::parse("aten::clone.default"),
                          {ir::Arg::of_node(a)},
                          {{"memory_format", ir::Arg::of_memory_format(c10::MemoryFormat::Contiguous)}},
                          ir::Type::make_tensor(m));
      }
      outs.push_back(ir::Arg::of_node(a));
    }
    g.set_output(std::move(outs));
  }
  ctx.state = std::move(state);
  // Later passes keep the placeholders (unroll repeats the user inputs), so count one step's here.
  ctx.num_user_inputs = 0;
  for (ir::Node* p : g.placeholders()) ctx.num_user_inputs += p->role() == ir::InputRole::UserInput;
  return PassResult::changed();
}

PassResult run_eliminate_dead_code(ir::Graph& g, PassContext&) {
  eliminate_dead_code(g);
  return PassResult::changed();
}

PassResult run_check_pure(ir::Graph& g, PassContext&) {
  check_pure(g);
  return PassResult::unchanged();
}

PassResult run_serialize_collectives(ir::Graph& g, PassContext&) {
  return serialize_collectives(g) ? PassResult::changed() : PassResult::unchanged();
}

PassResult run_unroll(ir::Graph& g, PassContext& ctx) {
  return PassResult::replaced(unroll(g, ctx.state.size(), ctx.unroll_steps));
}

// The pipeline (see build_train_step.h). Constant data: no static constructor runs.
constexpr Pass kTrainStepPasses[] = {
    // First: accumulate copies the joint graph per micro-batch.
    {"recompose_activation_backward", nullptr, run_recompose_activation_backward},
    {"accumulate", [](const PassContext& c) { return c.spec.accumulate > 1; }, run_accumulate},
    {"read_outputs", nullptr, run_read_outputs},
    {"lift_optimizer_state", nullptr, run_lift_optimizer_state},
    {"all_reduce_grads", [](const PassContext& c) { return c.spec.data_parallel.has_value(); }, run_all_reduce_grads},
    {"clip_grad_norm", [](const PassContext& c) { return c.spec.clip_max_norm.has_value(); }, run_clip_grad_norm},
    {"shard_optimizer_state", sharded, run_shard_optimizer_state},
    {"append_update", [](const PassContext& c) { return !sharded(c); }, run_append_update},
    {"thread_rng", nullptr, run_thread_rng},
    {"rewire_outputs", nullptr, run_rewire_outputs},
    {"eliminate_dead_code", nullptr, run_eliminate_dead_code},
    {"check_pure", nullptr, run_check_pure},
    {"unroll", [](const PassContext& c) { return c.unroll_steps > 1; }, run_unroll},
    {"check_pure", [](const PassContext& c) { return c.unroll_steps > 1; }, run_check_pure},
    // Last: the executors run collectives in graph order (and .pt2 keeps it).
    {"serialize_collectives", [](const PassContext& c) { return c.spec.data_parallel.has_value(); },
     run_serialize_collectives},
};

}  // namespace

std::vector<Pass> train_step_passes() { return std::vector<Pass>(std::begin(kTrainStepPasses), std::end(kTrainStepPasses)); }

TrainStepGraph build_train_step(const ir::Graph& joint, const TrainStepSpec& spec, int64_t unroll_steps) {
  auto g = joint.clone();
  ir::verify(*g);
  const ir::Node* loss = output_node(*g, spec.loss_output, "loss");
  TORCH_CHECK(loss->type().is_tensor() && loss->type().tensor.sizes.empty(),
              "build_train_step: the loss must be a scalar tensor, got ", loss->type().is_tensor() ? "a tensor of rank " +
              std::to_string(loss->type().tensor.sizes.size()) : std::string("a non-tensor"));
  TORCH_CHECK(spec.accumulate >= 1, "build_train_step: accumulate must be >= 1, got ", spec.accumulate);
  TORCH_CHECK(spec.accumulate == 1 || unroll_steps == 1, "build_train_step: accumulate (", spec.accumulate,
              ") and unroll (", unroll_steps, ") cannot be combined");
  PassContext ctx(spec, unroll_steps);
  TrainStepGraph out;
  out.graph = PassManager(train_step_passes()).run(std::move(g), ctx);
  for (const auto& e : ctx.state) out.state_names.push_back(e.first);
  out.num_user_inputs = ctx.num_user_inputs;
  return out;
}

}  // namespace torch_ext::passes
