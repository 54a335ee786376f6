// Free lists of CPU blocks keyed by their exact byte size, holding at most `cap` bytes: the memory
// the next call of the same program asks for again. Shared by ResultPool (the returned optimizer
// state) and CallPool (an AOTInductor package's per-call blocks); each decides when to take a block
// and when to raise the cap, this decides what is kept.
//
// Invariants: `cached` is the bytes in `free`; a block is kept only while cached <= cap; release()
// frees every kept block and sets cap to 0, so blocks returned afterwards are freed, not kept.
#pragma once

#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace torch_ext::runtime {

struct BlockCache {
  // A kept block of exactly `nbytes` (counted as reused), or nullptr (counted as fresh: the caller
  // allocates it).
  void* take(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(nbytes);
    if (it == free_.end() || it->second.empty()) {
      ++fresh_;
      return nullptr;
    }
    void* ptr = it->second.back();
    it->second.pop_back();
    cached_ -= static_cast<int64_t>(nbytes);
    ++reused_;
    return ptr;
  }

  // Keeps a block whose last user died, or frees it when keeping it would pass the cap.
  void give_back(void* ptr, size_t nbytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_ + static_cast<int64_t>(nbytes) <= cap_) {
        free_[nbytes].push_back(ptr);
        cached_ += static_cast<int64_t>(nbytes);
        return;
      }
    }
    c10::free_cpu(ptr);
  }

  void raise_cap(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    cap_ = std::max(cap_, bytes);
  }

  // Frees the kept blocks now; blocks in use are freed when they die (the cap is 0 until raised).
  void release() {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [size, ptrs] : free_) blocks.insert(blocks.end(), ptrs.begin(), ptrs.end());
      free_.clear();
      cached_ = 0;
      cap_ = 0;
    }
    for (void* p : blocks) c10::free_cpu(p);
  }

  int64_t cached_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }
  int64_t reused_blocks() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reused_;
  }
  int64_t fresh_blocks() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return fresh_;
  }

 private:
  mutable std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  int64_t cached_ = 0;
  int64_t cap_ = 0;
  int64_t reused_ = 0;
  int64_t fresh_ = 0;
};

}  // namespace torch_ext::runtime
