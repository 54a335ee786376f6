// recompose_activation_backward: SiLU's and Mish's backward as eager autograd runs them.
//
// Eager loss.backward() runs with grad mode off and calls the fused aten::silu_backward /
// aten::mish_backward kernels; export traces the joint graph with grad mode on, where autograd's
// formulas are the composites infinitely_differentiable_{silu,mish}_backward, which round otherwise
// (SiLU and Mish models' states drifted from eager's by ~1e-7 within a few steps):
//
//   SiLU  %sig = sigmoid(%x)   %one_minus = sub.Tensor(fill.Scalar(empty_like(%sig), 1), %sig)
//         %a = add.Scalar(mul.Tensor(%x, %one_minus), 1)
//         %out = mul.Tensor(%g, mul.Tensor(%sig, %a))
//   Mish  %tsp = tanh(softplus(%x))     %sq = mul.Tensor(%tsp, %tsp)
//         %one_minus = sub.Tensor(fill.Scalar(empty_like(%sq), 1), %sq)
//         %out = mul.Tensor(%g, add.Tensor(%tsp, mul.Tensor(mul.Tensor(%x, sigmoid(%x)), %one_minus)))
//
// Requires: a verified graph. Guarantees: every %out of one of those shapes whose %x is also read by
// the forward activation (aten::silu.default / aten::mish.default), or is a clone of what it reads (an
// in-place activation: autograd saved the input's value), is rewritten (below); a hand-written
// expression of that form is left alone. %out becomes aten::silu_backward.default(%g, %x) /
// aten::mish_backward.default(%g, %x), same name and type; the composite's other nodes are left to
// dead-code elimination. Returns how many were rewritten.
#pragma once

#include "ir/graph.h"

#include <cstdint>

namespace torch_ext::passes {

int64_t recompose_activation_backward(ir::Graph& g);

}  // namespace torch_ext::passes
