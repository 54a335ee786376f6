#include "passes/accumulate.h"

#include "passes/grad_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>

namespace torch_ext::passes {
namespace {

const ir::Node* output_at(const std::vector<ir::Arg>& outs, int64_t idx, const char* what) {
  TORCH_CHECK(idx >= 0 && idx < static_cast<int64_t>(outs.size()), "accumulate: ", what, " output index ", idx,
              " out of range (", outs.size(), " outputs)");
  TORCH_CHECK(outs[idx].kind == ir::Arg::Kind::Node, "accumulate: ", what, " output #", idx, " is not a graph value");
  return outs[idx].node;
}

}  // namespace

std::unique_ptr<ir::Graph> accumulate(const ir::Graph& joint, const TrainStepSpec& spec, int64_t n) {
  TORCH_CHECK(n >= 1, "accumulate: the number of micro-batches must be >= 1, got ", n);
  TORCH_CHECK(spec.aux_outputs.empty(), "accumulate: auxiliary outputs are not supported with accumulation");
  const auto& outs = joint.output()->args()[0].list;
  const ir::Node* loss = output_at(outs, spec.loss_output, "loss");
  TORCH_CHECK(loss->type().is_tensor() && loss->type().tensor.sizes.empty(), "accumulate: the loss must be a scalar");
  const ir::Node* seed = nullptr;
  for (const ir::Node* u : loss->users()) {
    if (!(u->target() == ir::Target{"aten", "ones_like", "default"})) continue;
    TORCH_CHECK(seed == nullptr, "accumulate: the loss %", loss->name(), " has two backward seeds (%", seed->name(),
                ", %", u->name(), ")");
    seed = u;
  }
  TORCH_CHECK(seed != nullptr, "accumulate: no aten::ones_like(%", loss->name(), ") seeds the backward");
  std::unordered_map<std::string, const ir::Node*> buffer_out;  // buffer state name -> new value
  for (const auto& [idx, name] : spec.buffer_mutations) buffer_out[name] = output_at(outs, idx, "buffer");

  auto g = std::make_unique<ir::Graph>();
  std::unordered_map<const ir::Node*, ir::Node*> shared;
  std::vector<const ir::Node*> user_inputs;
  for (const ir::Node* p : joint.placeholders()) {
    if (p->role() == ir::InputRole::UserInput) {
      user_inputs.push_back(p);
      continue;
    }
    shared[p] = g->create_placeholder(p->name(), p->role(), p->type(), p->state_name());
  }
  std::vector<ir::ValueMap> maps(n);
  for (int64_t k = 0; k < n; ++k) {
    const std::string suffix = "_mb" + std::to_string(k);
    auto& map = maps[k];
    for (const auto& [from, to] : shared) map[from] = to;
    if (k > 0)  // buffers read what the previous micro-batch wrote, as eager's module state does
      for (const auto& [from, to] : shared) {
        auto it = buffer_out.find(from->state_name());
        if (from->role() == ir::InputRole::Buffer && it != buffer_out.end()) map[from] = maps[k - 1].at(it->second);
      }
    for (const ir::Node* u : user_inputs) map[u] = g->create_placeholder(u->name() + suffix, u->role(), u->type());
    for (const auto& node : joint.nodes()) {
      if (node->kind() != ir::NodeKind::Call) continue;
      // A call that owns regions (torch.cond, while_loop) is copied with them: regions are closed
      // (they read only the call's operands), so each micro-batch's copy reads its own values.
      ir::Node* copy = g->copy_call(*node, map, g->unique_name(node->name() + suffix));
      if (node.get() == seed && n > 1) {
        // (loss / N).backward(): DivBackward hands ones / N to the loss's backward.
        ir::Node* scaled = g->create_call(g->unique_name(seed->name() + "_div" + suffix),
                                          ir::Target{"aten", "div", "Scalar"},
                                          {ir::Arg::of_node(copy), ir::Arg::of_int(n)}, {}, seed->type());
        scaled->set_module_path(seed->module_path());
        map[node.get()] = scaled;
      }
    }
  }
  std::vector<ir::Arg> new_outs = outs;
  std::vector<ir::Arg> losses;
  for (int64_t k = 0; k < n; ++k) losses.push_back(ir::Arg::of_node(maps[k].at(loss)));
  ir::TensorMeta stacked = loss->type().tensor;
  stacked.sizes = {n};
  stacked.strides = {1};
  new_outs[spec.loss_output] = ir::Arg::of_node(g->create_call(
      g->unique_name("micro_losses"), ir::Target::parse("aten::stack.default"), {ir::Arg::of_list(losses)}, {},
      ir::Type::make_tensor(stacked)));
  for (const auto& [idx, name] : spec.grads) {
    const ir::Node* grad = output_at(outs, idx, "gradient");
    // Each micro-batch's gradient in the layout AccumulateGrad gives .grad (grad_layout.h), so every sum
    // adds operands laid out alike, as eager's p.grad += g_k does into .grad's layout.
    const ir::Node* param = nullptr;
    for (const auto& [from, to] : shared)
      if (from->role() == ir::InputRole::Parameter && from->state_name() == name) param = to;
    // What eager's backward adds into .grad, one at a time: the gradient, or its events in order.
    std::vector<const ir::Node*> events{grad};
    auto listed = spec.grad_events.find(name);
    if (listed != spec.grad_events.end() && listed->second > 1) {
      events.clear();
      const ir::Node* fold = grad;
      for (int64_t e = listed->second - 1; e >= 1; --e) {
        const ir::Target add{"aten", "add", "Tensor"};
        const bool is_fold = fold->kind() == ir::NodeKind::Call && fold->target() == add &&
                             fold->name().rfind("reentrant_grad_fold", 0) == 0 && fold->args().size() == 2 &&
                             fold->args()[0].kind == ir::Arg::Kind::Node && fold->args()[1].kind == ir::Arg::Kind::Node;
        TORCH_CHECK(is_fold, "accumulate: the gradient of '", name, "' should sum ", listed->second,
                    " events with reentrant_grad_fold adds, found %", fold->name());
        events.push_back(fold->args()[1].node);
        fold = fold->args()[0].node;
      }
      events.push_back(fold);
      std::reverse(events.begin(), events.end());
    }
    auto laid_out = [&](int64_t k, const ir::Node* value) {
      ir::Node* gk = maps[k].at(value);
      return param != nullptr && gk->type().is_tensor() && param->type().is_tensor()
                 ? obey_grad_layout(*g, gk, param->type().tensor)
                 : gk;
    };
    ir::Node* acc = nullptr;
    int64_t adds = 0;
    for (int64_t k = 0; k < n; ++k)  // p.grad += g_k, in micro-batch order (each event on its own)
      for (const ir::Node* e : events) {
        ir::Node* v = laid_out(k, e);
        if (acc == nullptr) {
          acc = v;
          continue;
        }
        acc = g->create_call(g->unique_name(grad->name() + "_acc" + std::to_string(++adds)),
                             ir::Target{"aten", "add", "Tensor"}, {ir::Arg::of_node(acc), ir::Arg::of_node(v)}, {},
                             acc->type());
        acc->set_module_path("accumulate");
      }
    new_outs[idx] = ir::Arg::of_node(acc);
  }
  for (const auto& [idx, name] : spec.buffer_mutations) new_outs[idx] = ir::Arg::of_node(maps[n - 1].at(outs[idx].node));
  // Any other output (none today besides aux, refused above) keeps the last copy's value.
  for (size_t i = 0; i < outs.size(); ++i)
    if (new_outs[i].kind == ir::Arg::Kind::Node && new_outs[i].node->owner() != g.get())
      new_outs[i] = ir::Arg::of_node(maps[n - 1].at(outs[i].node));
  g->create_output(std::move(new_outs));
  return g;
}

}  // namespace torch_ext::passes
