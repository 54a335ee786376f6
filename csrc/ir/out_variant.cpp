#include "ir/out_variant.h"

#include "ir/schema.h"

#include <c10/core/DispatchKey.h>
#include <c10/core/TensorOptions.h>

#include <algorithm>
#include <unordered_map>

namespace torch_ext::ir {
namespace {

// Every overload name of each operator, from the dispatcher's registry. Rebuilt when operators
// were registered since (a library loaded later), so it never misses one.
std::vector<std::string> overloads_of(const std::string& qualified_name) {
  std::vector<std::string> out;
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNames())
    if (op.name == qualified_name) out.push_back(op.overload_name);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::optional<OutVariant> find_out_variant(const Node& node) {
  if (node.kind() != NodeKind::Call || node.target().is_builtin()) return std::nullopt;
  std::vector<const TensorMeta*> results;
  if (node.type().is_tensor()) results.push_back(&node.type().tensor);
  if (node.type().kind == Type::Kind::Tuple)
    for (const Type& e : node.type().elems) {
      if (!e.is_tensor()) return std::nullopt;
      results.push_back(&e.tensor);
    }
  if (results.empty()) return std::nullopt;
  auto functional = find_op(node.target());
  if (!functional) return std::nullopt;
  const auto& fa = functional->schema().arguments();
  const size_t k = results.size();
  const TensorMeta& m = *results[0];
  const c10::DispatchKey backend = c10::computeDispatchKey(m.dtype, c10::kStrided, m.device);
  for (const std::string& overload : overloads_of(node.target().ns + "::" + node.target().name)) {
    Target t = node.target();
    t.overload = overload.empty() ? "default" : overload;
    if (t == node.target()) continue;
    auto out = find_op(t);
    if (!out) continue;
    const auto& oa = out->schema().arguments();
    if (oa.size() != fa.size() + k || out->schema().returns().size() != k) continue;
    bool ok = true;
    for (size_t i = 0; i < fa.size() && ok; ++i) ok = fa[i].name() == oa[i].name();
    OutVariant v{*out, {}};
    for (size_t i = fa.size(); i < oa.size() && ok; ++i) {
      const c10::Argument& o = oa[i];
      ok = o.kwarg_only() && o.alias_info() != nullptr && o.alias_info()->isWrite() &&
           o.type()->isSubtypeOf(*c10::TensorType::get());
      v.out_args.push_back(o.name());
    }
    if (!ok || !out->hasKernelForDispatchKey(backend)) continue;
    return v;
  }
  return std::nullopt;
}

}  // namespace torch_ext::ir
