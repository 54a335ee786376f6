#include "runtime/result_pool.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

namespace torch_ext::runtime {

struct ResultPool::State {
  std::mutex mutex;
  std::map<size_t, std::vector<void*>> free;  // block size -> cached blocks
  int64_t cached = 0;                          // bytes in `free`
  int64_t cap = 0;                             // most bytes one run took
  int64_t reused = 0;
  bool closed = false;
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
  {
    std::lock_guard<std::mutex> lock(b->pool->mutex);
    ResultPool::State& s = *b->pool;
    if (!s.closed && s.cached + static_cast<int64_t>(b->nbytes) <= s.cap) {
      s.free[b->nbytes].push_back(b->ptr);
      s.cached += static_cast<int64_t>(b->nbytes);
      return;
    }
  }
  c10::free_cpu(b->ptr);
}

}  // namespace

ResultPool::ResultPool() : state_(std::make_shared<State>()) {}

ResultPool::~ResultPool() {
  std::vector<void*> blocks;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
    for (auto& [size, ptrs] : state_->free) blocks.insert(blocks.end(), ptrs.begin(), ptrs.end());
    state_->free.clear();
    state_->cached = 0;
  }
  for (void* p : blocks) c10::free_cpu(p);
}

int64_t ResultPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->cached;
}

int64_t ResultPool::reused_blocks() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->reused;
}

ResultPool::Run::~Run() {
  std::lock_guard<std::mutex> lock(pool_.state_->mutex);
  pool_.state_->cap = std::max(pool_.state_->cap, taken_);
}

at::Tensor ResultPool::Run::empty_like(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous() || t.numel() == 0 || t.is_quantized() || t.is_sparse())
    return at::empty_like(t);
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  void* ptr = nullptr;
  {
    State& s = *pool_.state_;
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.free.find(nbytes);
    if (it != s.free.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      s.cached -= static_cast<int64_t>(nbytes);
      ++s.reused;
    }
  }
  if (ptr == nullptr) ptr = c10::alloc_cpu(nbytes);
  taken_ += static_cast<int64_t>(nbytes);
  c10::reportMemoryUsageToProfiler(ptr, static_cast<int64_t>(nbytes), 0, 0, c10::Device(c10::kCPU));
  c10::DataPtr data(ptr, new Block{pool_.state_, ptr, nbytes}, &give_back, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, t.options()).set_(std::move(storage), 0, t.sizes(), t.strides());
}

}  // namespace torch_ext::runtime
