#include "passes/build_train_step.h"

#include "ir/verifier.h"
#include "optim/descriptor.h"
#include "passes/accumulate.h"
#include "passes/all_reduce_grads.h"
#include "passes/append_update.h"
#include "passes/check_pure.h"
#include "passes/clip_grad_norm.h"
#include "passes/eliminate_dead_code.h"
#include "passes/lift_optimizer_state.h"
#include "passes/rewire_outputs.h"
#include "passes/shard_optimizer_state.h"
#include "passes/thread_rng.h"
#include "passes/unroll.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

void verify_after(const ir::Graph& g, const char* pass) {
  try {
    ir::verify(g);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "graph invalid after pass ", pass, ": ", e.what_without_backtrace());
  }
}

ir::Node* output_node(const ir::Graph& g, int64_t index, const char* what) {
  const auto& outs = g.output()->args()[0].list;
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(outs.size()), "build_train_step: ", what, " output index ",
              index, " out of range (", outs.size(), " outputs)");
  TORCH_CHECK(outs[index].kind == ir::Arg::Kind::Node, "build_train_step: ", what, " output #", index,
              " is not a graph value");
  return outs[index].node;
}

}  // namespace

TrainStepGraph build_train_step(const ir::Graph& joint, const TrainStepSpec& spec, int64_t unroll_steps) {
  auto g = joint.clone();
  ir::verify(*g);
  ir::Node* loss = output_node(*g, spec.loss_output, "loss");
  TORCH_CHECK(loss->type().is_tensor() && loss->type().tensor.sizes.empty(),
              "build_train_step: the loss must be a scalar tensor, got ", loss->type().is_tensor() ? "a tensor of rank " +
              std::to_string(loss->type().tensor.sizes.size()) : std::string("a non-tensor"));
  TORCH_CHECK(spec.accumulate >= 1, "build_train_step: accumulate must be >= 1, got ", spec.accumulate);
  TORCH_CHECK(spec.accumulate == 1 || unroll_steps == 1, "build_train_step: accumulate (", spec.accumulate,
              ") and unroll (", unroll_steps, ") cannot be combined");
  if (spec.accumulate > 1) {
    g = accumulate(*g, spec, spec.accumulate);
    verify_after(*g, "accumulate");
    loss = output_node(*g, spec.loss_output, "loss");
  }
  std::vector<std::pair<std::string, ir::Node*>> buffers;
  for (const auto& [idx, name] : spec.buffer_mutations) buffers.emplace_back(name, output_node(*g, idx, "buffer"));
  std::vector<ir::Node*> aux;
  for (int64_t idx : spec.aux_outputs) aux.push_back(output_node(*g, idx, "aux"));
  TORCH_CHECK(aux.empty() || unroll_steps == 1, "build_train_step: auxiliary outputs need unroll == 1, got unroll ",
              unroll_steps);
  std::vector<std::string> grad_order;
  std::map<std::string, ir::Node*> grads;
  for (const auto& [idx, name] : spec.grads) {
    grads[name] = output_node(*g, idx, "gradient");
    grad_order.push_back(name);
  }

  auto lifted = lift_optimizer_state(*g, spec);
  verify_after(*g, "lift_optimizer_state");
  if (spec.data_parallel.has_value()) {
    std::vector<ir::Node*> in, bufs;
    for (const std::string& n : grad_order) in.push_back(grads.at(n));
    for (const auto& b : buffers) bufs.push_back(b.second);
    auto synced = all_reduce_grads(*g, *spec.data_parallel, in, bufs);
    for (size_t i = 0; i < grad_order.size(); ++i) grads[grad_order[i]] = synced.grads[i];
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].second = synced.buffers[i];
    verify_after(*g, "all_reduce_grads");
  }
  if (spec.clip_max_norm.has_value()) {
    std::vector<ir::Node*> in;
    for (const std::string& n : grad_order) in.push_back(grads.at(n));
    auto clipped = clip_grad_norm(*g, in, *spec.clip_max_norm, spec.clip_norm_type);
    for (size_t i = 0; i < grad_order.size(); ++i) grads[grad_order[i]] = clipped[i];
    verify_after(*g, "clip_grad_norm");
  }
  const bool sharded = spec.data_parallel.has_value() && spec.data_parallel->shard_optimizer_state;
  auto updated = sharded ? shard_optimizer_state(*g, spec, *spec.data_parallel, grads, lifted)
                         : append_update(*g, spec, grads, lifted);
  verify_after(*g, sharded ? "shard_optimizer_state" : "append_update");
  ir::Node* rng = thread_rng(*g);
  verify_after(*g, "thread_rng");

  // Output order: new parameters, new buffers, new optimizer state.
  std::vector<std::pair<std::string, ir::Node*>> state;
  for (const auto& e : updated)
    if (!optim::parse_state_name(e.first)) state.push_back(e);
  state.insert(state.end(), buffers.begin(), buffers.end());
  if (rng != nullptr) state.emplace_back("rng", rng);
  for (const auto& e : updated)
    if (optim::parse_state_name(e.first)) state.push_back(e);
  const size_t num_state = rewire_outputs(*g, loss, state);
  if (!aux.empty()) {
    std::vector<ir::Arg> outs = g->output()->args()[0].list;
    for (ir::Node* a : aux) outs.push_back(ir::Arg::of_node(a));
    g->set_output(std::move(outs));
  }
  verify_after(*g, "rewire_outputs");
  eliminate_dead_code(*g);
  verify_after(*g, "eliminate_dead_code");
  check_pure(*g);

  TrainStepGraph out;
  for (const auto& e : state) out.state_names.push_back(e.first);
  for (ir::Node* p : g->placeholders()) out.num_user_inputs += p->role() == ir::InputRole::UserInput;
  if (unroll_steps > 1) {
    g = unroll(*g, num_state, unroll_steps);
    verify_after(*g, "unroll");
    check_pure(*g);
  }
  out.graph = std::move(g);
  return out;
}

}  // namespace torch_ext::passes
