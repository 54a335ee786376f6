// Schemas and kernels of every optimizer, generated from its Descriptor: one boxed kernel checks
// the arguments and calls the descriptor's kernel (in place, or writing fresh results through
// Update::write for the functional op). The kernels are ATen calls, so the same boxed kernel is
// registered for the CPU and CUDA dispatch keys (define, below); only cache blocking is CPU's.
#include "optim/descriptor.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>

namespace torch_ext::optim {
namespace {

const char* type_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return "float";
    case ScalarType::Int:
      return "int";
    case ScalarType::Bool:
      return "bool";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ScalarType");
}

// "(Tensor param, Tensor grad, Tensor <slot>..., Tensor lr, <type> <scalar>...)"; `inplace`
// marks param and every slot as written (Tensor(a!), Tensor(b!), ...); `scheduled` makes each
// schedulable scalar a Tensor.
std::string arguments(const Descriptor& d, bool inplace, bool scheduled) {
  char alias = 'a';
  auto tensor = [&](const std::string& name, bool written) {
    return std::string("Tensor") + (inplace && written ? std::string("(") + alias++ + "!)" : "") + " " + name;
  };
  std::string s = "(" + tensor("param", true) + ", " + tensor("grad", false);
  for (const Slot& slot : d.slots) s += ", " + tensor(slot.name, true);
  s += ", " + tensor("lr", false);
  for (const Scalar& x : d.scalars)
    s += std::string(", ") + (scheduled && x.schedulable ? "Tensor" : type_name(x.type)) + " " + x.name;
  return s + ")";
}

// lr and the scheduled scalars are float64 tensors that the step keeps on the CPU whatever the
// model's device (lift_optimizer_state declares them so, and train_step.py makes them so): reading
// one is a host read. One on another device is still read (a device sync per parameter), not refused.
double scalar_of(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.numel() == 1, what, " must be a 1-element tensor, got shape ", t.sizes());
  return t.item<double>();
}

// The parameter is floating point; `other` has its dtype and device.
void check_kind_like(const at::Tensor& param, const at::Tensor& other, const std::string& what) {
  TORCH_CHECK(at::isFloatingType(param.scalar_type()), "parameter must be floating point, got ", param.scalar_type());
  // Mixed dtypes or devices would fail deep inside a kernel with a message naming none of the arguments.
  TORCH_CHECK(other.scalar_type() == param.scalar_type(), what, " has dtype ", other.scalar_type(),
              " but the parameter has dtype ", param.scalar_type());
  TORCH_CHECK(other.device() == param.device(), what, " is on ", other.device(), " but the parameter is on ",
              param.device());
}

void check_like(const at::Tensor& param, const at::Tensor& other, const std::string& what) {
  TORCH_CHECK(other.sizes() == param.sizes(), what, " has shape ", other.sizes(), " but the parameter has shape ",
              param.sizes());
  check_kind_like(param, other, what);
}

// A factored slot (Adafactor's row_var, col_var): the shape `slot` derives from the parameter's.
void check_factored(const at::Tensor& param, const at::Tensor& other, const Slot& slot) {
  const std::vector<int64_t> want = slot.shape(param.sizes());
  TORCH_CHECK(other.sizes() == c10::IntArrayRef(want), slot.name, " has shape ", other.sizes(),
              " but a parameter of shape ", param.sizes(), " needs ", c10::IntArrayRef(want),
              " (its size along dim ", slot.factored_dim, " reduced to 1)");
  check_kind_like(param, other, slot.name);
}

void check_scalar_slot(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK(t.numel() == 1, what, " must be a 1-element tensor, got shape ", t.sizes());
}

size_t index_of(const Descriptor& d, const std::string& name, ScalarType type) {
  for (size_t k = 0; k < d.scalars.size(); ++k)
    if (d.scalars[k].name == name) {
      TORCH_INTERNAL_ASSERT(d.scalars[k].type == type, d.kind, ": scalar '", name, "' read with the wrong type");
      return k;
    }
  TORCH_INTERNAL_ASSERT(false, d.kind, ": no scalar '", name, "'");
}

// Blocked updates. An optimizer's kernel is a sequence of whole-tensor ATen ops (torch.optim's
// single-tensor form, for bit-exact parity), so each op streams param, grad and every state
// tensor through memory: AdamW is seven passes, 77 ms a step over GPT-2's 14.7M parameters on
// one thread of this machine. An elementwise kernel gives the same bits when it runs on slices,
// the same ops on the same values, so large tensors run slice by slice, each small enough that
// its passes stay in the core's L2 (256 KiB a tensor: 22 ms for the same update, one thread).
constexpr int64_t kBlockBytes = 256 * 1024;

