#include "ops/onednn_rnn.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace torch_ext::ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mkldnn_rnn_layer(
    const at::Tensor& input, const at::Tensor& weight0, const at::Tensor& weight1, const at::Tensor& weight2,
    const at::Tensor& weight3, const at::Tensor& hx, const at::Tensor& cx, bool reverse, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool bidirectional, bool batch_first, bool train) {
  // No input of this kernel requires grad (it runs below autograd), so grad mode records nothing here.
  c10::AutoGradMode grad_mode(train);
  auto result = at::mkldnn_rnn_layer(input, weight0, weight1, weight2, weight3, hx, cx, reverse, /*batch_sizes=*/{},
                                     mode, hidden_size, num_layers, has_biases, bidirectional, batch_first, train);
  auto& workspace = std::get<3>(result);
  if (!train) {
    workspace = at::empty({0}, input.options().dtype(at::kByte));  // (ATen's is undefined: an op returns tensors)
  }
  TORCH_CHECK(workspace.defined(), "torch_ext::mkldnn_rnn_layer: ATen's oneDNN LSTM layer returned no workspace "
              "with train=True (input ", input.sizes(), ", hidden_size ", hidden_size, ")");
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
mkldnn_rnn_layer_backward(
    const at::Tensor& input, const at::Tensor& weight1, const at::Tensor& weight2, const at::Tensor& weight3,
    const at::Tensor& weight4, const at::Tensor& hx, const at::Tensor& cx_tmp, const at::Tensor& output,
    const at::Tensor& hy, const at::Tensor& cy, const std::optional<at::Tensor>& grad_output,
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy, bool reverse, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool train, bool bidirectional, bool batch_first,
    const at::Tensor& workspace) {
  TORCH_CHECK(workspace.defined() && workspace.numel() > 0,
              "torch_ext::mkldnn_rnn_layer_backward: the workspace is ", workspace.defined() ? "empty" : "undefined",
              " (input ", input.sizes(), ", hidden_size ", hidden_size, "): the forward must run with train=True");
  // oneDNN's backward writes into its workspace (ATen's schema does not say so): this op's is a copy, so that the
  // op is pure (its workspace input read only), as AOTInductor takes it.
  auto [dx, dw1, dw2, db, db_again, dhx, dcx] = at::mkldnn_rnn_layer_backward(
      input, weight1, weight2, weight3, weight4, hx, cx_tmp, output, hy, cy, grad_output, grad_hy, grad_cy, reverse,
      mode, hidden_size, num_layers, has_biases, train, bidirectional, /*batch_sizes=*/{}, batch_first, workspace.clone());
  if (db_again.is_alias_of(db)) db_again = db_again.clone();
  return {dx, dw1, dw2, db, db_again, dhx, dcx};
}

}  // namespace torch_ext::ops
