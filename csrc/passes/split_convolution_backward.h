// Pass: split_convolution_backward. A convolution_backward that computes the input gradient and
// the weight (and bias) gradient in one call becomes two calls of the same op, one per part:
//
//   %cb : (T gi, T gw, T gb) = aten::convolution_backward.default(%go, %x, %w, ..., [True, True, m])
// becomes
//   %cb_weight : (none, T gw, T gb) = aten::convolution_backward.default(%go, %x, %w, ..., [False, True, m])
//   %cb        : (T gi, none, none) = aten::convolution_backward.default(%go, %x, %w, ..., [True, False, False])
// and the getitems of parts 1 and 2 read %cb_weight.
//
// Why: the fused call holds the input gradient, its own scratch for the weight gradient (oneDNN
// reorders the gradient and the input, 16 MiB for a 64x32x32x32 float activation) and its inputs
// at once; split, the weight-gradient scratch is gone before the input gradient is allocated, and
// a scheduler may free the saved input %x right after the weight call when nothing else reads it.
//
// Exactness: ATen's backends compute the masked parts with separate kernel calls (oneDNN's
// mkldnn_convolution_backward calls *_backward_input if mask[0] and *_backward_weights if mask[1]
// or mask[2]; cuDNN and the slow paths likewise), so each part of a split call is the same kernel
// on the same inputs. tests/python/test_memory.py checks the split plan bit-exact against the
// unsplit step on a CNN.
//
// Whether a split lowers the peak depends on the kernels' own scratch, which the IR does not
// see: measured here, oneDNN's weight-gradient scratch is 2x the activation at 16 or 32 channels
// (the split wins by it) but at 8 channels the fused call peaks in its input part, where the split
// holds the weight gradient too (the split loses its bytes). So the caller names the calls to
// split (torch_ext/memory.py measures each call both ways on its device).
//
// Requires: a verified graph. A splittable call is a convolution_backward.default with all eleven
// arguments positional (as torch.export writes them), a literal output_mask asking for the input
// gradient and the weight or bias gradient, read only by getitems of constant indices.
// Guarantees: the verifier passes afterwards.
#pragma once

#include "ir/graph.h"

#include <string>
#include <vector>

namespace torch_ext::passes {

// Whether `node` is a call the pass can split, and every such call of `graph`, in graph order.
bool splittable(const ir::Node& node);
std::vector<std::string> splittable_convolution_backwards(const ir::Graph& graph);

// Splits the named calls (each must be splittable: refused by name otherwise, the graph untouched);
// returns their names.
std::vector<std::string> split_convolution_backward(ir::Graph& graph, const std::vector<std::string>& names);

}  // namespace torch_ext::passes
