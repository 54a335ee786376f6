// batch_layout: where the K copies of a batched cone sit in each value, and how each op moves them.
// The layout algebra of batch_cone (passes/batch_cone.h), apart from the pass that walks the graph
// and builds the batched one (passes/batch_cone.cpp), as memory_algorithms.* is apart from
// plan_memory.cpp. Everything here is a function of sizes, dims and an op's arguments: no graph is
// built or changed.
//
// Inside the batched graph each stacked value keeps its copies in one dim b (a Layout: b, and `in`, how
// many of the original dim's elements sit inside the copy index; `in` == the dim's size: whole chunks),
// and every op moves b as it moves that dim (out_layout). A view keeps the copy index at its place in
// the row-major order of the elements, which several output dims may hold (view_layouts lists them all,
// the likeliest first; batch_cone backtracks over the choice). The site placeholder and the outputs
// hold their copies as whole chunks of dim 0; move_from_chunks / move_to_chunks are the reshape /
// permute / reshape that move them to a layout and back.
#pragma once

#include "ir/graph.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torch_ext::passes::batch_layout {

// Where a stacked value keeps its copies: along dim `b`, whose size is the original one times the copies,
// the copy index sitting in that dim with `in` of the original dim's elements inside it (index of
// original element j of copy i: (j / in) * copies * in + i * in + j % in). `in` == the dim's size: the
// copies are whole chunks of dim b (the form the site placeholder and the outputs have along dim 0).
struct Layout {
  int64_t b = 0;
  int64_t in = 0;
  bool operator==(const Layout& o) const { return b == o.b && in == o.in; }
  bool operator!=(const Layout& o) const { return !(*this == o); }
};

// The first tensor of a value (itself, or the first tensor element of a tuple); null when none.
const ir::TensorMeta* first_tensor(const ir::Type& t);
// `d` counted from the front of `rank` dims.
inline int64_t norm_dim(int64_t d, int64_t rank) { return d < 0 ? d + rank : d; }

// The copies as whole chunks of dim b of `t` (its first tensor).
Layout whole_chunks(const ir::Type& t, int64_t b);
// "dim b", with "(every in rows)" when the copies are not whole chunks of it: for messages.
std::string layout_text(const Layout& l, const ir::Type& t);

// A view's output layouts (view / reshape / _unsafe_view / unflatten of a value of sizes `in_sizes`
// with its copies on `l`, to sizes `out`, the unstacked sizes): the copy index keeps its place in the
// row-major order of the elements (I of them inside it), so it lands in an output dim d with
// prod(out[d+1:]) | I and I / prod(out[d+1:]) | out[d]. Several dims can hold that place (copies
// innermost of dim d are outermost of dim d + 1, and size-1 dims add more): all of them, the likeliest
// first (dim b itself where the view keeps dims 0..b, then whole chunks of a dim, innermost first, then
// the rest, outermost first). Refuses (c10::Error naming `w`) an empty output, or a view that leaves the
// copies in no single dim.
std::vector<Layout> view_layouts(const std::vector<int64_t>& in_sizes, Layout l, const std::vector<int64_t>& out,
                                 const std::string& w);

// Picks one of several equally valid layouts (batch_cone's backtracking); called for views only.
using LayoutChoice = std::function<Layout(const std::vector<Layout>&)>;

// Where cone call `n` (aten op `op`, named `w` in messages) has its copies, given its stacked input's
// layout `l` (unstacked sizes `in_sizes`) and its output rank `out_rank`, refusing (c10::Error) ops that
// contract or mix the stacked dim: transposes and permutes carry b, select / squeeze / unsqueeze / stack
// / keepdim=False reductions shift it, flatten and views keep the copy index at its place in the
// row-major order (`choose` picks among view_layouts). `x_by_matrix`: a matmul of the stacked input by
// a constant matrix; `stacked_args`: bit i set when argument i (0 or 1) is stacked. Which dims an op
// works along (and so must not be b) is the pass's check, not this.
Layout out_layout(const ir::Node& n, const std::string& op, Layout l, const std::vector<int64_t>& in_sizes,
                  int64_t out_rank, bool x_by_matrix, unsigned stacked_args, const std::string& w,
                  const LayoutChoice& choose);

// Moving c copies of a value of unstacked sizes `sizes` between whole chunks of dim 0 and a layout:
// reshape to `split`, permute by `perm`, reshape to `sizes_after`.
struct LayoutMove {
  std::vector<int64_t> split;
  std::vector<int64_t> perm;
  std::vector<int64_t> sizes_after;
};
// From whole chunks of dim 0 to `to`: [c, n0, ..., n_b / in, in, ...], c moved before `in`,
// [n0, ..., c * n_b, ...].
LayoutMove move_from_chunks(const std::vector<int64_t>& sizes, Layout to, int64_t c);
// The inverse: from `from` to whole chunks of dim 0 ([c * n0, n1, ...]).
LayoutMove move_to_chunks(const std::vector<int64_t>& sizes, Layout from, int64_t c);

}  // namespace torch_ext::passes::batch_layout
