#include "passes/serialize_collectives.h"

#include "ir/schema.h"
#include "passes/ready_set.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace torch_ext::passes {

namespace {

using ir::is_collective;
const auto& is_wait = ir::is_collective_wait;

// The collective a wait waits for (its argument), or null.
const ir::Node* waited(const ir::Node& wait) {
  const auto& args = wait.args();
  return args.empty() ? nullptr : args[0].node;
}

}  // namespace

bool runs_alone(const ir::Node& n) {
  return is_collective(n) && n.target().name != "all_reduce" && n.target().name != "broadcast";
}

std::vector<const ir::Node*> serialize_collectives(const std::vector<const ir::Node*>& order) {
  if (std::none_of(order.begin(), order.end(), [](const ir::Node* n) { return runs_alone(*n); })) return order;
  ReadySet rs(order);
  std::vector<const ir::Node*> in_flight;  // issued collectives whose wait has not run, oldest first
  const ir::Node* alone = nullptr;         // the runs_alone collective in flight
  const auto allowed = [&](const ir::Node* n) {
    if (alone != nullptr) return is_wait(*n) && waited(*n) == alone;
    if (runs_alone(*n)) return in_flight.empty();
    return true;
  };
  std::vector<const ir::Node*> out;
  out.reserve(order.size());
  while (!rs.ready().empty()) {
    const auto& ready = rs.ready();
    const auto by_rank = [&](const ir::Node* a, const ir::Node* b) { return rs.rank(a) < rs.rank(b); };
    // The best-ranked allowed node. A runs_alone collective that is the best-ranked ready node but
    // must wait for the collectives in flight first drains them, oldest first, rather than let
    // later nodes (and more collectives) pass it.
    const auto best_ready = std::min_element(ready.begin(), ready.end(), by_rank);
    auto pick = ready.end();
    if (alone == nullptr && runs_alone(**best_ready) && !in_flight.empty())
      for (const ir::Node* c : in_flight) {
        pick = std::find_if(ready.begin(), ready.end(), [&](const ir::Node* r) { return is_wait(*r) && waited(*r) == c; });
        if (pick != ready.end()) break;
      }
    if (pick == ready.end())
      for (auto it = ready.begin(); it != ready.end(); ++it)
        if (allowed(*it) && (pick == ready.end() || by_rank(*it, *pick))) pick = it;
    // Nothing allowed: a collective without its wait. Keep the given order; collective_overlap()
    // names the violation to whoever checks.
    if (pick == ready.end()) pick = best_ready;
    const ir::Node* n = rs.take(static_cast<size_t>(pick - ready.begin()));
    out.push_back(n);
    if (is_collective(*n)) {
      in_flight.push_back(n);
      if (runs_alone(*n)) alone = n;
    } else if (is_wait(*n)) {
      auto it = std::find(in_flight.begin(), in_flight.end(), waited(*n));
      if (it != in_flight.end()) in_flight.erase(it);
      if (waited(*n) == alone) alone = nullptr;
    }
  }
  TORCH_INTERNAL_ASSERT(out.size() == order.size(), "serialize_collectives: the order is not a DAG");
  return out;
}

bool serialize_collectives(ir::Graph& g) {
  std::vector<const ir::Node*> calls;
  for (const auto& n : g.nodes())
    if (n->kind() == ir::NodeKind::Call) calls.push_back(n.get());
  const auto order = serialize_collectives(calls);
  if (order == calls) return false;
  std::vector<ir::Node*> mutable_order;
  mutable_order.reserve(order.size());
  for (const ir::Node* n : order) mutable_order.push_back(const_cast<ir::Node*>(n));  // g's own nodes
  g.reorder_calls(mutable_order);
  return true;
}

std::string collective_overlap(const std::vector<const ir::Node*>& order) {
  std::vector<const ir::Node*> in_flight;
  for (const ir::Node* n : order) {
    if (is_collective(*n)) {
      const ir::Node* clash = nullptr;
      for (const ir::Node* c : in_flight)
        if (runs_alone(*n) || runs_alone(*c)) clash = c;
      if (clash != nullptr)
        return "%" + n->name() + " (" + n->target().str() + ") is issued while %" + clash->name() + " (" +
               clash->target().str() + ") is in flight";
      in_flight.push_back(n);
    } else if (is_wait(*n)) {
      in_flight.erase(std::remove(in_flight.begin(), in_flight.end(), waited(*n)), in_flight.end());
    }
  }
  return {};
}

}  // namespace torch_ext::passes