// The number of elements per block for `u`, or 0 when u runs whole: a parameter off the CPU (the
// block size is a CPU cache's; a GPU's kernels stream whole tensors and each block would cost a
// launch per op), a kernel that reads whole
// tensors (Muon) or gains nothing from blocks (Descriptor::blocked), a tensor under two blocks,
// or per-element tensors whose memory is not laid out alike (the same strides, dense and
// non-overlapping), so that one flat slice of memory holds the same elements of each.
int64_t block_elements(const Update& u) {
  if (!u.param.is_cpu() || !u.desc->elementwise || !u.desc->blocked || !u.param.is_non_overlapping_and_dense())
    return 0;
  for (const Slot& slot : u.desc->slots)
    if (slot.is_factored()) return 0;  // not shaped like the parameter (and never elementwise)
  const int64_t block = std::max<int64_t>(1, kBlockBytes / static_cast<int64_t>(u.param.element_size()));
  if (u.param.numel() < 2 * block) return 0;
  auto laid_out_alike = [&](const at::Tensor& t) {
    return t.is_non_overlapping_and_dense() && t.strides() == u.param.strides() && t.device() == u.param.device();
  };
  if (!laid_out_alike(u.grad)) return 0;
  for (size_t k = 0; k < u.state.size(); ++k)
    if (!u.desc->slots[k].is_scalar() && !laid_out_alike(u.state[k])) return 0;
  return block;
}

// t's memory as a 1-D tensor (t dense and non-overlapping).
at::Tensor flat_memory(const at::Tensor& t) { return t.as_strided({t.numel()}, {1}, t.storage_offset()); }

// Runs u's kernel block by block over flat slices (u as run_update prepared it; its results are
// left in u.param and u.state). A scalar slot (a step counter, NAdam's mu_product) is whole: every
// block's kernel reads the value it had before the update (the first block the real one, later
// blocks a copy whose result is dropped), so a kernel that reads it before writing it
// (sgd_momentum) decides alike in every block.
void run_blocked(Update& u, int64_t block) {
  const Descriptor& d = *u.desc;
  const size_t num_slots = d.slots.size();
  // Per block, one copy of each scalar slot's value before the update (scratch, reset per block).
  std::vector<at::Tensor> scalar_before(num_slots), scalar_scratch(num_slots);
  for (size_t k = 0; k < num_slots; ++k)
    if (d.slots[k].is_scalar()) {
      scalar_before[k] = u.state[k].clone();
      scalar_scratch[k] = at::empty_like(scalar_before[k]);
    }
  // Whole results of the functional op; the in-place op writes the caller's tensors.
  at::Tensor param_out = u.inplace ? u.param : fresh_like(u.param);
  std::vector<at::Tensor> state_out(num_slots);
  for (size_t k = 0; k < num_slots; ++k)
    if (!d.slots[k].is_scalar()) state_out[k] = u.inplace ? u.state[k] : fresh_like(u.state[k]);
  TORCH_INTERNAL_ASSERT(param_out.strides() == u.param.strides(), d.kind, ": a result is laid out unlike its input");
  // Flat views made once; each block narrows them.
  const at::Tensor param_flat = flat_memory(u.param), grad_flat = flat_memory(u.grad);
  const at::Tensor param_out_flat = u.inplace ? param_flat : flat_memory(param_out);
  std::vector<at::Tensor> slot_flat(num_slots), slot_out_flat(num_slots);
  for (size_t k = 0; k < num_slots; ++k)
    if (!d.slots[k].is_scalar()) {
      slot_flat[k] = flat_memory(u.state[k]);
      slot_out_flat[k] = u.inplace ? slot_flat[k] : flat_memory(state_out[k]);
    }
  const int64_t numel = u.param.numel();
  std::vector<at::Tensor> step_result(num_slots);
  Update b;
  b.desc = &d;
  b.inplace = u.inplace;
  b.lr = u.lr;
  b.scalars = u.scalars;
  for (int64_t start = 0; start < numel; start += block) {
    const int64_t len = std::min(block, numel - start);
    b.param = param_flat.narrow(0, start, len);
    b.grad = grad_flat.narrow(0, start, len);
    const at::Tensor param_slice = b.param;
    at::Tensor param_out_slice = u.inplace ? param_slice : param_out_flat.narrow(0, start, len);
    std::vector<at::Tensor> slot_slice(num_slots), slot_out_slice(num_slots);
    b.state.clear();
    b.inputs.clear();
    b.destinations.clear();
    for (size_t k = 0; k < num_slots; ++k) {
      if (d.slots[k].is_scalar()) {
        if (start != 0) scalar_scratch[k].copy_(scalar_before[k]);
        b.state.push_back(start == 0 ? u.state[k] : scalar_scratch[k]);
      } else {
        slot_slice[k] = slot_flat[k].narrow(0, start, len);
        slot_out_slice[k] = u.inplace ? slot_slice[k] : slot_out_flat[k].narrow(0, start, len);
        b.state.push_back(slot_slice[k]);
      }
    }
    if (!u.inplace) {
      b.inputs.push_back(param_slice);
      b.destinations.emplace_back(param_slice, param_out_slice);
      for (size_t k = 0; k < num_slots; ++k) {
        if (!d.slots[k].is_scalar()) {
          b.inputs.push_back(slot_slice[k]);
          b.destinations.emplace_back(slot_slice[k], slot_out_slice[k]);
        } else if (start == 0) {
          b.inputs.push_back(u.state[k]);
        }
      }
    }
    d.kernel(b);
    if (!u.inplace) {  // what this configuration leaves alone is still the input: copy it across
      if (b.param.is_same(param_slice)) param_out_slice.copy_(param_slice);
      for (size_t k = 0; k < num_slots; ++k)
        if (!d.slots[k].is_scalar() && b.state[k].is_same(slot_slice[k])) slot_out_slice[k].copy_(slot_slice[k]);
    }
    if (start == 0)
      for (size_t k = 0; k < num_slots; ++k)
        if (d.slots[k].is_scalar()) step_result[k] = b.state[k];
  }
  u.param = param_out;
  for (size_t k = 0; k < num_slots; ++k) u.state[k] = d.slots[k].is_scalar() ? step_result[k] : state_out[k];
}

