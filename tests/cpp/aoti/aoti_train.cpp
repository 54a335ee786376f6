// Runs an AOTInductor-compiled torch_ext pure training step with no Python.
//
//   aoti_train <step.pt2> <state.pt> <batches.pt> [--constant-lr | --lrs <lrs.pt>] [--save-state <out.pt>]
//
// step.pt2 is a package from step.to_aoti(path): its metadata holds the flat layout, read here
// (not taken from Python): "torch_ext.inputs" names each program input in order (a state entry,
// or "batch:<i>", the i-th tensor of a call's batch), "torch_ext.state_names" the entries of the
// new state, "torch_ext.outputs" the program's outputs in order ("loss", returned state entries,
// "aux:<k>"), "torch_ext.donated" the state entries a donating package (step.to_aoti(path,
// donate=True)) writes into its input tensors instead of returning them, and
// "torch_ext.fingerprint" the program's hash, and "torch_ext.input_strides" (only in a package of
// step.to_aoti(path, channels_last=True)) the strides each input was compiled for, one
// "<rank>:<s0>,<s1>,..." line per input (contiguous where absent), and "torch_ext.batch" the dtype
// and shape each batch tensor was compiled for, one "<ScalarType>:<d0>,<d1>,..." line per tensor
// (the package's kernels read a batch with those, unchecked: a call whose batch differs is refused).
// "torch_ext.state" holds each state input's dtype and shape ("<name>=<ScalarType>:<d0>,<d1>,...");
// an entry that differs is refused. "torch_ext.batch_paths" holds each batch tensor's pytree key path in the example batch, one per line
// ("[0]" for the first positional tensor, "[0]['tokens']" for a dict's key): a call whose batch is a
// dict (or a list holding dicts) is matched by those keys, whatever their order; a package whose
// batch has dict keys refuses a flat list (its order may not be the example's).
// Packages older than "torch_ext.outputs" return the loss and then every state entry.
// state.pt is torch.save(state.state_dict()) (the checkpoint format: params/buffers/opt dicts,
// the lr list, rng, fingerprint); batches.pt is torch.save([[tensor, ...], ...]), one list of
// batch tensors per call. Each call's new state feeds the next. Prints one loss per line (an
// accumulating or unrolled package: one per micro-batch or step, in order). A package
// of a step built with scheduler= ("torch_ext.scheduler" is 1) takes its lr as an input it does not
// advance (the schedule itself is Python, not in the package): it is refused unless --lrs gives the
// lr of every param group for each call (torch.save(step.lr_schedule(state, calls)): a list of lists
// of floats, in the state's lr order), or --constant-lr says to train every call at the state's lr.
// A package whose scheduler also cycles momentum takes the scheduled hyperparameters as inputs too
// ("opt:<scalar>:group<k>", e.g. opt:momentum:group0): --lrs then holds, per call, a dict from each
// such input's name (and each lr's, "opt:lr:group<k>") to its value
// (torch.save(step.input_schedule(state, calls))).
// --save-state <out.pt> writes the state after the last call in the format state.pt was read in
// (a pickle of the state_dict(): torch.load(out.pt, weights_only=True) reads it, and
// torch_ext.load_step(step.pt2).load_state(out.pt) makes it a TrainState), every key of state.pt
// kept in its order: the entries as the package left them (optimizer step counts and the rng
// included), "sched_epoch" advanced by the calls' steps ("torch_ext.unroll" per call) when a
// scheduled package follows --lrs, and "unstepped" emptied by any call (every parameter has
// optimizer state after one). A scheduled package's lr is then the schedule's for the next call, as
// load_step's state holds it: --lrs must give one more entry than there are calls
// (step.input_schedule(state, calls + 1)), or the saved lr would be the last call's, which the
// scheduler refuses on the next call. Under --constant-lr the epoch stays, as load_step(path,
// manual_lr=True) keeps it.
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {
c10::IValue load(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::string("cannot read ") + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return torch::jit::pickle_load(bytes);
  } catch (const c10::Error& e) {
    // torch.save(state) pickles a Python TrainState, which C++ cannot unpickle (it threw a stack trace
    // naming only the class): say which file and what to save instead.
    if (std::string(e.what_without_backtrace()).find("TrainState") != std::string::npos)
      throw std::runtime_error(std::string(path) + " holds a pickled Python TrainState (torch.save(state)); "
                               "save torch.save(state.state_dict(), path) for aoti_train");
    throw std::runtime_error(std::string(path) + ": " + e.what_without_backtrace());
  }
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

// The lines of an optional metadata entry (none when absent).
std::vector<std::string> meta_lines_or(const std::unordered_map<std::string, std::string>& meta, const std::string& key,
                                       std::vector<std::string> otherwise) {
  auto it = meta.find(key);
  return it == meta.end() ? otherwise : lines(it->second);
}

// The strides of "torch_ext.input_strides" by input name; empty for a package compiled contiguous.
std::map<std::string, std::vector<int64_t>> strides_by_input(const std::vector<std::string>& inputs,
                                                             const std::vector<std::string>& spec, const char* package) {
  std::map<std::string, std::vector<int64_t>> out;
  if (spec.empty()) return out;
  if (spec.size() != inputs.size()) {
    throw std::runtime_error(std::string(package) + ": torch_ext.input_strides has " + std::to_string(spec.size()) +
                             " lines for " + std::to_string(inputs.size()) + " inputs");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const size_t colon = spec[i].find(':');
    std::vector<int64_t> strides;
    std::istringstream is(spec[i].substr(colon + 1));
    for (std::string s; std::getline(is, s, ',');) strides.push_back(std::stoll(s));
    if (colon == std::string::npos || strides.size() != std::stoul(spec[i].substr(0, colon))) {
      throw std::runtime_error(std::string(package) + ": bad torch_ext.input_strides line '" + spec[i] + "'");
    }
    out[inputs[i]] = std::move(strides);
  }
  return out;
}

// A batch tensor's dtype and shape as "torch_ext.batch" writes them: "<ScalarType>:<d0>,<d1>,...".
std::string dtype_and_shape(const at::Tensor& t) {
  std::string out = std::string(c10::toString(t.scalar_type())) + ":";
  for (size_t d = 0; d < static_cast<size_t>(t.dim()); ++d) out += (d ? "," : "") + std::to_string(t.size(d));
  return out;
}

// t in the strides the package indexes it with (unchecked by its kernels): t itself when it has
// them, else a copy (contiguous when the package records none).
at::Tensor in_compiled_strides(const at::Tensor& t, const std::map<std::string, std::vector<int64_t>>& strides,
                               const std::string& name) {
  auto it = strides.find(name);
  if (it == strides.end()) return t.contiguous();
  if (t.strides() == at::IntArrayRef(it->second)) return t;
  return at::empty_strided(t.sizes(), it->second, t.options()).copy_(t);
}

std::string meta_at(const std::unordered_map<std::string, std::string>& meta, const std::string& key,
                    const char* package) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    throw std::runtime_error(std::string(package) + " has no " + key +
                             " metadata: compile it with step.to_aoti(path)");
  }
  return it->second;
}

