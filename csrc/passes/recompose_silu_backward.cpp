#include "passes/recompose_silu_backward.h"

#include <vector>

namespace torch_ext::passes {
namespace {

// The node an argument refers to when it is a call of `op` (ns::name.overload), else null.
ir::Node* call_of(const ir::Arg& a, const char* op) {
  if (a.kind != ir::Arg::Kind::Node || a.node->kind() != ir::NodeKind::Call) return nullptr;
  return a.node->target().str() == op ? a.node : nullptr;
}

bool is_one(const ir::Arg& a) {
  return (a.kind == ir::Arg::Kind::Int && a.i == 1) || (a.kind == ir::Arg::Kind::Float && a.f == 1.0);
}

bool is_node(const ir::Arg& a, const ir::Node* n) { return a.kind == ir::Arg::Kind::Node && a.node == n; }

// %x when `out` is the composite's last multiply (see the header), else null.
ir::Node* silu_backward_input(const ir::Node& out) {
  if (out.args().size() != 2) return nullptr;
  ir::Node* m1 = call_of(out.args()[1], "aten::mul.Tensor");
  if (m1 == nullptr || m1->args().size() != 2) return nullptr;
  ir::Node* sig = call_of(m1->args()[0], "aten::sigmoid.default");
  ir::Node* a = call_of(m1->args()[1], "aten::add.Scalar");
  if (sig == nullptr || a == nullptr || a->args().size() != 2 || !is_one(a->args()[1])) return nullptr;
  ir::Node* m = call_of(a->args()[0], "aten::mul.Tensor");
  if (m == nullptr || m->args().size() != 2) return nullptr;
  ir::Node* x = sig->args()[0].kind == ir::Arg::Kind::Node ? sig->args()[0].node : nullptr;
  ir::Node* s = call_of(m->args()[1], "aten::sub.Tensor");
  if (x == nullptr || !is_node(m->args()[0], x) || s == nullptr || s->args().size() != 2 || !is_node(s->args()[1], sig))
    return nullptr;
  ir::Node* f = call_of(s->args()[0], "aten::fill.Scalar");
  if (f == nullptr || f->args().size() != 2 || !is_one(f->args()[1])) return nullptr;
  ir::Node* e = call_of(f->args()[0], "aten::empty_like.default");
  if (e == nullptr || e->args().empty() || !is_node(e->args()[0], sig)) return nullptr;
  for (const ir::Node* u : x->users())
    if (u->kind() == ir::NodeKind::Call && u->target().str() == "aten::silu.default") return x;
  return nullptr;
}

}  // namespace

int64_t recompose_silu_backward(ir::Graph& g) {
  const ir::Target mul = ir::Target::parse("aten::mul.Tensor");
  std::vector<std::pair<ir::Node*, ir::Node*>> found;  // (out, x)
  for (const auto& n : g.nodes()) {
    if (n->kind() != ir::NodeKind::Call || !(n->target() == mul)) continue;
    if (ir::Node* x = silu_backward_input(*n)) found.emplace_back(n.get(), x);
  }
  const ir::Target silu_backward = ir::Target::parse("aten::silu_backward.default");
  for (auto& [out, x] : found) {
    const ir::Arg grad = out->args()[0];
    g.set_target(out, silu_backward);
    g.set_args(out, {grad, ir::Arg::of_node(x)}, {});
  }
  return static_cast<int64_t>(found.size());
}

}  // namespace torch_ext::passes
