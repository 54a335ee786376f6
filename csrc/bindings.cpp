// The only pybind11 translation unit: exposes the IR builder, printer, parser,
// verifier and the runtimes as torch_ext._C.
#include <torch/extension.h>

#include "ir/graph.h"
#include "ir/higher_order.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/type_check.h"
#include "ir/verifier.h"
#include "optim/descriptor.h"
#include "passes/batch_cone.h"
#include "passes/build_train_step.h"
#include "passes/lower_out_variants.h"
#include "passes/memory_algorithms.h"
#include "passes/memory_analysis.h"
#include "passes/plan_memory.h"
#include "passes/rematerialize.h"
#include "passes/split_convolution_backward.h"
#include "passes/schedule.h"
#include "passes/serialize_collectives.h"
#include "passes/sequence_axis.h"
#include "passes/split_heads.h"
#include "runtime/arena_executor.h"
#include "runtime/call_pool.h"
#include "reactive/content_digest.h"
#include "reactive/engine.h"
#include "reactive/sole_fresh.h"
#include "runtime/executor.h"

#include <c10/core/impl/COW.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace py = pybind11;
using namespace torch_ext;

namespace {

// A reference to a node by name, used in args crossing the Python boundary.
struct NodeRef {
  std::string name;
};
// dtype / device / layout / memory_format constants, as their text form.
struct Special {
  std::string kind;
  std::string text;
};

// Nested Python lists and tuple types are converted recursively; like the parser, refuse depths
// that would overflow the C stack.
constexpr int kMaxPyNesting = 64;

ir::Type type_from_py(const py::handle& h, int depth = 0) {
  TORCH_CHECK(depth <= kMaxPyNesting, "tuple types nested deeper than the limit of ", kMaxPyNesting);
  auto t = h.cast<py::tuple>();
  auto kind = t[0].cast<std::string>();
  if (kind == "tensor") {
    ir::TensorMeta m;
    auto dt = ir::dtype_from_short_name(t[1].cast<std::string>());
    TORCH_CHECK(dt.has_value(), "unsupported dtype '", t[1].cast<std::string>(), "'");
    m.dtype = *dt;
    m.sizes = t[2].cast<std::vector<int64_t>>();
    m.strides = t[3].cast<std::vector<int64_t>>();
    m.device = c10::Device(t[4].cast<std::string>());
    return ir::Type::make_tensor(std::move(m));
  }
  if (kind == "tuple") {
    std::vector<ir::Type> elems;
    for (auto e : t[1].cast<py::list>()) elems.push_back(type_from_py(e, depth + 1));
    return ir::Type::make_tuple(std::move(elems));
  }
  if (kind == "int") return ir::Type::make_scalar(ir::Type::Kind::Int);
  if (kind == "float") return ir::Type::make_scalar(ir::Type::Kind::Float);
  if (kind == "bool") return ir::Type::make_scalar(ir::Type::Kind::Bool);
  TORCH_CHECK(kind == "none", "unknown type kind '", kind, "'");
  return ir::Type::make_scalar(ir::Type::Kind::None);
}

py::object type_to_py(const ir::Type& t) {
  switch (t.kind) {
    case ir::Type::Kind::Tensor:
      return py::make_tuple("tensor", ir::dtype_short_name(t.tensor.dtype), t.tensor.sizes, t.tensor.strides,
                            t.tensor.device.str());
    case ir::Type::Kind::Tuple: {
      py::list elems;
      for (const auto& e : t.elems) elems.append(type_to_py(e));
      return py::make_tuple("tuple", elems);
    }
    case ir::Type::Kind::Int: return py::make_tuple("int");
    case ir::Type::Kind::Float: return py::make_tuple("float");
    case ir::Type::Kind::Bool: return py::make_tuple("bool");
    case ir::Type::Kind::None: return py::make_tuple("none");
  }
  return py::none();
}

ir::Arg arg_from_py(ir::Graph& g, const py::handle& h, int depth = 0) {
  TORCH_CHECK(depth <= kMaxPyNesting, "argument lists nested deeper than the limit of ", kMaxPyNesting);
  if (h.is_none()) return ir::Arg::none();
  if (py::isinstance<NodeRef>(h)) {
    const auto& name = h.cast<const NodeRef&>().name;
    ir::Node* n = g.find(name);
    TORCH_CHECK(n != nullptr, "reference to unknown node %", name);
    return ir::Arg::of_node(n);
  }
  if (py::isinstance<py::bool_>(h)) return ir::Arg::of_bool(h.cast<bool>());
  if (py::isinstance<py::int_>(h)) return ir::Arg::of_int(h.cast<int64_t>());
  if (py::isinstance<py::float_>(h)) return ir::Arg::of_float(h.cast<double>());
  if (py::isinstance<py::str>(h)) return ir::Arg::of_string(h.cast<std::string>());
  if (py::isinstance<py::list>(h) || py::isinstance<py::tuple>(h)) {
    std::vector<ir::Arg> items;
    for (auto e : h) items.push_back(arg_from_py(g, e, depth + 1));
    return ir::Arg::of_list(std::move(items));
  }
  if (py::isinstance<Special>(h)) {
    const auto& s = h.cast<const Special&>();
    if (s.kind == "dtype") {
      auto dt = ir::dtype_from_torch_name(s.text);
      TORCH_CHECK(dt.has_value(), "unsupported dtype ", s.text);
      return ir::Arg::of_dtype(*dt);
    }
    if (s.kind == "device") return ir::Arg::of_device(c10::Device(s.text));
    // Layout and memory format share the parser's spelling.
    auto parsed = ir::parse("graph:\n  return (" + s.text + ")\n");
    return parsed->output()->args()[0].list.at(0);
  }
  TORCH_CHECK(false, "unsupported argument of Python type ", py::str(py::type::handle_of(h)).cast<std::string>());
}

py::object arg_to_py(const ir::Arg& a) {
  switch (a.kind) {
    case ir::Arg::Kind::None: return py::none();
    case ir::Arg::Kind::Node: return py::cast(NodeRef{a.node->name()});
    case ir::Arg::Kind::Int: return py::int_(a.i);
    case ir::Arg::Kind::Float: return py::float_(a.f);
    case ir::Arg::Kind::Bool: return py::bool_(a.i != 0);
    case ir::Arg::Kind::String: return py::str(a.s);
    case ir::Arg::Kind::List: {
      py::list out;
      for (const auto& e : a.list) out.append(arg_to_py(e));
      return out;
    }
    case ir::Arg::Kind::Dtype: return py::cast(Special{"dtype", ir::print_arg(a)});
    case ir::Arg::Kind::Device: return py::cast(Special{"device", a.s});
    case ir::Arg::Kind::Layout: return py::cast(Special{"layout", ir::print_arg(a)});
    case ir::Arg::Kind::MemoryFormat: return py::cast(Special{"memory_format", ir::print_arg(a)});
  }
  return py::none();
}

c10::IValue ivalue_from_py(const py::handle& h) {
  if (THPVariable_Check(h.ptr())) return c10::IValue(THPVariable_Unpack(h.ptr()));
  if (h.is_none()) return c10::IValue();
  if (py::isinstance<py::bool_>(h)) return c10::IValue(h.cast<bool>());
  if (py::isinstance<py::int_>(h)) return c10::IValue(h.cast<int64_t>());
  if (py::isinstance<py::float_>(h)) return c10::IValue(h.cast<double>());
  TORCH_CHECK(false, "unsupported input of Python type ", py::str(py::type::handle_of(h)).cast<std::string>());
}

py::object ivalue_to_py(const c10::IValue& v) {
  if (v.isTensor()) return py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor()));
  if (v.isNone()) return py::none();
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isTuple() || v.isList()) {
    py::list out;
    if (v.isTuple()) {
      for (const auto& e : v.toTupleRef().elements()) out.append(ivalue_to_py(e));
    } else {
      for (const auto& e : v.toListRef()) out.append(ivalue_to_py(e));
    }
    return py::tuple(out);
  }
  TORCH_CHECK(false, "unsupported output value of kind ", v.tagKind());
}

