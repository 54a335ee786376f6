// An optimizer is one Descriptor: its state slots, its scalar hyperparameters, its two ops and
// its kernel (CPU and CUDA). Everything that depends on the optimizer kind reads the registry below: the
// torch_ext op schemas and kernels (define), the passes that lift state and append the update
// (lift_optimizer_state, append_update, shard_optimizer_state), ir::is_update_op, and, through
// torch_ext._C.optimizer_descriptors(), the fake kernels and the torch.optim mapping in Python.
//
// Adding an optimizer is one file here, <name>.cpp, holding its kernel and
//   TORCH_LIBRARY_FRAGMENT(torch_ext, m) { optim::define(m, Descriptor{...}); }
// (the only static registration is the torch library's own), plus one Python file in
// torch_ext/optim/ that maps a torch.optim class to the kind.
//
// The ops of kind K:
//   K_update (Tensor param, Tensor grad, Tensor <slot>..., Tensor lr, <scalar>...) -> (param', <slot>'...)
//     functional: fresh outputs, never aliasing an input (a lone Tensor when there are no slots);
//   K_update_(Tensor(a!) param, Tensor grad, Tensor(b!) <slot>..., Tensor lr, <scalar>...) -> ()
//     the same update in place, for eager scripts and the planned arena (donate=True).
// `lr` is a 1-element tensor so a schedule changes it without rebuilding the program.
//
// A kind with schedulable scalars (momentum, beta1: those torch's schedulers change with
// cycle_momentum=True) also has the overload "scheduled" of both ops, K_update.scheduled and
// K_update_.scheduled, where each schedulable scalar is a 1-element float64 tensor, as lr is. The
// kernel is the same: Update::f reads the double either way.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch {
class Library;
}

namespace torch_ext::optim {

struct Descriptor;

// How a state slot starts when torch.optim has not created it yet.
enum class SlotInit {
  Zeros,        // zeros shaped like the parameter
  StepCounter,  // an f32[] count of applied steps, starting at 0; kept whole when state is sharded
  ScalarOne,    // an f32[] per-parameter scalar starting at 1 (NAdam's mu_product); kept whole, like the step
  Factored,     // zeros shaped like the parameter with one of its last two dims (Slot::factored_dim) reduced
                // to 1: Adafactor's row_var and col_var. Needs a parameter of 2 or more dims; never blocked
                // or sharded (a kind with such a slot is not elementwise).
};

struct Slot {
  std::string name;  // the schema argument name and the last part of the state name
  SlotInit init = SlotInit::Zeros;
  int64_t factored_dim = 0;  // Factored: the dim (-1 or -2) that has size 1 in the slot
  bool is_step() const { return init == SlotInit::StepCounter; }
  // An f32[] per parameter rather than a tensor like it: whole in blocked updates and sharded state.
  bool is_scalar() const { return init == SlotInit::StepCounter || init == SlotInit::ScalarOne; }
  bool is_factored() const { return init == SlotInit::Factored; }
  // The slot's shape for a parameter of shape `param`: the parameter's (Zeros), [] (a scalar slot), or
  // the parameter's with factored_dim set to 1 (Factored; TORCH_CHECKs that the parameter has 2 or
  // more dims, naming the slot and the shape).
  std::vector<int64_t> shape(c10::IntArrayRef param) const;
};

enum class ScalarType { Float, Int, Bool };

// A hyperparameter passed as a constant argument. Its value is ParamUpdate::flags[name] for Bool,
// else ParamUpdate::hyper[name] (Int: the double converted to int64).
struct Scalar {
  std::string name;  // the schema argument name and the ParamUpdate key
  ScalarType type = ScalarType::Float;
  // A Float that a scheduler may change per step: a Tensor argument in the "scheduled" overload.
  bool schedulable = false;
};

// The overload name of the ops whose schedulable scalars are tensors.
constexpr const char* kScheduledOverload = "scheduled";

// Where the functional op's fresh results come from: at::empty_like, unless a runtime installs a
// ResultAllocator on the calling thread for the duration of a run (runtime::Executor does, to
// recycle the memory of the state it returned once the caller drops it; csrc/runtime/result_pool.h).
class ResultAllocator {
 public:
  virtual ~ResultAllocator() = default;
  // A tensor shaped, strided and typed like `t`, on its device; contents undefined.
  virtual at::Tensor empty_like(const at::Tensor& t) = 0;
};

// Installs `a` (nullptr: none) on this thread while alive, then puts back the one before.
class ResultAllocatorGuard {
 public:
  explicit ResultAllocatorGuard(ResultAllocator* a);
  ~ResultAllocatorGuard();
  ResultAllocatorGuard(const ResultAllocatorGuard&) = delete;
  ResultAllocatorGuard& operator=(const ResultAllocatorGuard&) = delete;

