// oneDNN's LSTM layer (aten::mkldnn_rnn_layer and its backward) as AOTInductor packages can call them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace torch_ext::ops {

// at::mkldnn_rnn_layer(..., batch_sizes=[], ...), one direction of one LSTM layer as eager's CPU LSTM runs it,
// run with grad mode on when `train`: ATen's kernel returns the workspace its backward reads only under grad mode,
// and AOTInductor runs a package's kernels with it off, so the package's training step got an undefined workspace
// (and its backward failed on it). Returns (output, hy, cy, workspace: empty unless `train`).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mkldnn_rnn_layer(
    const at::Tensor& input, const at::Tensor& weight0, const at::Tensor& weight1, const at::Tensor& weight2,
    const at::Tensor& weight3, const at::Tensor& hx, const at::Tensor& cx, bool reverse, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool bidirectional, bool batch_first, bool train);

// at::mkldnn_rnn_layer_backward(..., batch_sizes=[], ...): the layer's backward, the kernel eager's autograd runs.
// torch 2.9's AOTInductor proxy executor passes an empty int[] argument as None (pytorch/pytorch#194324: "Expected
// IntList but got None" at run time), so to_aoti calls these ops instead of ATen's (torch_ext/_aoti.py); packed
// sequences, the only callers with batch_sizes, are refused at trace time. Returns ATen's seven gradients (input,
// weight1, weight2, the two biases' (equal), hx, cx); the second bias gradient is a copy where ATen's aliases the
// first (no two outputs of an op may alias). The workspace is copied: ATen's kernel writes into it.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
mkldnn_rnn_layer_backward(
    const at::Tensor& input, const at::Tensor& weight1, const at::Tensor& weight2, const at::Tensor& weight3,
    const at::Tensor& weight4, const at::Tensor& hx, const at::Tensor& cx_tmp, const at::Tensor& output,
    const at::Tensor& hy, const at::Tensor& cy, const std::optional<at::Tensor>& grad_output,
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy, bool reverse, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool train, bool bidirectional, bool batch_first,
    const at::Tensor& workspace);

}  // namespace torch_ext::ops
