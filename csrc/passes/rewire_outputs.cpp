#include "passes/rewire_outputs.h"

#include <c10/util/Exception.h>

#include <unordered_map>
#include <unordered_set>

namespace torch_ext::passes {

size_t rewire_outputs(ir::Graph& g, ir::Node* loss, const std::vector<std::pair<std::string, ir::Node*>>& new_state) {
  std::unordered_map<std::string, ir::Node*> by_state;
  for (ir::Node* p : g.placeholders())
    if (!p->state_name().empty()) by_state[p->state_name()] = p;
  std::vector<ir::Node*> order;
  std::unordered_set<ir::Node*> taken;
  for (const auto& [name, node] : new_state) {
    auto it = by_state.find(name);
    TORCH_CHECK(it != by_state.end(), "rewire_outputs: no placeholder holds state '", name, "'");
    TORCH_CHECK(taken.insert(it->second).second, "rewire_outputs: state '", name, "' is updated twice");
    TORCH_CHECK(node->owner() == &g, "rewire_outputs: new value of '", name, "' is not in this graph");
    order.push_back(it->second);
  }
  TORCH_CHECK(loss->owner() == &g, "rewire_outputs: the loss is not in this graph");
  std::vector<ir::Node*> others, users;
  for (ir::Node* p : g.placeholders()) {
    if (taken.count(p)) continue;
    (p->role() == ir::InputRole::UserInput ? users : others).push_back(p);
  }
  std::vector<ir::Node*> final_order = order;
  final_order.insert(final_order.end(), others.begin(), others.end());
  final_order.insert(final_order.end(), users.begin(), users.end());
  g.reorder_placeholders(final_order);
  std::vector<ir::Arg> outs{ir::Arg::of_node(loss)};
  for (const auto& entry : new_state) outs.push_back(ir::Arg::of_node(entry.second));
  g.set_output(std::move(outs));
  return new_state.size();
}

}  // namespace torch_ext::passes
