// naive: every buffer at its own offset, in list order (no reuse): the upper bound.
#include "passes/memory_algorithms.h"

namespace torch_ext::passes {

ir::ArenaPlan plan_naive(const std::vector<ir::BufferLife>& buffers) {
  std::vector<int64_t> offsets(buffers.size());
  int64_t cursor = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    offsets[i] = cursor;
    cursor += ir::align_up(buffers[i].size);
  }
  return arena_plan_of("naive", buffers, std::move(offsets));
}

}  // namespace torch_ext::passes
