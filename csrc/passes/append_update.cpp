#include "passes/append_update.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

double hyper(const ParamUpdate& u, const char* key) {
  auto it = u.hyper.find(key);
  TORCH_CHECK(it != u.hyper.end(), "append_update: parameter '", u.param, "' (", u.kind, ") is missing hyperparameter '",
              key, "'");
  return it->second;
}

bool flag(const ParamUpdate& u, const char* key) {
  auto it = u.flags.find(key);
  TORCH_CHECK(it != u.flags.end(), "append_update: parameter '", u.param, "' (", u.kind, ") is missing flag '", key, "'");
  return it->second;
}

ir::Node* param_node(const ir::Graph& g, const std::string& name) {
  for (ir::Node* p : g.placeholders())
    if (p->state_name() == name && p->role() == ir::InputRole::Parameter) return p;
  TORCH_CHECK(false, "append_update: no parameter placeholder for '", name, "'");
}

// Arguments after (param, grad, <state...>, lr) for each kind, in schema order.
std::vector<ir::Arg> scalar_args(const ParamUpdate& u) {
  using A = ir::Arg;
  if (u.kind == "sgd") return {A::of_float(hyper(u, "weight_decay")), A::of_bool(flag(u, "maximize"))};
  if (u.kind == "sgd_momentum")
    return {A::of_float(hyper(u, "momentum")), A::of_float(hyper(u, "dampening")), A::of_float(hyper(u, "weight_decay")),
            A::of_bool(flag(u, "nesterov")), A::of_bool(flag(u, "maximize"))};
  if (u.kind == "adam" || u.kind == "adam_amsgrad")
    return {A::of_float(hyper(u, "beta1")), A::of_float(hyper(u, "beta2")), A::of_float(hyper(u, "eps")),
            A::of_float(hyper(u, "weight_decay")), A::of_bool(flag(u, "decoupled")), A::of_bool(flag(u, "maximize"))};
  if (u.kind == "muon")
    return {A::of_float(hyper(u, "weight_decay")), A::of_float(hyper(u, "momentum")), A::of_bool(flag(u, "nesterov")),
            A::of_float(hyper(u, "a")), A::of_float(hyper(u, "b")), A::of_float(hyper(u, "c")),
            A::of_int(static_cast<int64_t>(hyper(u, "ns_steps"))), A::of_float(hyper(u, "eps")),
            A::of_float(hyper(u, "lr_ratio"))};
  if (u.kind == "rmsprop")
    return {A::of_float(hyper(u, "alpha")), A::of_float(hyper(u, "eps")), A::of_float(hyper(u, "weight_decay")),
            A::of_float(hyper(u, "momentum")), A::of_bool(flag(u, "centered")), A::of_bool(flag(u, "maximize"))};
  if (u.kind == "adagrad")
    return {A::of_float(hyper(u, "lr_decay")), A::of_float(hyper(u, "weight_decay")), A::of_float(hyper(u, "eps")),
            A::of_bool(flag(u, "maximize"))};
  TORCH_CHECK(false, "append_update: unknown update kind '", u.kind, "'");
}

}  // namespace

std::vector<std::pair<std::string, ir::Node*>> append_update(ir::Graph& g, const TrainStepSpec& spec,
                                                             const std::map<std::string, ir::Node*>& grads,
                                                             const std::map<std::string, ir::Node*>& lifted,
                                                             const std::map<std::string, ir::Node*>& values) {
  // Validate every entry before adding a node.
  for (const ParamUpdate& u : spec.updates) {
    param_node(g, u.param);
    scalar_args(u);
    for (const std::string& slot : state_slots(u.kind))
      TORCH_CHECK(lifted.count(state_name(u.param, slot)), "append_update: state '", state_name(u.param, slot),
                  "' was not lifted");
    TORCH_CHECK(lifted.count(lr_name(u.group)), "append_update: no lr input for group ", u.group);
  }
  std::vector<std::pair<std::string, ir::Node*>> updated;
  for (const ParamUpdate& u : spec.updates) {
    auto gi = grads.find(u.param);
    if (gi == grads.end()) continue;  // no gradient: torch.optim leaves the parameter and its state alone
    auto vi = values.find(u.param);
    ir::Node* p = vi != values.end() ? vi->second : param_node(g, u.param);
    const std::vector<std::string> slots = state_slots(u.kind);
    std::vector<ir::Arg> args{ir::Arg::of_node(p), ir::Arg::of_node(gi->second)};
    std::vector<ir::Type> out_types{p->type()};
    for (const std::string& slot : slots) {
      ir::Node* s = lifted.at(state_name(u.param, slot));
      args.push_back(ir::Arg::of_node(s));
      out_types.push_back(s->type());
    }
    args.push_back(ir::Arg::of_node(lifted.at(lr_name(u.group))));
    for (ir::Arg& a : scalar_args(u)) args.push_back(std::move(a));
    const std::string target = "torch_ext::" + u.kind + "_update.default";
    ir::Type type = out_types.size() == 1 ? out_types[0] : ir::Type::make_tuple(out_types);
    ir::Node* upd = g.create_call(g.unique_name(p->name() + "_" + u.kind), ir::Target::parse(target), std::move(args),
                                  {}, type);
    upd->set_module_path("optimizer");
    if (out_types.size() == 1) {
      updated.emplace_back(u.param, upd);
      continue;
    }
    for (size_t i = 0; i < out_types.size(); ++i) {
      ir::Node* item = g.create_call(g.unique_name(upd->name() + "_" + (i == 0 ? std::string("param") : slots[i - 1])),
                                     ir::Target::getitem(), {ir::Arg::of_node(upd), ir::Arg::of_int(static_cast<int64_t>(i))},
                                     {}, out_types[i]);
      item->set_module_path("optimizer");
      updated.emplace_back(i == 0 ? u.param : state_name(u.param, slots[i - 1]), item);
    }
  }
  return updated;
}

}  // namespace torch_ext::passes
