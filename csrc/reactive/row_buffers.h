// Reused memory for the row path of the reactive engine (rows.cpp).
//
// A token-granular cone's values have shapes that depend on the site's first changed row, so they
// cannot be planned once into the whole-cone scratch (scratch.cpp). Allocated afresh, values past
// glibc's mmap / trim thresholds (a batched unit's MLP activations: megabytes) go back to the system
// when freed and fault in fresh zeroed pages at the next unit: a sixth of a batched sweep's time at
// d_model 128. A RowBufferPool keeps such storages and hands one out again once nothing references
// it any more (its storage's reference count is 1: the pool's own), so a unit's values are written
// into memory the previous unit (or the previous value of the same unit) left hot. Nothing is ever
// overwritten while a tensor or view anyone holds points into it; the pool's free storages are
// capped, the rest go back to the allocator. Engines may share one pool (the batched cones of one
// sweep share their base engine's), so the memory is reused across units as well.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace torch_ext::reactive {

class RowBufferPool {
 public:
  // Values smaller than this come from the allocator (its small-block caches are hot already).
  static constexpr int64_t kMinBytes = 32 * 1024;
  // Free storages kept beyond this many bytes are returned to the allocator.
  static constexpr int64_t kMaxFreeBytes = 64 * 1024 * 1024;

  // A contiguous tensor of `sizes` and `options` (CPU, strided): a free pooled storage of at least its
  // bytes (at most twice as many), else a new one added to the pool. Its contents are unspecified.
  at::Tensor take(at::IntArrayRef sizes, const at::TensorOptions& options);
  // Storages handed out again so far, and newly allocated (tests and benchmarks).
  int64_t reused() const { return reused_; }
  int64_t allocated() const { return allocated_; }
  // Drops every free storage (the ones still referenced stay alive with their tensors).
  void clear();

 private:
  std::mutex mutex_;  // engines sharing a pool may run on two threads (evaluate releases the GIL)
  std::vector<c10::Storage> storages_;
  int64_t reused_ = 0;
  int64_t allocated_ = 0;
};

// Whether `options` and `nbytes` call for a pooled buffer (CPU strided tensors of kMinBytes or more).
bool poolable(const at::TensorOptions& options, int64_t nbytes);

}  // namespace torch_ext::reactive
