// The torch_ext graph IR: one small, explicit dataflow graph shared by the passes,
// the executors and the reactive engine.
//
// Node kinds (the whole vocabulary):
//   Placeholder  a graph input. Carries an InputRole (parameter, buffer, constant,
//                optimizer state, user input) and, for state, the fully qualified
//                name it was lifted from ("fc1.weight").
//   Call         one operator application. Its Target is a qualified op name with
//                overload ("aten::addmm.default") or the builtin `getitem`.
//                Positional args and kwargs are typed Args. A Call may own regions
//                (nested Graphs), which is how higher-order ops such as cond and
//                while_loop carry their branches and bodies.
//   Output       exactly one per graph, always last; its single arg is a list.
//
// Ownership and edges:
//   * The Graph owns its nodes; nodes live in topological (insertion) order.
//   * A node's inputs are the node references found in its args and kwargs.
//   * Use lists are private and change only through Graph methods (create_*,
//     set_args, replace_all_uses_with, replace_input_of, erase), which keep them
//     exact: `users()` holds each user once, in the order the uses were added.
//   * Names are unique within a graph and come from the importer or from
//     `unique_name`, never from pointers, so the printed form is deterministic.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Layout.h>
#include <c10/core/MemoryFormat.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_ext::ir {

class Graph;
class Node;

enum class NodeKind { Placeholder, Call, Output };

enum class InputRole { UserInput, Parameter, Buffer, Constant, OptimizerState };

const char* to_string(NodeKind kind);
const char* to_string(InputRole role);
std::optional<InputRole> input_role_from_string(const std::string& text);

// Shape, dtype, strides and device of one tensor value.
struct TensorMeta {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // always filled; contiguous when imported without strides
  c10::Device device = c10::Device(c10::kCPU);

  int64_t numel() const;
  int64_t nbytes() const;
  bool is_contiguous() const;
  static std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);
  bool operator==(const TensorMeta& other) const;
  bool operator!=(const TensorMeta& other) const { return !(*this == other); }
};

// The type of the value a node produces.
struct Type {
  enum class Kind { Tensor, Tuple, Int, Float, Bool, None };
  Kind kind = Kind::None;
  TensorMeta tensor;        // Kind::Tensor
  std::vector<Type> elems;  // Kind::Tuple (multi-output ops, Tensor[] results)

  static Type make_tensor(TensorMeta meta);
  static Type make_tuple(std::vector<Type> elems);
  static Type make_scalar(Kind kind);
  bool is_tensor() const { return kind == Kind::Tensor; }
  bool operator==(const Type& other) const;
  bool operator!=(const Type& other) const { return !(*this == other); }
};

// One typed argument of a Call node.
struct Arg {
  enum class Kind { None, Node, Int, Float, Bool, String, List, Dtype, Device, Layout, MemoryFormat };
  Kind kind = Kind::None;
  Node* node = nullptr;
  int64_t i = 0;  // Int, Bool, Dtype, Layout, MemoryFormat (as the enum value)
  double f = 0.0;
  std::string s;  // String; Device as its string form ("cpu", "cuda:0")
  std::vector<Arg> list;

  static Arg none() { return Arg{}; }
  static Arg of_node(Node* n);
  static Arg of_int(int64_t v);
  static Arg of_float(double v);
  static Arg of_bool(bool v);
  static Arg of_string(std::string v);
  static Arg of_list(std::vector<Arg> v);
  static Arg of_dtype(c10::ScalarType v);
  static Arg of_device(const c10::Device& v);
  static Arg of_layout(c10::Layout v);
  static Arg of_memory_format(c10::MemoryFormat v);

  // Calls fn(Node*) for every node reference inside this arg, lists included.
  template <typename Fn>
  void for_each_node(Fn&& fn) const {
    if (kind == Kind::Node) fn(node);
    if (kind == Kind::List)
      for (const Arg& a : list) a.for_each_node(fn);
  }
};

// "aten::addmm.default" splits into ns "aten", name "addmm", overload "default".
// The builtin getitem has an empty namespace.
struct Target {
  std::string ns;
  std::string name;
  std::string overload;

  static Target parse(const std::string& qualified);  // throws on malformed text
  static Target getitem() { return Target{"", "getitem", ""}; }
  bool is_getitem() const { return ns.empty() && name == "getitem"; }
  bool is_builtin() const { return ns.empty(); }
  std::string str() const;  // inverse of parse
  bool operator==(const Target& o) const { return ns == o.ns && name == o.name && overload == o.overload; }
};

using Kwargs = std::vector<std::pair<std::string, Arg>>;

class Node {
 public:
  NodeKind kind() const { return kind_; }
  const std::string& name() const { return name_; }
  const Type& type() const { return type_; }
  void set_type(Type t) { type_ = std::move(t); }
  const Target& target() const { return target_; }
  const std::vector<Arg>& args() const { return args_; }
  const Kwargs& kwargs() const { return kwargs_; }
  const Arg* kwarg(const std::string& key) const;
  // Distinct input nodes in first-use order.
  std::vector<Node*> inputs() const;
  const std::vector<Node*>& users() const { return users_; }
  Graph* owner() const { return owner_; }

