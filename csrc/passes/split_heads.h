// split_heads: an attention output projection becomes per-head products plus a sum, so that each
// head's contribution to the residual stream (TransformerLens `hook_result`, [..., head, d_model])
// is a node of its own that a sweep can patch.
//
//   %z    : [..., H*dh]  (the heads' outputs, concatenated; TransformerLens hook_z)
//   %out  : [..., D] = aten::linear.default(%z, %W [D, H*dh], %b [D] or None)
// becomes
//   %z_heads   : [..., H, 1, dh] = aten::view.default(%z, [..., H, 1, dh])
//   %w_view    : [D, H, dh]      = aten::view.default(%W, [D, H, dh])
//   %w_heads   : [H, dh, D]      = aten::permute.default(%w_view, [1, 2, 0])
//   %result_mm : [..., H, 1, D]  = aten::matmul.default(%z_heads, %w_heads)
//   %result    : [..., H, D]     = aten::squeeze.dim(%result_mm, -2)
//   %heads_sum : [..., D]        = aten::sum.dim_IntList(%result, [-2])
//   %out       : [..., D]        = aten::add.Tensor(%heads_sum, %b)      (when there is a bias)
// and every use of the old %out reads the new one.
//
// Hugging Face's Conv1D (GPT-2's c_proj) computes the same projection on a 2-d view, with the
// weight laid out [in, out]:
//   %flat : [N, H*dh] = aten::view.default(%z, [-1, H*dh])          (or aten::reshape; N = prod(...))
//   %mm   : [N, D]    = aten::addmm.default(%b [D], %flat, %W [H*dh, D])   (or aten::mm(%flat, %W))
//   %out  : [..., D]  = aten::view.default(%mm, [..., D])
// It becomes the same per-head form with %w_heads : [H, dh, D] = aten::view.default(%W, [H, dh, D])
// (no permute; the nodes are named after %mm); %out and %mm are erased, %flat too unless something
// else reads it. The form is accepted only when the types prove it: %flat is [prod(leading dims of
// %z), H*dh], %mm is read only by %out, %out is [leading dims of %z, D], beta and alpha are 1 and
// the bias is [D]; otherwise the refusal names the node and what was expected.
//
// Numerically the sum over heads is added in
// another order than the single linear's dot products: results agree within float rounding
// (about 1e-6 relative in float32), not bit for bit.
//
// Invariants: the graph verifies after the pass; a refused request (a node that is not such a
// projection's input, a width not divisible by `heads`) leaves the graph unchanged.
#pragma once

#include "ir/graph.h"

#include <string>
#include <vector>

namespace torch_ext::passes {

struct SplitHeadsSite {
  std::string z;    // the node feeding the projection (its last dim is heads * d_head)
  int64_t heads;    // number of heads
};

struct SplitHeadsResult {
  std::string result;  // the per-head node [..., H, D]
  std::string output;  // the node that replaced the projection [..., D] (its old name is gone)
  std::string replaced;  // the projection's old name
};

// Returns, per site (same order), the new nodes.
std::vector<SplitHeadsResult> split_heads(ir::Graph& g, const std::vector<SplitHeadsSite>& sites);

}  // namespace torch_ext::passes
