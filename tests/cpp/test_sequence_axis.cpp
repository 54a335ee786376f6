// Golden text-IR tests for the sequence-axis dependency analysis (passes/sequence_axis.h).
#include "ir/parser.h"
#include "ir/verifier.h"
#include "passes/sequence_axis.h"

#include <gtest/gtest.h>

#include <string>

using namespace torch_ext;

namespace {

// Causal attention twice over [batch, head, seq, dim] inputs (sequence on dim 2): with a mask built
// in the graph from ones(T, T).tril() == 0, and with SDPA's is_causal.
const char* kCausal = R"(graph:
  %q : f32[1,2,4,3] = input()
  %k : f32[1,2,4,3] = input()
  %v : f32[1,2,4,3] = input()
  %transpose : f32[1,2,3,4]{24,12,1,3} = aten::transpose.int(%k, -2, -1)
  %matmul : f32[1,2,4,4] = aten::matmul.default(%q, %transpose)
  %mul : f32[1,2,4,4] = aten::mul.Tensor(%matmul, 0.5)
  %ones : f32[4,4] = aten::ones.default([4, 4], device=device("cpu"), pin_memory=False)
  %tril : f32[4,4] = aten::tril.default(%ones)
  %eq : b8[4,4] = aten::eq.Scalar(%tril, 0)
  %masked_fill : f32[1,2,4,4] = aten::masked_fill.Scalar(%mul, %eq, -inf)
  %softmax : f32[1,2,4,4] = aten::softmax.int(%masked_fill, -1)
  %matmul_1 : f32[1,2,4,3] = aten::matmul.default(%softmax, %v)
  %scaled_dot_product_attention : f32[1,2,4,3] = aten::scaled_dot_product_attention.default(%q, %k, %v, None, 0.0, True)
  return (%matmul_1, %scaled_dot_product_attention)
)";

// What the pass cannot bound: a mean over the sequence, a cumsum, non-causal attention; and a mask it
// cannot prove (triu of ones with the diagonal kept). A reshape that merges the axis in as the inner
// index of a dim (features x positions) is followed as rows in blocks (fold).
const char* kFallback = R"(graph:
  %x : f32[2,4,3] = input()
  %mean : f32[2,1,3] = aten::mean.dim(%x, [1], True)
  %add : f32[2,4,3] = aten::add.Tensor(%mean, %x)
  %cumsum : f32[2,4,3] = aten::cumsum.default(%x, 1)
  %add_1 : f32[2,4,3] = aten::add.Tensor(%x, 1)
  %add_2 : f32[2,4,3] = aten::add.Tensor(%x, 2)
  %scaled_dot_product_attention : f32[2,4,3] = aten::scaled_dot_product_attention.default(%x, %add_1, %add_2)
  %transpose : f32[2,3,4]{12,1,3} = aten::transpose.int(%x, 1, 2)
  %reshape : f32[2,12] = aten::reshape.default(%transpose, [2, -1])
  %matmul : f32[2,4,4] = aten::matmul.default(%x, %transpose)
  %ones : f32[4,4] = aten::ones.default([4, 4], device=device("cpu"), pin_memory=False)
  %triu : f32[4,4] = aten::triu.default(%ones)
  %eq : b8[4,4] = aten::eq.Scalar(%triu, 0)
  %masked_fill : f32[2,4,4] = aten::masked_fill.Scalar(%matmul, %eq, -inf)
  %softmax : f32[2,4,4] = aten::softmax.int(%masked_fill, -1)
  %matmul_1 : f32[2,4,3] = aten::matmul.default(%softmax, %x)
  return (%add, %cumsum, %scaled_dot_product_attention, %reshape, %matmul_1)
)";

