#include "reactive/row_buffers.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <limits>

namespace torch_ext::reactive {

bool poolable(const at::TensorOptions& options, int64_t nbytes) {
  return nbytes >= RowBufferPool::kMinBytes && options.device().is_cpu() && options.layout() == at::kStrided;
}

at::Tensor RowBufferPool::take(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const auto dtype = c10::scalarTypeToTypeMeta(options.dtype().toScalarType());
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t need = static_cast<size_t>(numel) * dtype.itemsize();
  std::lock_guard<std::mutex> lock(mutex_);
  // The free storage handed out last that fits (the most recently used memory: likely still in cache);
  // one of twice the need or more stays for a larger value.
  size_t free_bytes = 0;
  size_t found = storages_.size();
  for (size_t i = storages_.size(); i-- > 0;) {
    const c10::Storage& s = storages_[i];
    if (s.use_count() != 1) continue;  // a tensor or view still points into it
    free_bytes += s.nbytes();
    if (s.nbytes() >= need && s.nbytes() < 2 * need + 4096) {
      found = i;
      break;
    }
  }
  c10::Storage storage;
  if (found < storages_.size()) {
    storage = storages_[found];
    std::rotate(storages_.begin() + static_cast<std::ptrdiff_t>(found), storages_.begin() + static_cast<std::ptrdiff_t>(found) + 1,
                storages_.end());  // to the back: the most recently used
    ++reused_;
  } else {
    if (free_bytes + need > static_cast<size_t>(kMaxFreeBytes))
      storages_.erase(std::remove_if(storages_.begin(), storages_.end(), [](const c10::Storage& s) { return s.use_count() == 1; }),
                      storages_.end());
    storage = c10::Storage(c10::Storage::use_byte_size_t(), need, c10::GetCPUAllocator(), /*resizable=*/false);
    storages_.push_back(storage);
    ++allocated_;
  }
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

void RowBufferPool::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  storages_.erase(std::remove_if(storages_.begin(), storages_.end(), [](const c10::Storage& s) { return s.use_count() == 1; }),
                  storages_.end());
}

}  // namespace torch_ext::reactive

// ---- The row path's use of the pool (Engine members; rows.cpp calls them) -------------------------
#include "reactive/engine.h"

#include <ATen/TensorUtils.h>

namespace torch_ext::reactive {
namespace {

// (requires_grad does not matter: the row path runs below autograd, see HeldCone.)
bool plain_cpu(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == at::kStrided && !t.is_neg() && !t.is_conj();
}

// Strides that never decrease inwards (the row-major order, some dims maybe sliced): TensorIterator
// gives an elementwise result of such inputs the contiguous layout.
bool row_major_order(const at::Tensor& t) {
  int64_t last = std::numeric_limits<int64_t>::max();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (t.stride(d) > last || t.stride(d) <= 0) return false;
    last = t.stride(d);
  }
  return true;
}

}  // namespace

at::Tensor Engine::pooled_contiguous(const at::Tensor& x, RowBufferPool* pool) {
  if (pool == nullptr || x.is_contiguous() || !plain_cpu(x) || !poolable(x.options(), x.nbytes())) return x.contiguous();
  at::Tensor out = pool->take(x.sizes(), x.options());
  out.copy_(x);  // what contiguous() does into memory of its own: the same bits
  return out;
}

at::Tensor Engine::pooled_reshape(const at::Tensor& x, at::IntArrayRef sizes, RowBufferPool* pool) {
  // reshape is a view where one exists, else _unsafe_view of a contiguous clone: the clone goes to the pool.
  if (pool == nullptr || !plain_cpu(x) || at::detail::computeStride(x.sizes(), x.strides(), sizes).has_value())
    return x.reshape(sizes);
  return pooled_contiguous(x, pool).view(sizes);
}

at::Tensor Engine::run_pooled(const RowStep& step, const ir::Node& node, RowBufferPool& pool) {
  const auto& args = node.args();
  auto tensor_arg = [&](size_t k) -> const at::Tensor* {
    if (k >= args.size() || args[k].kind != ir::Arg::Kind::Node) return nullptr;
    const c10::IValue& v = values_[ids_.at(args[k].node)];
    return v.isTensor() && plain_cpu(v.toTensor()) ? &v.toTensor() : nullptr;
  };
  const at::Tensor* x = tensor_arg(0);
  if (x == nullptr || node.type().kind != ir::Type::Kind::Tensor || x->scalar_type() != node.type().tensor.dtype)
    return {};
  switch (step.pooled) {
    case 1: {
      // aten::linear with a contiguous input and a contiguous 1-D bias is addmm(bias, x as [M, K], w.t())
      // viewed back (_flatten_nd_linear, and the 2-D fast path): the same call, into a pooled [M, N].
      const at::Tensor* w = tensor_arg(1);
      const at::Tensor* b = tensor_arg(2);
      if (w == nullptr || b == nullptr || args.size() != 3 || x->dim() < 2 || !x->is_contiguous() || w->dim() != 2 ||
          b->dim() != 1 || !b->is_contiguous() || w->scalar_type() != x->scalar_type() ||
          b->scalar_type() != x->scalar_type() || x->size(-1) != w->size(1) || b->size(0) != w->size(0))
        return {};
      const int64_t K = x->size(-1);
      const int64_t N = w->size(0);
      const int64_t M = K == 0 ? 0 : x->numel() / K;
      if (M == 0 || !poolable(x->options(), M * N * x->element_size())) return {};
      at::Tensor out = pool.take({M, N}, x->options());
      at::addmm_out(out, *b, x->view({M, K}), w->t());
      std::vector<int64_t> sizes(x->sizes().begin(), x->sizes().end() - 1);
      sizes.push_back(N);
      return out.view(sizes);
    }
    case 2: {  // gelu(x, approximate): of a contiguous x, the result is contiguous
      const ir::Arg* a = args.size() > 1 ? &args[1] : node.kwarg("approximate");
      if (args.size() > 2 || !x->is_contiguous() || x->numel() == 0 || (a != nullptr && a->kind != ir::Arg::Kind::String) ||
          !poolable(x->options(), x->nbytes()))
        return {};
      at::Tensor out = pool.take(x->sizes(), x->options());
      at::gelu_out(out, *x, a != nullptr ? a->s : "none");
      return out;
    }
    case 3: {  // add(a, b) of two tensors of the same sizes and dtype, both in row-major order, alpha 1
      const at::Tensor* y = tensor_arg(1);
      if (y == nullptr || args.size() != 2 || node.kwarg("alpha") != nullptr || y->sizes() != x->sizes() ||
          y->scalar_type() != x->scalar_type() || x->numel() == 0 || !row_major_order(*x) || !row_major_order(*y) ||
          !poolable(x->options(), x->nbytes()))
        return {};
      at::Tensor out = pool.take(x->sizes(), x->options());
      at::add_out(out, *x, *y);
      return out;
    }
    default:
      return {};
  }
}

}  // namespace torch_ext::reactive