 private:
  ResultAllocator* previous_;
};

// A fresh result like `t`: from this thread's ResultAllocator, else at::empty_like(t).
at::Tensor fresh_like(const at::Tensor& t);

// One update call's values, checked against the schema. The kernel computes the new `param` and
// `state` and leaves them there.
//
// Writes: a kernel's first write into param or a slot goes through write(t, op), every later one
// may be an in-place op on t. In the in-place op (K_update_) t is the caller's tensor and is
// updated in place; in the functional op (K_update) the first write goes to a fresh tensor, so the
// inputs are never written and never copied (one pass over each state tensor less than clone()
// followed by the in-place update, with the same kernels on the same values: bit-identical).
struct Update {
  const Descriptor* desc = nullptr;
  bool inplace = true;  // false in the functional op
  at::Tensor param;
  at::Tensor grad;
  std::vector<at::Tensor> state;  // in Descriptor::slots order
  double lr = 0;
  std::vector<c10::IValue> scalars;  // in Descriptor::scalars order (a schedulable one may be a tensor)

  at::Tensor& slot(const std::string& name);
  double f(const std::string& name) const;
  int64_t i(const std::string& name) const;
  bool b(const std::string& name) const;

  // The opening lines every torch.optim single-tensor update shares, one place for all kernels:
  // The gradient to descend: -grad when the kind's "maximize" flag is set, else grad itself.
  at::Tensor descent_grad() const;
  // Counts this update in the "step" slot (torch.optim: step_t += 1); returns the slot.
  at::Tensor& count_step();
  // torch.optim's weight decay by the "weight_decay" scalar, none when it is 0: L2 returns
  // g + weight_decay * param; `decoupled` (AdamW's form) instead writes param *= 1 - lr * weight_decay
  // and returns g as it is.
  at::Tensor weight_decayed(at::Tensor g, bool decoupled = false);
  // The Adam family's moments from `grad` (Adam, NAdam, RAdam): exp_avg.lerp_(grad, 1 - beta1), then
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2), each slot written through write().
  void update_moments(const at::Tensor& grad, double beta1, double beta2);

  // Writes `t` (param or one of state) by op(out, in): an out= call that reads `in` and writes
  // `out` (e.g. at::lerp_out(out, in, grad, w)); afterwards t names the result. In the in-place
  // op, and once t has been written, out and in are both t (op(t, t) is the in-place op); in the
  // functional op's first write, out is a fresh tensor like t (fresh_like) and in the input.
  template <class Op>
  at::Tensor& write(at::Tensor& t, Op&& op) {
    if (inplace || fresh(t)) {
      op(t, t);
      return t;
    }
    at::Tensor out = destination(t);
    op(out, static_cast<const at::Tensor&>(t));
    t = std::move(out);
    return t;
  }

  // The functional op's inputs (param, then state), to tell them from results. Set by the caller.
  std::vector<at::Tensor> inputs;
  // (input, result) pairs: where the functional op's first write of that input goes instead of a
  // fresh tensor. A blocked update (define.cpp) points each block's slices into whole results.
  std::vector<std::pair<at::Tensor, at::Tensor>> destinations;