// "opt:<hyper>:group<k>": a param group's per-call input, its lr or a scheduled hyperparameter (no
// hyperparameter name holds ':' or '.'; parameter names "model.<...>" hold a '.').
bool is_scheduled_input(const std::string& name) {
  const std::string prefix = "opt:", group = ":group";
  if (name.rfind(prefix, 0) != 0) return false;
  const size_t at = name.rfind(group);
  if (at == std::string::npos || at <= prefix.size() || at + group.size() == name.size()) return false;
  const std::string hyper = name.substr(prefix.size(), at - prefix.size());
  return hyper.find_first_of(":.") == std::string::npos &&
         std::all_of(name.begin() + at + group.size(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The tensors of one call's batch by pytree key path, as torch_ext's layout writes them ("[i]" for a
// list element or an int key, "['k']" for a string key).
void flatten_with_paths(const c10::IValue& v, const std::string& path, std::vector<std::pair<std::string, at::Tensor>>& out,
                        const char* file) {
  if (v.isTensor()) {
    out.emplace_back(path, v.toTensor());
  } else if (v.isList() || v.isTuple()) {
    const auto elems = v.isList() ? v.toListRef().vec() : v.toTupleRef().elements().vec();
    for (size_t i = 0; i < elems.size(); ++i) flatten_with_paths(elems[i], path + "[" + std::to_string(i) + "]", out, file);
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) {
      const c10::IValue& k = kv.key();
      TORCH_CHECK(k.isString() || k.isInt(), file, ": batch key ", path, "[", k.tagKind(), "] is neither a string nor an int");
      flatten_with_paths(kv.value(), path + (k.isString() ? "['" + k.toStringRef() + "']" : "[" + std::to_string(k.toInt()) + "]"),
                         out, file);
    }
  } else {
    TORCH_CHECK(false, file, ": batch element ", path.empty() ? "(the call's batch)" : path, " is a ", v.tagKind(),
                ", not a tensor, list or dict");
  }
}

// One call's batch tensors in the package's order. `paths` (torch_ext.batch_paths, empty in older
// packages) are matched by key when the example batch had dict keys: a dict's keys may come in any
// order (positionally, {"targets", "tokens"} fed the targets as the tokens, silently), but none may be
// missing or extra. A call given as a dict is the batch of one positional argument ({...} for "[0]...").
std::vector<at::Tensor> batch_in_package_order(const c10::IValue& call_batch, const std::vector<std::string>& paths,
                                               size_t call, const char* file) {
  const bool keyed = std::any_of(paths.begin(), paths.end(), [](const std::string& p) { return p.find("['") != std::string::npos; });
  std::vector<std::pair<std::string, at::Tensor>> flat;
  if (call_batch.isGenericDict()) {
    flatten_with_paths(call_batch, "[0]", flat, file);
  } else {
    flatten_with_paths(call_batch, "", flat, file);
  }
  if (!keyed) {
    TORCH_CHECK(!call_batch.isGenericDict(), file, ": call ", call, "'s batch is a dict, but the package's example batch had no dict keys; save a list of tensors");
    std::vector<at::Tensor> out;
    for (auto& [_, t] : flat) out.push_back(t);
    return out;
  }
  std::map<std::string, at::Tensor> by_path(flat.begin(), flat.end());
  std::vector<std::string> missing, extra;
  for (const std::string& p : paths)
    if (!by_path.count(p)) missing.push_back(p);
  for (const auto& [p, _] : flat)
    if (std::find(paths.begin(), paths.end(), p) == paths.end()) extra.push_back(p);
  if (!missing.empty() || !extra.empty()) {
    auto join = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& e : v) s += (s.empty() ? "" : ", ") + e;
      return s.empty() ? std::string("none") : s;
    };
    throw std::invalid_argument(std::string(file) + ": call " + std::to_string(call) +
                                "'s batch does not have the example batch's keys (the package's batch is keyed: save "
                                "each call's batch as a dict, or a list of dicts per unrolled call); missing " +
                                join(missing) + "; not in the example: " + join(extra));
  }
  std::vector<at::Tensor> out;
  for (const std::string& p : paths) out.push_back(by_path.at(p));
  return out;
}

// The state's entries by the names the layout uses (TrainState.lookup): "model.*" parameters and
// buffers, "opt:<param>:<slot>" and scheduled hyperparameters "opt:<scalar>:group<k>" (both in
// "opt"), "opt:lr:group<k>" and "rng".
std::map<std::string, at::Tensor> entries_of(const c10::IValue& state) {
  const auto dict = state.toGenericDict();
  std::map<std::string, at::Tensor> out;
  for (const char* part : {"params", "buffers", "opt"}) {
    for (const auto& kv : dict.at(part).toGenericDict()) out[kv.key().toStringRef()] = kv.value().toTensor();
  }
  const auto lr = dict.at("lr").toListRef();
  for (size_t k = 0; k < lr.size(); ++k) out["opt:lr:group" + std::to_string(k)] = lr[k].toTensor();
  if (!dict.at("rng").isNone()) out["rng"] = dict.at("rng").toTensor();
  return out;
}

// torch::pickle_save without its type tags: it wraps every typed dict and list in
// torch.jit._pickle.restore_type_tag, a global torch.load(weights_only=True) refuses (so do
// build_tensorlist and the other specialized lists: the caller saves lists of Any). The same
// archive otherwise ("data.pkl" and its tensors' storages, in a zip torch.load reads).
std::vector<char> pickle_untagged(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* buf, size_t size) { pickled.insert(pickled.end(), buf, buf + size); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> out;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
      const char* bytes = static_cast<const char*>(data);
      out.insert(out.end(), bytes, bytes + size);
      return size;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  }
  return out;
}

