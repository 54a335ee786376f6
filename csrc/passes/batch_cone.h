// batch_cone: the downstream cone of one node, K times over, for batched sweep sites.
//
// Given a graph, a site node s and K, builds a new graph that evaluates K variants of s's value at
// once: the variants are stacked along dim 0 (variant i is chunk i of K along dim 0), and only the
// strict cone V+(s) is computed, at K times its size along dim 0. Values the cone reads from
// outside it are placeholders (their clean, cached values are bound by the caller): read as they
// are where they broadcast, or "tiled" (bound as the clean value repeated K times along dim 0)
// where a cone node lines them up with its stacked dim 0. The new graph:
//   * placeholders: every external value read by the cone (same name, or "<name>_tiled" when
//     tiled; parameters and buffers keep their role, computed values become constants), then the
//     site itself (same name, a user input, dim 0 times K, contiguous);
//   * the cone's calls, same names, same topological order, with size arguments rewritten where
//     an op spells out dim 0 (view / reshape / _unsafe_view / expand sizes, a full slice of dim 0);
//   * the same outputs: a cone node's stacked value, or the external clean value otherwise.
// Nodes in `stop` (pinned nodes of a reactive graph) are not part of the cone: they are external
// values read as they are. Cone nodes that reach no output (only through a stop node) are dropped.
//
// Requires: the site is a node of `g` with a tensor value of rank >= 1; k >= 1.
// Guarantees: every cone call is an op the pass proves keeps the K variants apart (a documented
// whitelist with per-op dim checks: elementwise and broadcasting ops, row-wise ops such as linear /
// addmm / layer_norm / embedding, attention and batched matmuls, views and reshapes, transposes /
// permutes / softmaxes / reductions / splits / cats / slices that do not touch the stacked dim), and
// its type, inferred on meta tensors, is exactly the original type with the stacked dim times K.
// Anything else is refused with a c10::Error naming the node, its op and the reason; `g` is never
// modified.
//
// Where the copies go. Inside the batched graph each stacked value keeps its K copies in one dim b
// (a Layout: b, and `in`, how many of the original dim's elements sit inside the copy index; `in` ==
// the dim's size: whole chunks), and every op moves b as it moves that dim: a transpose or permute
// carries it, select / squeeze / unsqueeze / stack / keepdim=False reductions shift it, a view,
// reshape, flatten or unflatten keeps the copy index at its place in the row-major order (the copies
// of [seq, K*batch, d] viewed as [seq*batch, d] sit inside dim 0, every `batch` rows; viewed back as
// [seq, batch, d] they are on dim 1 again). A view whose sizes allow several places (size-1 dims) is
// tried with each, in a fixed order, with bounded backtracking. The site is stacked along its dim 0
// first, else along the first other dim whose cone passes (dim 1 of nn.MultiheadAttention's default
// [seq, batch, d] stream, whose attention would mix copies stacked along seq): the site placeholder is
// still bound as whole chunks of dim 0 and moved in the graph (%<s>_dim<b>, a reshape / permute /
// reshape), as are tiled externals (%<x>_dim<b>), and every stacked output is moved back to whole
// chunks of dim 0 (%<r>_chunks). The choice is made from what each op does to each dim, never from
// sizes (seq == batch changes nothing). A refusal names the node and reason for every dim tried.
// The layout algebra (Layout, view_layouts, out_layout, the moves) is passes/batch_layout.h.
//
// Entries along a chain (batch_cone over several (site, k) entries): copies that enter at different
// nodes of one path, such as one position's residual stream at several layers. Entry j's k_j copies
// are patched at s_j; each s_j (j >= 2) must be in the strict cone of s_{j-1}, so a cone node carries
// the copies of a prefix of the entries: c(n) = k_1 + ... + k_m, m the last entry whose cone reaches n
// (the batch grows at each entry). Upstream of s_2 only k_1 copies run. The new graph has one site
// placeholder, named s_1, holding every entry's copies in entry order (dim 0 times k_1 + ... + k_M;
// every s_j has s_1's type), so one patched value drives the whole unit:
//   %<s_j>_copies = aten::slice.Tensor(%<s_1>, 0, lo_j, hi_j)  entry j's copies (rows of the placeholder)
//   %<s_j>_joined = aten::cat.default([%<s_j>, %<s_j>_copies])  j >= 2: the copies so far, then entry j's
// and %<s_1>_copies stands for s_1. A node that reads a value with fewer copies than its own reads it
// padded with that value's clean copies (%<x>_pad<c> = cat of x and its clean value tiled), since a copy
// that enters downstream of x sees x unpatched; outputs are padded to every copy. These plumbing calls
// count in num_calls. One entry gives exactly the single-site form.
#pragma once

#include "ir/graph.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch_ext::passes {

struct BatchConeExternal {
  std::string placeholder;  // its name in the batched graph
  std::string source;       // the node of the original graph whose value it takes
  bool tiled = false;       // bind the source value repeated `copies` times along dim 0
  int64_t copies = 0;       // tiled: how many times (k for one entry; per reader with entries)
};

struct BatchConeEntry {
  std::string site;
  int64_t k = 1;
};

struct BatchCone {
  std::unique_ptr<ir::Graph> graph;
  std::vector<BatchConeExternal> externals;  // in placeholder order (the site placeholder comes last)
  std::vector<bool> output_batched;          // per output: stacked along dim 0 (else the clean value)
  int64_t num_calls = 0;                     // cone calls kept (countable nodes of the batched graph)
};

BatchCone batch_cone(const ir::Graph& g, const std::string& site, int64_t k,
                     const std::vector<std::string>& stop = {});

// Entries along a chain (see above); one entry is batch_cone(g, site, k, stop).
BatchCone batch_cone(const ir::Graph& g, const std::vector<BatchConeEntry>& entries,
                     const std::vector<std::string>& stop = {});

}  // namespace torch_ext::passes
