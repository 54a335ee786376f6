// Test operators whose out= kernels misuse their `out` (registered once for the whole test binary; used by
// test_lower_out_variants.cpp and test_reactive.cpp). Each computes sum(x * x):
//   * torch_ext_test::sq_sum_resizing.out uses `out` as scratch of x's shape first (as torch 2.9's CPU
//     mse_loss.out does): on a planned view, which cannot grow, it throws "Trying to resize storage that is not
//     resizable";
//   * torch_ext_test::sq_sum_repointing.out points `out` at a fresh tensor (set_): no error, but the planned
//     view no longer views the planned memory.
// Neither is in ir::out_variant.cpp's name list, so find_out_variant offers their out= overloads, until a runtime
// marks them unusable (ir::mark_out_kernel_unusable, process-wide): so each is registered twice, `arena_` for
// test_lower_out_variants.cpp and `scratch_` for test_reactive.cpp, and neither test depends on the other's order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

namespace {

at::Tensor sq_sum(const at::Tensor& x) { return (x * x).sum(); }

at::Tensor& sq_sum_resizing_out(const at::Tensor& x, at::Tensor& out) {
  out.resize_(x.sizes());
  at::mul_out(out, x, x);
  const at::Tensor s = out.sum();
  out.resize_({});
  out.copy_(s);
  return out;
}

at::Tensor& sq_sum_repointing_out(const at::Tensor& x, at::Tensor& out) {
  out.set_(sq_sum(x));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext_test, m) {
  for (const char* use : {"arena_", "scratch_"})
    for (const char* kind : {"resizing", "repointing"}) {
      const std::string name = std::string(use) + "sq_sum_" + kind;
      m.def((name + "(Tensor x) -> Tensor").c_str());
      m.def((name + ".out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)").c_str());
      m.impl(name.c_str(), c10::DispatchKey::CPU, TORCH_FN(sq_sum));
      if (std::string(kind) == "resizing")
        m.impl((name + ".out").c_str(), c10::DispatchKey::CPU, TORCH_FN(sq_sum_resizing_out));
      else
        m.impl((name + ".out").c_str(), c10::DispatchKey::CPU, TORCH_FN(sq_sum_repointing_out));
    }
}
