// Memory planning algorithms, apart from the pass that feeds them (passes/plan_memory.h).
//
// A buffer is a block of bytes live over an inclusive range [first, last] of schedule positions.
// A plan gives every buffer an offset in one arena. Two buffers may share bytes only when their
// lifetimes are disjoint; verify_plan() rejects any plan that breaks this.
//
// Algorithms (registry: plan_buffers(name, ...)):
//   greedy_by_size  Pisarchyk & Lee 2020 (TFLite's planner): buffers by decreasing size, each
//                   placed at the best-fitting gap among already placed, lifetime-overlapping
//                   buffers (smallest gap that fits, else the lowest offset past the others).
//   greedy_by_breadth  the same paper's breadth-first variant: positions by decreasing total live
//                   bytes; at each position its unplaced buffers by decreasing size, best fit.
//   naive           every buffer at its own offset (no reuse): the upper bound.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torch_ext::runtime {

struct BufferLife {
  int64_t size = 0;   // bytes, > 0
  int64_t first = 0;  // inclusive schedule positions
  int64_t last = 0;
};

struct ArenaPlan {
  std::string algorithm;
  std::vector<int64_t> offsets;  // per buffer
  int64_t arena_bytes = 0;
};

constexpr int64_t kArenaAlignment = 64;

int64_t align_up(int64_t bytes, int64_t alignment = kArenaAlignment);

ArenaPlan plan_greedy_by_size(const std::vector<BufferLife>& buffers);
ArenaPlan plan_greedy_by_breadth(const std::vector<BufferLife>& buffers);
ArenaPlan plan_naive(const std::vector<BufferLife>& buffers);
// Runs `algorithm` ("greedy_by_size", "greedy_by_breadth", "naive"); throws on an unknown name.
ArenaPlan plan_buffers(const std::string& algorithm, const std::vector<BufferLife>& buffers);
// The smallest arena among greedy_by_size and greedy_by_breadth.
ArenaPlan plan_best(const std::vector<BufferLife>& buffers);

// Largest total of live bytes at any position: no arena can be smaller.
int64_t lower_bound_bytes(const std::vector<BufferLife>& buffers);

// Throws c10::Error naming the first two buffers that overlap in both lifetime and bytes, or a
// buffer that leaves the arena or is misaligned.
void verify_plan(const std::vector<BufferLife>& buffers, const ArenaPlan& plan);

}  // namespace torch_ext::runtime
