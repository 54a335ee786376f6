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

// What the pass cannot bound: a mean over the sequence, a cumsum, non-causal attention, a reshape
// that merges the axis away; and a mask it cannot prove (triu of ones with the diagonal kept).
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
            "%reshape: all | %transpose: all\n"
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
            "%transpose=rows %reshape=all %matmul=all %masked_fill=all %softmax=all %matmul_1=all ");
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
