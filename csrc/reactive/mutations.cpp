// Mutations of the reactive engine (see engine.h, "Mutations"): patch, restore, restore(node) and
// graft each validate, apply their own change to the engine's inputs in a new revision, and hand
// the rest to apply() as a Mutation; invalidate() is the one rule that turns a Mutation into
// invalid nodes, structurally dirty nodes and stale baselines. Inside a batch, apply() only records
// it, and settle() runs the recorded ones in order at the batch's end or the next read.
//
// Adding a mutation kind: a public method here (declared in engine.h, bound in bindings.cpp) that
// validates (a refused mutation changes nothing), changes the inputs in a new revision and fills a
// Mutation for apply(); batches, transactions and check_invariants then cover it unchanged.
#include "reactive/engine.h"

#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/eliminate_dead_code.h"
#include "runtime/executor.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace torch_ext::reactive {
namespace {

// Two types that hold the same values the same way: equal, or tensors that differ only in the strides of
// size-1 dims (which address nothing). A Linear grafted after a transposed [1, T, d] node (strides [d, d, 1])
// returns [T * d, d, 1]: the same layout, which the exact comparison refused as "block output type differs".
bool same_value_type(const ir::Type& a, const ir::Type& b) {
  if (a == b) return true;
  if (!a.is_tensor() || !b.is_tensor()) return false;
  const ir::TensorMeta& x = a.tensor;
  const ir::TensorMeta& y = b.tensor;
  if (x.dtype != y.dtype || x.sizes != y.sizes || x.device != y.device || x.strides.size() != x.sizes.size() ||
      y.strides.size() != y.sizes.size())
    return false;
  for (size_t d = 0; d < x.sizes.size(); ++d)
    if (x.sizes[d] > 1 && x.strides[d] != y.strides[d]) return false;
  return true;
}

// The parts of a graft block, checked against the source it is spliced after.
struct BlockParts {
  const ir::Node* input = nullptr;        // the one user input: takes the source's value
  std::vector<const ir::Node*> params;    // the other placeholders: constants given by the caller
  const ir::Node* output = nullptr;       // the one computed value, read by the rerouted consumers
};

BlockParts check_block(const ir::Graph& block, const ir::Node& src, const std::vector<c10::IValue>& params) {
  ir::verify(block);
  check_no_dead_code(block, "graft block");
  BlockParts parts;
  for (const ir::Node* p : block.placeholders()) {
    if (p->role() != ir::InputRole::UserInput) {
      parts.params.push_back(p);
      continue;
    }
    TORCH_CHECK(parts.input == nullptr, "graft: the block must have exactly one user input, found %",
                parts.input == nullptr ? "" : parts.input->name(), " and %", p->name());
    parts.input = p;
  }
  TORCH_CHECK(parts.input != nullptr, "graft: the block has no user input");
  TORCH_CHECK(parts.input->type() == src.type(), "graft: block input type ", ir::print_type(parts.input->type()),
              " differs from %", src.name(), " : ", ir::print_type(src.type()));
  const auto& outs = block.output()->args()[0].list;
  TORCH_CHECK(outs.size() == 1 && outs[0].kind == ir::Arg::Kind::Node && outs[0].node->kind() == ir::NodeKind::Call,
              "graft: the block must return exactly one computed value");
  parts.output = outs[0].node;
  TORCH_CHECK(same_value_type(parts.output->type(), src.type()), "graft: block output type ", ir::print_type(parts.output->type()),
              " differs from %", src.name(), " : ", ir::print_type(src.type()));
  TORCH_CHECK(params.size() == parts.params.size(), "graft: the block has ", parts.params.size(),
              " parameter inputs, got ", params.size(), " values");
  for (size_t i = 0; i < params.size(); ++i) runtime::check_input(*parts.params[i], params[i], i);
  for (const auto& n : block.nodes()) {
    if (n->kind() != ir::NodeKind::Call) continue;
    TORCH_CHECK(!runtime::BoundKernel::bind(*n).mutates(), "graft: block node %", n->name(), " (", n->target().str(),
                ") mutates its inputs");
  }
  return parts;
}

// The consumers a graft reroutes: dst alone (the edge form, which must exist and must not close a
// cycle), or every user of src (the node form).
std::vector<ir::Node*> graft_consumers(ir::Graph& graph, ir::Node* src, const std::string& dst_name) {
  if (dst_name.empty()) {
    TORCH_CHECK(!src->users().empty(), "graft: %", src->name(), " has no consumers to reroute");
    return src->users();
  }
  ir::Node* dst = graph.find(dst_name);
  TORCH_CHECK(dst != nullptr && dst->kind() == ir::NodeKind::Call, "graft: unknown node '", dst_name, "'");
  // dst upstream of src (or src itself) would close a cycle through the block.
  std::vector<const ir::Node*> work{src};
  std::set<const ir::Node*> seen{src};
  while (!work.empty()) {
    const ir::Node* v = work.back();
    work.pop_back();
    TORCH_CHECK(v != dst, "graft %", src->name(), " -> %", dst_name, ": would create a cycle (%", dst_name,
                " is upstream of %", src->name(), ")");
    for (const ir::Node* in : v->inputs())
      if (seen.insert(in).second) work.push_back(in);
  }
  const auto& users = src->users();
  TORCH_CHECK(std::find(users.begin(), users.end(), dst) != users.end(), "graft: no edge %", src->name(), " -> %",
              dst_name, " (%", dst_name, " does not read %", src->name(), ")");
  return {dst};
}

}  // namespace

