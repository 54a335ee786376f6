// Keeps the CPU memory an opaque callable allocates in one call for its next call.
//
// An AOTInductor package allocates its intermediates and outputs afresh on every call
// (aoti_torch_empty_strided, through c10's CPU allocator) and frees them at the end. glibc serves
// blocks above its mmap threshold (always those of 32 MiB and more, such as GPT-2's 1024 x 8192
// logits and their gradient) with a fresh mmap and unmaps them on free, so every call first-touches
// them again: on this VM ~2.6 us per 4 KiB page, 16,000 page faults and ~40 ms of a 330 ms GPT-2
// step. While a CallPool::Scope is alive, CPU allocations made *on its thread* come from the pool:
// a block whose tensors all died goes back to the pool's free list (keyed by its exact byte size),
// and the next call of the same program, which asks for the same sizes, gets warm memory.
//
// How it is scoped: c10 has one process-wide CPU allocator and no per-thread hook, so the first
// live Scope installs a forwarding allocator (c10::SetCPUAllocator, priority 0), and the previous
// allocator is put back by the last Scope that ends with no pooled block alive: a pooled block may
// have been raw-allocated (oneDNN's raw_allocate / raw_deallocate), so until it dies c10's raw
// deleter must stay ours (through the previous allocator's it would be freed behind the pool's back,
// and a later raw free of the same address, handed out again by glibc, would reach the pool with the
// stale size). The forwarding allocator serves only threads inside a Scope; any other thread's
// allocation goes to the previous allocator, unchanged. If a higher-priority CPU allocator is
// registered, nothing is installed and the scope pools nothing (installed() says so); one registered
// while a pooled block is alive would get that block's raw free (not guarded here).
//
// Threads: a block may die on any thread (a gloo worker dropping a call's output); its free touches
// only the address table and the pool's free lists, each under its mutex. The thread-local stack of
// scopes is read only by its own thread, and scopes install and restore under one mutex.
//
// Invariants: a block is in the free lists only after its last tensor died; the pool keeps at most
// `cap` bytes there (the most bytes one scope allocated afresh), the rest goes back to c10::free_cpu;
// blocks outlive the pool safely (each holds the shared state); after release() or destruction
// every cached block is freed, and blocks in use are freed when they die. Allocations are reported
// to the profiler as c10's CPU allocator reports them.
#pragma once

#include <cstdint>
#include <memory>

namespace torch_ext::runtime {

class CallPool {
 public:
  CallPool();
  ~CallPool();  // releases the cached blocks; blocks in use are freed when they die
  CallPool(const CallPool&) = delete;
  CallPool& operator=(const CallPool&) = delete;

  // Pools this thread's CPU allocations for its lifetime (nestable; the innermost pool serves).
  class Scope {
   public:
    explicit Scope(CallPool& pool);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    // Whether the forwarding allocator is c10's CPU allocator (false: allocations are not pooled).
    bool installed() const { return installed_; }

    struct Frame;  // this scope on its thread's stack of scopes

   private:
    std::unique_ptr<Frame> frame_;
    bool installed_;
  };

  struct State;  // shared with the blocks' deleters

  // Frees the cached blocks now (the next call allocates afresh).
  void release();
  int64_t cached_bytes() const;
  // Blocks handed out from the free lists, and blocks newly allocated, since construction.
  int64_t reused_blocks() const;
  int64_t fresh_blocks() const;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace torch_ext::runtime
