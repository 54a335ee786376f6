#include "ops/random.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace torch_ext::ops {
namespace {

at::Generator generator_from(const at::Tensor& rng_state, const char* op) {
  // The serialized size of CPUGeneratorImpl's state (5056 bytes in torch 2.9), asked once.
  static const int64_t expected = at::make_generator<at::CPUGeneratorImpl>().get_state().numel();
  TORCH_CHECK(rng_state.scalar_type() == at::kByte && rng_state.dim() == 1 && rng_state.numel() == expected, op,
              ": rng_state must be a uint8 tensor of shape [", expected,
              "] (the format of torch.get_rng_state()), got ", rng_state.scalar_type(), " of shape ",
              rng_state.sizes());
  TORCH_CHECK(rng_state.device().is_cpu(), op, ": rng_state must be on the CPU, got ", rng_state.device());
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>();
  gen.set_state(rng_state);
  return gen;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_dropout_rng(const at::Tensor& input, double p,
                                                                  std::optional<bool> train,
                                                                  const at::Tensor& rng_state) {
  TORCH_CHECK(p >= 0 && p <= 1, "native_dropout_rng: dropout probability has to be between 0 and 1, but got ", p);
  TORCH_CHECK(input.device().is_cpu(), "native_dropout_rng: input must be on the CPU, got ", input.device());
  at::Generator gen = generator_from(rng_state, "native_dropout_rng");
  // The op sequence of at::native_dropout's CPU kernel, with the generator made explicit.
  if (input.numel() == 0) {
    return {input.clone(), at::empty_like(input, input.options().dtype(at::kBool)), rng_state.clone()};
  }
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool)), rng_state.clone()};
  }
  const double p1m = 1. - p;
  const double scale = p1m == 0 ? 0. : 1. / p1m;
  // empty_like preserves the input's strides, as the CPU kernel's own mask does: the draws fill the mask in
  // memory order, so a contiguous mask for a transposed input (MultiheadAttention's batch_first output)
  // drew another pattern than eager's.
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
  mask.bernoulli_(p1m, gen);
  at::Tensor output = input.mul(mask).mul_(scale);
  return {output, mask, gen.get_state()};
}

namespace {

// `out` filled by `fill(out, generator)` on a generator set to `rng_state`, and the advanced state: each
// op below is its eager counterpart's own sequence (an empty tensor, then the in-place draw).
template <class Fill>
std::tuple<at::Tensor, at::Tensor> drawn(const at::Tensor& rng_state, const char* op, at::Tensor out, Fill&& fill) {
  at::Generator gen = generator_from(rng_state, op);
  fill(out, gen);
  return {out, gen.get_state()};
}

void check_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": input must be on the CPU, got ", t.device());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> randn_like_rng(const at::Tensor& self, const at::Tensor& rng_state) {
  check_cpu(self, "randn_like_rng");
  // at::randn_like: empty_like (strides preserved), then normal_
  return drawn(rng_state, "randn_like_rng", at::empty_like(self), [](at::Tensor& t, at::Generator& g) { t.normal_(0, 1, g); });
}

std::tuple<at::Tensor, at::Tensor> rand_like_rng(const at::Tensor& self, const at::Tensor& rng_state) {
  check_cpu(self, "rand_like_rng");
  return drawn(rng_state, "rand_like_rng", at::empty_like(self), [](at::Tensor& t, at::Generator& g) { t.uniform_(0, 1, g); });
}

std::tuple<at::Tensor, at::Tensor> randn_rng(at::IntArrayRef size, at::ScalarType dtype, const at::Tensor& rng_state) {
  return drawn(rng_state, "randn_rng", at::empty(size, rng_state.options().dtype(dtype)),
               [](at::Tensor& t, at::Generator& g) { t.normal_(0, 1, g); });
}

std::tuple<at::Tensor, at::Tensor> rand_rng(at::IntArrayRef size, at::ScalarType dtype, const at::Tensor& rng_state) {
  return drawn(rng_state, "rand_rng", at::empty(size, rng_state.options().dtype(dtype)),
               [](at::Tensor& t, at::Generator& g) { t.uniform_(0, 1, g); });
}

std::tuple<at::Tensor, at::Tensor> randint_rng(int64_t low, int64_t high, at::IntArrayRef size, at::ScalarType dtype,
                                               const at::Tensor& rng_state) {
  TORCH_CHECK(low < high, "randint_rng: low (", low, ") must be below high (", high, ")");
  return drawn(rng_state, "randint_rng", at::empty(size, rng_state.options().dtype(dtype)),
               [&](at::Tensor& t, at::Generator& g) { t.random_(low, high, g); });
}

std::tuple<at::Tensor, at::Tensor> bernoulli_p_rng(const at::Tensor& self, double p, const at::Tensor& rng_state,
                                                   bool fill_in_place) {
  check_cpu(self, "bernoulli_p_rng");
  TORCH_CHECK(p >= 0 && p <= 1, "bernoulli_p_rng: p must be in [0, 1], got ", p);
  // at::bernoulli(self, p)'s result is contiguous, and so is this op's. fill_in_place: the node was an
  // in-place self.bernoulli_(p) (in-place dropout fills empty_like(x), in x's strides), functionalized;
  // the draws fill memory in order, so they go into self's layout first, as eager's did.
  if (!fill_in_place || self.is_contiguous())
    return drawn(rng_state, "bernoulli_p_rng", at::empty_like(self, at::MemoryFormat::Contiguous),
                 [&](at::Tensor& t, at::Generator& g) { t.bernoulli_(p, g); });
  auto [filled, state] = drawn(rng_state, "bernoulli_p_rng", at::empty_like(self),
                               [&](at::Tensor& t, at::Generator& g) { t.bernoulli_(p, g); });
  return {filled.contiguous(), state};
}

std::tuple<at::Tensor, at::Tensor> rng_seed(const at::Tensor& rng_state) {
  at::Generator gen = generator_from(rng_state, "rng_seed");
  const uint64_t draw = gen.get<at::CPUGeneratorImpl>()->random64();
  at::Tensor seed = at::scalar_tensor(static_cast<int64_t>(draw), rng_state.options().dtype(at::kLong));
  return {seed, gen.get_state()};
}

}  // namespace torch_ext::ops