// The kernel of K_update (or K_update_ when `inplace`) for every descriptor, on any device. The registry
// owns the descriptor for the life of the process.
void run_update(const Descriptor* d, bool inplace, torch::jit::Stack* stack) {
  const size_t num_args = 3 + d->slots.size() + d->scalars.size();
  auto args = torch::jit::last(*stack, num_args);
  Update u;
  u.desc = d;
  u.param = args[0].toTensor();
  u.grad = args[1].toTensor();
  check_like(u.param, u.grad, "grad");
  for (size_t k = 0; k < d->slots.size(); ++k) {
    u.state.push_back(args[2 + k].toTensor());
    if (d->slots[k].is_scalar()) {
      check_scalar_slot(u.state.back(), d->slots[k].name);
    } else if (d->slots[k].is_factored()) {
      check_factored(u.param, u.state.back(), d->slots[k]);
    } else {
      check_like(u.param, u.state.back(), d->slots[k].name);
    }
  }
  u.lr = scalar_of(args[2 + d->slots.size()].toTensor(), "lr");
  for (size_t k = 0; k < d->scalars.size(); ++k) u.scalars.push_back(args[3 + d->slots.size() + k]);
  u.inplace = inplace;
  std::vector<int64_t> versions;  // the functional op never writes (nor aliases) its inputs
  if (!inplace) {
    u.inputs.push_back(u.param);
    u.inputs.insert(u.inputs.end(), u.state.begin(), u.state.end());
    for (const at::Tensor& t : u.inputs) versions.push_back(t.is_inference() ? 0 : t._version());
  }
  if (const int64_t block = block_elements(u)) {
    run_blocked(u, block);
  } else {
    d->kernel(u);
  }
  torch::jit::drop(*stack, num_args);
  if (inplace) return;
  for (size_t k = 0; k < u.inputs.size(); ++k)
    TORCH_INTERNAL_ASSERT(u.inputs[k].is_inference() || u.inputs[k]._version() == versions[k], d->kind,
                          "_update wrote its input #", k, " in place: its kernel must write through Update::write");
  // Results the kernel did not write (a buffer this configuration leaves alone) are still inputs.
  if (u.param.is_same(u.inputs[0])) u.param = fresh_like(u.param).copy_(u.param);
  for (size_t k = 0; k < u.state.size(); ++k)
    if (u.state[k].is_same(u.inputs[k + 1])) u.state[k] = fresh_like(u.state[k]).copy_(u.state[k]);
  torch::jit::push(*stack, std::move(u.param));
  for (at::Tensor& s : u.state) torch::jit::push(*stack, std::move(s));
}

struct UpdateKernel final : c10::OperatorKernel {
  UpdateKernel(const Descriptor* d, bool inplace) : d(d), inplace(inplace) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) const {
    run_update(d, inplace, stack);
  }
  const Descriptor* d;
  bool inplace;
};

}  // namespace

namespace {
thread_local ResultAllocator* current_result_allocator = nullptr;
}  // namespace

ResultAllocatorGuard::ResultAllocatorGuard(ResultAllocator* a) : previous_(current_result_allocator) {
  current_result_allocator = a;
}

ResultAllocatorGuard::~ResultAllocatorGuard() { current_result_allocator = previous_; }

