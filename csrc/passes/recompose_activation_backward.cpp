#include "passes/recompose_activation_backward.h"

#include <utility>
#include <vector>

namespace torch_ext::passes {
namespace {

// The node an argument refers to when it is a call of `op` (ns::name.overload), else null.
ir::Node* call_of(const ir::Arg& a, const char* op) {
  if (a.kind != ir::Arg::Kind::Node || a.node->kind() != ir::NodeKind::Call) return nullptr;
  return a.node->target().str() == op ? a.node : nullptr;
}

// The node of the unary call `op` applied to an argument, its input returned through `input`.
ir::Node* unary_of(const ir::Arg& a, const char* op, ir::Node** input) {
  ir::Node* n = call_of(a, op);
  if (n == nullptr || n->args().empty() || n->args()[0].kind != ir::Arg::Kind::Node) return nullptr;
  *input = n->args()[0].node;
  return n;
}

bool is_one(const ir::Arg& a) {
  return (a.kind == ir::Arg::Kind::Int && a.i == 1) || (a.kind == ir::Arg::Kind::Float && a.f == 1.0);
}

bool is_node(const ir::Arg& a, const ir::Node* n) { return a.kind == ir::Arg::Kind::Node && a.node == n; }

bool binary(const ir::Node* n) { return n != nullptr && n->args().size() == 2; }

// Whether `a` is 1 - %v as autograd's rsub traces: sub.Tensor(fill.Scalar(empty_like(%v), 1), %v).
bool one_minus(const ir::Arg& a, const ir::Node* v) {
  ir::Node* s = call_of(a, "aten::sub.Tensor");
  if (!binary(s) || !is_node(s->args()[1], v)) return false;
  ir::Node* f = call_of(s->args()[0], "aten::fill.Scalar");
  if (!binary(f) || !is_one(f->args()[1])) return false;
  ir::Node* e = call_of(f->args()[0], "aten::empty_like.default");
  return e != nullptr && !e->args().empty() && is_node(e->args()[0], v);
}

// Whether the forward activation reads %x, or reads the tensor %x is a clone of: an in-place activation
// (nn.SiLU(inplace=True)) is functionalized to silu(y), and autograd saves y's original value as clone(y).
bool read_by(const ir::Node* x, const char* forward) {
  for (const ir::Node* u : x->users())
    if (u->kind() == ir::NodeKind::Call && u->target().str() == forward) return true;
  if (x->kind() == ir::NodeKind::Call && x->target().str() == "aten::clone.default" && !x->args().empty() &&
      x->args()[0].kind == ir::Arg::Kind::Node && x->args()[0].node != x)
    return read_by(x->args()[0].node, forward);
  return false;
}

// %x when `factor` (the second operand of the last multiply) is SiLU's composite, else null.
ir::Node* silu_input(const ir::Arg& factor) {
  ir::Node* m1 = call_of(factor, "aten::mul.Tensor");
  if (!binary(m1)) return nullptr;
  ir::Node* x = nullptr;
  ir::Node* sig = unary_of(m1->args()[0], "aten::sigmoid.default", &x);
  ir::Node* a = call_of(m1->args()[1], "aten::add.Scalar");
  if (sig == nullptr || !binary(a) || !is_one(a->args()[1])) return nullptr;
  ir::Node* m = call_of(a->args()[0], "aten::mul.Tensor");
  if (!binary(m) || !is_node(m->args()[0], x) || !one_minus(m->args()[1], sig)) return nullptr;
  return read_by(x, "aten::silu.default") ? x : nullptr;
}

// %x when `factor` is Mish's composite, else null.
ir::Node* mish_input(const ir::Arg& factor) {
  ir::Node* add = call_of(factor, "aten::add.Tensor");
  if (!binary(add) || add->kwarg("alpha") != nullptr) return nullptr;
  ir::Node *sp = nullptr, *x = nullptr;
  ir::Node* tsp = unary_of(add->args()[0], "aten::tanh.default", &sp);
  if (tsp == nullptr) return nullptr;
  ir::Node* softplus = unary_of(ir::Arg::of_node(sp), "aten::softplus.default", &x);
  // softplus(x) with its defaults (beta 1, threshold 20), as autograd's formula calls it
  if (softplus == nullptr || (softplus->args().size() > 1 && !is_one(softplus->args()[1])) ||
      (softplus->args().size() > 2 && !(softplus->args()[2].kind == ir::Arg::Kind::Int && softplus->args()[2].i == 20) &&
       !(softplus->args()[2].kind == ir::Arg::Kind::Float && softplus->args()[2].f == 20.0)))
    return nullptr;
  ir::Node* m2 = call_of(add->args()[1], "aten::mul.Tensor");
  if (!binary(m2)) return nullptr;
  ir::Node* m1 = call_of(m2->args()[0], "aten::mul.Tensor");
  ir::Node* sig_in = nullptr;
  if (!binary(m1) || !is_node(m1->args()[0], x) || unary_of(m1->args()[1], "aten::sigmoid.default", &sig_in) == nullptr ||
      sig_in != x)
    return nullptr;
  ir::Node* sq = call_of(m2->args()[1], "aten::sub.Tensor") != nullptr
                     ? call_of(call_of(m2->args()[1], "aten::sub.Tensor")->args()[1], "aten::mul.Tensor")
                     : nullptr;
  if (!binary(sq) || !is_node(sq->args()[0], tsp) || !is_node(sq->args()[1], tsp) || !one_minus(m2->args()[1], sq))
    return nullptr;
  return read_by(x, "aten::mish.default") ? x : nullptr;
}

}  // namespace

int64_t recompose_activation_backward(ir::Graph& g) {
  const ir::Target mul = ir::Target::parse("aten::mul.Tensor");
  std::vector<std::pair<ir::Node*, std::pair<ir::Node*, const char*>>> found;  // (out, (x, fused kernel))
  for (const auto& n : g.nodes()) {
    if (n->kind() != ir::NodeKind::Call || !(n->target() == mul) || n->args().size() != 2) continue;
    if (ir::Node* x = silu_input(n->args()[1])) {
      found.push_back({n.get(), {x, "aten::silu_backward.default"}});
    } else if (ir::Node* y = mish_input(n->args()[1])) {
      found.push_back({n.get(), {y, "aten::mish_backward.default"}});
    }
  }
  for (auto& [out, fused] : found) {
    const ir::Arg grad = out->args()[0];
    g.set_target(out, ir::Target::parse(fused.second));
    g.set_args(out, {grad, ir::Arg::of_node(fused.first)}, {});
  }
  return static_cast<int64_t>(found.size());
}

}  // namespace torch_ext::passes
