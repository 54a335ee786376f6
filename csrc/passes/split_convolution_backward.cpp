#include "passes/split_convolution_backward.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace torch_ext::passes {
namespace {

constexpr size_t kMaskArg = 10;  // output_mask, the last of convolution_backward's arguments

bool is_convolution_backward(const ir::Node& n) {
  return n.kind() == ir::NodeKind::Call && n.target().ns == "aten" && n.target().name == "convolution_backward" &&
         n.target().overload == "default";
}

// The literal output_mask of `n`, or empty when it is not three literal bools.
std::vector<bool> mask_of(const ir::Node& n) {
  if (n.args().size() != kMaskArg + 1 || !n.kwargs().empty()) return {};
  const ir::Arg& m = n.args()[kMaskArg];
  if (m.kind != ir::Arg::Kind::List || m.list.size() != 3) return {};
  std::vector<bool> out;
  for (const ir::Arg& b : m.list) {
    if (b.kind != ir::Arg::Kind::Bool) return {};
    out.push_back(b.i != 0);
  }
  return out;
}

std::vector<ir::Arg> with_mask(const ir::Node& n, bool input, bool weight, bool bias) {
  std::vector<ir::Arg> args = n.args();
  args[kMaskArg] = ir::Arg::of_list({ir::Arg::of_bool(input), ir::Arg::of_bool(weight), ir::Arg::of_bool(bias)});
  return args;
}

// `t` (a 3-tuple) with the elements not in `keep` made none.
ir::Type keep_parts(const ir::Type& t, bool in, bool w, bool b) {
  std::vector<ir::Type> elems = t.elems;
  const bool keep[3] = {in, w, b};
  for (size_t i = 0; i < 3; ++i)
    if (!keep[i]) elems[i] = ir::Type::make_scalar(ir::Type::Kind::None);
  return ir::Type::make_tuple(std::move(elems));
}

}  // namespace

bool splittable(const ir::Node& n) {
  if (!is_convolution_backward(n)) return false;
  const std::vector<bool> m = mask_of(n);
  if (m.empty() || !m[0] || !(m[1] || m[2]) || n.type().elems.size() != 3) return false;
  // Only getitems of constant indices can be told which of the two calls to read.
  return std::all_of(n.users().begin(), n.users().end(), [](const ir::Node* u) {
    return u->target().is_getitem() && u->args().size() == 2 && u->args()[1].kind == ir::Arg::Kind::Int;
  });
}

std::vector<std::string> splittable_convolution_backwards(const ir::Graph& g) {
  std::vector<std::string> out;
  for (const auto& n : g.nodes())
    if (splittable(*n)) out.push_back(n->name());
  return out;
}

std::vector<std::string> split_convolution_backward(ir::Graph& g, const std::vector<std::string>& names) {
  // Every name is checked before the first edit, so that a refusal leaves the graph unchanged.
  std::vector<ir::Node*> sites;
  for (const std::string& name : names) {
    ir::Node* n = g.find(name);
    TORCH_CHECK(n != nullptr, "split_convolution_backward: no node %", name);
    TORCH_CHECK(splittable(*n), "split_convolution_backward: %", name, " (", n->target().str(),
                ") is not a convolution_backward computing the input and the weight gradient with literal "
                "positional arguments, read only by getitems of constant indices");
    TORCH_CHECK(std::find(sites.begin(), sites.end(), n) == sites.end(), "split_convolution_backward: %", name,
                " is named twice");
    sites.push_back(n);
  }
  std::vector<std::string> split;
  for (ir::Node* n : sites) {
    const std::vector<bool> m = mask_of(*n);
    // The weight part runs first in graph order; the scheduler is free to reorder the two.
    ir::Node* weight = g.create_call(g.unique_name(n->name() + "_weight"), n->target(), with_mask(*n, false, m[1], m[2]),
                                     {}, keep_parts(n->type(), false, m[1], m[2]), n);
    weight->set_module_path(n->module_path());
    for (ir::Node* u : std::vector<ir::Node*>(n->users().begin(), n->users().end()))
      if (u->args()[1].i != 0) g.replace_input_of(u, n, weight);
    g.set_args(n, with_mask(*n, true, false, false), {});
    n->set_type(keep_parts(n->type(), true, false, false));
    split.push_back(n->name());
  }
  g.index();
  return split;
}

}  // namespace torch_ext::passes
