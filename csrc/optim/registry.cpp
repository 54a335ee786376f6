#include "optim/descriptor.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <map>

namespace torch_ext::optim {
namespace {

constexpr const char* kPrefix = "opt:";
constexpr const char* kGroup = ":group";

// Filled while the library loads (define runs inside TORCH_LIBRARY_FRAGMENT), read-only after.
// A deque keeps the descriptors' addresses stable; a function-local static is built on first
// use, whichever fragment's static initialiser comes first.
struct Registry {
  std::deque<Descriptor> descriptors;
  std::map<std::string, const Descriptor*> by_kind;
  std::map<std::string, const Descriptor*> by_op;
};

Registry& registry() {
  static Registry r;
  return r;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

namespace detail {
const Descriptor& add(Descriptor d) {
  Registry& r = registry();
  TORCH_CHECK(!r.by_kind.count(d.kind), "optimizer kind '", d.kind, "' is registered twice");
  TORCH_CHECK(d.kernel != nullptr, "optimizer kind '", d.kind, "' has no kernel");
  for (const Slot& slot : d.slots)
    TORCH_CHECK(!slot.is_factored() || !d.elementwise, "optimizer kind '", d.kind, "': slot '", slot.name,
                "' is factored (not shaped like the parameter), so the kind cannot be elementwise");
  const Descriptor& stored = r.descriptors.emplace_back(std::move(d));
  r.by_kind[stored.kind] = &stored;
  r.by_op[stored.op_name()] = &stored;
  return stored;
}
}  // namespace detail

std::vector<const Descriptor*> all() {
  std::vector<const Descriptor*> out;
  for (const auto& [kind, d] : registry().by_kind) out.push_back(d);
  return out;
}

const Descriptor* find(const std::string& kind) {
  const auto& m = registry().by_kind;
  auto it = m.find(kind);
  return it == m.end() ? nullptr : it->second;
}

const Descriptor& get(const std::string& kind) {
  if (const Descriptor* d = find(kind)) return *d;
  std::string known;
  for (const Descriptor* d : all()) known += (known.empty() ? "" : ", ") + d->kind;
  TORCH_CHECK(false, "unknown update kind '", kind, "' (expected one of: ", known, ")");
}

const Descriptor* find_by_op(const std::string& op_name) {
  const auto& m = registry().by_op;
  auto it = m.find(op_name);
  return it == m.end() ? nullptr : it->second;
}

std::vector<int64_t> Slot::shape(c10::IntArrayRef param) const {
  if (is_scalar()) return {};
  std::vector<int64_t> out(param.begin(), param.end());
  if (!is_factored()) return out;
  TORCH_CHECK(param.size() >= 2, "optimizer slot '", name, "' is factored over dim ", factored_dim,
              " and needs a parameter of 2 or more dims, got shape ", param);
  TORCH_INTERNAL_ASSERT(factored_dim == -1 || factored_dim == -2, "slot '", name, "': factored_dim ", factored_dim);
  out[out.size() + factored_dim] = 1;
  return out;
}

std::string state_name(const std::string& param, const std::string& slot) { return kPrefix + param + ":" + slot; }

std::string group_input_name(const std::string& hyper, int64_t group) {
  return kPrefix + hyper + kGroup + std::to_string(group);
}

std::string lr_name(int64_t group) { return group_input_name("lr", group); }

std::optional<StateName> parse_state_name(const std::string& name) {
  if (!starts_with(name, kPrefix)) return std::nullopt;
  StateName out;
  // "opt:<hyper>:group<digits>": no slot is named group<digits>, and no hyperparameter name holds
  // ':' or '.' (parameter names, "model.<...>", hold a '.').
  const size_t start = std::string(kPrefix).size();
  const size_t group_at = name.rfind(kGroup);
  const size_t digits = group_at + std::string(kGroup).size();
  if (group_at != std::string::npos && group_at > start && digits < name.size() &&
      std::all_of(name.begin() + digits, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    const std::string hyper = name.substr(start, group_at - start);
    if (hyper.find_first_of(":.") == std::string::npos) {
      out.group = std::stoll(name.substr(digits));
      out.hyper = hyper;
      return out;
    }
  }
  // The slot is the last part: parameter names may hold ':' (never slot names).
  const size_t colon = name.rfind(':');
  if (colon == std::string::npos || colon < start + 1 || colon + 1 == name.size()) return std::nullopt;
  out.param = name.substr(start, colon - start);
  out.slot = name.substr(colon + 1);
  return out;
}

}  // namespace torch_ext::optim
