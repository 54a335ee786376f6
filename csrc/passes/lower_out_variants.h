// Pass: out= and in-place lowering of a planned pure step, for runtime::ArenaExecutor.
//
// Requires: `plan` is plan_memory(graph, donate) of this very graph (its node pointers).
// Guarantees: only call targets change, by schema (ir/out_variant.h), never by name:
//   * a node whose every result is an arena buffer of `plan` calls its out= overload
//     (ir::find_out_variant). Its out arguments are left out of the node: the runtime binds them
//     to the buffers' arena views. `%y : f32[4] = aten::mul.out(%a, %b)`
//   * a torch_ext::*_update node whose in-place alias `plan` applied calls its in-place variant
//     (ir::find_inplace_variant), which overwrites the state inputs its results replace; the
//     node's value is those inputs. `%u : f32[4] = torch_ext::sgd_update_.default(%w, ...)`
//   * every other node is unchanged (its kernel allocates its result).
// Types, args, names, order and uses are unchanged, so the plan stays valid for the result.
// The result is a runtime graph: out= nodes miss their out arguments and in-place nodes mutate,
// so the pure-graph verifier no longer applies. A node the plan puts in the arena with no out=
// overload, or an applied alias with no in-place variant, is refused naming the node, the graph
// untouched.
#pragma once

#include "ir/graph.h"
#include "ir/memory_plan.h"

#include <cstdint>

namespace torch_ext::passes {

struct LoweringResult {
  int64_t out_variants = 0;  // nodes now writing into the arena
  int64_t inplace = 0;       // updates now overwriting their state inputs
};

LoweringResult lower_out_variants(ir::Graph& graph, const ir::MemoryPlan& plan);

}  // namespace torch_ext::passes
