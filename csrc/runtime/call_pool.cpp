#include "runtime/call_pool.h"

#include "runtime/block_cache.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torch_ext::runtime {

struct CallPool::State : BlockCache {};

struct CallPool::Scope::Frame {
  std::shared_ptr<CallPool::State> state;
  int64_t fresh = 0;  // bytes newly allocated in this scope (not served from the free lists)
  Frame* outer = nullptr;
};

namespace {

thread_local CallPool::Scope::Frame* current_frame = nullptr;

// Pooled blocks in use, by address: their DataPtrs are simple (context == data), as c10's raw
// allocation interface (raw_allocate / raw_deallocate, used by oneDNN among others) requires, so
// the deleter finds a block's pool here. Any other pointer is the replaced allocator's.
struct InUse {
  std::shared_ptr<CallPool::State> pool;
  size_t nbytes;
};
std::mutex in_use_mutex;
std::unordered_map<void*, InUse>& in_use() {
  static auto* m = new std::unordered_map<void*, InUse>();  // never destroyed: blocks may die at exit
  return *m;
}
std::atomic<c10::DeleterFnPtr> previous_raw_deleter{nullptr};

bool pooled_blocks_in_use() {
  std::lock_guard<std::mutex> lock(in_use_mutex);
  return !in_use().empty();
}

void give_back(void* ptr) {
  InUse b;
  {
    std::lock_guard<std::mutex> lock(in_use_mutex);
    auto it = in_use().find(ptr);
    if (it != in_use().end()) {
      b = std::move(it->second);
      in_use().erase(it);
    }
  }
  if (b.pool == nullptr) {
    // Raw-allocated by the replaced allocator and freed through ours (outside the lock: that
    // allocator's deleter may allocate).
    c10::DeleterFnPtr d = previous_raw_deleter.load();
    TORCH_INTERNAL_ASSERT(d != nullptr, "CallPool: freeing ", ptr,
                          ", not a pooled block, and the replaced CPU allocator has no raw deleter");
    d(ptr);
    return;
  }
  c10::reportMemoryUsageToProfiler(ptr, -static_cast<int64_t>(b.nbytes), 0, 0, c10::Device(c10::kCPU));
  b.pool->give_back(ptr, b.nbytes);
}

c10::DataPtr pooled(CallPool::Scope::Frame& f, size_t nbytes) {
  void* ptr = f.state->take(nbytes);
  if (ptr == nullptr) {
    ptr = c10::alloc_cpu(nbytes);
    // The cap is the most bytes one scope allocated afresh: the blocks a call of that program needs
    // to run warm. It grows during the first call, so that call's freed intermediates are kept
    // already. (Not the bytes a scope takes, reused blocks included: many times that, and with several
    // batch shapes the free lists filled up to it.)
    f.fresh += static_cast<int64_t>(nbytes);
    f.state->raise_cap(f.fresh);
  }
  {
    std::lock_guard<std::mutex> lock(in_use_mutex);
    in_use()[ptr] = InUse{f.state, nbytes};
  }
  c10::reportMemoryUsageToProfiler(ptr, static_cast<int64_t>(nbytes), 0, 0, c10::Device(c10::kCPU));
  return {ptr, ptr, &give_back, c10::Device(c10::kCPU)};
}

// c10's CPU allocator while any Scope is alive: a thread inside a Scope allocates from its pool,
// every other thread (and every empty request) from the allocator it replaced.
class Forwarding final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    CallPool::Scope::Frame* f = current_frame;
    if (f == nullptr || nbytes == 0) return previous.load()->allocate(nbytes);
    return pooled(*f, nbytes);
  }
  // Frees pooled blocks and, forwarded, the replaced allocator's raw allocations.
  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  // Set before the first install and never cleared: storages made here may resize after the scope.
  std::atomic<c10::Allocator*> previous{nullptr};
};

Forwarding& forwarding() {
  static Forwarding* f = new Forwarding();  // never destroyed: storages keep a pointer to it
  return *f;
}

std::mutex install_mutex;
int live_scopes = 0;

}  // namespace

CallPool::CallPool() : state_(std::make_shared<State>()) {}

CallPool::~CallPool() { release(); }

void CallPool::release() { state_->release(); }

int64_t CallPool::cached_bytes() const { return state_->cached_bytes(); }

int64_t CallPool::reused_blocks() const { return state_->reused_blocks(); }

int64_t CallPool::fresh_blocks() const { return state_->fresh_blocks(); }

CallPool::Scope::Scope(CallPool& pool) : frame_(std::make_unique<Frame>()) {
  Forwarding& fwd = forwarding();
  {
    std::lock_guard<std::mutex> lock(install_mutex);
    if (live_scopes++ == 0) {
      c10::Allocator* current = c10::GetCPUAllocator();
      if (current != &fwd) {
        fwd.previous.store(current);
        previous_raw_deleter.store(current->raw_deleter());
        c10::SetCPUAllocator(&fwd, /*priority=*/0);  // no effect under a higher-priority allocator
      }
    }
    installed_ = c10::GetCPUAllocator() == &fwd;
  }
  frame_->state = pool.state_;
  frame_->outer = current_frame;
  current_frame = frame_.get();
}

CallPool::Scope::~Scope() {
  current_frame = frame_->outer;
  std::lock_guard<std::mutex> lock(install_mutex);
  Forwarding& fwd = forwarding();
  // Not while a pooled block is alive: it may have been raw-allocated (oneDNN), and its raw free
  // must come back through our raw deleter. Through the replaced allocator's it would be freed
  // behind the pool's back, leaving its entry in `in_use`; the next raw free of that address
  // (glibc hands it out again) would then put a foreign block into the free lists with a stale size.
  if (--live_scopes == 0 && c10::GetCPUAllocator() == &fwd && !pooled_blocks_in_use()) {
    c10::SetCPUAllocator(fwd.previous.load(), 0);
  }
}

}  // namespace torch_ext::runtime
