// Stable text form of the IR.
//
//   graph:
//     %x : f32[8,16] = input()
//     %fc_weight : f32[4,16] = param("fc.weight")
//     %linear : f32[8,4] = aten::linear.default(%x, %fc_weight)  # fc
//     %topk : (f32[8,2], i64[8,2]) = aten::topk.default(%linear, 2, dim=-1)
//     %getitem : f32[8,2] = getitem(%topk, 0)
//     return (%getitem)
//
// Types: dtype abbreviation and sizes; strides follow in braces only when not
// contiguous ({1,8}); a non-CPU device follows '@' (@cuda:0). Tuples print as
// (t1, t2); scalars as int, float, bool, none. A call that owns regions is
// followed by one brace-delimited nested graph per region. Floats print in the
// shortest form that reads back to the same double, so print(parse(t)) == t.
#pragma once

#include "ir/graph.h"

#include <optional>
#include <string>

namespace torch_ext::ir {

std::string print(const Graph& graph);
std::string print_type(const Type& type);
std::string print_arg(const Arg& arg);

// dtype spellings shared by the printer and the parser.
std::string dtype_short_name(c10::ScalarType t);                        // f32
std::optional<c10::ScalarType> dtype_from_short_name(const std::string& s);
std::string dtype_torch_name(c10::ScalarType t);                        // torch.float32
std::optional<c10::ScalarType> dtype_from_torch_name(const std::string& s);
std::string format_double(double v);  // shortest round-trip form, always with '.', 'e', inf or nan

}  // namespace torch_ext::ir
