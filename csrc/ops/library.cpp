// The one TORCH_LIBRARY of torch_ext, with the ops that are not optimizers. Each optimizer's
// update ops are defined in the same library by a fragment in its csrc/optim/<name>.cpp,
// generated from its descriptor (optim/descriptor.h).
#include "ops/onednn_rnn.h"
#include "ops/random.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch_ext::ops {

TORCH_LIBRARY(torch_ext, m) {
  // Random ops with explicit generator state (see ops/random.h); used by passes/thread_rng.h.
  m.def(
      "native_dropout_rng(Tensor input, float p, bool? train, Tensor rng_state) -> (Tensor, Tensor, Tensor)");
  m.def("randn_like_rng(Tensor self, Tensor rng_state) -> (Tensor, Tensor)");
  m.def("rand_like_rng(Tensor self, Tensor rng_state) -> (Tensor, Tensor)");
  m.def("randn_rng(int[] size, ScalarType dtype, Tensor rng_state) -> (Tensor, Tensor)");
  m.def("rand_rng(int[] size, ScalarType dtype, Tensor rng_state) -> (Tensor, Tensor)");
  m.def("randint_rng(int low, int high, int[] size, ScalarType dtype, Tensor rng_state) -> (Tensor, Tensor)");
  m.def("bernoulli_p_rng(Tensor self, float p, Tensor rng_state, bool fill_in_place=False) -> (Tensor, Tensor)");
  m.def("rng_seed(Tensor rng_state) -> (Tensor, Tensor)");
  // aten::mkldnn_rnn_layer and its backward with batch_sizes=[] (see ops/onednn_rnn.h): what to_aoti hands
  // AOTInductor for an LSTM layer of a training step.
  m.def(
      "mkldnn_rnn_layer(Tensor input, Tensor weight0, Tensor weight1, Tensor weight2, Tensor weight3, Tensor hx_, "
      "Tensor cx_, bool reverse, int mode, int hidden_size, int num_layers, bool has_biases, bool bidirectional, "
      "bool batch_first, bool train) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "mkldnn_rnn_layer_backward(Tensor input, Tensor weight1, Tensor weight2, Tensor weight3, Tensor weight4, "
      "Tensor hx_, Tensor cx_tmp, Tensor output, Tensor hy_, Tensor cy_, Tensor? grad_output, Tensor? grad_hy, "
      "Tensor? grad_cy, bool reverse, int mode, int hidden_size, int num_layers, bool has_biases, bool train, "
      "bool bidirectional, bool batch_first, Tensor workspace) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_ext, CPU, m) {
  m.impl("native_dropout_rng", &native_dropout_rng);
  m.impl("randn_like_rng", &randn_like_rng);
  m.impl("rand_like_rng", &rand_like_rng);
  m.impl("randn_rng", &randn_rng);
  m.impl("rand_rng", &rand_rng);
  m.impl("randint_rng", &randint_rng);
  m.impl("bernoulli_p_rng", &bernoulli_p_rng);
  m.impl("rng_seed", &rng_seed);
  m.impl("mkldnn_rnn_layer", &mkldnn_rnn_layer);
  m.impl("mkldnn_rnn_layer_backward", &mkldnn_rnn_layer_backward);
}

}  // namespace torch_ext::ops
