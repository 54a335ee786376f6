// Recycles the memory of the optimizer state a runtime returned, once its caller drops it.
//
// A pure step returns a new state every call (param', every optimizer slot'), and the caller drops
// the old one after the call: on the CPU that is a state-sized free and a state-sized allocation
// per step. glibc returns freed memory at the top of its heap (and any block above its mmap
// threshold) to the OS, so the next step's fresh state is new pages, first touched inside the update
// kernels: thousands of page faults per step (ResNet-18 with AdamW: ~6,000 a step, ~7% of it), which
// eager torch.optim, updating in place, never pays. A ResultPool hands the functional update ops
// (optim::fresh_like, through a ResultAllocatorGuard on the running thread) CPU blocks whose
// deleter puts them back into the pool instead of freeing them, so the next call reuses warm memory.
//
// Invariants: a block is in the free lists only after its last tensor died; the pool keeps at most
// `cap` bytes there (the most bytes one run took from it), the rest goes back to the allocator;
// blocks outlive the pool safely (each holds the shared state); after close() every returned block
// is freed. Allocations are reported to the profiler like c10's CPU allocator does (a block handed
// out counts as allocated, one returned to the pool as freed), so measured peaks stay honest.
// Non-CPU or non-dense tensors take at::empty_like (device allocators cache on their own).
#pragma once

#include "optim/descriptor.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace torch_ext::runtime {

class ResultPool {
 public:
  ResultPool();
  ~ResultPool();  // closes the pool: cached blocks are freed now, blocks in use when they die
  ResultPool(const ResultPool&) = delete;
  ResultPool& operator=(const ResultPool&) = delete;

  // One run's allocator: install it with optim::ResultAllocatorGuard for the run; on destruction it
  // raises the pool's cap to the bytes this run took.
  class Run final : public optim::ResultAllocator {
   public:
    explicit Run(const ResultPool& pool) : pool_(pool) {}
    ~Run() override;
    at::Tensor empty_like(const at::Tensor& t) override;

   private:
    const ResultPool& pool_;
    int64_t taken_ = 0;
  };

  struct State;  // shared with the blocks' deleters

  // Bytes in the free lists now (for tests).
  int64_t cached_bytes() const;
  // Blocks handed out that were recycled rather than newly allocated, since construction.
  int64_t reused_blocks() const;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace torch_ext::runtime
