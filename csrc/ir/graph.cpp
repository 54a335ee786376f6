#include "ir/graph.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_set>

namespace torch_ext::ir {

const char* to_string(NodeKind kind) {
  switch (kind) {
    case NodeKind::Placeholder: return "placeholder";
    case NodeKind::Call: return "call";
    case NodeKind::Output: return "output";
  }
  return "?";
}

const char* to_string(InputRole role) {
  switch (role) {
    case InputRole::UserInput: return "input";
    case InputRole::Parameter: return "param";
    case InputRole::Buffer: return "buffer";
    case InputRole::Constant: return "const";
    case InputRole::OptimizerState: return "optstate";
  }
  return "?";
}

std::optional<InputRole> input_role_from_string(const std::string& text) {
  for (InputRole r : {InputRole::UserInput, InputRole::Parameter, InputRole::Buffer, InputRole::Constant,
                      InputRole::OptimizerState})
    if (text == to_string(r)) return r;
  return std::nullopt;
}

// ---------------------------------------------------------------- TensorMeta

namespace {
// Sizes come from user text, so every product is checked: signed overflow is undefined behaviour.
int64_t checked_mul(int64_t a, int64_t b, const std::vector<int64_t>& sizes, const char* what) {
  int64_t r = 0;
  TORCH_CHECK(!__builtin_mul_overflow(a, b, &r), "tensor of sizes ", c10::IntArrayRef(sizes), ": ", what,
              " overflows int64");
  return r;
}
int64_t checked_add(int64_t a, int64_t b, const std::vector<int64_t>& sizes, const char* what) {
  int64_t r = 0;
  TORCH_CHECK(!__builtin_add_overflow(a, b, &r), "tensor of sizes ", c10::IntArrayRef(sizes), ": ", what,
              " overflows int64");
  return r;
}
}  // namespace

int64_t TensorMeta::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "tensor of sizes ", c10::IntArrayRef(sizes), " has a negative size");
    n = checked_mul(n, s, sizes, "the element count");
  }
  return n;
}

int64_t TensorMeta::nbytes() const {
  // Storage span actually addressed, which is numel for contiguous tensors.
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  if (sizes.empty()) return elem;
  const int64_t n = numel();
  if (n == 0) return 0;
  int64_t span = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    const int64_t stride = strides.size() == sizes.size() ? strides[d] : 1;
    TORCH_CHECK(stride != INT64_MIN, "tensor of sizes ", c10::IntArrayRef(sizes), ": stride out of range");
    span = checked_add(span, checked_mul(sizes[d] - 1, std::abs(stride), sizes, "the storage span"), sizes,
                       "the storage span");
  }
  return checked_mul(std::max(span, n), elem, sizes, "the byte size");
}

std::vector<int64_t> TensorMeta::contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t acc = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = acc;
    // The outermost size never enters a stride, so only inner products are checked.
    if (d > 0) acc = checked_mul(acc, std::max<int64_t>(sizes[d], 1), sizes, "the contiguous strides");
  }
  return strides;
}

bool TensorMeta::is_contiguous() const { return strides == contiguous_strides(sizes); }

bool TensorMeta::operator==(const TensorMeta& o) const {
  return dtype == o.dtype && sizes == o.sizes && strides == o.strides && device == o.device;
}

// ---------------------------------------------------------------- Type

Type Type::make_tensor(TensorMeta meta) {
  Type t;
  t.kind = Kind::Tensor;
  if (meta.strides.size() != meta.sizes.size()) meta.strides = TensorMeta::contiguous_strides(meta.sizes);
  t.tensor = std::move(meta);
  return t;
}

Type Type::make_tuple(std::vector<Type> elems) {
  Type t;
  t.kind = Kind::Tuple;
  t.elems = std::move(elems);
  return t;
}

Type Type::make_scalar(Kind kind) {
  TORCH_INTERNAL_ASSERT(kind != Kind::Tensor && kind != Kind::Tuple);
  Type t;
  t.kind = kind;
  return t;
}

bool Type::operator==(const Type& o) const {
  if (kind != o.kind) return false;
  if (kind == Kind::Tensor) return tensor == o.tensor;
  if (kind == Kind::Tuple) return elems == o.elems;
  return true;
}

