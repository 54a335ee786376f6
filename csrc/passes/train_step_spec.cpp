#include "passes/train_step_spec.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {

std::vector<std::string> state_slots(const std::string& kind) {
  if (kind == "sgd") return {};
  if (kind == "sgd_momentum") return {"momentum_buffer", "step"};
  if (kind == "adam") return {"exp_avg", "exp_avg_sq", "step"};
  if (kind == "adam_amsgrad") return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"};
  if (kind == "muon") return {"momentum_buffer"};
  if (kind == "rmsprop") return {"square_avg", "grad_avg", "momentum_buffer", "step"};
  if (kind == "adagrad") return {"sum", "step"};
  TORCH_CHECK(false, "unknown update kind '", kind,
              "' (expected sgd, sgd_momentum, adam, adam_amsgrad, muon, rmsprop or adagrad)");
}

std::string state_name(const std::string& param, const std::string& slot) { return "opt:" + param + ":" + slot; }

std::string lr_name(int64_t group) { return "opt:lr:group" + std::to_string(group); }

}  // namespace torch_ext::passes