// Position-wise ops on [batch, seq, d]: embedding, a positional table, layer norm, linear, split,
// view / transpose into heads and back, cat, then the last row read by select.
const char* kPositionWise = R"(graph:
  %emb : f32[10,4] = param("emb.weight")
  %pos : f32[3,4] = param("pos.weight")
  %w : f32[8,4] = param("fc.weight")
  %g : f32[4] = param("ln.weight")
  %idx : i64[2,3] = input()
  %embedding : f32[2,3,4] = aten::embedding.default(%emb, %idx)
  %add : f32[2,3,4] = aten::add.Tensor(%embedding, %pos)
  %layer_norm : f32[2,3,4] = aten::layer_norm.default(%add, [4], %g)
  %linear : f32[2,3,8] = aten::linear.default(%layer_norm, %w)
  %split : (f32[2,3,4]{24,8,1}, f32[2,3,4]{24,8,1}) = aten::split.Tensor(%linear, 4, -1)
  %getitem : f32[2,3,4]{24,8,1} = getitem(%split, 0)
  %getitem_1 : f32[2,3,4]{24,8,1} = getitem(%split, 1)
  %view : f32[2,3,2,2]{24,8,2,1} = aten::view.default(%getitem, [2, 3, 2, 2])
  %transpose : f32[2,2,3,2]{24,2,8,1} = aten::transpose.int(%view, 1, 2)
  %gelu : f32[2,2,3,2]{12,2,4,1} = aten::gelu.default(%transpose)
  %transpose_1 : f32[2,3,2,2] = aten::transpose.int(%gelu, 1, 2)
  %reshape : f32[2,3,4] = aten::reshape.default(%transpose_1, [2, 3, 4])
  %cat : f32[2,3,8] = aten::cat.default([%reshape, %getitem_1], -1)
  %select : f32[2,8]{24,1} = aten::select.int(%cat, 1, -1)
  return (%cat, %select)
)";

// Hugging Face GPT-2's shapes: Conv1D flattens [batch, seq] into batch*seq rows before its GEMM and
// views them back; attention takes a boolean mask built from positions (j <= i, so causal), and one
// built the other way round (j >= i), and one read from a buffer (its value can change: not proven).
const char* kConv1d = R"(graph:
  %w : f32[4,12] = param("c_attn.weight")
  %b : f32[12] = param("c_attn.bias")
  %tab : f32[6,12] = param("table")
  %mb : b8[3,3] = buffer("mask")
  %x : f32[2,3,4] = input()
  %view : f32[6,4] = aten::view.default(%x, [-1, 4])
  %addmm : f32[6,12] = aten::addmm.default(%b, %view, %w)
  %gelu : f32[6,12] = aten::gelu.default(%addmm)
  %add : f32[6,12] = aten::add.Tensor(%gelu, %tab)
  %view_1 : f32[2,3,12] = aten::view.default(%gelu, [2, 3, 12])
  %view_2 : f32[3,2,12] = aten::view.default(%gelu, [3, 2, 12])
  %view_3 : f32[1,6,12] = aten::view.default(%gelu, [1, 6, 12])
  %split : (f32[2,3,4]{36,12,1}, f32[2,3,4]{36,12,1}, f32[2,3,4]{36,12,1}) = aten::split.Tensor(%view_1, 4, 2)
  %getitem : f32[2,3,4]{36,12,1} = getitem(%split, 0)
  %getitem_1 : f32[2,3,4]{36,12,1} = getitem(%split, 1)
  %getitem_2 : f32[2,3,4]{36,12,1} = getitem(%split, 2)
  %arange : i64[3] = aten::arange.default(3, device=device("cpu"), pin_memory=False)
  %unsqueeze : i64[3,1] = aten::unsqueeze.default(%arange, 1)
  %unsqueeze_1 : i64[1,3] = aten::unsqueeze.default(%arange, 0)
  %le : b8[3,3] = aten::le.Tensor(%unsqueeze_1, %unsqueeze)
  %ge : b8[3,3] = aten::ge.Tensor(%unsqueeze_1, %unsqueeze)
  %expand : b8[2,3,3]{0,3,1} = aten::expand.default(%le, [2, 3, 3])
  %sdpa : f32[2,3,4] = aten::scaled_dot_product_attention.default(%getitem, %getitem_1, %getitem_2, %expand)
  %sdpa_1 : f32[2,3,4] = aten::scaled_dot_product_attention.default(%getitem, %getitem_1, %getitem_2, %ge)
  %sdpa_2 : f32[2,3,4] = aten::scaled_dot_product_attention.default(%getitem, %getitem_1, %getitem_2, %mb)
  return (%add, %view_2, %view_3, %sdpa, %sdpa_1, %sdpa_2)
)";