// Converts inputs, runs `fn` without the GIL, converts the outputs.
template <typename Fn>
py::list run_without_gil(py::sequence inputs, Fn&& fn) {
  std::vector<c10::IValue> in;
  in.reserve(py::len(inputs));
  for (auto h : inputs) in.push_back(ivalue_from_py(h));
  std::vector<c10::IValue> out;
  {
    py::gil_scoped_release no_gil;
    out = fn(std::move(in));
  }
  py::list result;
  for (const auto& v : out) result.append(ivalue_to_py(v));
  return result;
}

// The sweep's hot loop (torch_ext.reactive._sweep): for every site, in order, `patch(clean, site)` on the
// node's cached value (a write into it is refused by its version counter), the node's prepared cone
// evaluated with the result (Engine::evaluate_patched, or, with `rows`, evaluate_patched_rows for a node
// with a sequence axis), `metric(outputs)` on copies of the outputs (metric_copy; an in-place write into
// them refused the same way; a fresh output of the cone that only the loop holds is handed over as it is,
// see sole_fresh), its value kept. Python runs only the user's callbacks; everything between them stays here.
// `user` maps the flat outputs to what the metric receives: an int (that output alone) or a callable.
// `convert` turns a metric result other than a float or a one-element floating tensor into what is stored,
// and `fail(kind, i)` raises the Python error for site i ("patch_wrote", "not_tensor", "metric_wrote"; i = -1:
// the unpatched metric); a `fail` that returns instead still stops the loop, with a generic error. With
// `clean` (a list), the metric of the current outputs is appended to it first (sweep()'s clean_metric, one
// crossing fewer per sweep).
int64_t tensor_version(const at::Tensor& t) {
  return t.defined() && !t.is_inference() ? static_cast<int64_t>(t._version()) : -1;
}

// A dense CPU tensor whose elements are its bytes as they lie (no lazy conjugation or negation, no Python
// subclass dispatching its reads): what the two fast paths below may read or write with plain memory ops.
bool plain_cpu(const at::Tensor& t) {
  return t.is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && t.has_storage() && !t.is_conj() &&
         !t.is_neg() && !t.unsafeGetTensorImpl()->is_python_dispatch();
}

// `dst.copy_(src)` for tensors of one shape, dtype and device. Between dense CPU tensors it is a memcpy,
// the same bytes: for a small activation copy_'s TensorIterator setup costs as much as the copy.
void copy_spare(at::Tensor& dst, const at::Tensor& src) {
  if (plain_cpu(dst) && plain_cpu(src) && dst.scalar_type() == src.scalar_type() && dst.sizes() == src.sizes()) {
    if (src.numel() > 0) std::memcpy(dst.data_ptr(), src.const_data_ptr(), src.nbytes());
    dst.unsafeGetTensorImpl()->bump_version();  // a write, as copy_ records one
    return;
  }
  dst.copy_(src);
}

// Whether at::_lazy_clone(t) gives t's elements as a tensor of its own geometry: no autograd history, no lazy
// conjugation or negation (the lazy copy would not carry the bit), no Python subclass, on memory whose
// allocator allows copy on write (c10::impl::cow).
bool cow_shareable(const at::Tensor& t) {
  if (t.requires_grad() || t.layout() != at::kStrided || !t.has_storage() || t.is_conj() || t.is_neg() ||
      t.unsafeGetTensorImpl()->is_python_dispatch())
    return false;
  const c10::StorageImpl& storage = *t.storage().unsafeGetStorageImpl();
  return c10::impl::cow::has_simple_data_ptr(storage) || c10::impl::cow::is_cow_data_ptr(storage.data_ptr());
}

// A lazy copy of `t` (at::_lazy_clone, copy on write): the same elements in a tensor of the same sizes and
// strides whose memory is shared until either side writes, when the writer gets memory of its own. Only
// where it is indistinguishable from t.clone() but for that sharing: a dense strided tensor that fills its
// whole storage from offset 0 (clone keeps those strides), with no lazy conjugation or negation (the lazy
// copy would not carry the bit), no autograd history and no Python subclass, on memory whose allocator
// allows copy on write (c10::impl::cow). Else undefined: the caller copies.
// A copy of `t` with its sizes and strides (a strided view's gaps included), as an eager hook is handed `t`
// itself: clone() would lay a non-dense view out densely, and a patch returning its argument (or an op on it)
// would then give another layout than eager's. An overlapping tensor (expanded) cannot be written in its own
// layout: clone().
at::Tensor copy_in_layout(const at::Tensor& t) {
  if (t.layout() != at::kStrided || t.is_non_overlapping_and_dense()) return t.clone();
  // No two elements at one address: the dims of size > 1, by stride, each step past the last one's extent.
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return t.clone();  // overlapping (an expanded dim) or interleaved: not writable as laid out
    extent = stride * size;
  }
  return at::empty_strided(t.sizes(), t.strides(), t.options()).copy_(t);
}

at::Tensor lazy_copy(const at::Tensor& t) {
  // clone() keeps the strides of a dense tensor and starts at offset 0: so must the lazy copy.
  if (!cow_shareable(t) || t.storage_offset() != 0 || !t.is_non_overlapping_and_dense() ||
      t.storage().nbytes() != t.nbytes())
    return {};
  return at::_lazy_clone(t);
}

// What a metric is handed for an output `t` (a cached value, a row buffer reused across sites, or a slice
// of a batched output): a copy, so that a write through .data, .numpy() or the storage, which shares the
// memory but not the version counter, cannot reach the cache. Copy on write (at::_lazy_clone, same sizes,
// strides and storage offset as `t`: the metric sees the tensor it saw before) where the memory allows it,
// so a metric that only reads costs no copy; else t.clone(). Not a tensor: itself.
c10::IValue metric_copy(const c10::IValue& v) {
  if (!v.isTensor()) return v;
  const at::Tensor& t = v.toTensor();
  if (!t.defined()) return v;
  return cow_shareable(t) ? at::_lazy_clone(t) : t.clone();
}

