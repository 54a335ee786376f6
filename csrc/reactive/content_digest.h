// A 64-bit content digest of tensors' bytes: how the reactive graph sees writes that move no version
// counter (W.data.mul_(2), W.numpy()[...] = ...). Reads every byte (no sampling: a write anywhere
// changes the digest), at memory bandwidth (XXH3), without the GIL.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torch_ext::reactive {

/// XXH3-64 of the bytes of t's elements in row-major order (a non-contiguous tensor is read through a
/// contiguous copy). nullopt where there are no bytes to read: a meta or non-strided tensor. CPU only.
std::optional<uint64_t> content_digest(const at::Tensor& t);

/// content_digest of each tensor, the tensors split over at::parallel_for's threads.
std::vector<std::optional<uint64_t>> content_digests(const std::vector<at::Tensor>& tensors);

}  // namespace torch_ext::reactive