std::string analyze(const std::string& text, int64_t seq_dim) {
  auto g = ir::parse(text);
  ir::verify(*g);
  return passes::print_sequence_axis(*g, passes::analyze_sequence_axis(*g, seq_dim));
}

std::string cone(const std::string& text, int64_t seq_dim, const std::string& source) {
  auto g = ir::parse(text);
  const auto a = passes::analyze_sequence_axis(*g, seq_dim);
  const auto ch = passes::seq_cone(*g, a, g->find(source));
  std::string out;
  for (const auto& n : g->nodes())
    if (ch.count(n.get())) out += "%" + n->name() + "=" + passes::to_string(ch.at(n.get())) + " ";
  return out;
}

}  // namespace

TEST(SequenceAxis, CausalAttentionMaskedAndSdpa) {
  EXPECT_EQ(analyze(kCausal, 2),
            "%transpose: row=3 | %k: row@2\n"
            "%matmul: row=2 key=3 | %q: row@2, %transpose: key@3\n"
            "%mul: row=2 key=3 | %matmul: row@2\n"
            "%ones: const ones\n"
            "%tril: const tril | %ones: none\n"
            "%eq: const triu | %tril: none\n"
            "%masked_fill: row=2 key=3 causal-mask upper=-inf | %mul: row@2, %eq: row@0\n"
            "%softmax: row=2 key=3 upper=0 mixes-key | %masked_fill: row@2\n"
            "%matmul_1: row=2 | %softmax: row@2, %v: prefix@2\n"
            "%scaled_dot_product_attention: row=2 causal-attention | %q: row@2, %k: prefix@2, %v: prefix@2\n");
  // A patch of rows [p, T) of the keys changes score columns [p, T) of earlier rows (upper); the mask
  // hides them, so everything after it changes rows [p, T) only.
  EXPECT_EQ(cone(kCausal, 2, "k"),
            "%transpose=rows %matmul=upper %mul=upper %masked_fill=rows %softmax=rows %matmul_1=rows "
            "%scaled_dot_product_attention=rows ");
  EXPECT_EQ(cone(kCausal, 2, "v"), "%matmul_1=rows %scaled_dot_product_attention=rows ");
}

TEST(SequenceAxis, ConservativeFallback) {
  EXPECT_EQ(analyze(kFallback, 1),
            "%mean: all | %x: all\n"
            "%add: row=1 | %mean: none, %x: row@1\n"
            "%cumsum: all | %x: all\n"
            "%add_1: row=1 | %x: row@1\n"
            "%add_2: row=1 | %x: row@1\n"
            "%scaled_dot_product_attention: all | %x: all, %add_1: all, %add_2: all\n"
            "%transpose: row=2 | %x: row@1\n"
            "%reshape: row=1 fold=3 | %transpose: row@2\n"
            "%matmul: row=1 key=2 | %x: row@1, %transpose: key@2\n"
            "%ones: const ones\n"
            "%triu: const | %ones: none\n"
            "%eq: const | %triu: none\n"
            "%masked_fill: row=1 key=2 | %matmul: row@1, %eq: row@0\n"
            "%softmax: row=1 key=2 mixes-key | %masked_fill: row@1\n"
            "%matmul_1: all | %softmax: all, %x: all\n");
  // Every row of what reads the mean or the unprovable mask changes.
  EXPECT_EQ(cone(kFallback, 1, "x"),
            "%mean=all %add=all %cumsum=all %add_1=rows %add_2=rows %scaled_dot_product_attention=all "
            "%transpose=rows %reshape=rows %matmul=all %masked_fill=all %softmax=all %matmul_1=all ");
}

