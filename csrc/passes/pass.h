// The pass interface (MLIR's Pass, torch.fx's PassBase): a pass has a name, an enablement
// predicate and a run function on a graph with a typed PassContext, the values the train-step
// passes hand each other. A pass is plain data, so a pipeline is a declared list that a
// PassManager (pass_manager.h) runs, verifying the graph after every pass.
//
// Adding a pass: write csrc/passes/<name>.{h,cpp} with a function
//   PassResult run_<name>(ir::Graph& graph, PassContext& ctx);
// reading and updating the context fields it needs, then add one entry {"<name>", predicate,
// run_<name>} to the pipeline's list (build_train_step.cpp for the training step).
#pragma once

#include "ir/graph.h"
#include "passes/train_step_spec.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch_ext::passes {

// Values keyed by state name, in a fixed order (the spec's, or the step's output order).
using NamedValues = std::vector<std::pair<std::string, ir::Node*>>;

// What the passes of a pipeline share. Node pointers point into the pipeline's current graph;
// a pass that replaces the graph (PassResult::replaced) runs before any field holding nodes is
// filled, or refills the fields it invalidates.
struct PassContext {
  PassContext(const TrainStepSpec& spec, int64_t unroll_steps) : spec(spec), unroll_steps(unroll_steps) {}

  const TrainStepSpec& spec;
  int64_t unroll_steps;  // steps per call (see unroll.h)

  // The joint graph's outputs, read by the read_outputs pass; the passes that transform them
  // (all_reduce_grads, clip_grad_norm) store the new values in place.
  ir::Node* loss = nullptr;
  NamedValues grads;    // gradient by parameter state name, in spec.grads order
  NamedValues buffers;  // new value by buffer state name, in spec.buffer_mutations order
  std::vector<ir::Node*> aux;

  std::map<std::string, ir::Node*> lifted;  // lift_optimizer_state: the new placeholders by state name
  NamedValues updated;                      // append_update / shard_optimizer_state: new params and optimizer state
  ir::Node* rng = nullptr;                  // thread_rng: the final generator state, or null when nothing draws

  // rewire_outputs: the step's state in output order (outputs 1..), and the signature of one step.
  NamedValues state;
  size_t num_user_inputs = 0;

  // grads as the name -> node map the optimizer passes take.
  std::map<std::string, ir::Node*> grad_map() const { return {grads.begin(), grads.end()}; }
};

// What a pass did (torch.fx's PassResult). The manager verifies after a pass that changed the
// graph; an analysis returns unchanged().
struct PassResult {
  bool modified = true;
  std::unique_ptr<ir::Graph> replacement;  // set by a pass that builds a new graph

  static PassResult changed() { return {}; }
  static PassResult unchanged() { return {false, nullptr}; }
  static PassResult replaced(std::unique_ptr<ir::Graph> g) { return {true, std::move(g)}; }
};

struct Pass {
  const char* name;
  // Whether the pass runs in this pipeline (a predicate on the spec); nullptr: always.
  bool (*enabled)(const PassContext& ctx);
  // Transforms `graph` in place, or returns a replacement, and records what later passes need in
  // the context. Throws c10::Error, naming the node, on input it refuses; the pipeline stops.
  PassResult (*run)(ir::Graph& graph, PassContext& ctx);
};

}  // namespace torch_ext::passes
