// runtime::CallPool: a scope's CPU allocations are recycled by the next scope, and nothing else is.
#include "runtime/call_pool.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

using torch_ext::runtime::CallPool;

namespace {

constexpr int64_t kFloats = 1 << 20;  // 4 MiB: above glibc's initial mmap threshold

TEST(CallPool, ScopeInstallsItsAllocatorAndPutsThePreviousBack) {
  c10::Allocator* before = c10::GetCPUAllocator();
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

}  // namespace
