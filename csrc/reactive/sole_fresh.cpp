#include "reactive/sole_fresh.h"

#include <c10/core/impl/COW.h>

namespace torch_ext::reactive {

bool sole_fresh(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || t.use_count() != 1 || !t.has_storage() || t.requires_grad() ||
      t.unsafeGetTensorImpl()->is_python_dispatch())
    return false;
  const c10::Storage& storage = t.storage();
  return storage.use_count() == 1 && c10::impl::cow::has_simple_data_ptr(*storage.unsafeGetStorageImpl());
}

}  // namespace torch_ext::reactive
