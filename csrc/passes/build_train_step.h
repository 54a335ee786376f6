// The pure-training-step pipeline: joint forward/backward graph in, one side-effect-free step out.
//
//   recompose_activation_backward -> [accumulate] -> read_outputs -> lift_optimizer_state -> [all_reduce_grads]
//   -> [clip_grad_norm]
//   -> append_update (or shard_optimizer_state, ZeRO-1) -> thread_rng -> rewire_outputs
//   -> eliminate_dead_code -> check_pure -> [unroll -> check_pure]
//
// A declared list of passes (train_step_passes()) run by a PassManager; a bracketed pass is an
// entry whose predicate on the spec (or the unroll count) is false when it is not wanted.
// Outputs: (loss, new state..., aux...). The state is parameters, buffers, "rng" (only when the
// step draws random numbers, see thread_rng.h), then optimizer state.
// The verifier runs after every pass; a failure names the pass. The input graph is not changed.
#pragma once

#include "ir/graph.h"
#include "passes/pass.h"
#include "passes/train_step_spec.h"

#include <memory>
#include <string>
#include <vector>

namespace torch_ext::passes {

struct TrainStepGraph {
  std::unique_ptr<ir::Graph> graph;
  std::vector<std::string> state_names;  // the first inputs, and outputs 1.., in this order
  size_t num_user_inputs = 0;            // per step
};

// The pipeline's passes, in order (disabled entries included).
std::vector<Pass> train_step_passes();

TrainStepGraph build_train_step(const ir::Graph& joint, const TrainStepSpec& spec, int64_t unroll_steps);

}  // namespace torch_ext::passes
