#include "passes/unroll.h"

#include <c10/util/Exception.h>

#include <unordered_map>

namespace torch_ext::passes {

std::unique_ptr<ir::Graph> unroll(const ir::Graph& step, size_t num_state, int64_t steps) {
  TORCH_CHECK(steps >= 1, "unroll: steps must be >= 1, got ", steps);
  const auto placeholders = step.placeholders();
  const auto& outs = step.output()->args()[0].list;
  TORCH_CHECK(outs.size() == num_state + 1, "unroll: expected ", num_state + 1, " outputs (loss and state), got ",
              outs.size());
  auto g = std::make_unique<ir::Graph>();
  std::unordered_map<const ir::Node*, ir::Node*> shared;  // state and other inputs, step-invariant
  std::vector<const ir::Node*> user_inputs;
  for (size_t i = 0; i < placeholders.size(); ++i) {
    const ir::Node* p = placeholders[i];
    if (p->role() == ir::InputRole::UserInput) {
      user_inputs.push_back(p);
      continue;
    }
    shared[p] = g->create_placeholder(p->name(), p->role(), p->type(), p->state_name());
  }
  std::vector<ir::Node*> state(num_state);
  for (size_t k = 0; k < num_state; ++k) state[k] = shared.at(placeholders[k]);
  std::vector<ir::Arg> losses;
  for (int64_t s = 0; s < steps; ++s) {
    const std::string suffix = "_s" + std::to_string(s);
    ir::ValueMap map;
    for (size_t k = 0; k < num_state; ++k) map[placeholders[k]] = state[k];
    for (const auto& [from, to] : shared)
      if (!map.count(from)) map[from] = to;
    for (const ir::Node* u : user_inputs)
      map[u] = g->create_placeholder(u->name() + suffix, u->role(), u->type(), u->state_name());
    for (const auto& n : step.nodes())
      if (n->kind() == ir::NodeKind::Call) g->copy_call(*n, map, g->unique_name(n->name() + suffix));
    losses.push_back(ir::remap_arg(outs[0], map));
    for (size_t k = 0; k < num_state; ++k) state[k] = ir::remap_arg(outs[k + 1], map).node;
  }
  const ir::Type& loss_type = outs[0].node->type();
  TORCH_CHECK(loss_type.is_tensor() && loss_type.tensor.sizes.empty(), "unroll: the loss must be a scalar tensor");
  ir::TensorMeta stacked = loss_type.tensor;
  stacked.sizes = {steps};
  stacked.strides = {1};
  ir::Node* loss_stack = g->create_call(g->unique_name("losses"), ir::Target::parse("aten::stack.default"),
                                        {ir::Arg::of_list(losses)}, {}, ir::Type::make_tensor(stacked));
  std::vector<ir::Arg> out{ir::Arg::of_node(loss_stack)};
  for (ir::Node* s : state) out.push_back(ir::Arg::of_node(s));
  g->create_output(std::move(out));
  return g;
}

}  // namespace torch_ext::passes
