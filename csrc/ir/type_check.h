// Type checks of call nodes against their operator schemas, used by the verifier.
//
// Two levels, both per node and independent of other nodes (each input is taken at its
// declared type, and every node's declared type is itself checked, so the whole graph is
// consistent once every node passes):
//
//  1. Arguments. Every given argument fits its formal's schema type: a graph value of type
//     Tensor for Tensor, int for int/SymInt, a list (of fitting elements) for T[], and so
//     on; constants convert exactly as the runtimes will convert them (constant_to_ivalue).
//  2. Results. The operator runs once on meta tensors built from the inputs' declared types
//     (shape and dtype inference through its Meta kernel; torch_ext ops get theirs from the
//     fake kernels registered in torch_ext/_fake.py), and the node's declared type must equal
//     what it produces: dtype, sizes and, where they matter (dims of size > 1 in a non-empty
//     tensor), strides (the arena executor and the reactive scratch path lay out= buffers out by
//     them). Strides are not compared for an operator that only has a CompositeImplicitAutograd
//     kernel: its decomposition depends on the device (scaled_dot_product_attention takes the math
//     path on meta, a fused kernel with another layout on CPU). An operator that refuses the meta
//     inputs is reported, so a verified graph never hands a kernel arguments its declared types rule out.
//
// Inference is skipped, documented by this rule, when it cannot be done soundly:
//   * the operator has no Meta kernel in this process, so the dispatcher's Meta fallback raises
//     NotImplementedError (aten ops whose meta kernels are Python registrations, and torch_ext ops, in a C++-only
//     process, where the Python fake kernels are not registered);
//   * its output shape or value depends on data (tags dynamic_output_shape,
//     data_dependent_output: nonzero, item, ...);
//   * an input is a scalar graph value (int, float, bool), whose value is unknown before run.
// One limit keeps inference cheap: an operator returning a list (split, unbind, ...) whose
// inputs allow more than max(65536, declared length) results is refused, naming the limit.
// Results are cached process-wide by operator, constants and types, so graphs that repeat
// layers, and graphs verified again by each runtime, pay once per distinct node signature.
// Devices are not inferred by the meta run: every Device argument is replaced by meta (so no real
// memory is ever allocated at verify time). Instead the declared device of the result (a tuple's
// first element) must be the one the call puts it on: its Device argument when the schema has one
// (a factory with none given makes CPU tensors), else its first tensor input that is not a 0-d CPU
// tensor (those mix with any device), else its first tensor input. This check runs at level 1.
#pragma once

#include "ir/graph.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <string>
#include <vector>

namespace torch_ext::ir {

// Converts a constant (node-free) argument to the IValue of schema type `formal`, as every
// runtime binds it. Throws c10::Error prefixed with `where` when the constant does not fit.
c10::IValue constant_to_ivalue(const Arg& a, const c10::TypePtr& formal, const std::string& where);

// The same for a schema argument, which also knows the argument's real type: an int given for a
// ScalarType, Layout or MemoryFormat must name a value of that enum (ATen reads an out-of-range
// one out of bounds instead of refusing it).
c10::IValue constant_to_ivalue(const Arg& a, const c10::Argument& formal, const std::string& where);

// Checks `node` (a call of `op` whose arity already fits the schema) as described above;
// appends one message per problem, each starting with `where`. `infer_results` false: level 1 only.
void check_call_types(const Node& node, const c10::OperatorHandle& op, const std::string& where,
                      std::vector<std::string>& errors, bool infer_results = true);

// The operators whose CPU kernels lay their first result (the output, the input's gradient) out otherwise than
// their meta kernels, which keep the input's layout: batch norm's follow the input's suggested memory format
// (aten/src/ATen/native/Normalization.cpp: empty_like(input, input.suggest_memory_format())); layer norm's
// (layer_norm.cpp), mse_loss_backward's, huber_loss_backward's and _log_softmax_backward_data's are contiguous
// whatever the input's layout. A transposed input comes out contiguous on the CPU. native_dropout_backward's and
// the backward of softplus, elu, hardswish, hardsigmoid, hardtanh and logit lay theirs out as TensorIterator lays out
// an elementwise op over the two tensor arguments (the gradient's layout where they disagree), where the meta
// kernels return it contiguous or in `self`'s layout. The one table of them: tracing
// records these overloads in the CPU kernels' layout (torch_ext/_compat.py, eager_batch_norm_layouts, reads it
// through _C.cpu_layout_ops), and the type checker infers that layout for every overload of these names on the CPU.
enum class CpuLayout {
  SuggestedFormat,  // the input's suggested memory format (batch norm)
  Contiguous,       // contiguous whatever the input's layout
  Elementwise,      // TensorIterator's layout over the two tensor arguments
};
struct CpuLayoutOp {
  const char* name;      // an aten operator
  const char* overload;  // "default" for the default overload
  int input;             // the position of the input whose shape the first result has
  CpuLayout layout;
};
const std::vector<CpuLayoutOp>& cpu_layout_ops();
// A meta tensor of `m`'s sizes, strides and dtype: what the checks and the passes run meta kernels on.
at::Tensor meta_tensor(const TensorMeta& m);
// The cpu_layout_ops() entry of an aten operator, by name (any overload: the out= variants too), or null.
const CpuLayoutOp* cpu_layout_op(const Target& target);
// The strides TensorIterator gives an elementwise op over the tensors `a` and `b` (TensorIterator's own rule: the
// result of at::mul on meta tensors of their sizes and strides), or nullopt where they do not broadcast. The one
// copy of the rule: the type checker's Elementwise entries, and torch_ext/_compat.py's trace patch through
// _C.elementwise_strides.
std::optional<std::vector<int64_t>> elementwise_strides(const at::Tensor& a, const at::Tensor& b);
// The strides the CPU kernel of `op` gives its first result, of sizes `result_sizes`, for the arguments `args` (the
// operator's argument stack before the call; meta tensors do), or nullopt where the entry does not apply (the
// result's sizes are not those of the input it follows, an Elementwise entry without exactly two tensors).
std::optional<std::vector<int64_t>> cpu_result_strides(const CpuLayoutOp& op, const std::vector<c10::IValue>& args,
                                                       c10::IntArrayRef result_sizes);

// A reason why `type` cannot be the type of a value (negative size, rank mismatch between
// sizes and strides, element count or byte size overflowing int64), or empty when it can.
std::string invalid_type_reason(const Type& type);
// print_type(type), or a placeholder for a type without a text form (errors must not throw).
std::string print_type_safe(const Type& type);

}  // namespace torch_ext::ir