// Writes the state after the calls as `in` (state.pt's state_dict) holds it: the same keys in the same
// order, each entry replaced by its value in `entries`, "sched_epoch" advanced by `epochs`, and
// "unstepped" emptied once a call has run (torch_ext's call leaves no parameter without optimizer state).
void save_state(const c10::IValue& in, const std::map<std::string, at::Tensor>& entries, int64_t epochs, bool stepped,
                const char* path) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  auto entry = [&](const std::string& name) {
    auto it = entries.find(name);
    TORCH_CHECK(it != entries.end(), "--save-state: no entry '", name, "'");
    return it->second;
  };
  bool has_epoch = false;
  for (const auto& kv : in.toGenericDict()) {
    const std::string key = kv.key().toStringRef();
    if (key == "params" || key == "buffers" || key == "opt") {
      c10::impl::GenericDict part(c10::StringType::get(), c10::TensorType::get());
      for (const auto& e : kv.value().toGenericDict()) part.insert(e.key(), entry(e.key().toStringRef()));
      out.insert(kv.key(), part);
    } else if (key == "lr") {
      // A list of Any: a List[Tensor] pickles as torch.jit._pickle.build_tensorlist, refused by weights_only.
      c10::impl::GenericList lr(c10::AnyType::get());
      for (size_t k = 0; k < kv.value().toListRef().size(); ++k) lr.push_back(entry("opt:lr:group" + std::to_string(k)));
      out.insert(kv.key(), lr);
    } else if (key == "rng") {
      out.insert(kv.key(), kv.value().isNone() ? c10::IValue() : c10::IValue(entry("rng")));
    } else if (key == "sched_epoch") {
      has_epoch = true;
      out.insert(kv.key(), kv.value().toInt() + epochs);
    } else if (key == "unstepped" && stepped) {
      out.insert(kv.key(), c10::impl::GenericList(c10::AnyType::get()));
    } else {
      out.insert(kv.key(), kv.value());
    }
  }
  if (!has_epoch) out.insert("sched_epoch", epochs);  // a checkpoint from before the epoch was saved
  const std::vector<char> bytes = pickle_untagged(out);
  // Written whole to a temporary name and renamed: an interrupted run leaves no truncated checkpoint.
  const std::string tmp = std::string(path) + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f.good()) throw std::runtime_error(std::string("cannot write ") + tmp);
  }
  if (std::rename(tmp.c_str(), path) != 0) throw std::runtime_error(std::string("cannot rename ") + tmp + " to " + path);
}

