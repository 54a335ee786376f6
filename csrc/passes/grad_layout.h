// The layout eager gives a parameter's .grad, for the step's gradients.
//
// Eager's AccumulateGrad keeps a gradient the backward made as it is only when it obeys the layout
// contract (torch/csrc/autograd/utils/grad_layout_contract.h): the parameter's strides (on dims of
// size > 1) where the parameter is dense and non-overlapping, else contiguous; any other gradient
// is copied into that layout (clone_obey_contract). The copy keeps every value, but the update
// kernels round by their operands' layouts in bfloat16/float16 (TensorIterator's vectorized loop
// over operands laid out alike, a strided scalar one over mixed layouts: Lion's
// exp_avg.mul(beta2).add_(grad, 1 - beta2) and SGD's momentum ended 1 ulp off eager on a weight
// stored transposed whose gradient the backward made contiguous), so the step copies likewise.
#pragma once

#include "ir/graph.h"

namespace torch_ext::passes {

// Whether AccumulateGrad would keep a gradient of type `grad` for a parameter of type `param` as it is.
bool obeys_grad_layout(const ir::TensorMeta& grad, const ir::TensorMeta& param);

// `grad` itself when it obeys the contract, else a copy of it in the parameter's layout (a
// permute, a contiguous clone and the inverse permute; a contiguous clone for a parameter that is
// not dense), created before `before` (null: before the output). Tensor types only.
ir::Node* obey_grad_layout(ir::Graph& g, ir::Node* grad, const ir::TensorMeta& param, ir::Node* before = nullptr);

}  // namespace torch_ext::passes