at::Tensor fresh_like(const at::Tensor& t) {
  return current_result_allocator != nullptr ? current_result_allocator->empty_like(t) : at::empty_like(t);
}

bool Update::fresh(const at::Tensor& t) const {
  return std::none_of(inputs.begin(), inputs.end(), [&](const at::Tensor& in) { return in.is_same(t); });
}

at::Tensor Update::destination(const at::Tensor& t) const {
  for (const auto& [input, result] : destinations)
    if (input.is_same(t)) return result;
  return fresh_like(t);
}

at::Tensor number(double v) { return at::native::wrapped_scalar_tensor(v); }

at::Tensor& Update::slot(const std::string& name) {
  for (size_t k = 0; k < desc->slots.size(); ++k)
    if (desc->slots[k].name == name) return state[k];
  TORCH_INTERNAL_ASSERT(false, desc->kind, ": no slot '", name, "'");
}

double Update::f(const std::string& name) const {
  const c10::IValue& v = scalars[index_of(*desc, name, ScalarType::Float)];
  // A scheduled scalar: a float64 tensor holding the Python float eager reads, so the same double.
  return v.isTensor() ? scalar_of(v.toTensor(), name.c_str()) : v.toDouble();
}
int64_t Update::i(const std::string& name) const { return scalars[index_of(*desc, name, ScalarType::Int)].toInt(); }
bool Update::b(const std::string& name) const { return scalars[index_of(*desc, name, ScalarType::Bool)].toBool(); }

at::Tensor Update::descent_grad() const { return b("maximize") ? at::neg(grad) : grad; }

at::Tensor& Update::count_step() {
  return write(slot("step"), [](at::Tensor& out, const at::Tensor& in) { at::add_out(out, in, number(1)); });
}

at::Tensor Update::weight_decayed(at::Tensor g, bool decoupled) {
  const double weight_decay = f("weight_decay");
  if (weight_decay == 0) return g;
  if (!decoupled) return g.add(param, weight_decay);
  write(param, [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(1 - lr * weight_decay)); });
  return g;
}

void Update::update_moments(const at::Tensor& grad, double beta1, double beta2) {
  write(slot("exp_avg"), [&](at::Tensor& out, const at::Tensor& in) { at::lerp_out(out, in, grad, 1 - beta1); });
  write(slot("exp_avg_sq"), [&](at::Tensor& out, const at::Tensor& in) { at::mul_out(out, in, number(beta2)); })
      .addcmul_(grad, grad, 1 - beta2);
}

bool Descriptor::has_schedulable() const {
  return std::any_of(scalars.begin(), scalars.end(), [](const Scalar& x) { return x.schedulable; });
}

std::vector<std::string> Descriptor::schedulable() const {
  std::vector<std::string> out;
  for (const Scalar& x : scalars)
    if (x.schedulable) out.push_back(x.name);
  return out;
}

namespace {
// The dispatch keys of every update op's kernel. CompositeExplicitAutograd would claim every backend
// (XLA, MPS, XPU, ...) where no run has checked the kernels' ATen calls and .item() reads; the Meta
// kernels are the fake kernels torch_ext/_fake.py registers.
constexpr c10::DispatchKey kUpdateKernelKeys[] = {c10::DispatchKey::CPU, c10::DispatchKey::CUDA};

std::string qualified(const std::string& op, bool scheduled) {
  return scheduled ? op + "." + kScheduledOverload : op;
}
}  // namespace

std::string Descriptor::schema(bool scheduled) const {
  std::string returns = "Tensor";
  if (!slots.empty()) {
    returns = "(Tensor";
    for (size_t k = 0; k < slots.size(); ++k) returns += ", Tensor";
    returns += ")";
  }
  return qualified(op_name(), scheduled) + arguments(*this, false, scheduled) + " -> " + returns;
}

std::string Descriptor::inplace_schema(bool scheduled) const {
  return qualified(inplace_op_name(), scheduled) + arguments(*this, true, scheduled) + " -> ()";
}

void define(torch::Library& m, Descriptor d) {
  const Descriptor& stored = detail::add(std::move(d));
  for (const bool scheduled : {false, true}) {
    if (scheduled && !stored.has_schedulable()) continue;
    m.def(stored.schema(scheduled).c_str());
    m.def(stored.inplace_schema(scheduled).c_str());
    for (const bool inplace : {false, true}) {
      const std::string name = qualified(inplace ? stored.inplace_op_name() : stored.op_name(), scheduled);
      for (const c10::DispatchKey key : kUpdateKernelKeys)
        m.impl(name.c_str(), torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(
                                                      std::make_unique<UpdateKernel>(&stored, inplace))));
    }
  }
}

}  // namespace torch_ext::optim