int run(int argc, char** argv) {
  bool constant_lr = false, bad_usage = argc < 4;
  const char* lrs_path = nullptr;
  const char* save_path = nullptr;
  for (int i = 4; i < argc && !bad_usage; ++i) {
    const std::string flag = argv[i];
    if (flag == "--constant-lr" && !constant_lr) {
      constant_lr = true;
    } else if (flag == "--lrs" && !lrs_path && i + 1 < argc) {
      lrs_path = argv[++i];
    } else if (flag == "--save-state" && !save_path && i + 1 < argc) {
      save_path = argv[++i];
    } else {
      bad_usage = true;
    }
  }
  const bool lr_file = lrs_path != nullptr;
  if (bad_usage || (constant_lr && lr_file)) {
    std::fprintf(stderr,
                 "usage: %s <step.pt2> <state.pt> <batches.pt> [--constant-lr | --lrs <lrs.pt>] [--save-state <out.pt>]\n",
                 argv[0]);
    return 2;
  }
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  const auto meta = loader.get_metadata();
  const std::vector<std::string> inputs = lines(meta_at(meta, "torch_ext.inputs", argv[1]));
  const std::vector<std::string> state_names = lines(meta_at(meta, "torch_ext.state_names", argv[1]));
  const std::string fingerprint = meta_at(meta, "torch_ext.fingerprint", argv[1]);
  const bool has_scheduler = meta_lines_or(meta, "torch_ext.scheduler", {"0"}) != std::vector<std::string>{"0"};
  // A step built with scheduler= takes its lr as an input it does not advance (the scheduler is
  // Python): this runner would train every call at the state's lr, which the step did not do.
  if (has_scheduler && !constant_lr && !lr_file) {
    std::fprintf(stderr,
                 "%s was compiled from a step built with scheduler=, whose lr follows the scheduler; pass "
                 "--lrs <lrs.pt> (torch.save(step.lr_schedule(state, calls), 'lrs.pt')) to follow it, or "
                 "--constant-lr to keep the state's lr for every call\n",
                 argv[1]);
    return 2;
  }
  // The scheduler epochs one call advances (a step unrolled k times takes k optimizer steps per call).
  int64_t unroll = 1;
  if (save_path && has_scheduler && lr_file) {
    const std::vector<std::string> u = meta_lines_or(meta, "torch_ext.unroll", {});
    if (u.size() != 1) {
      std::fprintf(stderr,
                   "%s records no torch_ext.unroll (compiled before --save-state), so the scheduler epoch of the "
                   "saved state is unknown: compile it again with step.to_aoti(path)\n",
                   argv[1]);
      return 2;
    }
    unroll = std::stoll(u[0]);
  }
  std::vector<std::string> loss_then_state{"loss"};
  loss_then_state.insert(loss_then_state.end(), state_names.begin(), state_names.end());
  const std::vector<std::string> outputs = meta_lines_or(meta, "torch_ext.outputs", loss_then_state);
  const std::vector<std::string> donated = meta_lines_or(meta, "torch_ext.donated", {});
  std::map<std::string, size_t> output_index;
  for (size_t i = 0; i < outputs.size(); ++i) output_index[outputs[i]] = i;
  if (outputs.empty() || outputs[0] != "loss") {
    std::fprintf(stderr, "%s: the program's first output is '%s', not the loss\n", argv[1],
                 outputs.empty() ? "" : outputs[0].c_str());
    return 2;
  }
  // Every new state entry is either returned or written in place into its (donated) input.
  for (const std::string& name : state_names) {
    const bool is_donated = std::find(donated.begin(), donated.end(), name) != donated.end();
    if (!output_index.count(name) && !is_donated) {
      std::fprintf(stderr, "%s: state entry '%s' is neither an output nor donated\n", argv[1], name.c_str());
      return 2;
    }
  }

  const c10::IValue state = load(argv[2]);
  if (!state.isGenericDict()) {
    std::fprintf(stderr, "%s holds a %s, not a state (torch.save(state.state_dict()), a dict)\n", argv[2],
                 state.tagKind().c_str());
    return 2;
  }
  for (const char* key : {"params", "buffers", "opt", "lr", "rng", "fingerprint"}) {
    if (!state.toGenericDict().contains(key)) {
      std::fprintf(stderr, "%s has no '%s': expected torch.save(state.state_dict())\n", argv[2], key);
      return 2;
    }
  }
  const std::string made_by = state.toGenericDict().at("fingerprint").toStringRef();
  if (made_by != fingerprint) {
    std::fprintf(stderr, "%s was made by a different program (fingerprint '%s') than %s (fingerprint '%s')\n",
                 argv[2], made_by.c_str(), argv[1], fingerprint.c_str());
    return 2;
  }
  std::map<std::string, at::Tensor> entries = entries_of(state);
  // Each state input's dtype and shape as compiled ("torch_ext.state", "<name>=<ScalarType>:<d0>,..."
  // lines; absent in older packages): the kernels read an entry with those, unchecked, so a float32
  // lr (read as float64) or a float16 moment trained silently on other values.
  for (const std::string& line : meta_lines_or(meta, "torch_ext.state", {})) {
    const size_t eq = line.rfind('=');
    const std::string name = line.substr(0, eq), want = line.substr(eq + 1);
    auto it = entries.find(name);
    if (it == entries.end()) continue;  // reported below, where the program reads it
    const std::string got = dtype_and_shape(it->second);
    const bool same = want.rfind("?:", 0) == 0 ? got.substr(got.find(':')) == want.substr(1) : got == want;
    if (!same) {
      std::fprintf(stderr, "%s: entry '%s' has dtype:shape %s, %s was compiled for %s\n", argv[2], name.c_str(),
                   got.c_str(), argv[1], want.c_str());
      return 2;
    }
  }
  // The package's kernels index every input with the strides it was compiled for, without checking
  // (torch.save keeps a transposed tensor transposed): the runner owns copies in those strides.
  const auto strides = strides_by_input(inputs, meta_lines_or(meta, "torch_ext.input_strides", {}), argv[1]);
  for (auto& entry : entries) entry.second = in_compiled_strides(entry.second, strides, entry.first);
  // A donating package overwrites each donated entry's tensor: entries sharing memory (torch.save
  // keeps sharing) would overwrite each other's new values.
  std::map<const void*, std::string> donated_storage;
  for (const std::string& name : donated) {
    auto it = entries.find(name);
    if (it == entries.end()) {
      std::fprintf(stderr, "%s has no entry '%s' that %s updates in place\n", argv[2], name.c_str(), argv[1]);
      return 2;
    }
    auto [seen, fresh] = donated_storage.emplace(it->second.storage().data(), name);
    if (!fresh) {
      std::fprintf(stderr, "%s: entries '%s' and '%s' share memory, and %s updates both in place (a donating package)\n",
                   argv[2], seen->second.c_str(), name.c_str(), argv[1]);
      return 2;
    }
  }
  const std::string batch_prefix = "batch:";
  // The dtype and shape of each batch tensor the package was compiled for (absent in packages from
  // before it was recorded): its kernels read a batch with those, unchecked, so a float64 batch or a
  // last partial batch (a view of a full one: torch.save keeps the whole storage) trained silently
  // on other values.
  const std::vector<std::string> batch_spec = meta_lines_or(meta, "torch_ext.batch", {});
  const std::vector<std::string> batch_paths = meta_lines_or(meta, "torch_ext.batch_paths", {});
  const c10::IValue batches = load(argv[3]);  // kept alive: toListRef() views it
  // --lrs: per call, the value of every per-call input (each group's lr, and any scheduled
  // hyperparameter), fed as the state's entries of those names (float64 scalars).
  std::vector<std::map<std::string, double>> per_call;
  if (lr_file) {
    size_t groups = 0;
    while (entries.count("opt:lr:group" + std::to_string(groups))) ++groups;
    std::vector<std::string> scheduled;  // inputs "opt:<scalar>:group<k>" other than the lr
    for (const std::string& name : inputs)
      if (is_scheduled_input(name) && name.rfind("opt:lr:", 0) != 0) scheduled.push_back(name);
    const c10::IValue given = load(lrs_path);
    TORCH_CHECK(given.isList(), lrs_path, ": expected a list (one per call) of lists of floats or dicts, got ",
                given.tagKind());
    for (const auto& call : given.toListRef()) {
      std::map<std::string, double> values;
      auto value_of = [&](const c10::IValue& v) {
        TORCH_CHECK(v.isDouble() || v.isInt(), lrs_path, ": entry ", per_call.size(), " holds a ", v.tagKind(),
                    ", not a float");
        return v.toScalar().toDouble();
      };
      if (call.isGenericDict()) {
        for (const auto& kv : call.toGenericDict()) {
          const std::string name = kv.key().toStringRef();
          TORCH_CHECK(is_scheduled_input(name) && entries.count(name), lrs_path, ": entry ", per_call.size(),
                      " sets '", name, "', which is not a per-call input of ", argv[1]);
          values[name] = value_of(kv.value());
        }
      } else {
        TORCH_CHECK(call.isList(), lrs_path, ": entry ", per_call.size(), " is a ", call.tagKind(),
                    ", not a list of floats");
        const auto list = call.toListRef();
        TORCH_CHECK(list.size() == groups, lrs_path, ": entry ", per_call.size(), " has ", list.size(),
                    " lrs, the state has ", groups, " param groups");
        for (size_t k = 0; k < list.size(); ++k) values["opt:lr:group" + std::to_string(k)] = value_of(list[k]);
      }
      for (size_t k = 0; k < groups; ++k)
        TORCH_CHECK(values.count("opt:lr:group" + std::to_string(k)), lrs_path, ": entry ", per_call.size(),
                    " gives no lr for group ", k);
      for (const std::string& name : scheduled)
        TORCH_CHECK(values.count(name), lrs_path, ": entry ", per_call.size(), " gives no value for '", name,
                    "', an input the scheduler sets per call in ", argv[1],
                    "; save torch.save(step.input_schedule(state, calls), path) instead");
      per_call.push_back(std::move(values));
    }
    const size_t calls = batches.toListRef().size();
    TORCH_CHECK(per_call.size() >= calls, lrs_path, " has lrs for ", per_call.size(), " calls, ", argv[3], " has ",
                calls, " batches");
    // The saved state of a scheduled package holds the lr of the call after the last (the scheduler's at
    // its epoch, as load_step's state does); the last call's would be refused by the scheduler on resuming.
    if (save_path && has_scheduler && per_call.size() < calls + 1) {
      std::fprintf(stderr,
                   "%s has lrs for %zu calls; --save-state of a package built with scheduler= needs one more than "
                   "the %zu batches of %s (the lr the saved state holds for its next call): save "
                   "step.input_schedule(state, %zu)\n",
                   lrs_path, per_call.size(), calls, argv[3], calls + 1);
      return 2;
    }
  }
  size_t call = 0;
  for (const auto& batch_value : batches.toListRef()) {
    if (lr_file) {
      for (const auto& [name, value] : per_call[call]) {
        at::Tensor& t = entries[name];
        t = at::full({}, value, t.options());
      }
    }
    ++call;
    std::vector<at::Tensor> batch;
    try {
      batch = batch_in_package_order(batch_value, batch_paths, call, argv[3]);
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 2;
    }
    if (meta.count("torch_ext.batch")) {
      if (batch.size() != batch_spec.size()) {
        std::fprintf(stderr, "%s: call %zu's batch has %zu tensors, %s takes %zu\n", argv[3], call, batch.size(),
                     argv[1], batch_spec.size());
        return 2;
      }
      for (size_t i = 0; i < batch.size(); ++i) {
        const std::string& want = batch_spec[i];
        const std::string got = dtype_and_shape(batch[i]);
        // ("?:..." : a dtype without a ScalarType name in the metadata; its shape is still checked)
        const bool same = want.rfind("?:", 0) == 0 ? got.substr(got.find(':')) == want.substr(1) : got == want;
        if (!same) {
          std::fprintf(stderr, "%s: call %zu's batch tensor %zu has dtype:shape %s, %s was compiled for %s\n",
                       argv[3], call, i, got.c_str(), argv[1], want.c_str());
          return 2;
        }
      }
    }
    // In the strides the package was compiled for: the example batch's, recorded in
    // torch_ext.input_strides when they are not contiguous (channels-last images); else contiguous.
    for (size_t i = 0; i < batch.size(); ++i) {
      batch[i] = in_compiled_strides(batch[i], strides, batch_prefix + std::to_string(i));
    }
    std::vector<at::Tensor> flat;
    flat.reserve(inputs.size());
    for (const std::string& name : inputs) {
      if (name.rfind(batch_prefix, 0) == 0) {
        const size_t i = std::stoul(name.substr(batch_prefix.size()));
        if (i >= batch.size()) {
          std::fprintf(stderr, "the program reads %s but a call's batch has %zu tensors\n", name.c_str(), batch.size());
          return 2;
        }
        flat.push_back(batch[i]);
        continue;
      }
      auto it = entries.find(name);
      if (it == entries.end()) {
        std::fprintf(stderr, "%s has no entry '%s' that the program reads\n", argv[2], name.c_str());
        return 2;
      }
      // (a returned entry normally comes back in its compiled strides: then no copy)
      it->second = in_compiled_strides(it->second, strides, name);
      flat.push_back(it->second);
    }
    std::vector<at::Tensor> outs = loader.run(flat);
    if (outs.size() != outputs.size()) {
      std::fprintf(stderr, "%s returned %zu outputs, its layout lists %zu\n", argv[1], outs.size(), outputs.size());
      return 1;
    }
    // One line per loss the call returns: an accumulating or unrolled step returns one per
    // micro-batch or step (item() on them threw "a Tensor with 2 elements cannot be converted to Scalar").
    const at::Tensor losses = outs[0].reshape({-1}).to(at::kDouble).contiguous();
    for (int64_t i = 0; i < losses.numel(); ++i) std::printf("%.9g\n", losses.data_ptr<double>()[i]);
    // Donated entries already hold their new values (written into entries[name] by the call).
    for (const std::string& name : state_names) {
      auto it = output_index.find(name);
      if (it != output_index.end()) entries[name] = outs[it->second];
    }
  }
  if (save_path) {
    if (has_scheduler && lr_file) {
      for (const auto& [name, value] : per_call[call]) {  // the schedule's values for the next call
        at::Tensor& t = entries[name];
        t = at::full({}, value, t.options());
      }
    }
    save_state(state, entries, has_scheduler && lr_file ? static_cast<int64_t>(call) * unroll : 0, call > 0, save_path);
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "aoti_train: %s\n", e.what());
    return 2;
  }
}
