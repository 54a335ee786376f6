// The memory plan of a scheduled pure step: a value, produced by passes::plan_memory and consumed
// by runtime::ArenaExecutor (which never plans), the memory report and the budget search.
//
// Terms. A position is an index into `order`. A buffer is one storage-owning value (a call's
// result, or one element of a tuple result) live over the inclusive range [first, last] of
// positions: its producer's position to its last storage reader's. A view (a schema view, a
// getitem, aten::_unsafe_view ...) owns no storage: it is an alias of the buffer it reads and
// lives within that buffer's lifetime. Arena buffers get a 64-byte aligned offset in one arena;
// two of them may share bytes only when their lifetimes are disjoint.
//
// verify_memory_plan() checks exactly that, naming the culprits: it is the storage-overlap
// verifier every hand-made or transformed plan must pass.
#pragma once

#include "ir/graph.h"

#include <cstdint>
#include <string>
#include <vector>

namespace torch_ext::ir {

struct BufferLife {
  int64_t size = 0;   // bytes, > 0
  int64_t first = 0;  // inclusive positions
  int64_t last = 0;
};

// Offsets for a list of BufferLife (the output of one planning algorithm).
struct ArenaPlan {
  std::string algorithm;
  std::vector<int64_t> offsets;  // per buffer
  int64_t arena_bytes = 0;
};

constexpr int64_t kArenaAlignment = 64;

int64_t align_up(int64_t bytes, int64_t alignment = kArenaAlignment);

// Largest total of live (aligned) bytes at any position: no arena can be smaller.
int64_t lower_bound_bytes(const std::vector<BufferLife>& buffers);

// Throws c10::Error naming the first two buffers (by index) that overlap in both lifetime and
// bytes, or a buffer that leaves the arena or is misaligned.
void verify_plan(const std::vector<BufferLife>& buffers, const ArenaPlan& plan);

struct PlannedBuffer {
  const Node* node = nullptr;  // producer
  int64_t elem = -1;           // tuple element, -1 for a single tensor
  BufferLife life;
};

// A value that shares an arena buffer's storage (alias-of that buffer).
struct PlannedView {
  const Node* node = nullptr;
  int64_t elem = -1;
  size_t buffer = 0;  // index into MemoryPlan::buffers
  int64_t first = 0;  // the view's own lifetime: its definition to its last reader
  int64_t last = 0;
};

// Whether a functional optimizer update may overwrite its (donated) state inputs in place.
struct AliasDecision {
  const Node* update = nullptr;  // the torch_ext::*_update node
  bool applied = false;
  std::string reason;  // why it was refused
};

// Which part of a training step a call node belongs to: the forward (the loss depends on it), the
// optimizer update (an update op and the getitems of its results), or the backward (the rest).
enum class StepPhase { Forward, Backward, Update };
const char* to_string(StepPhase phase);

struct MemoryPlan {
  std::vector<const Node*> order;  // call nodes in schedule order
  std::vector<StepPhase> phases;   // per position of `order`
  std::vector<PlannedBuffer> buffers;  // in the arena (arena.offsets[i] is buffers[i]'s)
  std::vector<PlannedView> views;      // values aliasing an arena buffer
  // Buffers their kernels allocate (no out= overload with a kernel of its own, or a tuple result
  // with an element outside the arena, or moved out of the arena because they fit under the peak
  // of those), and the largest sum of them live at one position.
  std::vector<PlannedBuffer> dynamic;
  int64_t dynamic_bytes = 0;
  ArenaPlan arena;
  std::vector<AliasDecision> aliases;
  int64_t persistent_bytes = 0;  // placeholders: state and batch
  int64_t escaping_bytes = 0;    // outputs not written in place into donated state
  int64_t lower_bound = 0;       // largest live arena bytes at any position (LB_sched minus persistent)
  int64_t lb_graph = 0;          // passes::graph_lower_bound(): no order or placement has a smaller peak_bytes()

  int64_t aliases_applied() const;
  int64_t aliases_refused() const;
  int64_t peak_bytes() const { return persistent_bytes + escaping_bytes + arena.arena_bytes + dynamic_bytes; }
  int64_t lb_sched() const { return persistent_bytes + escaping_bytes + lower_bound; }
};

// The storage-overlap verifier. Throws c10::Error naming the nodes involved when
//   * two arena buffers live at one position share bytes (neither is an alias of the other),
//   * a view outlives the buffer it aliases (its bytes may then be reused while it is read),
//   * a buffer is misaligned, leaves the arena, or its lifetime is not [its producer's position,
//     a later one] within `order`, or `phases` does not cover `order`.
void verify_memory_plan(const MemoryPlan& plan);

}  // namespace torch_ext::ir
