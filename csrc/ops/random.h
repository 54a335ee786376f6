// CPU kernels of the random ops whose generator state is an explicit tensor, so a pure step can
// carry its RNG like a JAX key. The state is the mt19937 byte layout of torch.get_rng_state().
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace torch_ext::ops {

// aten::native_dropout drawn from `rng_state` instead of the global generator: the same draws
// (Bernoulli(1 - p) into a bool mask), the same output arithmetic, bit for bit. Returns
// (output, mask, advanced state); `rng_state` itself is not modified.
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_dropout_rng(const at::Tensor& input, double p,
                                                                  std::optional<bool> train,
                                                                  const at::Tensor& rng_state);

}  // namespace torch_ext::ops
