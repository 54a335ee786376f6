#include "reactive/content_digest.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

namespace torch_ext::reactive {

#if defined(__x86_64__) && defined(TORCH_EXT_XXH3_AVX2)
uint64_t xxh3_64_avx2(const void* data, size_t bytes);  // content_digest_avx2.cpp

namespace {
// Same function, same digests: the AVX2 build reads twice the bytes per instruction of the SSE2 one.
uint64_t xxh3_64(const void* data, size_t bytes) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 ? xxh3_64_avx2(data, bytes) : XXH3_64bits(data, bytes);
}
}  // namespace
#else
namespace {
uint64_t xxh3_64(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }
}  // namespace
#endif

std::optional<uint64_t> content_digest(const at::Tensor& t) {
  if (!t.defined() || t.is_meta() || t.layout() != at::kStrided) {
    return std::nullopt;
  }
  TORCH_CHECK(t.device().is_cpu(), "content_digest: expected a CPU tensor, got one on ", t.device());
  const at::NoGradGuard no_grad;  // the contiguous copy of a tensor with autograd history records none
  const at::Tensor c = t.is_contiguous() ? t : t.contiguous();
  const auto bytes = static_cast<size_t>(c.numel()) * c.element_size();
  if (bytes == 0) {
    return 0;
  }
  return xxh3_64(c.const_data_ptr(), bytes);
}

std::vector<std::optional<uint64_t>> content_digests(const std::vector<at::Tensor>& tensors) {
  std::vector<std::optional<uint64_t>> out(tensors.size());
  // One tensor per task: a model's weights are many tensors of a few MB, each read once.
  at::parallel_for(0, static_cast<int64_t>(tensors.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i] = content_digest(tensors[i]);
    }
  });
  return out;
}

}  // namespace torch_ext::reactive
