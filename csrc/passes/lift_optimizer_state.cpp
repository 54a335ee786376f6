#include "ir/type_check.h"
#include "passes/lift_optimizer_state.h"

#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cctype>

namespace torch_ext::passes {
namespace {

ir::Node* find_param(const ir::Graph& g, const std::string& state) {
  for (ir::Node* p : g.placeholders())
    if (p->state_name() == state && p->role() == ir::InputRole::Parameter) return p;
  return nullptr;
}

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '_') ? c : '_';
  return out;
}

ir::Type scalar_type(c10::ScalarType dtype) {
  ir::TensorMeta m;
  m.dtype = dtype;
  return ir::Type::make_tensor(m);
}

// The strides torch.zeros_like(param) gives (memory_format=preserve, as torch.optim and torch_ext.optim
// create their slots and init_state copies them): the parameter's own where it is dense and
// non-overlapping (a transposed weight), else those of its suggested memory format. The slot's
// layout decides the update's rounding in bfloat16/float16: TensorIterator runs a vectorized loop
// over operands laid out alike and a strided scalar one over mixed layouts, and the two round
// otherwise (Lion's exp_avg.mul(beta2).add_(grad, 1 - beta2) on a transposed weight: 1 ulp off eager).
std::vector<int64_t> zeros_like_strides(const ir::TensorMeta& param) {
  return at::empty_like(ir::meta_tensor(param)).strides().vec();
}

}  // namespace

std::map<std::string, ir::Node*> lift_optimizer_state(ir::Graph& g, const TrainStepSpec& spec) {
  // Validate first so a refused spec leaves the graph unchanged.
  for (const ParamUpdate& u : spec.updates) {
    ir::Node* p = find_param(g, u.param);
    TORCH_CHECK(p != nullptr, "lift_optimizer_state: no parameter placeholder for '", u.param, "'");
    TORCH_CHECK(p->type().is_tensor(), "lift_optimizer_state: parameter '", u.param, "' is not a tensor");
    TORCH_CHECK(u.group >= 0 && u.group < spec.num_groups, "lift_optimizer_state: parameter '", u.param,
                "' has group ", u.group, " but there are ", spec.num_groups, " groups");
    const optim::Descriptor& d = optim::get(u.kind);
    TORCH_CHECK(!u.scheduled || d.has_schedulable(), "lift_optimizer_state: parameter '", u.param, "' (", u.kind,
                ") is marked scheduled but ", d.title, " has no schedulable hyperparameter");
    for (const optim::Slot& slot : d.slots)
      TORCH_CHECK(!slot.is_factored() || p->type().tensor.sizes.size() >= 2, "lift_optimizer_state: parameter '",
                  u.param, "' (", u.kind, ") has shape ", c10::IntArrayRef(p->type().tensor.sizes), " but ", d.title,
                  "'s slot '", slot.name, "' is factored over its last two dims and needs 2 or more");
  }
  std::map<std::string, ir::Node*> lifted;
  for (const ParamUpdate& u : spec.updates) {
    ir::Node* p = find_param(g, u.param);
    for (const optim::Slot& slot : optim::get(u.kind).slots) {
      const std::string name = optim::state_name(u.param, slot.name);
      if (lifted.count(name)) continue;
      ir::Type t = slot.is_scalar() ? scalar_type(c10::ScalarType::Float) : p->type();
      if (slot.is_factored()) {  // Adafactor's row_var, col_var: new_zeros(shape), contiguous
        t.tensor.sizes = slot.shape(p->type().tensor.sizes);
        t.tensor.strides = ir::TensorMeta::contiguous_strides(t.tensor.sizes);
      } else if (!slot.is_scalar()) {
        t.tensor.strides = zeros_like_strides(p->type().tensor);
      }
      lifted[name] = g.create_placeholder(g.unique_name("opt_" + sanitize(u.param) + "_" + slot.name),
                                          ir::InputRole::OptimizerState, t, name);
    }
  }
  auto group_input = [&](const std::string& hyper, int64_t grp) {
    const std::string name = optim::group_input_name(hyper, grp);
    if (!lifted.count(name))
      lifted[name] = g.create_placeholder(g.unique_name(hyper + "_group" + std::to_string(grp)),
                                          ir::InputRole::OptimizerState, scalar_type(c10::ScalarType::Double), name);
  };
  for (int64_t grp = 0; grp < spec.num_groups; ++grp) group_input("lr", grp);
  // After every lr, so a step without scheduled scalars keeps its layout.
  for (const ParamUpdate& u : spec.updates)
    if (u.scheduled)
      for (const std::string& s : optim::get(u.kind).schedulable()) group_input(s, u.group);
  return lifted;
}

}  // namespace torch_ext::passes
