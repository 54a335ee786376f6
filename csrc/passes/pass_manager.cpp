#include "passes/pass_manager.h"

#include "ir/printer.h"
#include "ir/verifier.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <iostream>

namespace torch_ext::passes {

PassManagerOptions PassManagerOptions::from_env() {
  PassManagerOptions o;
  // Read per manager, not once per process, so a test can switch it on; one getenv per pipeline.
  const char* env = std::getenv("TORCH_EXT_PRINT_AFTER_ALL");
  o.print_after_all = env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
  return o;
}

PassManager::PassManager(std::vector<Pass> passes, PassManagerOptions options)
    : passes_(std::move(passes)), options_(options) {
  for (const Pass& p : passes_) TORCH_INTERNAL_ASSERT(p.name != nullptr && p.run != nullptr);
}

std::unique_ptr<ir::Graph> PassManager::run(std::unique_ptr<ir::Graph> graph, PassContext& ctx) const {
  TORCH_INTERNAL_ASSERT(graph != nullptr);
  for (const Pass& pass : passes_) {
    if (pass.enabled != nullptr && !pass.enabled(ctx)) continue;
    PassResult result = pass.run(*graph, ctx);
    if (result.replacement != nullptr) graph = std::move(result.replacement);
    // An unchanged graph is the one verified before.
    if (options_.verify_each && result.modified) {
      try {
        ir::verify(*graph);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "graph invalid after pass ", pass.name, ": ", e.what_without_backtrace());
      }
    }
    if (options_.print_after_all) {
      std::ostream& os = options_.print_to != nullptr ? *options_.print_to : std::cerr;
      os << "// ----- IR after " << pass.name << " ----- //\n" << ir::print(*graph) << std::flush;
    }
  }
  return graph;
}

}  // namespace torch_ext::passes
