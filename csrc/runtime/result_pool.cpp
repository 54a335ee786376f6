#include "runtime/result_pool.h"

#include "runtime/block_cache.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace torch_ext::runtime {

// The cap is the most bytes ever in use at once from the pool (its blocks alive), not the bytes a run
// took: a run that frees and takes blocks of many sizes (a new batch shape) would otherwise raise it
// by everything it ever took. So the pool holds at most its peak in cached blocks.
struct ResultPool::State : BlockCache {
  std::atomic<int64_t> in_use{0};
  std::atomic<int64_t> peak_in_use{0};

  void taken(size_t nbytes) {
    const int64_t now = in_use.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
    int64_t peak = peak_in_use.load();
    while (now > peak && !peak_in_use.compare_exchange_weak(peak, now)) {
    }
  }
  void returned(void* ptr, size_t nbytes) {
    in_use.fetch_sub(static_cast<int64_t>(nbytes));
    give_back(ptr, nbytes);
  }
};

namespace {

struct Block {
  std::shared_ptr<ResultPool::State> pool;
  void* ptr;
  size_t nbytes;
};

void give_back(void* ctx) {
  std::unique_ptr<Block> b(static_cast<Block*>(ctx));
  c10::reportMemoryUsageToProfiler(b->ptr, -static_cast<int64_t>(b->nbytes), 0, 0, c10::Device(c10::kCPU));
  b->pool->returned(b->ptr, b->nbytes);
}

}  // namespace

ResultPool::ResultPool() : state_(std::make_shared<State>()) {}

ResultPool::~ResultPool() { state_->release(); }  // closed: the cap is 0, so blocks in use are freed when they die

int64_t ResultPool::cached_bytes() const { return state_->cached_bytes(); }

int64_t ResultPool::reused_blocks() const { return state_->reused_blocks(); }

ResultPool::Run::~Run() { pool_.state_->raise_cap(pool_.state_->peak_in_use.load()); }

void* ResultPool::Run::take(size_t nbytes) {
  void* ptr = pool_.state_->take(nbytes);
  if (ptr == nullptr) ptr = c10::alloc_cpu(nbytes);
  pool_.state_->taken(nbytes);
  c10::reportMemoryUsageToProfiler(ptr, static_cast<int64_t>(nbytes), 0, 0, c10::Device(c10::kCPU));
  return ptr;
}

at::Tensor ResultPool::Run::empty_like(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous() || t.numel() == 0 || t.is_quantized() || t.is_sparse())
    return at::empty_like(t);
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  void* ptr = take(nbytes);
  c10::DataPtr data(ptr, new Block{pool_.state_, ptr, nbytes}, &give_back, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, t.options()).set_(std::move(storage), 0, t.sizes(), t.strides());
}

namespace {

thread_local ResultPool::Run* pooled_run = nullptr;

// The pooled blocks handed out through the wrapped allocator, by address: their deleter receives the
// address only (raw_deallocate gives nothing else), so it finds the block's pool here.
struct PooledBlocks {
  std::mutex mutex;
  std::unordered_map<void*, Block> blocks;
};
PooledBlocks& pooled_blocks() {
  static auto* table = new PooledBlocks();  // never destroyed: blocks may die during exit
  return *table;
}

c10::Allocator* wrapped_allocator = nullptr;

void delete_pooled(void* ptr) {
  std::optional<Block> block;
  {
    PooledBlocks& table = pooled_blocks();
    std::lock_guard<std::mutex> lock(table.mutex);
    auto it = table.blocks.find(ptr);
    if (it != table.blocks.end()) {
      block = std::move(it->second);
      table.blocks.erase(it);
    }
  }
  if (!block) {  // allocated by the wrapped allocator and handed out raw (raw_allocate outside a run)
    wrapped_allocator->raw_deleter()(ptr);
    return;
  }
  c10::reportMemoryUsageToProfiler(ptr, -static_cast<int64_t>(block->nbytes), 0, 0, c10::Device(c10::kCPU));
  block->pool->returned(ptr, block->nbytes);
}

class PoolingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    ResultPool::Run* run = pooled_run;
    if (run == nullptr || nbytes < PooledAllocations::kPooledMinBytes) return wrapped_allocator->allocate(nbytes);
    void* ptr = run->take(nbytes);
    {
      PooledBlocks& table = pooled_blocks();
      std::lock_guard<std::mutex> lock(table.mutex);
      table.blocks.emplace(ptr, Block{run->pool_state(), ptr, nbytes});
    }
    return {ptr, ptr, &delete_pooled, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return wrapped_allocator->raw_deleter() != nullptr ? &delete_pooled : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    wrapped_allocator->copy_data(dest, src, count);
  }
};

// Installs the wrapper once, when the first guard is made: SetCPUAllocator is not thread-safe, and
// the Python module is imported (and the first run made) before user threads use it.
void install_pooling_allocator() {
  static const bool installed = [] {
    static PoolingCPUAllocator allocator;
    wrapped_allocator = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
    return c10::GetCPUAllocator() == &allocator;
  }();
  (void)installed;
}

}  // namespace

std::shared_ptr<ResultPool::State> ResultPool::Run::pool_state() const { return pool_.state_; }

PooledAllocations::PooledAllocations(ResultPool::Run& run) : previous_(pooled_run) {
  install_pooling_allocator();
  pooled_run = &run;
}

PooledAllocations::~PooledAllocations() { pooled_run = previous_; }

}  // namespace torch_ext::runtime