void Engine::apply(Mutation m) {
  pending_.push_back(std::move(m));
  if (batch_depth_ == 0) settle();
}

void Engine::settle() {
  take_written_inputs();
  settle_pending();
}

void Engine::take_written_inputs(const char* refusing) {
  if (!has_run_) return;
  for (int64_t id : input_ids_) {
    NodeState& st = states_[id];
    // A pinned input holds the patch (check_intact guards it); the input itself is its overlay baseline.
    auto base = st.pinned ? overlay_.find(id) : overlay_.end();
    if (st.pinned && base == overlay_.end()) continue;
    const int64_t recorded = st.pinned ? base->second.version : versions_[id];
    if (recorded < 0) continue;
    const int64_t now = version_of(st.pinned ? base->second.value : values_[id]);
    if (now == recorded) continue;
    TORCH_CHECK(!txn_ && !inputs_frozen_ && refusing == nullptr, refusing ? refusing : "sweep", ": input %", st.node->name(),
                " of the graph (a parameter, buffer or input) was written in place during a sweep (tensor version ",
                now, ", stored at version ", recorded, "): a patch function or metric wrote into the model, and ",
                "every later site would see it. Write into a copy instead (e.g. x = x.clone() first). Outside a ",
                "sweep, the next demand() takes such a write as an edit of that input");
    Mutation m;
    m.under_patch = !pinned_.empty();
    m.rewired = {id};  // every cached value of D(input), and its baseline, was computed from the old contents
    if (st.pinned) {
      base->second.version = now;  // restore() puts the edited input back; D(input) is then recomputed
    } else {
      versions_[id] = now;
      st.changed_at = st.verified_at = ++revision_;
      m.changed = {id};
    }
    ++input_edits_;
    pending_.push_back(std::move(m));
  }
}

void Engine::settle_pending() {
  if (pending_.empty() && !rekey_pending_) return;
  if (rekey_pending_) rekey_dirty();  // grafts shifted topological indices: once per batch
  rekey_pending_ = false;
  std::vector<Mutation> todo;
  todo.swap(pending_);
  for (const Mutation& m : todo) invalidate(m);
}

