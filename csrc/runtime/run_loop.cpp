#include "runtime/run_loop.h"

#include <c10/util/Exception.h>

namespace torch_ext::runtime {

void rethrow_executing(const BoundKernel& kernel, const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  TORCH_CHECK(false, "while executing node %", kernel.node_name(), ": ",
              c10_error != nullptr ? c10_error->what_without_backtrace() : e.what());
}

}  // namespace torch_ext::runtime