// `t.item<double>()` for a one-element floating tensor; a float or double on the CPU is read directly (the
// same conversion _local_scalar_dense makes, without its dispatch).
double item_double(const at::Tensor& t) {
  if (plain_cpu(t)) {
    if (t.scalar_type() == at::kFloat) return static_cast<double>(*t.const_data_ptr<float>());
    if (t.scalar_type() == at::kDouble) return *t.const_data_ptr<double>();
  }
  return t.item<double>();
}

py::list sweep_sites(reactive::Engine& e, const std::vector<std::string>& nodes, py::sequence sites,
                     py::sequence patches, bool rows,
                     const std::vector<int64_t>& read_rows, const std::vector<std::vector<int64_t>>& read_cols,
                     py::function metric, py::object user, py::function convert, py::function fail,
                     bool skip_identical, py::object identical, py::object clean_out) {
  const size_t n = nodes.size();
  TORCH_CHECK(py::len(sites) == n && py::len(patches) == n,
              "sweep_sites: nodes, sites and patches must have one entry per site");
  const bool single = py::isinstance<py::int_>(user);
  const int64_t single_index = single ? user.cast<int64_t>() : -1;
  // The node's id and whether its sites take the row path, found once per run of sites on one node (the
  // engine's *_at forms then take the id: no name is looked up per site).
  int64_t id = -1;
  bool rows_here = false;
  // Copies handed to patch functions, kept for the next site of the same shape, dtype and device.
  std::vector<at::Tensor> spares;
  py::list results;
  // The copies the metric could write into, with their versions (one site at a time; kept here so that its
  // memory is reused).
  std::vector<std::pair<at::Tensor, int64_t>> guarded;
  // metric(outputs) for `flat` (site i; -1: the unpatched outputs), as stored. `fresh_ok`: an output this loop
  // alone holds may be handed over as it is (sole_fresh: a cone's fresh outputs), else every output is copied.
  const auto measure = [&](std::vector<c10::IValue>& flat, bool fresh_ok, const py::object& site,
                           int64_t i) -> py::object {
    // The metric gets copies of the outputs (metric_copy): the engine's buffers are never handed out. An
    // in-place write into a copy is still refused (its version counter), as documented.
    guarded.clear();
    py::object outs;
    if (single) {
      TORCH_CHECK(single_index >= 0 && single_index < static_cast<int64_t>(flat.size()),
                  "sweep_sites: output index ", single_index, " out of range");
      // A fresh output only this loop holds (a cone's, once the cached values are put back) is handed over
      // as it is: nothing else can see a write into it (sole_fresh). Else a copy.
      if (!fresh_ok || !reactive::sole_fresh(flat[single_index])) flat[single_index] = metric_copy(flat[single_index]);
      outs = ivalue_to_py(flat[single_index]);
      const int64_t version = flat[single_index].isTensor() ? tensor_version(flat[single_index].toTensor()) : -1;
      if (version >= 0) guarded.emplace_back(flat[single_index].toTensor(), version);
    } else {
      py::list l;
      for (auto& v : flat) {
        if (!fresh_ok || !reactive::sole_fresh(v)) v = metric_copy(v);  // as above
        l.append(ivalue_to_py(v));
        const int64_t version = v.isTensor() ? tensor_version(v.toTensor()) : -1;
        if (version >= 0) guarded.emplace_back(v.toTensor(), version);
      }
      outs = user(l);
    }
    // The engine's references go now: it reuses an output's buffer only while it holds the sole reference,
    // and a copy nobody kept leaves that buffer's memory its own again when the engine next writes it.
    flat.clear();
    py::object result = metric(outs);
    bool wrote = false;
    for (const auto& [t, version] : guarded) wrote = wrote || tensor_version(t) != version;
    // Released before the Python outputs: a tensor whose Python object dies while C++ still holds it
    // has that object kept alive with it (resurrected), work that is wasted here.
    guarded.clear();
    outs = py::object();
    if (wrote) {
      fail("metric_wrote", i);
      TORCH_CHECK(false, "sweep_sites: the metric wrote into the outputs at ",
                  i < 0 ? std::string("the unpatched outputs") : "a site of %" + nodes[i]);
    }
    if (THPVariable_Check(result.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(result.ptr());
      if (t.numel() == 1 && at::isFloatingType(t.scalar_type()))
        result = py::float_(item_double(t));
      else
        result = convert(result, site);
    } else if (!PyFloat_CheckExact(result.ptr())) {
      result = convert(result, site);
    }
    return result;
  };
  if (!clean_out.is_none()) {
    // The unpatched metric first (sweep()'s clean_metric), on copies of the current outputs, as at the sites
    // skip_identical answers: the caller checked hooks and attributes, and nothing is stale here.
    std::vector<c10::IValue> flat = e.demand();
    clean_out.attr("append")(measure(flat, false, py::str("unpatched"), -1));
  }
  for (size_t i = 0; i < n; ++i) {
    py::object site = sites[i];
    if (i == 0 || nodes[i] != nodes[i - 1]) {
      id = e.node_id(nodes[i]);
      rows_here = rows && e.seq_axis_at(id) >= 0;
    }
    // The patch function gets a copy of the cached value: a write through .data or .numpy() shares the
    // memory but not the version counter, so a guard on the cached tensor itself would miss it
    // (ReactiveGraph._call_patch_fn, the per-site path, does the same). An in-place edit of the
    // copy is still refused: the function must return a new tensor. Where it can, the copy is lazy
    // (lazy_copy): copy on write, so a function that only reads its argument costs no copy of it, and
    // any write into either tensor (.data, .numpy(), out=, a storage write) first gives the writer
    // memory of its own. Else the copy is written into an earlier site's copy of the same shape,
    // dtype and device when nothing but this loop holds that tensor or its memory (the patch function
    // kept no reference to it or to a view of it, and the metric kept none of an output it became),
    // or is a fresh tensor. A tensor the user holds is never overwritten.
    const at::Tensor cached = e.value_at(id).toTensor();
    at::Tensor clean = lazy_copy(cached);
    if (!clean.defined()) {
      at::Tensor* reused = nullptr;
      if (!cached.requires_grad())
        for (at::Tensor& t : spares)
          if (t.use_count() == 1 && t.storage().use_count() == 1 && !t.is_inference() && t.sizes() == cached.sizes() &&
              t.strides() == cached.strides() && t.dtype() == cached.dtype() && t.device() == cached.device()) {
            reused = &t;
            break;
          }
      if (reused != nullptr) {
        copy_spare(*reused, cached);
      } else {
        spares.erase(std::remove_if(spares.begin(), spares.end(),
                                    [](const at::Tensor& t) { return t.use_count() > 1 || t.storage().use_count() > 1; }),
                     spares.end());  // held by the user: never written again
        if (spares.size() >= 8) spares.erase(spares.begin());  // a few shapes at a time
        spares.push_back(copy_in_layout(cached));
        reused = &spares.back();
      }
      clean = *reused;
    }
    const int64_t clean_version = tensor_version(clean);
    py::object patched = patches[i](py::reinterpret_steal<py::object>(THPVariable_Wrap(clean)), site);
    if (tensor_version(clean) != clean_version) {
      fail("patch_wrote", i);
      TORCH_CHECK(false, "sweep_sites: the patch function wrote into the copy of %", nodes[i], " it was given");
    }
    if (!THPVariable_Check(patched.ptr())) {
      fail("not_tensor", i, patched);
      TORCH_CHECK(false, "sweep_sites: the patch function for %", nodes[i], " returned no tensor");
    }
    at::Tensor value = THPVariable_Unpack(patched.ptr());
    if (value.requires_grad()) value = value.detach();
    patched = py::object();
    clean.reset();  // a lazy copy nobody kept leaves the cached tensor its memory's one owner again
    std::vector<c10::IValue> flat;
    // The cone's outputs may be fresh tensors only this loop holds (sole_fresh tells, per output: a cached
    // value, a pooled row buffer or a view of either has another owner, and is copied).
    bool fresh = true;
    if (skip_identical && reactive::same_input(value, cached)) {
      fresh = false;
      // A value bit-identical to the cached one changes nothing: the cone would recompute its cached
      // values, so the site takes the current outputs (nothing stale: can_evaluate_patched holds), with
      // zero evaluations; the caller is told which sites these were (they leave the ledger's sum).
      flat = e.demand();
      if (!identical.is_none()) identical.attr("append")(i);
    } else {
      py::gil_scoped_release no_gil;
      if (rows_here)
        flat = e.evaluate_patched_rows_at(id, std::move(value), read_rows, read_cols);
      else
        flat = e.evaluate_patched_at(id, std::move(value));
    }
    results.append(measure(flat, fresh, site, static_cast<int64_t>(i)));
  }
  return results;
}

py::dict node_to_py(const ir::Node& n) {
  py::dict d;
  d["kind"] = ir::to_string(n.kind());
  d["name"] = n.name();
  d["type"] = type_to_py(n.type());
  d["module_path"] = n.module_path();
  if (n.kind() == ir::NodeKind::Placeholder) {
    d["role"] = ir::to_string(n.role());
    d["state_name"] = n.state_name();
  }
  if (n.kind() == ir::NodeKind::Call) d["target"] = n.target().str();
  // Only the count: a region is cloned when torch_ext.ir.Node.regions is first read (Graph.regions).
  d["num_regions"] = n.regions().size();
  py::list args;
  for (const auto& a : n.args()) args.append(arg_to_py(a));
  d["args"] = args;
  py::list kwargs;
  for (const auto& kv : n.kwargs()) kwargs.append(py::make_tuple(kv.first, arg_to_py(kv.second)));
  d["kwargs"] = kwargs;
  py::list users;
  for (const ir::Node* u : n.users()) users.append(u->name());
  d["users"] = users;
  return d;
}

passes::TrainStepSpec spec_from_py(const py::dict& d) {
  passes::TrainStepSpec spec;
  spec.loss_output = d["loss_output"].cast<int64_t>();
  spec.buffer_mutations = d["buffer_mutations"].cast<std::vector<std::pair<int64_t, std::string>>>();
  spec.grads = d["grads"].cast<std::vector<std::pair<int64_t, std::string>>>();
  spec.num_groups = d["num_groups"].cast<int64_t>();
  if (!d["clip_max_norm"].is_none()) spec.clip_max_norm = d["clip_max_norm"].cast<double>();
  spec.clip_norm_type = d["clip_norm_type"].cast<double>();
  if (d.contains("aux_outputs")) spec.aux_outputs = d["aux_outputs"].cast<std::vector<int64_t>>();
  if (d.contains("accumulate")) spec.accumulate = d["accumulate"].cast<int64_t>();
  if (d.contains("grad_events")) spec.grad_events = d["grad_events"].cast<std::map<std::string, int64_t>>();
  if (d.contains("data_parallel") && !d["data_parallel"].is_none()) {
    auto dp = d["data_parallel"].cast<py::dict>();
    passes::DataParallel v;
    v.group_name = dp["group_name"].cast<std::string>();
    v.world_size = dp["world_size"].cast<int64_t>();
    v.rank = dp["rank"].cast<int64_t>();
    v.shard_optimizer_state = dp["shard_optimizer_state"].cast<bool>();
    spec.data_parallel = v;
  }
  for (auto h : d["updates"].cast<py::list>()) {
    auto u = h.cast<py::dict>();
    passes::ParamUpdate pu;
    pu.param = u["param"].cast<std::string>();
    pu.kind = u["kind"].cast<std::string>();
    pu.group = u["group"].cast<int64_t>();
    pu.hyper = u["hyper"].cast<std::map<std::string, double>>();
    pu.flags = u["flags"].cast<std::map<std::string, bool>>();
    pu.scheduled = u.contains("scheduled") && u["scheduled"].cast<bool>();
    spec.updates.push_back(std::move(pu));
  }
  return spec;
}

py::dict plan_to_py(const ir::MemoryPlan& plan) {
  py::dict d;
  d["algorithm"] = plan.arena.algorithm;
  d["arena_bytes"] = plan.arena.arena_bytes;
  d["persistent_bytes"] = plan.persistent_bytes;
  d["escaping_bytes"] = plan.escaping_bytes;
  d["lower_bound"] = plan.lower_bound;
  d["lb_sched"] = plan.lb_sched();
  d["lb_graph"] = plan.lb_graph;
  d["peak_bytes"] = plan.peak_bytes();
  py::list buffers;
  for (size_t i = 0; i < plan.buffers.size(); ++i) {
    const auto& b = plan.buffers[i];
    buffers.append(py::make_tuple(b.node->name(), b.elem, b.life.size, b.life.first, b.life.last, plan.arena.offsets[i]));
  }
  d["buffers"] = buffers;
  py::list dynamic;  // allocated by their kernels: (node, elem, size, first, last)
  for (const auto& b : plan.dynamic) dynamic.append(py::make_tuple(b.node->name(), b.elem, b.life.size, b.life.first, b.life.last));
  d["dynamic"] = dynamic;
  d["dynamic_bytes"] = plan.dynamic_bytes;
  py::list aliases;
  for (const auto& a : plan.aliases) aliases.append(py::make_tuple(a.update->name(), a.applied, a.reason));
  d["aliases"] = aliases;
  py::list order;
  for (const ir::Node* n : plan.order) order.append(n->name());
  d["order"] = order;
  py::list phases;  // per position of order: "forward", "backward" or "update"
  for (ir::StepPhase p : plan.phases) phases.append(ir::to_string(p));
  d["phases"] = phases;
  py::list views;  // aliases of arena buffers: (node, elem, index into buffers, first, last)
  for (const auto& v : plan.views) views.append(py::make_tuple(v.node->name(), v.elem, v.buffer, v.first, v.last));
  d["views"] = views;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ext C++ core";

  py::class_<NodeRef>(m, "NodeRef")
      .def(py::init<std::string>())
      .def_readonly("name", &NodeRef::name)
      .def("__repr__", [](const NodeRef& r) { return "%" + r.name; })
      .def("__eq__", [](const NodeRef& a, const NodeRef& b) { return a.name == b.name; });
  py::class_<Special>(m, "Special")
      .def(py::init<std::string, std::string>())
      .def_readonly("kind", &Special::kind)
      .def_readonly("text", &Special::text)
      .def("__repr__", [](const Special& s) { return s.text; });

  py::class_<ir::Graph, std::shared_ptr<ir::Graph>>(m, "Graph")
      .def(py::init<>())
      .def_static("parse", [](const std::string& text) { return std::shared_ptr<ir::Graph>(ir::parse(text)); })
      .def("add_placeholder",
           [](ir::Graph& g, const std::string& name, const std::string& role, py::handle type,
              const std::string& state_name) {
             auto r = ir::input_role_from_string(role);
             TORCH_CHECK(r.has_value(), "unknown input role '", role, "'");
             g.create_placeholder(name, *r, type_from_py(type), state_name);
           })
      .def("add_call",
           [](ir::Graph& g, const std::string& name, const std::string& target, py::list args, py::list kwargs,
              py::handle type, const std::string& module_path, const std::vector<std::shared_ptr<ir::Graph>>& regions) {
             std::vector<ir::Arg> a;
             for (auto e : args) a.push_back(arg_from_py(g, e));
             ir::Kwargs kw;
             for (auto e : kwargs) {
               auto kv = e.cast<py::tuple>();
               kw.emplace_back(kv[0].cast<std::string>(), arg_from_py(g, kv[1]));
             }
             ir::Node* n = g.create_call(name, ir::Target::parse(target), std::move(a), std::move(kw),
                                         type_from_py(type));
             n->set_module_path(module_path);
             for (const auto& r : regions) g.add_region(n, r->clone());
           },
           py::arg("name"), py::arg("target"), py::arg("args"), py::arg("kwargs"), py::arg("type"),
           py::arg("module_path"), py::arg("regions") = std::vector<std::shared_ptr<ir::Graph>>{})
      .def("set_output",
           [](ir::Graph& g, py::list values) {
             std::vector<ir::Arg> vals;
             for (auto e : values) vals.push_back(arg_from_py(g, e));
             g.create_output(std::move(vals));
           })
      .def("__str__", [](const ir::Graph& g) { return ir::print(g); })
      .def("__len__", [](const ir::Graph& g) { return g.size(); })
      .def("verify", [](const ir::Graph& g) { ir::verify(g); })
      .def("verify_errors", [](const ir::Graph& g) { return ir::verify_errors(g); })
      .def("clone", [](const ir::Graph& g) { return std::shared_ptr<ir::Graph>(g.clone()); })
      .def("nodes",
           [](const ir::Graph& g) {
             py::list out;
             for (const auto& n : g.nodes()) out.append(node_to_py(*n));
             return out;
           })
      .def("node",
           [](const ir::Graph& g, const std::string& name) {
             const ir::Node* n = g.find(name);
             TORCH_CHECK(n != nullptr, "no node named %", name);
             return node_to_py(*n);
           })
      // Copies, so that a view of a region outlives any later edit of this graph.
      .def("regions", [](const ir::Graph& g, const std::string& name) {
        const ir::Node* n = g.find(name);
        TORCH_CHECK(n != nullptr, "no node named %", name);
        std::vector<std::shared_ptr<ir::Graph>> out;
        for (const auto& r : n->regions()) out.push_back(std::shared_ptr<ir::Graph>(r->clone()));
        return out;
      });

  py::class_<runtime::Executor, std::shared_ptr<runtime::Executor>>(m, "Executor")
      .def(py::init([](const ir::Graph& g) { return std::make_shared<runtime::Executor>(g); }))
      .def("num_inputs", &runtime::Executor::num_inputs)
      .def("inplace_steps", &runtime::Executor::inplace_steps)
      .def("result_pool_stats",
           [](const runtime::Executor& ex) {
             py::dict d;
             d["cached_bytes"] = ex.result_pool().cached_bytes();
             d["reused_blocks"] = ex.result_pool().reused_blocks();
             return d;
           })
      .def("run", [](const runtime::Executor& ex, py::sequence inputs) {
        return run_without_gil(inputs, [&](std::vector<c10::IValue> in) { return ex.run(std::move(in)); });
      });

  // A CPU block cache across calls of an opaque callable (runtime/call_pool.h); torch_ext.deploy runs
  // AOTInductor packages through call().
  py::class_<runtime::CallPool, std::shared_ptr<runtime::CallPool>>(m, "CallPool")
      .def(py::init([] { return std::make_shared<runtime::CallPool>(); }))
      .def("call",
           [](runtime::CallPool& pool, const py::function& fn, const py::args& args) {
             runtime::CallPool::Scope scope(pool);
             return fn(*args);
           })
      .def("release", &runtime::CallPool::release)
      .def("stats", [](const runtime::CallPool& pool) {
        py::dict d;
        d["cached_bytes"] = pool.cached_bytes();
        d["reused_blocks"] = pool.reused_blocks();
        d["fresh_blocks"] = pool.fresh_blocks();
        return d;
      });

  py::class_<reactive::Engine, std::shared_ptr<reactive::Engine>>(m, "Engine")
      .def(py::init([](const ir::Graph& g, bool infer_results) {
             return std::make_shared<reactive::Engine>(g, infer_results);
           }),
           py::arg("graph"), py::arg("infer_results") = true)
      .def("run",
           [](reactive::Engine& e, py::sequence inputs) {
             std::vector<c10::IValue> in;
             for (auto h : inputs) in.push_back(ivalue_from_py(h));
             py::gil_scoped_release no_gil;
             e.run(std::move(in));
           })
      .def("demand",
           [](reactive::Engine& e) {
             std::vector<c10::IValue> out;
             {
               py::gil_scoped_release no_gil;
               out = e.demand();
             }
             py::list result;
             for (const auto& v : out) result.append(ivalue_to_py(v));
             return result;
           })
      .def("value", [](reactive::Engine& e, const std::string& n) { return ivalue_to_py(e.value(n)); })
      .def("baseline", [](reactive::Engine& e, const std::string& n) { return ivalue_to_py(e.baseline(n)); })
      .def("patch", [](reactive::Engine& e, const std::string& n, py::handle v) { e.patch(n, ivalue_from_py(v)); })
      .def("restore", [](reactive::Engine& e) { e.restore(); })
      .def("restore_node", [](reactive::Engine& e, const std::string& n) { e.restore(n); })
      .def("graft",
           [](reactive::Engine& e, const std::string& src, const std::string& dst, const ir::Graph& block,
              py::sequence params) {
             std::vector<c10::IValue> p;
             for (auto h : params) p.push_back(ivalue_from_py(h));
             return e.graft(src, dst, block, std::move(p));
           })
      .def("evaluate_patched",
           [](reactive::Engine& e, const std::string& n, py::handle v) {
             c10::IValue value = ivalue_from_py(v);
             std::vector<c10::IValue> out;
             {
               py::gil_scoped_release no_gil;
               out = e.evaluate_patched(n, std::move(value));
             }
             py::list result;
             for (const auto& x : out) result.append(ivalue_to_py(x));
             return result;
           })
      .def("sweep_sites", &sweep_sites, py::arg("nodes"), py::arg("sites"), py::arg("patches"), py::arg("rows"), py::arg("read_rows"), py::arg("read_cols"), py::arg("metric"), py::arg("user"),
           py::arg("convert"), py::arg("fail"), py::arg("skip_identical") = false, py::arg("identical") = py::none(),
           py::arg("clean") = py::none())
      .def("evaluate_patched_rows",
           [](reactive::Engine& e, const std::string& n, py::handle v, std::vector<int64_t> read_rows,
              std::vector<std::vector<int64_t>> read_cols) {
             c10::IValue value = ivalue_from_py(v);
             std::vector<c10::IValue> out;
             {
               py::gil_scoped_release no_gil;
               out = e.evaluate_patched_rows(n, std::move(value), read_rows, read_cols);
             }
             py::list result;
             for (const auto& x : out) result.append(ivalue_to_py(x));
             return result;
           },
           py::arg("node"), py::arg("value"), py::arg("read_rows") = std::vector<int64_t>{},
           py::arg("read_cols") = std::vector<std::vector<int64_t>>{})
      .def("node_cost",
           [](const reactive::Engine& e, const std::string& name) {
             const ir::Node* n = e.graph().find(name);
             TORCH_CHECK(n != nullptr, "unknown node '", name, "'");
             return reactive::node_cost(*n);
           })
      .def("can_evaluate_patched_rows", &reactive::Engine::can_evaluate_patched_rows)
      .def("set_positions", &reactive::Engine::set_positions, py::arg("enabled"), py::arg("seq_dim") = 1)
      .def("positions", &reactive::Engine::positions)
      .def("seq_axis", &reactive::Engine::seq_axis)
      .def("seq_fold", &reactive::Engine::seq_fold)
      .def("first_changed_row",
           [](reactive::Engine& e, const std::string& n, py::handle v) { return e.first_changed_row(n, ivalue_from_py(v)); })
      .def("can_evaluate_patched", &reactive::Engine::can_evaluate_patched)
      .def("plans_built", &reactive::Engine::plans_built)
      .def("scratch_bytes", &reactive::Engine::scratch_bytes)
      .def("inplace_steps", &reactive::Engine::inplace_steps, py::arg("node"))
      .def("set_scratch", &reactive::Engine::set_scratch)
      .def("scratch", &reactive::Engine::scratch)
      .def("share_row_buffers", &reactive::Engine::share_row_buffers, py::arg("other"))
      .def("row_buffers_reused", &reactive::Engine::row_buffers_reused)
      .def("row_buffers_allocated", &reactive::Engine::row_buffers_allocated)
      .def("begin_transaction", &reactive::Engine::begin_transaction, py::arg("restore_counts") = false)
      .def("commit", &reactive::Engine::commit)
      .def("check_patch",
           [](const reactive::Engine& e, const std::string& n, py::handle v) { e.check_patch(n, ivalue_from_py(v)); })
      .def("rollback", &reactive::Engine::rollback)
      .def("in_transaction", &reactive::Engine::in_transaction)
      .def("check_intact", [](reactive::Engine& e, const std::string& n) { e.check_intact(n); })
      .def("node",
           [](const reactive::Engine& e, const std::string& name) {
             const ir::Node* n = e.graph().find(name);
             TORCH_CHECK(n != nullptr, "unknown node '", name, "'");
             return node_to_py(*n);
           })
      .def("begin_batch", &reactive::Engine::begin_batch)
      .def("end_batch", &reactive::Engine::end_batch)
      .def("num_pending", &reactive::Engine::num_pending)
      .def("input_edits", &reactive::Engine::input_edits)
      .def("set_inputs_frozen", &reactive::Engine::set_inputs_frozen)
      .def("graph_revision", &reactive::Engine::graph_revision)
      .def("cone", &reactive::Engine::cone, py::arg("node"), py::arg("stop_at_pins") = false)
      .def("cone_cost", &reactive::Engine::cone_cost)
      .def("num_countable", &reactive::Engine::num_countable)
      .def("num_dirty", &reactive::Engine::num_dirty)
      .def("is_valid", &reactive::Engine::is_valid)
      .def("pinned", &reactive::Engine::pinned)
      .def("set_cutoff", &reactive::Engine::set_cutoff)
      .def("stats",
           [](reactive::Engine& e) {
             const auto& s = e.stats();
             py::dict d;
             d["evaluations"] = s.evaluations;
             d["cost"] = s.cost;
             d["cutoffs"] = s.cutoffs;
             d["invalidated"] = s.invalidated;
             d["restored"] = s.restored;
             d["row_evaluations"] = s.row_evaluations.value();
             // The same sum exactly: {T: rows} meaning the sum of rows / T (whole evaluations under T = 1).
             py::dict parts;
             parts[py::int_(1)] = s.row_evaluations.whole;
             for (const auto& [T, k] : s.row_evaluations.partial) parts[py::int_(T)] = k;
             d["row_evaluations_exact"] = parts;
             return d;
           })
      .def("reset_stats", &reactive::Engine::reset_stats)
      .def("check_invariants", &reactive::Engine::check_invariants)
      .def("graph", [](const reactive::Engine& e) { return std::shared_ptr<ir::Graph>(e.graph().clone()); })
      .def("__str__", [](const reactive::Engine& e) { return ir::print(e.graph()); });

  // Content digests of the tensors a reactive graph reads (csrc/reactive/content_digest.h): one call per check.
  m.def(
      "content_digests",
      [](std::vector<at::Tensor> tensors) {
        // A tensor on another device is read through a detached host copy (a sparse one has no bytes to read);
        // a CPU tensor as it lies, autograd history or not (content_digest reads bytes, under no_grad). Done
        // here rather than per tensor in Python, which cost a Python step per weight per check.
        size_t bytes = 0;
        for (at::Tensor& t : tensors) {
          if (!t.defined() || t.is_meta() || t.layout() != at::kStrided) continue;
          if (!t.is_cpu()) t = t.detach().cpu();
          bytes += t.nbytes();
        }
        // The GIL goes for a pass long enough to matter (a model's weights); releasing it costs more than
        // hashing an activation of a few KB.
        if (bytes < (size_t{1} << 20)) return reactive::content_digests(tensors);
        py::gil_scoped_release release;
        return reactive::content_digests(tensors);
      },
      py::arg("tensors"));
  // The copy a patch function is handed (ReactiveGraph._call_patch_fn): a copy-on-write copy where one can
  // stand for clone() (lazy_copy above), else None.
  // What a sweep's metric is handed for an output (metric_copy above): a copy-on-write copy of the same
  // geometry where the memory allows it, else a clone.
  m.def(
      "metric_copy", [](const at::Tensor& t) { return metric_copy(c10::IValue(t)).toTensor(); }, py::arg("tensor"));
  m.def("copy_in_layout", &copy_in_layout, py::arg("tensor"),
        "A copy of the tensor with its sizes and strides, gaps included (clone() where it overlaps).");
  m.def(
      "lazy_copy",
      [](const at::Tensor& t) -> py::object {
        at::Tensor c = lazy_copy(t);
        if (!c.defined()) return py::none();
        return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(c)));
      },
      py::arg("tensor"));
  // One number for the version counters and storage addresses of a model's tensors (TrainStep's check that
  // nothing wrote the model between calls): equal numbers, nothing moved; the cheap first test of every call.
  m.def(
      "write_signature",
      [](const std::vector<at::Tensor>& tensors) {
        uint64_t h = 0x9e3779b97f4a7c15ULL;
        auto mix = [&h](uint64_t v) {
          h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
          h *= 0xbf58476d1ce4e5b9ULL;
          h ^= h >> 31;
        };
        for (const at::Tensor& t : tensors) {
          mix(t.is_inference() ? 0 : static_cast<uint64_t>(t._version()));
          mix(reinterpret_cast<uintptr_t>(t.data_ptr()));
        }
        return static_cast<int64_t>(h);
      },
      py::arg("tensors"));
  m.def(
      "build_train_step",
      [](const ir::Graph& joint, const py::dict& spec, int64_t unroll_steps) {
        auto out = passes::build_train_step(joint, spec_from_py(spec), unroll_steps);
        return py::make_tuple(std::shared_ptr<ir::Graph>(std::move(out.graph)), out.state_names, out.num_user_inputs);
      },
      py::arg("joint"), py::arg("spec"), py::arg("unroll") = 1);
  // The higher-order op table (csrc/ir/higher_order.h), for torch_ext/ir.py's importer and exporter.
  m.def("higher_order_ops", [] {
    py::list out;
    for (const ir::HigherOrderOp& op : ir::higher_order_ops()) {
      py::list args, fx_args;
      for (const ir::HopArg& a : op.args)
        args.append(py::make_tuple(a.name, a.kind == ir::HopArg::Kind::List ? "list" : "value"));
      for (const ir::FxArg& a : op.fx_args)
        fx_args.append(py::make_tuple(a.kind == ir::FxArg::Kind::Region ? "region" : "arg", a.index));
      py::dict d;
      d["name"] = op.name;
      d["target"] = std::string(ir::kHigherOrderNamespace) + "::" + op.name + ".default";
      d["args"] = args;
      d["num_regions"] = op.num_regions;
      d["fx_args"] = fx_args;
      d["bare_output_regions"] = op.bare_output_regions;
      out.append(d);
    }
    return out;
  });

  // The ops whose CPU kernels lay their first result out otherwise than their meta kernels (csrc/ir/type_check.h),
  // for torch_ext/_compat.py's trace patch: (name, overload, input position, layout), the layout True (contiguous),
  // False (the input's suggested memory format) or "elementwise".
  m.def("cpu_layout_ops", [] {
    py::list out;
    for (const ir::CpuLayoutOp& op : ir::cpu_layout_ops())
      out.append(py::make_tuple(op.name, op.overload, op.input,
                                op.layout == ir::CpuLayout::Elementwise
                                    ? py::object(py::str("elementwise"))
                                    : py::object(py::bool_(op.layout == ir::CpuLayout::Contiguous))));
    return out;
  });

  // TensorIterator's layout for an elementwise op over two tensors of these sizes and strides (the type checker's
  // rule, ir::elementwise_strides), for torch_ext/_compat.py's trace patch: the result's strides, or None where
  // they do not broadcast.
  m.def("elementwise_strides", [](std::vector<int64_t> a_sizes, std::vector<int64_t> a_strides,
                                  std::vector<int64_t> b_sizes, std::vector<int64_t> b_strides) -> py::object {
    TORCH_CHECK(a_sizes.size() == a_strides.size() && b_sizes.size() == b_strides.size(),
                "elementwise_strides: sizes and strides of different lengths: ", a_sizes.size(), " and ",
                a_strides.size(), ", ", b_sizes.size(), " and ", b_strides.size());
    const auto meta = [](const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
      return at::empty_strided(sizes, strides, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
    };
    auto strides = ir::elementwise_strides(meta(a_sizes, a_strides), meta(b_sizes, b_strides));
    if (!strides) return py::none();
    return py::tuple(py::cast(*strides));
  }, py::arg("a_sizes"), py::arg("a_strides"), py::arg("b_sizes"), py::arg("b_strides"));

  // The optimizer registry (optim/descriptor.h): torch_ext.optim generates the fake kernels and
  // reads the state slots from it; state names are built and parsed only here.
  m.def("optimizer_descriptors", [] {
    py::list out;
    for (const optim::Descriptor* d : optim::all()) {
      py::list slots, scalars;
      for (const optim::Slot& s : d->slots)
        slots.append(py::make_tuple(s.name, s.is_step()                            ? "step"
                                            : s.init == optim::SlotInit::ScalarOne ? "one"
                                            : s.is_factored()                      ? "factored"
                                                                                   : "zeros"));
      py::list schedulable;
      for (const optim::Scalar& x : d->scalars) {
        scalars.append(py::make_tuple(x.name, x.type == optim::ScalarType::Bool  ? "bool"
                                              : x.type == optim::ScalarType::Int ? "int"
                                                                                 : "float"));
        if (x.schedulable) schedulable.append(x.name);
      }
      py::dict e;
      e["kind"] = d->kind;
      e["title"] = d->title;
      e["op"] = d->op_name();
      e["inplace_op"] = d->inplace_op_name();
      e["slots"] = slots;
      e["scalars"] = scalars;
      e["schedulable"] = schedulable;  // Tensor arguments of the "scheduled" overload
      e["elementwise"] = d->elementwise;
      out.append(e);
    }
    return out;
  });
  // A slot's shape for a parameter's shape, as the descriptor derives it (a factored slot's differs).
  m.def(
      "optimizer_slot_shape",
      [](const std::string& kind, const std::string& slot, const std::vector<int64_t>& param) {
        const std::vector<optim::Slot>& slots = optim::get(kind).slots;
        auto it = std::find_if(slots.begin(), slots.end(), [&](const optim::Slot& s) { return s.name == slot; });
        TORCH_CHECK(it != slots.end(), "optimizer kind '", kind, "' has no slot '", slot, "'");
        return it->shape(param);
      },
      py::arg("kind"), py::arg("slot"), py::arg("param_shape"));
  m.def("optimizer_state_name", &optim::state_name, py::arg("param"), py::arg("slot"));
  m.def("optimizer_lr_name", &optim::lr_name, py::arg("group"));
  m.def("optimizer_group_input_name", &optim::group_input_name, py::arg("hyper"), py::arg("group"));
  m.def(
      "parse_optimizer_state_name",
      [](const std::string& name) -> py::object {
        auto parsed = optim::parse_state_name(name);
        if (!parsed) return py::none();
        if (parsed->is_lr()) return py::make_tuple("lr", *parsed->group);
        if (parsed->group) return py::make_tuple("hyper", parsed->hyper, *parsed->group);
        return py::make_tuple("slot", parsed->param, parsed->slot);
      },
      py::arg("name"));

  m.def(
      "sequence_axis",
      [](const ir::Graph& g, int64_t seq_dim) {
        return passes::print_sequence_axis(g, passes::analyze_sequence_axis(g, seq_dim));
      },
      py::arg("graph"), py::arg("seq_dim") = 1);
  m.def(
      "sequence_cone",
      [](const ir::Graph& g, const std::string& source, int64_t seq_dim) {
        const ir::Node* s = g.find(source);
        TORCH_CHECK(s != nullptr && s->kind() != ir::NodeKind::Output, "sequence_cone: unknown node '", source, "'");
        const auto a = passes::analyze_sequence_axis(g, seq_dim);
        py::dict out;
        for (const auto& [n, c] : passes::seq_cone(g, a, s)) out[py::str(n->name())] = passes::to_string(c);
        return out;
      },
      py::arg("graph"), py::arg("source"), py::arg("seq_dim") = 1);
  m.def("schedule", [](ir::Graph& g, bool donate) {
    auto r = passes::schedule(g, donate);
    return py::make_tuple(r.chosen, r.candidates);
  });
  m.def(
      "collective_overlap",
      [](const ir::Graph& g, const std::optional<std::vector<std::string>>& order) {
        std::vector<const ir::Node*> nodes;
        if (order) {
          for (const std::string& name : *order) {
            const ir::Node* n = g.find(name);
            TORCH_CHECK(n != nullptr, "collective_overlap: no node %", name, " in the graph");
            nodes.push_back(n);
          }
        } else {
          for (const auto& n : g.nodes())
            if (n->kind() == ir::NodeKind::Call) nodes.push_back(n.get());
        }
        return passes::collective_overlap(nodes);
      },
      py::arg("graph"), py::arg("order") = py::none());
  m.def("plan_buffers", [](const std::string& algorithm, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& lives) {
    std::vector<ir::BufferLife> b;
    for (const auto& [size, first, last] : lives) b.push_back({size, first, last});
    ir::ArenaPlan plan = algorithm == "best" ? passes::plan_best(b) : passes::plan_buffers(algorithm, b);
    ir::verify_plan(b, plan);
    return py::make_tuple(plan.algorithm, plan.offsets, plan.arena_bytes, ir::lower_bound_bytes(b));
  });
  m.def(
      "batch_cone",
      [](const ir::Graph& g, const py::object& site, int64_t k, const std::vector<std::string>& stop) {
        std::vector<passes::BatchConeEntry> entries;
        if (py::isinstance<py::str>(site)) {
          entries.push_back({site.cast<std::string>(), k});
        } else {  // [(site, k), ...] along a chain, upstream first
          for (const auto& e : site.cast<std::vector<std::pair<std::string, int64_t>>>())
            entries.push_back({e.first, e.second});
        }
        passes::BatchCone r = passes::batch_cone(g, entries, stop);
        std::vector<std::tuple<std::string, std::string, int64_t>> ext;
        for (const auto& e : r.externals) ext.emplace_back(e.placeholder, e.source, e.copies);
        return py::make_tuple(std::shared_ptr<ir::Graph>(std::move(r.graph)), ext, r.output_batched, r.num_calls);
      },
      py::arg("graph"), py::arg("site"), py::arg("k") = 1, py::arg("stop") = std::vector<std::string>{},
      "The cone of `site` K times over along dim 0, or of entries [(site, k), ...] along a chain "
      "(csrc/passes/batch_cone.h): (graph, [(placeholder, source, copies: 0 read as it is, else tiled that many "
      "times)], per-output stacked flags, number of calls).");
  m.def(
      "split_heads",
      [](ir::Graph& g, const std::vector<std::pair<std::string, int64_t>>& sites) {
        std::vector<passes::SplitHeadsSite> s;
        for (const auto& p : sites) s.push_back({p.first, p.second});
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (const auto& r : passes::split_heads(g, s)) out.emplace_back(r.result, r.output, r.replaced);
        return out;
      },
      "Splits each (z node, heads) attention output projection into per-head results plus a sum; returns "
      "(result, output, replaced projection) node names per site (csrc/passes/split_heads.h).");
  m.def("split_convolution_backward", &passes::split_convolution_backward,
        "Splits each named convolution_backward computing input and weight gradients into one call per part "
        "(csrc/passes/split_convolution_backward.h).");
  m.def("splittable_convolution_backwards", &passes::splittable_convolution_backwards,
        "The convolution_backward calls split_convolution_backward can split, in graph order.");
  m.def("rematerialize", [](ir::Graph& g, const std::vector<std::string>& names) {
    auto r = passes::rematerialize(g, names);
    return py::make_tuple(r.recomputed, r.clones);
  });
  m.def("rematerialize_for_budget", [](ir::Graph& g, int64_t budget, bool donate, bool prune_by_bound) {
    auto r = passes::rematerialize_for_budget(g, budget, donate, prune_by_bound);
    py::dict d;
    d["feasible"] = r.feasible;
    d["budget"] = r.budget;
    d["peak_before"] = r.peak_before;
    d["peak"] = r.peak;
    d["min_peak"] = r.min_peak;
    d["forward_flops"] = r.forward_flops;
    d["added_flops"] = r.added_flops;
    d["recomputed"] = r.recomputed;
    d["evaluations"] = r.evaluations;
    d["pruned"] = r.pruned;
    return d;
  }, py::arg("graph"), py::arg("budget"), py::arg("donate"), py::arg("prune_by_bound") = true);
  m.def("plan_memory", [](const ir::Graph& g, bool donate) { return plan_to_py(passes::plan_memory(g, donate)); });
  py::class_<runtime::ArenaExecutor, std::shared_ptr<runtime::ArenaExecutor>>(m, "ArenaExecutor")
      .def(py::init([](const ir::Graph& g, size_t num_state, bool donate) {
        // verify, plan, lower, run: the executor only consumes the plan and the lowered graph.
        auto lowered = g.clone();
        ir::verify(*lowered);
        ir::MemoryPlan plan = passes::plan_memory(*lowered, donate);
        passes::lower_out_variants(*lowered, plan);
        return std::make_shared<runtime::ArenaExecutor>(std::move(lowered), std::move(plan), num_state, donate);
      }))
      .def("plan", [](const runtime::ArenaExecutor& ex) { return plan_to_py(ex.plan()); })
      .def("memory_analysis",
           [](const runtime::ArenaExecutor& ex) {
             const auto sep = passes::plan_phases_separately(ex.plan());
             py::dict parts;
             for (const auto& [phase, bytes] : sep.parts) parts[ir::to_string(phase)] = bytes;
             py::dict d;
             d["separate_planned"] = sep.total;
             d["separate_parts"] = parts;
             d["timeline"] = passes::live_timeline(ex.plan());
             return d;
           },
           "The memory report's analyses of this plan (csrc/passes/memory_analysis.h).")
      .def("num_out_variant", &runtime::ArenaExecutor::num_out_variant)
      .def("num_inplace_updates", &runtime::ArenaExecutor::num_inplace_updates)
      .def("fallbacks", &runtime::ArenaExecutor::fallbacks)
      .def("run", [](runtime::ArenaExecutor& ex, py::sequence inputs) {
        return run_without_gil(inputs, [&](std::vector<c10::IValue> in) { return ex.run(std::move(in)); });
      });
}