 private:
  bool fresh(const at::Tensor& t) const;
  at::Tensor destination(const at::Tensor& t) const;  // its entry in destinations, else fresh_like(t)
};

// A Python-number operand for out= calls (at::mul_out(out, in, number(beta2))): a wrapped 0-dim
// CPU tensor, as the Scalar overloads (mul_.Scalar, add_.Scalar) make, so types promote alike.
at::Tensor number(double v);

using Kernel = void (*)(Update& update);

struct Descriptor {
  std::string kind;   // ParamUpdate::kind, e.g. "adam_amsgrad"
  std::string title;  // the optimizer's name in messages, e.g. "Adam"
  std::vector<Slot> slots;      // in op-argument order
  std::vector<Scalar> scalars;  // in op-argument order, after lr
  Kernel kernel = nullptr;      // ATen calls on the tensors' own device
  // Each element's update reads only that element of param, grad and state (so ZeRO-1 may
  // update a flat shard). False for Muon, whose Newton-Schulz step needs the whole matrix.
  bool elementwise = true;
  // Whether an elementwise kernel runs large tensors block by block (define.cpp), so that its passes
  // over each block stay in cache. Pays where the kernel makes many passes (Adam, RMSprop: up to
  // 2-3.4x on tensors past the cache); SGD's and Adagrad's few passes gain less than the per-block
  // cost (0.8-0.93x, measured by scripts/bench_optim_update.py), so they run whole.
  bool blocked = true;

  std::string op_name() const { return kind + "_update"; }
  std::string inplace_op_name() const { return kind + "_update_"; }
  // `scheduled`: the "scheduled" overload's schema (schedulable scalars as Tensor).
  std::string schema(bool scheduled = false) const;
  std::string inplace_schema(bool scheduled = false) const;
  bool has_schedulable() const;
  std::vector<std::string> schedulable() const;  // the schedulable scalars' names, in order
};

// Registers `d` and defines its two ops with their kernels (CPU and CUDA) in `m` (a torch_ext library
// fragment). TORCH_CHECKs that the kind is new.
void define(torch::Library& m, Descriptor d);
// Adam's scalars, in its ops' argument order (beta1 schedulable, beta2, eps, weight_decay, decoupled,
// maximize): shared by the kinds whose ops take exactly these (adam, adam_amsgrad, radam).
std::vector<Scalar> adam_scalars();

namespace detail {
// Adds `d` to the registry (define's first step); TORCH_CHECKs that the kind is new.
const Descriptor& add(Descriptor d);
}  // namespace detail

// Every registered descriptor, sorted by kind.
std::vector<const Descriptor*> all();
const Descriptor* find(const std::string& kind);
// TORCH_CHECKs that `kind` is registered, naming the known kinds.
const Descriptor& get(const std::string& kind);
// The descriptor whose functional op is torch_ext::`op_name` (in-place variants are not matched).
const Descriptor* find_by_op(const std::string& op_name);

// State names of the lifted optimizer inputs: "opt:<param>:<slot>", and a param group's inputs
// "opt:lr:group<g>" and "opt:<scalar>:group<g>" (a scheduled scalar, e.g. "opt:momentum:group0").
std::string state_name(const std::string& param, const std::string& slot);
std::string group_input_name(const std::string& hyper, int64_t group);
std::string lr_name(int64_t group);  // group_input_name("lr", group)
// The inverse of state_name / group_input_name; nullopt for any other name (parameters, buffers, "rng").
struct StateName {
  std::optional<int64_t> group;  // set for a group input; param and slot are then empty
  std::string hyper;             // with group: "lr" or the scheduled scalar's name
  std::string param;
  std::string slot;
  bool is_lr() const { return group.has_value() && hyper == "lr"; }
};
std::optional<StateName> parse_state_name(const std::string& name);

}  // namespace torch_ext::optim