// ---------------------------------------------------------------- Arg

namespace {
// An Arg of `kind` with one payload field set by `fill`.
template <typename Fill>
Arg make_arg(Arg::Kind kind, Fill fill) {
  Arg a;
  a.kind = kind;
  fill(a);
  return a;
}
}  // namespace

Arg Arg::of_node(Node* n) {
  TORCH_INTERNAL_ASSERT(n != nullptr);
  return make_arg(Kind::Node, [&](Arg& a) { a.node = n; });
}
Arg Arg::of_int(int64_t v) { return make_arg(Kind::Int, [&](Arg& a) { a.i = v; }); }
Arg Arg::of_float(double v) { return make_arg(Kind::Float, [&](Arg& a) { a.f = v; }); }
Arg Arg::of_bool(bool v) { return make_arg(Kind::Bool, [&](Arg& a) { a.i = v ? 1 : 0; }); }
Arg Arg::of_string(std::string v) { return make_arg(Kind::String, [&](Arg& a) { a.s = std::move(v); }); }
Arg Arg::of_list(std::vector<Arg> v) { return make_arg(Kind::List, [&](Arg& a) { a.list = std::move(v); }); }
Arg Arg::of_dtype(c10::ScalarType v) { return make_arg(Kind::Dtype, [&](Arg& a) { a.i = static_cast<int64_t>(v); }); }
Arg Arg::of_device(const c10::Device& v) { return make_arg(Kind::Device, [&](Arg& a) { a.s = v.str(); }); }
Arg Arg::of_layout(c10::Layout v) { return make_arg(Kind::Layout, [&](Arg& a) { a.i = static_cast<int64_t>(v); }); }
Arg Arg::of_memory_format(c10::MemoryFormat v) {
  return make_arg(Kind::MemoryFormat, [&](Arg& a) { a.i = static_cast<int64_t>(v); });
}

// ---------------------------------------------------------------- Target

Target Target::parse(const std::string& q) {
  Target t;
  auto sep = q.find("::");
  if (sep == std::string::npos) {
    TORCH_CHECK(q == "getitem", "malformed op target '", q, "': expected ns::name.overload or getitem");
    return getitem();
  }
  t.ns = q.substr(0, sep);
  std::string rest = q.substr(sep + 2);
  auto dot = rest.find('.');
  TORCH_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < rest.size() && !t.ns.empty(),
              "malformed op target '", q, "': expected ns::name.overload (e.g. aten::mm.default)");
  t.name = rest.substr(0, dot);
  t.overload = rest.substr(dot + 1);
  return t;
}

std::string Target::str() const {
  if (is_builtin()) return name;
  return ns + "::" + name + "." + overload;
}

// ---------------------------------------------------------------- Node