void Engine::invalidate(const Mutation& m) {
  for (int64_t id : m.fresh) {
    if (!states_[id].valid) dirty_.insert({states_[id].node->index(), id});  // unless patched since
    ++stats_.invalidated;
  }
  for (int64_t id : m.recompute) {
    mark_invalid(id);
    states_[id].verified_at = 0;  // its function or inputs changed: recompute, no cutoff
  }
  for (int64_t id : m.recompute) invalidate_users(id);
  for (int64_t id : m.changed) invalidate_users(id);
  // Values that are no function of the current graph: restore() must recompute, never revive them.
  std::vector<int64_t> retired = m.fresh;
  retired.insert(retired.end(), m.retired.begin(), m.retired.end());
  for (int64_t w : m.rewired) {  // D(w), pinned or already invalid nodes included
    retired.push_back(w);
    for (int64_t d : downstream(w, /*stop_at_pins=*/false)) retired.push_back(d);
  }
  for (int64_t id : retired) {
    const NodeState& st = states_[id];
    // A pinned node counts too: in a batch it may have been patched after the graft that retired it.
    if (st.countable && (!st.valid || st.pinned)) structural_dirty_.insert(id);
    // A pinned one's saved baseline was computed by the old function (patched in this batch before the graft
    // settled, or before an input edit): restore() and a patch function must not take it.
    if (st.countable && st.pinned && overlay_.count(id)) baseline_stale_.insert(id);
    // A valid node of D(w) is one a pin shields (a patch in this batch, after the graft): its value
    // is current, but the baseline restore() would put back was computed by the old function.
    else if (st.countable && !pinned_.empty()) baseline_stale_.insert(id);
    if (m.under_patch) baseline_stale_.insert(id);  // its next value is computed under a patch
  }
}

void Engine::retire_written(int64_t id) {
  Mutation m;
  m.recompute = {id};
  m.retired = {id};
  invalidate(m);  // at once, not deferred: found by a read, which has settled everything else
}

void Engine::end_batch() {
  TORCH_CHECK(batch_depth_ > 0, "end_batch without begin_batch");
  if (--batch_depth_ == 0) settle();
}

void Engine::patch(const std::string& name, c10::IValue value) {
  const int64_t id = id_of(name);
  NodeState& st = states_[id];
  check_value_type(*st.node, value);
  TORCH_CHECK(has_run_, "patch %", name, ": call run() first, so there is a baseline to patch");
  // The baseline saved below must be the computed value. With mutations pending, a node that looks
  // valid may not be; restore() checks the saved baseline's version either way.
  if (st.valid && pending_.empty()) check_intact(id);
  journal(id);
  if (!st.pinned) {
    pinned_.push_back(id);
    st.pinned = true;
    ++pins_version_;
  }
  save_baseline(id);
  // A node a graft or an input edit retired and nobody recomputed still holds its old function's value: that is no
  // baseline (a patch function asking for it was handed the pre-graft value, 2.29 off eager, silently).
  if (structural_dirty_.count(id)) baseline_stale_.insert(id);
  if (!st.valid) {
    if (rekey_pending_) {  // the dirty set's keys predate a graft in this batch
      rekey_dirty();
      rekey_pending_ = false;
    }
    dirty_.erase({st.node->index(), id});
    st.valid = true;
  }
  store(id, std::move(value));
  st.changed_at = st.verified_at = ++revision_;
  Mutation m;
  m.under_patch = true;
  m.changed = {id};
  apply(std::move(m));
}

void Engine::restore() {
  refuse_in_transaction("restore");
  settle();  // what is put back depends on every earlier mutation's invalidation
  if (pinned_.empty() && overlay_.empty()) return;
  ++pins_version_;
  ++revision_;
  for (int64_t id : pinned_) states_[id].pinned = false;
  std::vector<int64_t> written;  // baselines written in place since they were saved (I8): recompute
  for (auto& entry : overlay_) {
    NodeState& st = states_[entry.first];
    Baseline& b = entry.second;
    if (b.version >= 0 && version_of(b.value) != b.version) written.push_back(entry.first);
    values_[entry.first] = std::move(b.value);
    versions_[entry.first] = b.version;
    if (!st.valid) dirty_.erase({st.node->index(), entry.first});
    st.valid = true;
    st.changed_at = b.changed_at;  // the baseline's revision: consumers stay consistent (I4)
    st.verified_at = revision_;
    ++stats_.restored;
  }
  // Invalid nodes that were never recomputed still hold their baseline value.
  for (auto it = dirty_.begin(); it != dirty_.end();) {
    const int64_t id = it->second;
    if (structural_dirty_.count(id)) {
      ++it;
      continue;
    }
    NodeState& st = states_[id];
    st.valid = true;
    st.verified_at = revision_;
    ++stats_.restored;
    it = dirty_.erase(it);
  }
  overlay_.clear();
  pinned_.clear();
  // Baselines a graft displaced (or never computed), or written in place, are recomputed.
  std::set<int64_t> stale;
  stale.swap(baseline_stale_);
  stale.insert(structural_dirty_.begin(), structural_dirty_.end());
  stale.insert(written.begin(), written.end());
  Mutation m;
  m.recompute.assign(stale.begin(), stale.end());
  m.retired = m.recompute;
  apply(std::move(m));
}