TEST(SequenceAxis, PositionWiseOpsFollowTheAxis) {
  EXPECT_EQ(analyze(kPositionWise, 1),
            "%embedding: row=1 | %emb: none, %idx: row@1\n"
            "%add: row=1 | %embedding: row@1, %pos: row@0\n"
            "%layer_norm: row=1 | %add: row@1, %g: none\n"
            "%linear: row=1 | %layer_norm: row@1, %w: none\n"
            "%split: row=1 | %linear: row@1\n"
            "%getitem: row=1 | %split: row@1\n"
            "%getitem_1: row=1 | %split: row@1\n"
            "%view: row=1 | %getitem: row@1\n"
            "%transpose: row=2 | %view: row@1\n"
            "%gelu: row=2 | %transpose: row@2\n"
            "%transpose_1: row=1 | %gelu: row@2\n"
            "%reshape: row=1 | %transpose_1: row@1\n"
            "%cat: row=1 | %reshape: row@1, %getitem_1: row@1\n"
            "%select: all | %cat: all\n");
  EXPECT_EQ(cone(kPositionWise, 1, "layer_norm"),
            "%linear=rows %split=rows %getitem=rows %getitem_1=rows %view=rows %transpose=rows %gelu=rows "
            "%transpose_1=rows %reshape=rows %cat=rows %select=all ");
  // On another axis (dim 0 as the sequence), layer norm and linear still follow it; seq_dim past the
  // inputs' rank leaves everything without an axis.
  EXPECT_NE(analyze(kPositionWise, 0).find("%linear: row=0"), std::string::npos);
  EXPECT_NE(analyze(kPositionWise, 5).find("%linear: all"), std::string::npos);
}

TEST(SequenceAxis, FoldedRowsAndMasksProvenByTheirValue) {
  EXPECT_EQ(analyze(kConv1d, 1),
            "%view: row=0 fold=2 | %x: row@1\n"
            "%addmm: row=0 fold=2 | %b: none, %view: row@0, %w: none\n"
            "%gelu: row=0 fold=2 | %addmm: row@0\n"
            "%add: all | %gelu: all, %tab: none\n"  // a table along folded rows: not followed
            "%view_1: row=1 | %gelu: row@0\n"
            "%view_2: all | %gelu: all\n"  // 3 x 2 rows: position t is not the inner index
            "%view_3: row=1 fold=2 | %gelu: row@0\n"
            "%split: row=1 | %view_1: row@1\n"
            "%getitem: row=1 | %split: row@1\n"
            "%getitem_1: row=1 | %split: row@1\n"
            "%getitem_2: row=1 | %split: row@1\n"
            "%arange: const\n"
            "%unsqueeze: const | %arange: none\n"
            "%unsqueeze_1: const | %arange: none\n"
            "%le: const tril | %unsqueeze_1: none, %unsqueeze: none\n"
            "%ge: const | %unsqueeze_1: none, %unsqueeze: none\n"
            "%expand: const tril | %le: none\n"
            "%sdpa: row=1 causal-attention | %getitem: row@1, %getitem_1: prefix@1, %getitem_2: prefix@1, "
            "%expand: row@1\n"
            "%sdpa_1: all | %getitem: all, %getitem_1: all, %getitem_2: all, %ge: none\n"
            "%sdpa_2: all | %getitem: all, %getitem_1: all, %getitem_2: all, %mb: none\n");
  EXPECT_EQ(cone(kConv1d, 1, "x"),
            "%view=rows %addmm=rows %gelu=rows %add=all %view_1=rows %view_2=all %view_3=rows %split=rows "
            "%getitem=rows %getitem_1=rows %getitem_2=rows %sdpa=rows %sdpa_1=all %sdpa_2=all ");
}