const Arg* Node::kwarg(const std::string& key) const {
  for (const auto& kv : kwargs_)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

std::vector<Node*> Node::inputs() const {
  std::vector<Node*> out;
  // Linear for wide nodes (an output returning 10^5 values): a set once the list grows.
  std::unordered_set<Node*> seen;
  auto add = [&](Node* n) {
    if (out.size() < 16) {
      if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
      return;
    }
    if (seen.empty()) seen.insert(out.begin(), out.end());
    if (seen.insert(n).second) out.push_back(n);
  };
  for (const Arg& a : args_) a.for_each_node(add);
  for (const auto& kv : kwargs_) kv.second.for_each_node(add);
  return out;
}

// ---------------------------------------------------------------- Graph

Graph::~Graph() = default;

Node* Graph::insert_node(std::unique_ptr<Node> node, size_t pos) {
  TORCH_CHECK(!node->name_.empty(), "node names must be non-empty");
  TORCH_CHECK(by_name_.count(node->name_) == 0, "duplicate node name '%", node->name_, "'");
  node->owner_ = this;
  Node* raw = node.get();
  by_name_[raw->name_] = raw;
  nodes_.insert(nodes_.begin() + static_cast<std::ptrdiff_t>(pos), std::move(node));
  add_uses(raw);
  // Only the positions from `pos` on moved; appending stays O(1), so building a graph is linear.
  for (size_t i = pos; i < nodes_.size(); ++i) nodes_[i]->index_ = static_cast<int64_t>(i);
  return raw;
}

void Graph::add_uses(Node* user) {
  for (Node* in : user->inputs()) {
    TORCH_CHECK(in->owner_ == this, "node '%", user->name_, "' uses '%", in->name_,
                "', which belongs to another graph");
    if (std::find(in->users_.begin(), in->users_.end(), user) == in->users_.end()) in->users_.push_back(user);
  }
}

void Graph::remove_uses(Node* user) {
  for (Node* in : user->inputs()) {
    auto& u = in->users_;
    u.erase(std::remove(u.begin(), u.end(), user), u.end());
  }
}

Node* Graph::create_placeholder(const std::string& name, InputRole role, Type type, std::string state_name) {
  auto node = std::unique_ptr<Node>(new Node());
  node->kind_ = NodeKind::Placeholder;
  node->name_ = name;
  node->role_ = role;
  node->type_ = std::move(type);
  node->state_name_ = std::move(state_name);
  size_t pos = nodes_.size();
  if (!nodes_.empty() && nodes_.back()->kind_ != NodeKind::Placeholder) {
    pos = 0;
    while (pos < nodes_.size() && nodes_[pos]->kind_ == NodeKind::Placeholder) ++pos;
  }
  return insert_node(std::move(node), pos);
}

Node* Graph::create_call(const std::string& name, Target target, std::vector<Arg> args, Kwargs kwargs, Type type,
                         Node* before) {
  auto node = std::unique_ptr<Node>(new Node());
  node->kind_ = NodeKind::Call;
  node->name_ = name;
  node->target_ = std::move(target);
  node->args_ = std::move(args);
  node->kwargs_ = std::move(kwargs);
  node->type_ = std::move(type);
  size_t pos = nodes_.size();
  if (before != nullptr) {
    TORCH_CHECK(before->owner_ == this, "insertion point '%", before->name_, "' is not in this graph");
    pos = static_cast<size_t>(before->index_);
  } else if (Node* out = output()) {
    pos = static_cast<size_t>(out->index_);
  }
  return insert_node(std::move(node), pos);
}

Node* Graph::create_output(std::vector<Arg> values) {
  TORCH_CHECK(output() == nullptr, "graph already has an output node");
  auto node = std::unique_ptr<Node>(new Node());
  node->kind_ = NodeKind::Output;
  node->name_ = unique_name("output");
  node->args_.push_back(Arg::of_list(std::move(values)));
  return insert_node(std::move(node), nodes_.size());
}

void Graph::add_region(Node* call, std::unique_ptr<Graph> region) {
  TORCH_CHECK(call->owner_ == this && call->kind_ == NodeKind::Call, "regions attach to call nodes of this graph");
  call->regions_.push_back(std::move(region));
}

void Graph::set_args(Node* node, std::vector<Arg> args, Kwargs kwargs) {
  TORCH_INTERNAL_ASSERT(node->owner_ == this);
  // Validate before touching anything, so a refused edit leaves the graph unchanged.
  auto check = [&](Node* in) {
    TORCH_CHECK(in->owner_ == this, "node '%", node->name_, "' cannot use '%", in->name_,
                "', which belongs to another graph");
  };
  for (const Arg& a : args) a.for_each_node(check);
  for (const auto& kv : kwargs) kv.second.for_each_node(check);
  remove_uses(node);
  node->args_ = std::move(args);
  node->kwargs_ = std::move(kwargs);
  add_uses(node);
}

void Graph::set_target(Node* node, Target target) {
  TORCH_INTERNAL_ASSERT(node->owner_ == this && node->kind_ == NodeKind::Call);
  node->target_ = std::move(target);
}

namespace {
void reroute(Arg& a, Node* from, Node* to) {
  if (a.kind == Arg::Kind::Node && a.node == from) a.node = to;
  for (Arg& e : a.list) reroute(e, from, to);
}
}  // namespace

void Graph::replace_input_of(Node* user, Node* old_node, Node* new_node) {
  TORCH_INTERNAL_ASSERT(user->owner_ == this && new_node->owner_ == this);
  std::vector<Arg> args = user->args_;
  Kwargs kwargs = user->kwargs_;
  for (Arg& a : args) reroute(a, old_node, new_node);
  for (auto& kv : kwargs) reroute(kv.second, old_node, new_node);
  set_args(user, std::move(args), std::move(kwargs));
}

void Graph::replace_all_uses_with(Node* old_node, Node* new_node, const Node* except) {
  std::vector<Node*> users = old_node->users_;
  for (Node* u : users)
    if (u != except) replace_input_of(u, old_node, new_node);
}

void Graph::erase(Node* node) {
  TORCH_INTERNAL_ASSERT(node->owner_ == this);
  TORCH_CHECK(node->users_.empty(), "cannot erase '%", node->name_, "': it still has ", node->users_.size(),
              " user(s), first '%", node->users_.empty() ? "" : node->users_[0]->name_, "'");
  remove_uses(node);
  by_name_.erase(node->name_);
  const size_t pos = static_cast<size_t>(node->index_);
  nodes_.erase(nodes_.begin() + node->index_);
  for (size_t i = pos; i < nodes_.size(); ++i) nodes_[i]->index_ = static_cast<int64_t>(i);
}

void Graph::erase_all(const std::vector<Node*>& dead) {
  std::unordered_set<const Node*> doomed(dead.begin(), dead.end());
  // Validate before touching anything, so a refused edit leaves the graph unchanged.
  for (Node* n : dead) {
    TORCH_INTERNAL_ASSERT(n->owner_ == this);
    for (Node* u : n->users_)
      TORCH_CHECK(doomed.count(u) != 0, "cannot erase '%", n->name_, "': its user '%", u->name_,
                  "' is not erased with it");
  }
  // Each surviving input loses its dead users in one filtering pass.
  std::unordered_set<Node*> touched;
  for (Node* n : dead)
    for (Node* in : n->inputs())
      if (doomed.count(in) == 0) touched.insert(in);
  for (Node* in : touched) {
    auto& u = in->users_;
    u.erase(std::remove_if(u.begin(), u.end(), [&](Node* x) { return doomed.count(x) != 0; }), u.end());
  }
  for (Node* n : dead) by_name_.erase(n->name_);
  nodes_.erase(std::remove_if(nodes_.begin(), nodes_.end(),
                              [&](const std::unique_ptr<Node>& n) { return doomed.count(n.get()) != 0; }),
               nodes_.end());
  index();
}

void Graph::move_before(Node* node, Node* before) {
  TORCH_INTERNAL_ASSERT(node->owner_ == this && before->owner_ == this);
  if (node == before) return;
  const size_t from = static_cast<size_t>(node->index_);
  const size_t to = static_cast<size_t>(before->index_);
  // A rotation of the range between the two positions; only that range is re-indexed.
  size_t lo, hi;
  if (from < to) {
    std::rotate(nodes_.begin() + from, nodes_.begin() + from + 1, nodes_.begin() + to);
    lo = from, hi = to;
  } else {
    std::rotate(nodes_.begin() + to, nodes_.begin() + from, nodes_.begin() + from + 1);
    lo = to, hi = from + 1;
  }
  for (size_t i = lo; i < hi; ++i) nodes_[i]->index_ = static_cast<int64_t>(i);
}

void Graph::reorder_calls(const std::vector<Node*>& order) {
  std::vector<std::unique_ptr<Node>> placeholders, calls, tail;
  std::unordered_map<Node*, std::unique_ptr<Node>> by_ptr;
  for (auto& n : nodes_) {
    if (n->kind_ == NodeKind::Placeholder) placeholders.push_back(std::move(n));
    else if (n->kind_ == NodeKind::Output) tail.push_back(std::move(n));
    else by_ptr.emplace(n.get(), std::move(n));
  }
  TORCH_INTERNAL_ASSERT(order.size() == by_ptr.size(), "reorder_calls needs a permutation of the call nodes");
  nodes_.clear();
  for (auto& p : placeholders) nodes_.push_back(std::move(p));
  for (Node* n : order) {
    auto it = by_ptr.find(n);
    TORCH_INTERNAL_ASSERT(it != by_ptr.end() && it->second, "reorder_calls: not a permutation");
    nodes_.push_back(std::move(it->second));
  }
  for (auto& t : tail) nodes_.push_back(std::move(t));
  index();
}

void Graph::reorder_placeholders(const std::vector<Node*>& order) {
  const size_t n = placeholders().size();
  TORCH_INTERNAL_ASSERT(order.size() == n, "reorder_placeholders needs a permutation of the placeholders");
  std::vector<std::unique_ptr<Node>> head;
  for (Node* p : order) {
    TORCH_INTERNAL_ASSERT(p->owner_ == this && p->kind_ == NodeKind::Placeholder && p->index_ >= 0 &&
                          static_cast<size_t>(p->index_) < n && nodes_[p->index_] != nullptr,
                          "reorder_placeholders: not a permutation");
    head.push_back(std::move(nodes_[p->index_]));
  }
  for (size_t i = 0; i < n; ++i) nodes_[i] = std::move(head[i]);
  index();
}

void Graph::set_output(std::vector<Arg> values) {
  Node* out = output();
  TORCH_CHECK(out != nullptr, "graph has no output node");
  set_args(out, {Arg::of_list(std::move(values))}, {});
}

std::vector<Node*> Graph::placeholders() const {
  std::vector<Node*> out;
  for (const auto& n : nodes_) {
    if (n->kind_ != NodeKind::Placeholder) break;
    out.push_back(n.get());
  }
  return out;
}

Node* Graph::output() const {
  if (nodes_.empty() || nodes_.back()->kind_ != NodeKind::Output) return nullptr;
  return nodes_.back().get();
}

Node* Graph::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::string Graph::unique_name(const std::string& base) const {
  if (!by_name_.count(base)) return base;
  for (int64_t k = 1;; ++k) {
    std::string cand = base + "_" + std::to_string(k);
    if (!by_name_.count(cand)) return cand;
  }
}

void Graph::index() {
  for (size_t i = 0; i < nodes_.size(); ++i) nodes_[i]->index_ = static_cast<int64_t>(i);
}

Arg remap_arg(const Arg& a, const ValueMap& map) {
  Arg b = a;
  if (a.kind == Arg::Kind::Node) {
    auto it = map.find(a.node);
    TORCH_CHECK(it != map.end(), "copy: input %", a.node->name(), " has no counterpart in the destination graph");
    b.node = it->second;
  }
  for (Arg& e : b.list) e = remap_arg(e, map);
  return b;
}

Node* Graph::copy_call(const Node& src, ValueMap& map, const std::string& name, Node* before) {
  TORCH_CHECK(src.kind_ == NodeKind::Call, "copy_call: %", src.name_, " is not a call node");
  std::vector<Arg> args;
  args.reserve(src.args_.size());
  for (const Arg& a : src.args_) args.push_back(remap_arg(a, map));
  Kwargs kwargs;
  for (const auto& kv : src.kwargs_) kwargs.emplace_back(kv.first, remap_arg(kv.second, map));
  Node* copy = create_call(name, src.target_, std::move(args), std::move(kwargs), src.type_, before);
  for (const auto& r : src.regions_) add_region(copy, r->clone());
  copy->module_path_ = src.module_path_;
  map[&src] = copy;
  return copy;
}

std::unique_ptr<Graph> Graph::clone() const {
  auto g = std::make_unique<Graph>();
  ValueMap map;
  for (const auto& n : nodes_) {
    if (n->kind_ == NodeKind::Call) {
      g->copy_call(*n, map, n->name_);
      continue;
    }
    Node* copy = nullptr;
    if (n->kind_ == NodeKind::Placeholder) {
      copy = g->create_placeholder(n->name_, n->role_, n->type_, n->state_name_);
    } else {
      std::vector<Arg> vals;
      for (const Arg& a : n->args_.at(0).list) vals.push_back(remap_arg(a, map));
      copy = g->create_output(std::move(vals));
    }
    copy->module_path_ = n->module_path_;
    map[n.get()] = copy;
  }
  return g;
}

}  // namespace torch_ext::ir
