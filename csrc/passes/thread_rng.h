// thread_rng: makes a step's randomness explicit state, like a JAX PRNG key.
//
// Requires: a verified graph. Its random ops are aten::native_dropout.default calls (dropout, as
// export traces it), aten::randn_like / rand_like calls whose result has their input's dtype, shape and
// device (a VAE's reparameterisation noise), aten::bernoulli.p (in-place dropout, stochastic depth)
// and the CPU factories aten::randn / rand / randint (a diffusion step's noise and timesteps); any
// other op that draws from a generator is refused, naming the node, and the graph is left unchanged.
// Guarantees: when the graph draws nothing it is unchanged and nullptr is returned. Otherwise a
// uint8 placeholder with state name `state_name` (role buffer, the layout of torch.get_rng_state())
// is added, every native_dropout becomes torch_ext::native_dropout_rng and every other one its
// torch_ext::<op>_rng form (ops/random.h), in graph order, each reading the state the previous one
// returned, and the final state node is returned. The same input state then gives the
// same draws as eager after torch.set_rng_state(state), in order.
#pragma once

#include "ir/graph.h"

#include <string>

namespace torch_ext::passes {

ir::Node* thread_rng(ir::Graph& g, const std::string& state_name = "rng");

}  // namespace torch_ext::passes
