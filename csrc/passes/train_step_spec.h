// What the pure-training-step passes need to know about the optimizer and the joint graph.
// Filled by the Python front end from a real torch.optim optimizer and the joint program's
// output signature; plain data, no torch types.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch_ext::passes {

// One parameter's update rule. `kind` names a registered optimizer (optim/descriptor.h), whose
// descriptor says which `hyper` and `flags` entries its update reads.
struct ParamUpdate {
  std::string param;  // the parameter's state name, e.g. "fc1.weight"
  std::string kind;
  int64_t group = 0;  // index of the lr input shared by the param group
  std::map<std::string, double> hyper;  // the descriptor's float and int scalars, by name
  std::map<std::string, bool> flags;    // its bool scalars, by name
  // A scheduler changes the kind's schedulable scalars: they are the group's inputs
  // "opt:<scalar>:group<g>" (as lr is), and `hyper` holds only their values at build.
  bool scheduled = false;
};

// Data parallelism over a torch.distributed process group (see all_reduce_grads.h and
// shard_optimizer_state.h). Each rank builds its own program; they differ only in `rank`.
struct DataParallel {
  std::string group_name;  // the group's registered name, as _c10d_functional ops take it
  int64_t world_size = 1;
  int64_t rank = 0;
  bool shard_optimizer_state = false;  // ZeRO-1: each rank keeps and updates 1/world_size of the state
};

struct TrainStepSpec {
  int64_t loss_output = -1;                                       // index into the joint graph's outputs
  std::vector<std::pair<int64_t, std::string>> buffer_mutations;  // output index -> buffer state name
  std::vector<std::pair<int64_t, std::string>> grads;             // output index -> parameter state name
  std::vector<ParamUpdate> updates;
  int64_t num_groups = 1;
  std::optional<double> clip_max_norm;
  double clip_norm_type = 2.0;
  std::vector<int64_t> aux_outputs;  // joint output indices returned after the state (loss_fn's aux)
  int64_t accumulate = 1;            // micro-batches per update (see accumulate.h)
  // Parameter state name -> how many events its gradient output sums (a parameter read inside a reentrant
  // checkpoint and elsewhere: eager adds each into .grad on its own; see accumulate.h).
  std::map<std::string, int64_t> grad_events;
  std::optional<DataParallel> data_parallel;  // unset: one process
};

}  // namespace torch_ext::passes
