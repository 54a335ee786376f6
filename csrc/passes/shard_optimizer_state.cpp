#include "passes/shard_optimizer_state.h"

#include "optim/descriptor.h"
#include "passes/append_update.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

ir::Type flat_type(const ir::Type& like, int64_t numel) {
  ir::TensorMeta m = like.tensor;
  m.sizes = {numel};
  m.strides = {1};
  return ir::Type::make_tensor(m);
}

ir::Node* call(ir::Graph& g, const std::string& base, const char* target, std::vector<ir::Arg> args, ir::Type type,
               ir::Node* before = nullptr) {
  ir::Node* n = g.create_call(g.unique_name(base), ir::Target::parse(target), std::move(args), {}, std::move(type),
                              before);
  n->set_module_path("zero");
  return n;
}

ir::Arg int_list(const std::vector<int64_t>& v) {
  std::vector<ir::Arg> out;
  for (int64_t x : v) out.push_back(ir::Arg::of_int(x));
  return ir::Arg::of_list(std::move(out));
}

// This rank's S elements of `v` (N elements) flattened and zero-padded to S * world_size.
ir::Node* shard_of(ir::Graph& g, ir::Node* v, const DataParallel& dp, int64_t numel, int64_t shard) {
  ir::Node* flat = call(g, v->name() + "_flat", "aten::view.default", {ir::Arg::of_node(v), int_list({-1})},
                        flat_type(v->type(), numel));
  const int64_t padded = shard * dp.world_size;
  if (padded != numel)
    flat = call(g, v->name() + "_padded", "aten::constant_pad_nd.default",
                {ir::Arg::of_node(flat), int_list({0, padded - numel}), ir::Arg::of_float(0.0)},
                flat_type(v->type(), padded));
  return call(g, v->name() + "_shard", "aten::slice.Tensor",
              {ir::Arg::of_node(flat), ir::Arg::of_int(0), ir::Arg::of_int(dp.rank * shard),
               ir::Arg::of_int((dp.rank + 1) * shard), ir::Arg::of_int(1)},
              flat_type(v->type(), shard));
}

}  // namespace

std::vector<std::pair<std::string, ir::Node*>> shard_optimizer_state(ir::Graph& g, const TrainStepSpec& spec,
                                                                     const DataParallel& dp,
                                                                     const std::map<std::string, ir::Node*>& grads,
                                                                     const std::map<std::string, ir::Node*>& lifted) {
  TORCH_CHECK(!dp.group_name.empty(), "shard_optimizer_state: the process group has no registered name");
  TORCH_CHECK(dp.world_size >= 1 && dp.rank >= 0 && dp.rank < dp.world_size, "shard_optimizer_state: rank ", dp.rank,
              " of world_size ", dp.world_size, " is invalid");
  // Validate every parameter before changing anything.
  std::map<std::string, ir::Node*> params;
  for (const ParamUpdate& u : spec.updates) {
    const optim::Descriptor& d = optim::get(u.kind);
    TORCH_CHECK(d.elementwise, "shard_optimizer_state: parameter '", u.param, "' uses ", d.title,
                ", whose update needs the whole matrix; shard_optimizer_state supports element-wise optimizers only");
    ir::Node* p = nullptr;
    for (ir::Node* ph : g.placeholders())
      if (ph->state_name() == u.param && ph->role() == ir::InputRole::Parameter) p = ph;
    TORCH_CHECK(p != nullptr && p->type().is_tensor(), "shard_optimizer_state: no parameter placeholder for '",
                u.param, "'");
    const ir::TensorMeta& m = p->type().tensor;
    TORCH_CHECK(m.strides == ir::TensorMeta::contiguous_strides(m.sizes), "shard_optimizer_state: parameter '",
                u.param, "' is not contiguous");
    for (const optim::Slot& slot : d.slots)
      TORCH_CHECK(lifted.count(optim::state_name(u.param, slot.name)), "shard_optimizer_state: state '",
                  optim::state_name(u.param, slot.name), "' was not lifted");
    params[u.param] = p;
  }

  std::map<std::string, ir::Node*> values, shard_grads;
  std::map<std::string, int64_t> numels, shards;
  for (const ParamUpdate& u : spec.updates) {
    ir::Node* p = params.at(u.param);
    const int64_t numel = p->type().tensor.numel();
    const int64_t shard = (numel + dp.world_size - 1) / dp.world_size;
    numels[u.param] = numel;
    shards[u.param] = shard;
    for (const optim::Slot& slot : optim::get(u.kind).slots) {
      ir::Node* s = lifted.at(optim::state_name(u.param, slot.name));
      // Slots that mirror the parameter are sharded; a scalar slot (a step counter, NAdam's mu_product)
      // stays whole even when it has the parameter's shape (a 0-d parameter).
      if (!slot.is_scalar() && s->type().is_tensor() && s->type().tensor.sizes == p->type().tensor.sizes)
        s->set_type(flat_type(s->type(), shard));
    }
    auto gi = grads.find(u.param);
    if (gi == grads.end()) continue;
    ir::Node* piece = shard_of(g, p, dp, numel, shard);
    values[u.param] = call(g, p->name() + "_owned", "aten::clone.default", {ir::Arg::of_node(piece)}, piece->type());
    shard_grads[u.param] = shard_of(g, gi->second, dp, numel, shard);
  }
  auto updated = append_update(g, spec, shard_grads, lifted, values);
  // Every all-gather is issued before the first wait, so they overlap each other.
  std::vector<ir::Node*> gathers;
  for (auto& [name, node] : updated) {
    if (!values.count(name)) continue;  // optimizer state: stays a shard
    const ir::Node* p = params.at(name);
    gathers.push_back(call(g, p->name() + "_all_gather", "_c10d_functional::all_gather_into_tensor.default",
                           {ir::Arg::of_node(node), ir::Arg::of_int(dp.world_size), ir::Arg::of_string(dp.group_name)},
                           flat_type(p->type(), shards.at(name) * dp.world_size)));
  }
  size_t k = 0;
  for (auto& [name, node] : updated) {
    if (!values.count(name)) continue;
    const ir::Node* p = params.at(name);
    ir::Node* gathered = gathers[k++];
    const int64_t numel = numels.at(name), padded = shards.at(name) * dp.world_size;
    ir::Node* full = call(g, p->name() + "_gathered", "_c10d_functional::wait_tensor.default",
                          {ir::Arg::of_node(gathered)}, gathered->type());
    if (padded != numel)
      full = call(g, p->name() + "_unpadded", "aten::slice.Tensor",
                  {ir::Arg::of_node(full), ir::Arg::of_int(0), ir::Arg::of_int(0), ir::Arg::of_int(numel),
                   ir::Arg::of_int(1)},
                  flat_type(p->type(), numel));
    node = call(g, p->name() + "_new", "aten::view.default", {ir::Arg::of_node(full), int_list(p->type().tensor.sizes)},
                p->type());
  }
  return updated;
}

}  // namespace torch_ext::passes
