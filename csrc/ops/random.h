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

// aten::randn_like / aten::rand_like drawn from `rng_state`: the same tensor (empty_like, then
// normal_(0, 1) / uniform_(0, 1) on the generator), bit for bit, and the advanced state.
std::tuple<at::Tensor, at::Tensor> randn_like_rng(const at::Tensor& self, const at::Tensor& rng_state);
std::tuple<at::Tensor, at::Tensor> rand_like_rng(const at::Tensor& self, const at::Tensor& rng_state);

// aten::randn / rand / randint(low, high) of a size and dtype (CPU), drawn from `rng_state`: empty,
// then normal_(0, 1) / uniform_(0, 1) / random_(low, high) on the generator, as the factories do.
std::tuple<at::Tensor, at::Tensor> randn_rng(at::IntArrayRef size, at::ScalarType dtype, const at::Tensor& rng_state);
std::tuple<at::Tensor, at::Tensor> rand_rng(at::IntArrayRef size, at::ScalarType dtype, const at::Tensor& rng_state);
std::tuple<at::Tensor, at::Tensor> randint_rng(int64_t low, int64_t high, at::IntArrayRef size, at::ScalarType dtype,
                                               const at::Tensor& rng_state);

// aten::bernoulli.p(self, p) drawn from `rng_state` (in-place dropout and stochastic depth functionalized:
// empty_like(self), then bernoulli_(p) on the generator), and the advanced state.
std::tuple<at::Tensor, at::Tensor> bernoulli_p_rng(const at::Tensor& self, double p, const at::Tensor& rng_state,
                                                   bool fill_in_place);

// One 64-bit draw from `rng_state` (gen.random64()), returned as an int64 0-dim tensor, and the
// state advanced past it; `rng_state` itself is not modified. The seed of a compiler's own
// counter-based random stream (Inductor's Philox) made pure: to_aoti decomposes each
// native_dropout_rng into this draw and a fused mask (torch_ext/_aoti.py).
std::tuple<at::Tensor, at::Tensor> rng_seed(const at::Tensor& rng_state);

}  // namespace torch_ext::ops
