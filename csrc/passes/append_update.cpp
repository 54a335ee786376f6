#include "passes/append_update.h"

#include "optim/descriptor.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

double hyper(const ParamUpdate& u, const std::string& key) {
  auto it = u.hyper.find(key);
  TORCH_CHECK(it != u.hyper.end(), "append_update: parameter '", u.param, "' (", u.kind, ") is missing hyperparameter '",
              key, "'");
  return it->second;
}

bool flag(const ParamUpdate& u, const std::string& key) {
  auto it = u.flags.find(key);
  TORCH_CHECK(it != u.flags.end(), "append_update: parameter '", u.param, "' (", u.kind, ") is missing flag '", key, "'");
  return it->second;
}

ir::Node* param_node(const ir::Graph& g, const std::string& name) {
  for (ir::Node* p : g.placeholders())
    if (p->state_name() == name && p->role() == ir::InputRole::Parameter) return p;
  TORCH_CHECK(false, "append_update: no parameter placeholder for '", name, "'");
}

// Arguments after (param, grad, <state...>, lr), in the descriptor's (= the schema's) order; a
// scheduled update reads its schedulable scalars from the group's inputs in `lifted`.
std::vector<ir::Arg> scalar_args(const ParamUpdate& u, const std::map<std::string, ir::Node*>& lifted) {
  std::vector<ir::Arg> out;
  for (const optim::Scalar& s : optim::get(u.kind).scalars) {
    if (u.scheduled && s.schedulable) {
      auto it = lifted.find(optim::group_input_name(s.name, u.group));
      TORCH_CHECK(it != lifted.end(), "append_update: no '", s.name, "' input for group ", u.group);
      out.push_back(ir::Arg::of_node(it->second));
      continue;
    }
    switch (s.type) {
      case optim::ScalarType::Float:
        out.push_back(ir::Arg::of_float(hyper(u, s.name)));
        break;
      case optim::ScalarType::Int:
        out.push_back(ir::Arg::of_int(static_cast<int64_t>(hyper(u, s.name))));
        break;
      case optim::ScalarType::Bool:
        out.push_back(ir::Arg::of_bool(flag(u, s.name)));
        break;
    }
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, ir::Node*>> append_update(ir::Graph& g, const TrainStepSpec& spec,
                                                             const std::map<std::string, ir::Node*>& grads,
                                                             const std::map<std::string, ir::Node*>& lifted,
                                                             const std::map<std::string, ir::Node*>& values) {
  // Validate every entry before adding a node.
  for (const ParamUpdate& u : spec.updates) {
    param_node(g, u.param);
    scalar_args(u, lifted);
    for (const optim::Slot& slot : optim::get(u.kind).slots)
      TORCH_CHECK(lifted.count(optim::state_name(u.param, slot.name)), "append_update: state '",
                  optim::state_name(u.param, slot.name), "' was not lifted");
    TORCH_CHECK(lifted.count(optim::lr_name(u.group)), "append_update: no lr input for group ", u.group);
  }
  std::vector<std::pair<std::string, ir::Node*>> updated;
  for (const ParamUpdate& u : spec.updates) {
    auto gi = grads.find(u.param);
    if (gi == grads.end()) continue;  // no gradient: torch.optim leaves the parameter and its state alone
    auto vi = values.find(u.param);
    ir::Node* p = vi != values.end() ? vi->second : param_node(g, u.param);
    const optim::Descriptor& d = optim::get(u.kind);
    std::vector<ir::Arg> args{ir::Arg::of_node(p), ir::Arg::of_node(gi->second)};
    std::vector<ir::Type> out_types{p->type()};
    for (const optim::Slot& slot : d.slots) {
      ir::Node* s = lifted.at(optim::state_name(u.param, slot.name));
      args.push_back(ir::Arg::of_node(s));
      out_types.push_back(s->type());
    }
    args.push_back(ir::Arg::of_node(lifted.at(optim::lr_name(u.group))));
    for (ir::Arg& a : scalar_args(u, lifted)) args.push_back(std::move(a));
    const std::string target =
        "torch_ext::" + d.op_name() + "." + (u.scheduled ? optim::kScheduledOverload : "default");
    ir::Type type = out_types.size() == 1 ? out_types[0] : ir::Type::make_tuple(out_types);
    ir::Node* upd = g.create_call(g.unique_name(p->name() + "_" + u.kind), ir::Target::parse(target), std::move(args),
                                  {}, type);
    upd->set_module_path("optimizer");
    if (out_types.size() == 1) {
      updated.emplace_back(u.param, upd);
      continue;
    }
    for (size_t i = 0; i < out_types.size(); ++i) {
      const std::string part = i == 0 ? std::string("param") : d.slots[i - 1].name;
      ir::Node* item = g.create_call(g.unique_name(upd->name() + "_" + part),
                                     ir::Target::getitem(), {ir::Arg::of_node(upd), ir::Arg::of_int(static_cast<int64_t>(i))},
                                     {}, out_types[i]);
      item->set_module_path("optimizer");
      updated.emplace_back(i == 0 ? u.param : optim::state_name(u.param, d.slots[i - 1].name), item);
    }
  }
  return updated;
}

}  // namespace torch_ext::passes