void Engine::restore(const std::string& name) {
  refuse_in_transaction("restore");
  const int64_t id = id_of(name);
  NodeState& st = states_[id];
  TORCH_CHECK(st.pinned, "restore %", name, ": node is not patched");
  if (pinned_.size() == 1) {
    restore();
    return;
  }
  // Other patches stay active: this node's inputs may differ from baseline, so recompute D(node).
  st.pinned = false;
  ++pins_version_;
  pinned_.erase(std::find(pinned_.begin(), pinned_.end(), id));
  ++revision_;
  Mutation m;
  m.under_patch = true;
  if (st.countable) {
    m.recompute = {id};  // its inputs may differ from when it was pinned
  } else {
    values_[id] = overlay_.at(id).value;
    versions_[id] = overlay_.at(id).version;
    st.changed_at = st.verified_at = revision_;
    m.changed = {id};
  }
  apply(std::move(m));
}

std::vector<std::string> Engine::graft(const std::string& src_name, const std::string& dst_name,
                                       const ir::Graph& given_block, std::vector<c10::IValue> block_params) {
  // Export leaves side-effect-free dead nodes (_assert_tensor_metadata for a .to()) in a block: drop them
  // first, so that a block of the wrong type is refused for its type, not for dead code.
  const std::unique_ptr<ir::Graph> block = given_block.clone();
  passes::eliminate_dead_code(*block);
  // Validate everything first: a refused graft changes nothing.
  refuse_in_transaction("graft");
  ir::Node* src = states_[id_of(src_name)].node;
  TORCH_CHECK(src->type().kind == ir::Type::Kind::Tensor, "graft: source %", src_name, " must be tensor-valued, got ",
              ir::print_type(src->type()));
  const std::vector<ir::Node*> consumers = graft_consumers(*graph_, src, dst_name);
  const BlockParts parts = check_block(*block, *src, block_params);

  // Splice: the block's constants become placeholders, its calls are copied before the first consumer.
  ++revision_;
  plans_.clear();  // cones change
  clear_row_plans();
  seq_.reset();
  const std::string prefix = "graft" + std::to_string(grafts_.size()) + "_";
  ir::ValueMap map;
  map[parts.input] = src;
  for (size_t i = 0; i < parts.params.size(); ++i) {
    const ir::Node* p = parts.params[i];
    ir::Node* copy = graph_->create_placeholder(graph_->unique_name(prefix + p->name()), ir::InputRole::Constant,
                                                p->type(), p->state_name());
    const int64_t id = add_state(copy);
    store(id, std::move(block_params[i]));
    states_[id].changed_at = states_[id].verified_at = revision_;
    map[p] = copy;
  }
  ir::Node* insert_before = *std::min_element(
      consumers.begin(), consumers.end(), [](const ir::Node* a, const ir::Node* b) { return a->index() < b->index(); });
  Mutation m;
  m.under_patch = !pinned_.empty();
  std::vector<std::string> names;
  for (const auto& n : block->nodes()) {
    if (n->kind() != ir::NodeKind::Call) continue;
    ir::Node* copy = graph_->copy_call(*n, map, graph_->unique_name(prefix + n->name()), insert_before);
    m.fresh.push_back(add_state(copy));
    names.push_back(copy->name());
  }
  for (ir::Node* c : consumers) graph_->replace_input_of(c, src, map.at(parts.output));
  rekey_pending_ = true;  // insertions shifted topological indices
  for (int64_t id : m.fresh) bind(id);
  for (ir::Node* c : consumers) {
    if (c->kind() != ir::NodeKind::Call) continue;  // the output node: only the block is new
    const int64_t w = ids_.at(c);
    bind(w);
    m.recompute.push_back(w);  // an input was rerouted
    m.rewired.push_back(w);    // every node of D(w) now has a new baseline
  }
  grafts_.push_back(Graft{m.fresh, revision_});
  apply(std::move(m));
  return names;
}

}  // namespace torch_ext::reactive
