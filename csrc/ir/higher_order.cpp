#include "ir/higher_order.h"

#include "ir/printer.h"
#include "ir/type_check.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace torch_ext::ir {
namespace {

std::vector<Type> region_inputs(const Graph& r) {
  std::vector<Type> out;
  for (const Node* p : r.placeholders()) out.push_back(p->type());
  return out;
}

std::vector<Type> region_outputs(const Graph& r) {
  std::vector<Type> out;
  if (r.output() == nullptr) return out;
  for (const Arg& a : r.output()->args()[0].list) out.push_back(a.kind == Arg::Kind::Node ? a.node->type() : Type());
  return out;
}

std::vector<Type> list_types(const Arg& list) {
  std::vector<Type> out;
  for (const Arg& a : list.list) out.push_back(a.kind == Arg::Kind::Node ? a.node->type() : Type());
  return out;
}

std::string types_str(const std::vector<Type>& ts) {
  std::string s = "(";
  for (size_t i = 0; i < ts.size(); ++i) s += (i ? ", " : "") + print_type(ts[i]);
  return s + ")";
}

// A predicate or loop condition: a bool scalar or a one-element tensor.
bool truth(const c10::IValue& v) { return v.isTensor() ? v.toTensor().item<bool>() : v.toBool(); }

// cond(pred, [operands]) {true branch} {false branch}: both branches take the operands and
// return the same types, the node's tuple type.
void verify_cond(const Node& n, const std::string& where, std::vector<std::string>& errors) {
  const Graph& r0 = *n.regions()[0];
  const Graph& r1 = *n.regions()[1];
  // The runtimes read the predicate as a bool scalar or a one-element tensor.
  const Arg& pred = n.args()[0];
  if (pred.kind == Arg::Kind::Node) {
    const Type& t = pred.node->type();
    const bool ok = t.kind == Type::Kind::Bool || (t.is_tensor() && invalid_type_reason(t).empty() &&
                                                   t.tensor.numel() == 1);
    if (!ok)
      errors.push_back(where + "predicate %" + pred.node->name() + " of type " + print_type_safe(t) +
                       " must be a bool or a one-element tensor");
  }
  const auto operands = list_types(n.args()[1]);
  for (int b = 0; b < 2; ++b)
    if (region_inputs(*n.regions()[b]) != operands)
      errors.push_back(where + (b == 0 ? "true" : "false") + " branch takes " + types_str(region_inputs(*n.regions()[b])) +
                       " but the operands are " + types_str(operands));
  if (region_outputs(r0) != region_outputs(r1))
    errors.push_back(where + "branches return different types: true " + types_str(region_outputs(r0)) + ", false " +
                     types_str(region_outputs(r1)));
  if (n.type().kind != Type::Kind::Tuple || n.type().elems != region_outputs(r0))
    errors.push_back(where + "node type " + print_type(n.type()) + " differs from the branches' outputs " +
                     types_str(region_outputs(r0)));
}

c10::IValue run_cond(const std::vector<std::vector<c10::IValue>>& args, const HopRunContext& ctx) {
  return c10::ivalue::Tuple::create(ctx.run_region(truth(args[0][0]) ? 0 : 1, args[1]));
}

// while_loop([carried], [additional]) {cond} {body}: both regions take the carried then the
// additional values; cond returns one b8[], body the carried values with unchanged types.
void verify_while_loop(const Node& n, const std::string& where, std::vector<std::string>& errors) {
  const Graph& r0 = *n.regions()[0];
  const Graph& r1 = *n.regions()[1];
  auto carried = list_types(n.args()[0]);
  auto inputs = carried;
  for (const Type& t : list_types(n.args()[1])) inputs.push_back(t);
  if (region_inputs(r0) != inputs || region_inputs(r1) != inputs)
    errors.push_back(where + "loop regions must take the carried and additional values " + types_str(inputs));
  const auto c_out = region_outputs(r0);
  if (c_out.size() != 1 || !c_out[0].is_tensor() || c_out[0].tensor.dtype != c10::ScalarType::Bool ||
      !c_out[0].tensor.sizes.empty())
    errors.push_back(where + "loop condition must return one b8[] scalar, got " + types_str(c_out));
  if (region_outputs(r1) != carried)
    errors.push_back(where + "loop body changes the carried values from " + types_str(carried) + " to " +
                     types_str(region_outputs(r1)) + " (shapes and dtypes must stay fixed)");
}

c10::IValue run_while_loop(const std::vector<std::vector<c10::IValue>>& args, const HopRunContext& ctx) {
  std::vector<c10::IValue> carried = args[0];
  const std::vector<c10::IValue>& additional = args[1];
  auto with_additional = [&](std::vector<c10::IValue> v) {
    v.insert(v.end(), additional.begin(), additional.end());
    return v;
  };
  for (int64_t iteration = 0;; ++iteration) {
    if (!truth(ctx.run_region(0, with_additional(carried)).at(0))) break;
    TORCH_CHECK(iteration < ctx.max_loop_iterations, "while_loop %", ctx.node_name, ": still running after ",
                ctx.max_loop_iterations, " iterations, the limit (set TORCH_EXT_MAX_LOOP_ITERATIONS to raise it)");
    carried = ctx.run_region(1, with_additional(std::move(carried)));
  }
  return c10::ivalue::Tuple::create(std::move(carried));
}

}  // namespace

const std::vector<HigherOrderOp>& higher_order_ops() {
  using K = HopArg::Kind;
  constexpr auto A = FxArg::Kind::Arg;
  constexpr auto R = FxArg::Kind::Region;
  // Built on first use, not at load time.
  static const std::vector<HigherOrderOp> ops = {
      {"cond", "cond takes (%pred, [operands]) and two regions", {{"predicate", K::Value}, {"operands", K::List}}, 2,
       verify_cond, run_cond, /*pure_if_regions_are=*/true, /*outputs_may_alias_operands=*/true,
       {{A, 0}, {R, 0}, {R, 1}, {A, 1}}, {}},
      {"while_loop", "while_loop takes ([carried], [additional]) and two regions",
       {{"carried values", K::List}, {"additional values", K::List}}, 2, verify_while_loop, run_while_loop,
       /*pure_if_regions_are=*/true, /*outputs_may_alias_operands=*/true, {{R, 0}, {R, 1}, {A, 0}, {A, 1}}, {0}},
  };
  return ops;
}

bool is_higher_order(const Target& target) { return target.ns == kHigherOrderNamespace; }

const HigherOrderOp* find_higher_order(const Target& target) {
  if (!is_higher_order(target)) return nullptr;
  for (const HigherOrderOp& op : higher_order_ops())
    if (target.name == op.name) return &op;
  return nullptr;
}

std::string higher_order_names() {
  const auto& ops = higher_order_ops();
  std::string s;
  for (size_t i = 0; i < ops.size(); ++i) s += (i == 0 ? "" : i + 1 == ops.size() ? " and " : ", ") + std::string(ops[i].name);
  return s;
}

std::string check_layout(const HigherOrderOp& op, const Node& node) {
  if (node.regions().size() != op.num_regions || node.args().size() != op.args.size()) return op.signature;
  for (size_t i = 0; i < op.args.size(); ++i)
    if (op.args[i].kind == HopArg::Kind::List && node.args()[i].kind != Arg::Kind::List)
      return std::string(op.name) + " " + op.args[i].name + " must be a list";
  return "";
}

}  // namespace torch_ext::ir
