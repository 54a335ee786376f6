// PassManager: runs a declared list of passes (pass.h) on a graph, MLIR-style.
//
// Requires: a verified graph.
// Guarantees: the enabled passes run in list order. After every pass that changed the graph, the
// verifier runs; a failure throws c10::Error "graph invalid after pass <name>: <errors>". With
// print_after_all (default: the environment variable TORCH_EXT_PRINT_AFTER_ALL=1), the IR after
// each pass that ran is written to the stream, headed "// ----- IR after <name> ----- //"; when
// off, nothing is printed or formatted.
#pragma once

#include "ir/graph.h"
#include "passes/pass.h"

#include <iosfwd>
#include <memory>
#include <vector>

namespace torch_ext::passes {

struct PassManagerOptions {
  bool verify_each = true;
  bool print_after_all = false;
  std::ostream* print_to = nullptr;  // nullptr: std::cerr

  // verify_each on; print_after_all when TORCH_EXT_PRINT_AFTER_ALL is set and not "0".
  static PassManagerOptions from_env();
};

class PassManager {
 public:
  explicit PassManager(std::vector<Pass> passes, PassManagerOptions options = PassManagerOptions::from_env());

  // Runs the pipeline on `graph`, which a pass may replace; returns the final graph.
  std::unique_ptr<ir::Graph> run(std::unique_ptr<ir::Graph> graph, PassContext& ctx) const;

  const std::vector<Pass>& passes() const { return passes_; }

 private:
  std::vector<Pass> passes_;
  PassManagerOptions options_;
};

}  // namespace torch_ext::passes
