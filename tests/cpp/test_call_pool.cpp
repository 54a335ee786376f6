// runtime::CallPool: a scope's CPU allocations are recycled by the next scope, and nothing else is.
#include "runtime/call_pool.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

using torch_ext::runtime::CallPool;

namespace {

constexpr int64_t kFloats = 1 << 20;  // 4 MiB: above glibc's initial mmap threshold

// c10's CPU allocator as it is with no scope and no pooled block alive. (An earlier test in this
// process may have kept a block past its last scope: the forwarding allocator stays until the next
// scope ends with none alive.)
c10::Allocator* settled_cpu_allocator() {
  CallPool pool;
  { CallPool::Scope scope(pool); }
  return c10::GetCPUAllocator();
}

TEST(CallPool, ScopeInstallsItsAllocatorAndPutsThePreviousBack) {
  c10::Allocator* before = settled_cpu_allocator();
  CallPool pool;
  {
    CallPool::Scope outer(pool);
    ASSERT_TRUE(outer.installed());
    EXPECT_NE(c10::GetCPUAllocator(), before);
    {
      CallPool::Scope inner(pool);  // nested: still installed, restored only by the last one
      EXPECT_TRUE(inner.installed());
    }
    EXPECT_NE(c10::GetCPUAllocator(), before);
  }
  EXPECT_EQ(c10::GetCPUAllocator(), before);
}

TEST(CallPool, TheNextScopeGetsTheBlocksOfTheLastOne) {
  CallPool pool;
  void* first = nullptr;
  {
    CallPool::Scope scope(pool);
    at::Tensor t = at::empty({kFloats});
    first = t.data_ptr();
    t.fill_(3.0f);
  }  // t died inside the scope: cached
  EXPECT_EQ(pool.cached_bytes(), kFloats * 4);
  {
    CallPool::Scope scope(pool);
    at::Tensor t = at::empty({kFloats});
    EXPECT_EQ(t.data_ptr(), first);
    at::Tensor other = at::empty({kFloats});  // the only cached block of that size is taken
    EXPECT_NE(other.data_ptr(), first);
  }
  EXPECT_EQ(pool.reused_blocks(), 1);
  EXPECT_EQ(pool.fresh_blocks(), 2);
}

TEST(CallPool, AnOutputKeptPastTheScopeIsNotHandedOutAgain) {
  CallPool pool;
  at::Tensor kept;
  {
    CallPool::Scope scope(pool);
    kept = at::full({kFloats}, 7.0f);
  }
  {
    CallPool::Scope scope(pool);
    at::Tensor t = at::zeros({kFloats});
    EXPECT_NE(t.data_ptr(), kept.data_ptr());
  }
  EXPECT_TRUE(at::equal(kept, at::full({kFloats}, 7.0f)));
  // The forwarding allocator stays while a pooled block is alive: a raw one must be freed through it.
  EXPECT_EQ(c10::GetCPUAllocator()->raw_deleter(), kept.storage().data_ptr().get_deleter());
  // Dies after the scope: freed, since the pool already caches the most one scope allocated afresh (4 MiB).
  kept.reset();
  EXPECT_EQ(pool.cached_bytes(), kFloats * 4);
}

TEST(CallPool, KeepsAtMostWhatOneScopeAllocatedAfreshNotWhatItTook) {
  // A call takes many blocks it already reused (here the same block ten times); capped by the bytes
  // taken, the free lists grew to that over calls of other shapes, many times what one call needs.
  CallPool pool;
  {
    CallPool::Scope scope(pool);
    for (int i = 0; i < 10; ++i) at::Tensor t = at::empty({kFloats});  // one fresh block, nine reuses
  }
  EXPECT_EQ(pool.fresh_blocks(), 1);
  EXPECT_EQ(pool.cached_bytes(), kFloats * 4);
  {
    CallPool::Scope scope(pool);  // another shape: three blocks of half the size, alive together
    std::vector<at::Tensor> halves;
    for (int i = 0; i < 3; ++i) halves.push_back(at::empty({kFloats / 2}));
  }
  // This scope allocated 1.5 blocks' worth afresh: that is the cap; the first half block fits beside
  // the cached whole one, the other two are freed.
  EXPECT_EQ(pool.fresh_blocks(), 4);
  EXPECT_EQ(pool.cached_bytes(), kFloats * 4 * 3 / 2);
}

TEST(CallPool, OutsideAScopeAndOnOtherThreadsNothingIsPooled) {
  CallPool pool;
  {
    CallPool::Scope scope(pool);
    at::empty({kFloats});
  }
  const int64_t fresh = pool.fresh_blocks();
  at::empty({kFloats});  // no scope
  {
    CallPool::Scope scope(pool);
    std::thread([] { at::empty({kFloats}).fill_(1.0f); }).join();  // another thread, during the scope
  }
  EXPECT_EQ(pool.fresh_blocks(), fresh);
  EXPECT_EQ(pool.reused_blocks(), 0);
}

TEST(CallPool, RawAllocationsWorkThroughTheForwardingAllocator) {
  // oneDNN and others allocate with raw_allocate / raw_deallocate on c10's CPU allocator; a block
  // raw-allocated before the scope may be freed during it (through the forwarding allocator).
  CallPool pool;
  void* before = c10::GetCPUAllocator()->raw_allocate(4096);
  {
    CallPool::Scope scope(pool);
    c10::Allocator* a = c10::GetCPUAllocator();
    void* p = a->raw_allocate(kFloats * 4);
    static_cast<float*>(p)[kFloats - 1] = 1.0f;
    a->raw_deallocate(p);
    a->raw_deallocate(before);
    void* again = a->raw_allocate(kFloats * 4);
    EXPECT_EQ(again, p);
    a->raw_deallocate(again);
  }
  EXPECT_EQ(pool.reused_blocks(), 1);
}

TEST(CallPool, ReleaseFreesTheCacheAndStopsCachingBlocksInUse) {
  CallPool pool;
  at::Tensor kept;
  {
    CallPool::Scope scope(pool);
    at::Tensor scratch = at::empty({kFloats});
    kept = at::empty({kFloats});
  }
  EXPECT_EQ(pool.cached_bytes(), kFloats * 4);  // scratch
  pool.release();
  EXPECT_EQ(pool.cached_bytes(), 0);
  kept.reset();
  EXPECT_EQ(pool.cached_bytes(), 0);
}

TEST(CallPool, BlocksOutliveThePool) {
  at::Tensor kept;
  {
    CallPool pool;
    CallPool::Scope scope(pool);
    kept = at::full({kFloats}, 2.0f);
  }
  EXPECT_EQ(kept.sum().item<float>(), 2.0f * kFloats);
  kept.reset();  // freed, the pool being gone
}

// A CPU allocator that hands out the address it was last given back first, as glibc does for a
// block of the same size: it makes the reuse of a freed address deterministic.
struct RecyclingAllocator final : c10::Allocator {
  static std::vector<void*>& returned() {
    static std::vector<void*> v;
    return v;
  }
  static std::vector<void*>& recycled() {
    static std::vector<void*> v;
    return v;
  }
  static void give_back(void* p) {
    returned().push_back(p);
    recycled().push_back(p);
  }
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = nullptr;
    if (!recycled().empty()) {  // the tests ask for at most the size of what was given back
      p = recycled().back();
      recycled().pop_back();
    } else {
      p = c10::alloc_cpu(std::max<size_t>(nbytes, kFloats * 4));
    }
    return {p, p, &give_back, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  ~RecyclingAllocator() override {
    for (void* p : recycled()) c10::free_cpu(p);
    recycled().clear();
    returned().clear();
  }
};

TEST(CallPool, ABlockRawAllocatedInAScopeAndRawFreedAfterItLeavesNoStaleEntry) {
  // oneDNN raw-allocates through c10's CPU allocator and may free after the call's scope ended. That
  // free must reach the pool: through the replaced allocator's raw deleter it left the block's entry
  // (its pool and 4 MiB size) behind, and when that allocator handed the address out again (for 64
  // bytes) and it was raw-freed inside a scope, the pool took that foreign block as a 4 MiB one.
  c10::Allocator* original = settled_cpu_allocator();
  RecyclingAllocator recycling;
  c10::SetCPUAllocator(&recycling, 0);
  {
    CallPool pool;
    void* p = nullptr;
    {
      CallPool::Scope scope(pool);
      ASSERT_TRUE(scope.installed());
      p = c10::GetCPUAllocator()->raw_allocate(kFloats * 4);
    }
    c10::GetCPUAllocator()->raw_deallocate(p);  // after the scope
    EXPECT_EQ(pool.cached_bytes(), kFloats * 4) << "the pooled block did not go back to its pool";
    EXPECT_EQ(std::count(RecyclingAllocator::returned().begin(), RecyclingAllocator::returned().end(), p), 0)
        << "the pooled block was freed by the replaced allocator";

    void* q = c10::GetCPUAllocator()->raw_allocate(64);  // the replaced allocator's, no scope
    const int64_t cached = pool.cached_bytes();
    RecyclingAllocator::returned().clear();
    {
      CallPool::Scope scope(pool);
      c10::GetCPUAllocator()->raw_deallocate(q);
    }
    EXPECT_EQ(pool.cached_bytes(), cached) << "a 64-byte block of the replaced allocator went into the pool";
    EXPECT_EQ(RecyclingAllocator::returned(), std::vector<void*>{q})
        << "the replaced allocator's block did not go back to it";
    EXPECT_EQ(c10::GetCPUAllocator(), &recycling);  // no scope and no pooled block left: put back
    pool.release();
  }
  c10::SetCPUAllocator(original, 0);
}

TEST(CallPool, AnotherThreadFreesPooledBlocksWhileScopesRun) {
  // A gloo worker drops the last reference of a tensor allocated inside a call, and raw-frees a block
  // raw-allocated inside it (oneDNN), while the main thread runs the next calls' scopes; the worker
  // itself allocates (plain and raw, half that size: glibc may hand out the same address) through
  // c10's CPU allocator. The main thread waits for the worker to finish inside every other call's
  // scope and after the others' (the worker's frees then meet a scope and no scope). No block may be
  // handed out while alive: each tensor and raw block carries its own value until it dies, checked
  // just before it does.
  CallPool pool;
  struct Item {
    at::Tensor tensor;
    float* raw = nullptr;
    int64_t raw_floats = 0;
    float value = 0;
  };
  std::mutex m;
  std::condition_variable cv;
  std::deque<Item> queue;
  bool done = false;
  int pending = 0;  // items pushed and not finished by the worker
  std::condition_variable finished;
  std::atomic<int64_t> corrupt{0};
  auto intact = [](const float* d, int64_t n, float v) {
    return d[0] == v && d[n / 2] == v && d[n - 1] == v;
  };
  std::thread worker([&] {
    float* own_raw = nullptr;  // the worker's raw block, alive until the next item
    int64_t own_floats = 0;
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return done || !queue.empty(); });
        if (queue.empty()) break;
        item = std::move(queue.front());
        queue.pop_front();
      }
      const int64_t n = item.tensor.numel();
      if (!intact(item.tensor.data_ptr<float>(), n, item.value)) ++corrupt;
      if (!intact(item.raw, item.raw_floats, -item.value)) ++corrupt;
      if (own_raw != nullptr) {
        if (!intact(own_raw, own_floats, 0.5f)) ++corrupt;
        c10::GetCPUAllocator()->raw_deallocate(own_raw);
      }
      at::Tensor own = at::empty({n}).fill_(-1.0f);  // not pooled: this thread has no scope
      item.tensor.reset();  // the last reference: freed on this thread
      c10::GetCPUAllocator()->raw_deallocate(item.raw);
      own_floats = item.raw_floats / 2;
      own_raw = static_cast<float*>(c10::GetCPUAllocator()->raw_allocate(own_floats * 4));
      std::fill(own_raw, own_raw + own_floats, 0.5f);
      std::lock_guard<std::mutex> lock(m);
      if (--pending == 0) finished.notify_one();
    }
    if (own_raw != nullptr) c10::GetCPUAllocator()->raw_deallocate(own_raw);
  });
  const int64_t sizes[] = {kFloats / 64, kFloats / 16, kFloats / 4};
  auto wait_for_worker = [&] {
    std::unique_lock<std::mutex> lock(m);
    finished.wait(lock, [&] { return pending == 0; });
  };
  for (int call = 0; call < 400; ++call) {
    {
      CallPool::Scope scope(pool);
      for (int i = 0; i < 3; ++i) {
        Item item;
        item.value = static_cast<float>(call * 3 + i + 1);
        item.tensor = at::empty({sizes[(call + i) % 3]}).fill_(item.value);
        at::Tensor scratch = at::empty({sizes[i]}).fill_(-item.value);  // dies inside the scope
        item.raw_floats = sizes[(call + i + 1) % 3];
        item.raw = static_cast<float*>(c10::GetCPUAllocator()->raw_allocate(item.raw_floats * 4));
        std::fill(item.raw, item.raw + item.raw_floats, -item.value);
        {
          std::lock_guard<std::mutex> lock(m);
          queue.push_back(std::move(item));
          ++pending;
        }
        cv.notify_one();
      }
      if (call % 2 == 0) wait_for_worker();  // inside the scope
    }
    if (call % 2 == 1) wait_for_worker();  // after it
  }
  {
    std::lock_guard<std::mutex> lock(m);
    done = true;
  }
  cv.notify_one();
  worker.join();
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_GT(pool.reused_blocks(), 0);
}

}  // namespace
