#include "passes/all_reduce_grads.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

// The node after `n` in the graph's order (where a collective on n's value is issued), or null
// when n is the last node before the output.
ir::Node* after(ir::Graph& g, const ir::Node* n) {
  g.index();
  const auto& nodes = g.nodes();
  for (size_t i = static_cast<size_t>(n->index()) + 1; i < nodes.size(); ++i) {
    ir::Node* next = nodes[i].get();
    if (next->kind() == ir::NodeKind::Call) return next;
    if (next->kind() == ir::NodeKind::Output) return nullptr;
  }
  return nullptr;
}

ir::Node* call(ir::Graph& g, const std::string& base, const char* target, std::vector<ir::Arg> args, ir::Type type,
               ir::Node* before) {
  ir::Node* n = g.create_call(g.unique_name(base), ir::Target::parse(target), std::move(args), {}, std::move(type),
                              before);
  n->set_module_path("data_parallel");
  return n;
}

void check_values(const ir::Graph& g, const std::vector<ir::Node*>& values, const char* what) {
  for (const ir::Node* v : values)
    TORCH_CHECK(v != nullptr && v->owner() == &g && v->type().is_tensor(), "all_reduce_grads: ", what, " %",
                v == nullptr ? std::string("<null>") : v->name(), " is not a tensor of this graph");
}

}  // namespace

DataParallelValues all_reduce_grads(ir::Graph& g, const DataParallel& dp, const std::vector<ir::Node*>& grads,
                                    const std::vector<ir::Node*>& buffers) {
  TORCH_CHECK(!dp.group_name.empty(), "all_reduce_grads: the process group has no registered name");
  TORCH_CHECK(dp.world_size >= 1, "all_reduce_grads: world_size must be >= 1, got ", dp.world_size);
  TORCH_CHECK(dp.rank >= 0 && dp.rank < dp.world_size, "all_reduce_grads: rank ", dp.rank, " is outside [0, ",
              dp.world_size, ")");
  check_values(g, grads, "gradient");
  check_values(g, buffers, "buffer");

  DataParallelValues out;
  const ir::Arg group = ir::Arg::of_string(dp.group_name);
  for (ir::Node* gr : grads) {
    ir::Node* at = after(g, gr);
    ir::Node* scaled = call(g, gr->name() + "_scaled", "aten::mul.Tensor",
                            {ir::Arg::of_node(gr), ir::Arg::of_float(1.0 / static_cast<double>(dp.world_size))},
                            gr->type(), at);
    ir::Node* reduce = call(g, gr->name() + "_all_reduce", "_c10d_functional::all_reduce.default",
                            {ir::Arg::of_node(scaled), ir::Arg::of_string("sum"), group}, gr->type(), at);
    out.grads.push_back(call(g, gr->name() + "_reduced", "_c10d_functional::wait_tensor.default",
                             {ir::Arg::of_node(reduce)}, gr->type(), nullptr));
  }
  for (ir::Node* b : buffers) {
    ir::Node* bcast = call(g, b->name() + "_broadcast", "_c10d_functional::broadcast.default",
                           {ir::Arg::of_node(b), ir::Arg::of_int(0), group}, b->type(), after(g, b));
    out.buffers.push_back(call(g, b->name() + "_synced", "_c10d_functional::wait_tensor.default",
                               {ir::Arg::of_node(bcast)}, b->type(), nullptr));
  }
  return out;
}

}  // namespace torch_ext::passes
