// recompose_silu_backward: SiLU's backward as eager autograd runs it.
//
// Eager loss.backward() runs with grad mode off and calls the fused aten::silu_backward kernel;
// export traces the joint graph with grad mode on, where autograd's formula is the composite
// infinitely_differentiable_silu_backward:
//
//   %sig = aten::sigmoid(%x)                      %e = aten::empty_like(%sig)   %f = aten::fill.Scalar(%e, 1)
//   %s = aten::sub.Tensor(%f, %sig)               %m = aten::mul.Tensor(%x, %s) %a = aten::add.Scalar(%m, 1)
//   %m1 = aten::mul.Tensor(%sig, %a)              %out = aten::mul.Tensor(%g, %m1)
//
// which rounds otherwise (Llama-style models' gradients differed from eager's in the last bits).
// Requires: a verified graph. Guarantees: every %out of that shape whose %x is also read by an
// aten::silu.default (the forward: a hand-written expression of that form is left alone) becomes
// aten::silu_backward.default(%g, %x), same name and type; the composite's other nodes are left to
// dead-code elimination. Returns how many were rewritten.
#pragma once

#include "ir/graph.h"

#include <cstdint>

namespace torch_ext::passes {

int64_t recompose_silu_backward(ir::Graph& g);

}  // namespace torch_ext::passes
