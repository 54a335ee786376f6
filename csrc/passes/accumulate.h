// accumulate: gradient accumulation over N micro-batches inside one joint graph.
//
// Requires: the joint forward/backward graph (verified) and its spec; the backward is seeded by a
// single aten::ones_like(loss). No auxiliary outputs.
// Guarantees: a new graph with the joint's output layout, computing what the eager loop
//   for mb in micro_batches: (loss_fn(model, *mb) / N).backward()
// computes: the forward/backward is copied N times, each copy reading its own user inputs
// (micro-batch k's inputs follow micro-batch k-1's) and the buffers the previous copy wrote; its
// backward seed is ones / N, as DivBackward gives; gradients are summed in micro-batch order, as
// AccumulateGrad does. The loss output becomes the N unscaled micro-batch losses, stacked;
// buffer-mutation outputs are the last copy's. The input graph is not changed.
// A gradient listed in spec.grad_events with E events is the left-nested sum of E values made by
// aten::add.Tensor nodes named "reentrant_grad_fold*" (torch_ext/_reentrant_grads.py: a parameter read
// inside a reentrant checkpoint and elsewhere, whose block gradient eager's inner backward adds into
// .grad on its own): each micro-batch's E values are added to the sum one at a time, in that order.
#pragma once

#include "ir/graph.h"
#include "passes/train_step_spec.h"

#include <memory>

namespace torch_ext::passes {

std::unique_ptr<ir::Graph> accumulate(const ir::Graph& joint, const TrainStepSpec& spec, int64_t micro_batches);

}  // namespace torch_ext::passes
