// Reads the text form written by printer.h back into a Graph.
//
// Errors are c10::Error with "line L, column C: <what was expected>" and leave
// nothing behind (the partially built graph is discarded).
#pragma once

#include "ir/graph.h"

#include <memory>
#include <string>

namespace torch_ext::ir {

std::unique_ptr<Graph> parse(const std::string& text);

}  // namespace torch_ext::ir