  // Placeholder data.
  InputRole role() const { return role_; }
  const std::string& state_name() const { return state_name_; }

  // Free-form provenance, e.g. "nn_module_stack" -> "layers.0.attn"; printed as a trailing comment.
  const std::string& module_path() const { return module_path_; }
  void set_module_path(std::string p) { module_path_ = std::move(p); }

  // Nested graphs (cond branches, loop bodies).
  const std::vector<std::unique_ptr<Graph>>& regions() const { return regions_; }

  // Position in the owning graph's node list; valid after Graph::index() or any edit.
  int64_t index() const { return index_; }

 private:
  friend class Graph;
  friend struct GraphTestPeer;  // lets the verifier's negative tests corrupt a graph on purpose
  Node() = default;

  NodeKind kind_ = NodeKind::Call;
  std::string name_;
  Type type_;
  Target target_;
  std::vector<Arg> args_;
  Kwargs kwargs_;
  std::vector<Node*> users_;
  Graph* owner_ = nullptr;
  InputRole role_ = InputRole::UserInput;
  std::string state_name_;
  std::string module_path_;
  std::vector<std::unique_ptr<Graph>> regions_;
  int64_t index_ = -1;
};

// Where a copied node finds its inputs: each node reference of the source is looked up here.
using ValueMap = std::unordered_map<const Node*, Node*>;

// `a` with every node reference (lists included) replaced through `map`; an unmapped reference is
// refused, naming the node, because it means the copy would read a value from the wrong graph.
Arg remap_arg(const Arg& a, const ValueMap& map);

class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph();

  // Deep copy; node names are preserved.
  std::unique_ptr<Graph> clone() const;

  // Placeholders are inserted after the last existing placeholder.
  Node* create_placeholder(const std::string& name, InputRole role, Type type, std::string state_name = "");
  // Calls are inserted before `before`, or before the output node (or at the end) when null.
  Node* create_call(const std::string& name, Target target, std::vector<Arg> args, Kwargs kwargs, Type type,
                    Node* before = nullptr);
  Node* create_output(std::vector<Arg> values);
  // torch.fx's Graph.node_copy: a copy of call node `src` (from any graph) named `name`, with its
  // inputs looked up in `map`, and its target, type, module path and regions; inserted as
  // create_call inserts. Records src -> copy in `map`. The one way passes and the engine copy nodes.
  Node* copy_call(const Node& src, ValueMap& map, const std::string& name, Node* before = nullptr);
  // Gives a Call ownership of a nested graph.
  void add_region(Node* call, std::unique_ptr<Graph> region);

  // Replace the args and kwargs of `node`, keeping use lists exact.
  void set_args(Node* node, std::vector<Arg> args, Kwargs kwargs);
  // Replace the operator `node` calls (a lowering to its out= or in-place variant); args, type and
  // uses are unchanged.
  void set_target(Node* node, Target target);
  // Every use of `old_node` (except by `except`, if given) now refers to `new_node`.
  void replace_all_uses_with(Node* old_node, Node* new_node, const Node* except = nullptr);
  // Only `user`'s uses of `old_node` are rerouted to `new_node`.
  void replace_input_of(Node* user, Node* old_node, Node* new_node);
  // Removes a node that has no users.
  void erase(Node* node);
  // Removes every node of `dead` in one O(graph) compaction (erase() per node is O(graph) each, so
  // a pass removing many nodes one by one is quadratic). Every user of a dead node must itself be
  // in `dead`; otherwise nothing is removed and the error names the first live user.
  void erase_all(const std::vector<Node*>& dead);
  // Moves `node` to just before `before` (same graph) in O(distance between them). The caller
  // keeps topological order.
  void move_before(Node* node, Node* before);
  // Reorders all call nodes to `order`, which must be a permutation of them.
  void reorder_calls(const std::vector<Node*>& order);
  // Reorders the placeholders to `order`, which must be a permutation of them.
  void reorder_placeholders(const std::vector<Node*>& order);
  // Replaces the output node's value list.
  void set_output(std::vector<Arg> values);

  const std::vector<std::unique_ptr<Node>>& nodes() const { return nodes_; }
  size_t size() const { return nodes_.size(); }
  std::vector<Node*> placeholders() const;
  Node* output() const;  // null when not yet created
  Node* find(const std::string& name) const;
  // A name not yet used in this graph, derived from `base`.
  std::string unique_name(const std::string& base) const;

  // Recomputes Node::index() for every node.
  void index();

 private:
  Node* insert_node(std::unique_ptr<Node> node, size_t pos);
  void add_uses(Node* user);
  void remove_uses(Node* user);

  std::vector<std::unique_ptr<Node>> nodes_;
  std::unordered_map<std::string, Node*> by_name_;
};

}  // namespace torch_ext::ir
