// Analysis pass: which rows along the sequence axis of each node's output depend on which rows of
// its inputs. Read-only (the graph is not changed).
//
// The sequence axis starts at the user inputs (`seq_dim`, 1 by default for [batch, seq, ...]) and is
// followed through the ops the pass knows. Every tensor input of a call gets a relation to the
// output's *row axis* (the sequence axis of the output):
//   row@d     output row i reads row i of this input along its dim d (position-wise ops: elementwise,
//             linear / matmul over the last dim, layer / RMS norm over the last dim, activations, eval
//             dropout, reductions over other dims; views, transposes, permutes, splits, cats that keep
//             or move the axis). Inputs that do not come from a user input (positional tables, masks)
//             are read row-wise too when they broadcast along the axis with its full length.
//   prefix@d  output row i reads rows <= i of this input along d (keys and values of causal attention).
//   key@d     output column j along the output's *key axis* reads row j of this input, every output
//             row reads it (q @ k^T: the scores of a causal attention before its mask).
//   all       every output row reads every row (the conservative fallback: reductions over the
//             sequence, non-causal attention, an op the pass does not know).
//   none      the input has no sequence axis and is read whole (weights, biases, size-1 broadcasts).
// A node whose row axis is -1 has none: printed "const" when it depends on no user input, else "all"
// (the fallback).
//
// Causal structure is proven, never assumed: SDPA with is_causal=True (or a boolean attention mask proven
// lower-triangular: then it is causal attention as well, printed causal-attention); masked_fill(x, m, -inf) where m is proven to be true exactly above the diagonal
// (built in the graph from ones(T, T).tril()/triu(), ==0 / !=0 / logical_not, slices from 0 and
// unsqueezes), or by its value where it is computed from integer and boolean constants alone (no
// placeholder reaches it: Hugging Face's mask compares positions with `le`); softmax over the key axis of such a masked tensor is zero above the diagonal, and its
// product with values is causal attention.
//
// seq_cone() composes the per-node relations for one patched source: a patch that changes rows
// [p, T) of the source changes, for each node of the cone,
//   Rows   rows [p, T) only,
//   Upper  rows [p, T), and columns [p, T) of rows < p along the key axis (attention scores before
//          the causal mask; every consumer of an Upper node reads it row-wise, else it is All),
//   All    anything.
#pragma once

#include "ir/graph.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_ext::passes {

enum class SeqRel { None, Row, Prefix, Key, All };

struct SeqInput {
  const ir::Node* node = nullptr;
  SeqRel rel = SeqRel::None;
  int64_t dim = -1;  // the input's dim for Row, Prefix and Key
};

struct SeqNode {
  int64_t row_axis = -1;   // the output's sequence axis; -1: none (constant or fallback)
  int64_t key_axis = -1;   // a second sequence axis (attention scores' key columns), or -1
  int64_t length = 0;      // T: the number of positions along the row axis
  // The row axis flattens `fold` blocks of T rows (index b * T + t; its size is fold * T): a view that
  // merges [B, T] into B*T rows, as Hugging Face's Conv1D does before its GEMM. Row (b, t) of the output
  // still reads row (b, t) of its inputs; followed by views, addmm, linear, norms and elementwise ops only.
  int64_t fold = 1;
  bool mixes_key = false;  // works along the key axis (softmax over keys): Upper inputs become All
  bool masks_upper = false;      // masked_fill with a proven causal mask: Upper input becomes Rows
  bool causal_attention = false;  // SDPA with is_causal=True (suffix rows need an explicit offset mask)
  bool causal_values = false;     // entries above the diagonal are -inf (masked scores) or 0 (probabilities)
  std::vector<SeqInput> inputs;  // one per distinct input node, in Node::inputs() order
  // Constant structure for the causal-mask proof: 1 = lower-triangular keep mask (true/1 where j <= i,
  // else false/0), 2 = its complement (true where j > i), 3 = all ones; 0 = unknown.
  int mask_kind = 0;
  bool varying = false;  // depends on a user input
};

struct SeqAxisAnalysis {
  int64_t seq_dim = 1;
  std::unordered_map<const ir::Node*, SeqNode> nodes;  // every call and placeholder
  const SeqNode& at(const ir::Node* n) const { return nodes.at(n); }
};

SeqAxisAnalysis analyze_sequence_axis(const ir::Graph& graph, int64_t seq_dim = 1);

// One line per call node: "%name: row=1 | %x: row@1, %w: none" (golden-test format).
std::string print_sequence_axis(const ir::Graph& graph, const SeqAxisAnalysis& analysis);

enum class SeqChange { None, Rows, Upper, All };
// For a patch that changes rows [p, T) of `source` (or all of it when it has no row axis): the
// change of every node of its strict cone (placeholders excluded), Upper nodes that a consumer or the
// output reads whole promoted to All.
std::unordered_map<const ir::Node*, SeqChange> seq_cone(const ir::Graph& graph, const SeqAxisAnalysis& analysis,
                                                         const ir::Node* source);
const char* to_string(SeqChange c);

}  // namespace torch_ext::passes
