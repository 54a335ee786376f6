// Reading a call's arguments by position or keyword, for passes that inspect op arguments.
#pragma once

#include "ir/graph.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace torch_ext::ir {

// The argument at `pos`, or the keyword `name`; null when absent.
inline const Arg* arg_at(const Node& n, size_t pos, const char* name) {
  if (pos < n.args().size()) return &n.args()[pos];
  return n.kwarg(name);
}

// The ints of argument `pos`/`name` (one int, or a list of ints); nullopt when absent or of
// another kind.
inline std::optional<std::vector<int64_t>> ints_arg(const Node& n, size_t pos, const char* name) {
  const Arg* a = arg_at(n, pos, name);
  if (a == nullptr) return std::nullopt;
  if (a->kind == Arg::Kind::Int) return std::vector<int64_t>{a->i};
  if (a->kind != Arg::Kind::List) return std::nullopt;
  std::vector<int64_t> out;
  for (const Arg& e : a->list) {
    if (e.kind != Arg::Kind::Int) return std::nullopt;
    out.push_back(e.i);
  }
  return out;
}

// The ints of argument `pos`/`name` as ints_arg reads them; `dflt` when absent or None.
inline std::optional<std::vector<int64_t>> ints_arg_or(const Node& n, size_t pos, const char* name,
                                                       std::optional<std::vector<int64_t>> dflt) {
  const Arg* a = arg_at(n, pos, name);
  if (a == nullptr || a->kind == Arg::Kind::None) return dflt;
  return ints_arg(n, pos, name);
}

}  // namespace torch_ext::ir
