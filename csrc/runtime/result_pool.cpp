#include "runtime/result_pool.h"

#include "runtime/block_cache.h"

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

struct ResultPool::State : BlockCache {};

namespace {

struct Block {
  std::shared_ptr<ResultPool::State> pool;
  void* ptr;
  size_t nbytes;
};

void give_back(void* ctx) {
  std::unique_ptr<Block> b(static_cast<Block*>(ctx));
  c10::reportMemoryUsageToProfiler(b->ptr, -static_cast<int64_t>(b->nbytes), 0, 0, c10::Device(c10::kCPU));
  b->pool->give_back(b->ptr, b->nbytes);
}

}  // namespace

ResultPool::ResultPool() : state_(std::make_shared<State>()) {}

ResultPool::~ResultPool() { state_->release(); }  // closed: the cap is 0, so blocks in use are freed when they die

int64_t ResultPool::cached_bytes() const { return state_->cached_bytes(); }

int64_t ResultPool::reused_blocks() const { return state_->reused_blocks(); }

ResultPool::Run::~Run() { pool_.state_->raise_cap(taken_); }

at::Tensor ResultPool::Run::empty_like(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous() || t.numel() == 0 || t.is_quantized() || t.is_sparse())
    return at::empty_like(t);
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  void* ptr = pool_.state_->take(nbytes);
  if (ptr == nullptr) ptr = c10::alloc_cpu(nbytes);
  taken_ += static_cast<int64_t>(nbytes);
  c10::reportMemoryUsageToProfiler(ptr, static_cast<int64_t>(nbytes), 0, 0, c10::Device(c10::kCPU));
  c10::DataPtr data(ptr, new Block{pool_.state_, ptr, nbytes}, &give_back, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, t.options()).set_(std::move(storage), 0, t.sizes(), t.strides());
}

}  // namespace torch_ext::runtime
