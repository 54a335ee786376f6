// Whether the sweep loop (csrc/bindings.cpp, sweep_sites) may hand a cone's output to the user's metric
// as it is, without the copy every other output gets.
#pragma once

#include <ATen/ATen.h>

namespace torch_ext::reactive {

/// Whether `v`, held by the caller's one reference, is a tensor no one else can reach: its TensorImpl and
/// its StorageImpl have no other owner (the engine, the cache, a view, the user), and its memory is the
/// plain allocation of that storage (a simple data pointer: not copy-on-write memory shared with another
/// storage, not memory borrowed from numpy or a from_blob owner). No autograd history and no Python
/// subclass. A fresh output of a sweep's cone, once the cached values are put back, is such a tensor: a
/// copy of it would be indistinguishable from it but for the cost, so the metric may be handed the tensor
/// itself (a write into it, through .data or .numpy() included, reaches nothing else). Not a tensor, or
/// undefined: false.
bool sole_fresh(const c10::IValue& v);

}  // namespace torch_ext::reactive
