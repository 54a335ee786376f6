#include "passes/thread_rng.h"

#include "ir/higher_order.h"
#include "ir/printer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <vector>

namespace torch_ext::passes {
namespace {

const ir::Target kDropout{"aten", "native_dropout", "default"};
const ir::Target kDropoutRng{"torch_ext", "native_dropout_rng", "default"};
// Noise like a tensor (a VAE's reparameterisation, noise injection): the op and its explicit-state form.
const ir::Target kRandnLike{"aten", "randn_like", "default"};
const ir::Target kRandLike{"aten", "rand_like", "default"};
const ir::Target kRandnLikeRng{"torch_ext", "randn_like_rng", "default"};
const ir::Target kRandLikeRng{"torch_ext", "rand_like_rng", "default"};

// aten::bernoulli.p(x, p): in-place dropout (F.dropout(inplace=True): empty_like(x).bernoulli_(1 - p)) and
// torchvision's stochastic depth, functionalized. Noise like x, drawn with a probability.
const ir::Target kBernoulliP{"aten", "bernoulli", "p"};
const ir::Target kEmptyLike{"aten", "empty_like", "default"};

bool is_noise_like(const ir::Node& n) {
  return n.target() == kRandnLike || n.target() == kRandLike || n.target() == kBernoulliP;
}

// Random factories (diffusion training: randint timesteps, randn noise): size and dtype are the node's type.
const ir::Target kRandn{"aten", "randn", "default"};
const ir::Target kRand{"aten", "rand", "default"};
const ir::Target kRandint{"aten", "randint", "default"};     // randint(high, size)
const ir::Target kRandintLow{"aten", "randint", "low"};      // randint(low, high, size)

bool is_factory(const ir::Node& n) {
  return n.target() == kRandn || n.target() == kRand || n.target() == kRandint || n.target() == kRandintLow;
}

void check_factory(const ir::Node& n) {
  TORCH_CHECK(n.type().kind == ir::Type::Kind::Tensor && n.type().tensor.device.is_cpu(), "thread_rng: node %",
              n.name(), " (", n.target().str(), ") makes a ", ir::print_type(n.type()),
              "; the pure step's RNG state is the CPU generator's, so it draws random factories on the CPU only");
  if (n.target() == kRandint || n.target() == kRandintLow) {
    const size_t bounds = n.target() == kRandint ? 1 : 2;
    TORCH_CHECK(n.args().size() == bounds + 1, "thread_rng: node %", n.name(), " is not a ", n.target().str(),
                " with ", bounds, " bounds and a size");
    for (size_t i = 0; i < bounds; ++i)
      TORCH_CHECK(n.args()[i].kind == ir::Arg::Kind::Int, "thread_rng: node %", n.name(), " (", n.target().str(),
                  ") has a bound that is not a constant int");
  }
}

// randn_like(x, *, dtype, layout, device, pin_memory, memory_format) whose result has x's dtype,
// shape and device, with the default memory format: then the explicit-state op (empty_like(x),
// strides preserved as randn_like preserves them, then the draw) computes the same tensor.
void check_noise_like(const ir::Node& n) {
  if (n.target() == kBernoulliP) {
    const ir::Arg* gen = n.kwarg("generator");
    TORCH_CHECK(n.args().size() == 2 && n.args()[0].kind == ir::Arg::Kind::Node &&
                    (n.args()[1].kind == ir::Arg::Kind::Float || n.args()[1].kind == ir::Arg::Kind::Int) &&
                    (gen == nullptr || gen->kind == ir::Arg::Kind::None) && n.type().kind == ir::Type::Kind::Tensor,
                "thread_rng: node %", n.name(), " is not a bernoulli.p(tensor, constant p) with one tensor result");
    return;
  }
  TORCH_CHECK(n.args().size() == 1 && n.args()[0].kind == ir::Arg::Kind::Node && n.type().kind == ir::Type::Kind::Tensor &&
                  n.args()[0].node->type().kind == ir::Type::Kind::Tensor,
              "thread_rng: node %", n.name(), " (", n.target().str(), ") is not a ", n.target().name,
              "(tensor) with one tensor result");
  const ir::Node& like = *n.args()[0].node;
  const ir::TensorMeta& a = like.type().tensor;
  const ir::TensorMeta& b = n.type().tensor;
  const ir::Arg* format = n.kwarg("memory_format");
  const bool preserve = format == nullptr || format->kind == ir::Arg::Kind::None ||
                        (format->kind == ir::Arg::Kind::MemoryFormat &&
                         format->i == static_cast<int64_t>(c10::MemoryFormat::Preserve));
  TORCH_CHECK(a.dtype == b.dtype && a.sizes == b.sizes && a.device == b.device && preserve, "thread_rng: node %",
              n.name(), " (", n.target().str(), ") makes a tensor of another dtype, device or memory format than its "
              "input %", like.name(), "; the pure step draws noise only like its input");
}
// The pure step's RNG state is the CPU generator's (mt19937, torch.get_rng_state()); eager draws a
// tensor off the CPU from that device's own generator (CUDA: Philox, seed and offset), so the draws of
// the explicit-state ops would differ from eager's without a word. Refused by name, at build time.
void check_drawn_on_cpu(const ir::Node& n) {
  const ir::Type& t = n.type().kind == ir::Type::Kind::Tuple && !n.type().elems.empty() ? n.type().elems[0] : n.type();
  if (t.kind != ir::Type::Kind::Tensor) return;  // the op's own check names the shape it expects
  TORCH_CHECK(t.tensor.device.is_cpu(), "thread_rng: node %", n.name(), " (", n.target().str(), ") draws on ",
              t.tensor.device.str(), "; the pure step's RNG state is the CPU generator's, and eager draws on ",
              t.tensor.device.str(), " from that device's generator, so random ops run on the CPU only (a model on ",
              t.tensor.device.type(), " with dropout or noise is not supported)");
}

constexpr int64_t kStateBytes = 5056;  // sizeof the mt19937 CPU generator state, torch.get_rng_state().numel()

// True when the op draws from a generator: tagged nondeterministic_seeded, or takes a Generator.
bool draws_random(const ir::Node& n) {
  if (n.kind() != ir::NodeKind::Call || n.target().is_builtin() || ir::is_higher_order(n.target())) return false;
  auto op = c10::Dispatcher::singleton().findOp(
      {n.target().ns + "::" + n.target().name, n.target().overload == "default" ? "" : n.target().overload});
  if (!op.has_value()) return false;
  const auto& params = op->schema().arguments();
  // Attention kernels take a generator but draw nothing when their dropout_p is a constant 0.
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name() != "dropout_p") continue;
    const ir::Arg* a = i < n.args().size() ? &n.args()[i] : n.kwarg("dropout_p");
    if (a == nullptr) return false;  // schema default: 0
    if ((a->kind == ir::Arg::Kind::Float && a->f == 0.0) || (a->kind == ir::Arg::Kind::Int && a->i == 0)) return false;
  }
  // An op with a `training` flag (aten::rrelu, rrelu_with_noise and its functional form: an RReLU in eval
  // mode) draws nothing when the flag is a constant false: the mean slope, (lower + upper) / 2.
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name() != "training" || params[i].type()->kind() != c10::TypeKind::BoolType) continue;
    const ir::Arg* a = i < n.args().size() ? &n.args()[i] : n.kwarg("training");
    if (a == nullptr) {
      if (params[i].default_value().has_value() && params[i].default_value()->isBool() &&
          !params[i].default_value()->toBool())
        return false;
      break;
    }
    if (a->kind == ir::Arg::Kind::Bool && a->i == 0) return false;
    break;
  }
  if (op->hasTag(at::Tag::nondeterministic_seeded)) return true;
  for (const auto& a : params)
    if (a.type()->kind() == c10::TypeKind::OptionalType &&
        a.type()->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::GeneratorType)
      return true;
  return false;
}

void refuse_in_regions(const ir::Node& n) {
  for (const auto& r : n.regions())
    for (const auto& inner : r->nodes()) {
      TORCH_CHECK(!draws_random(*inner), "thread_rng: node %", inner->name(), " (", inner->target().str(),
                  ") inside %", n.name(), " draws random numbers; random ops inside control flow are not supported");
      refuse_in_regions(*inner);
    }
}

}  // namespace

ir::Node* thread_rng(ir::Graph& g, const std::string& state_name) {
  // Validate first so a refused graph is left unchanged.
  std::vector<ir::Node*> drops;
  for (const auto& n : g.nodes()) {
    refuse_in_regions(*n);
    if (!draws_random(*n)) continue;
    TORCH_CHECK(n->target() == kDropout || is_noise_like(*n) || is_factory(*n), "thread_rng: node %", n->name(),
                " (", n->target().str(), ") draws from the global random generator; the pure step makes only dropout "
                "(aten::native_dropout), bernoulli(p), randn_like, rand_like, randn, rand and randint explicit in its RNG "
                "state, so "
                "this op would make it impure");
    if (!is_factory(*n)) check_drawn_on_cpu(*n);  // a factory states its device in check_factory's message
    if (is_factory(*n)) {
      check_factory(*n);
    } else if (is_noise_like(*n)) {
      check_noise_like(*n);
    } else {
      TORCH_CHECK(n->args().size() == 3 && n->type().kind == ir::Type::Kind::Tuple && n->type().elems.size() == 2,
                  "thread_rng: node %", n->name(), " is not a (input, p, train) native_dropout with two outputs");
    }
    drops.push_back(n.get());
  }
  if (drops.empty()) return nullptr;
  ir::TensorMeta meta;
  meta.dtype = c10::ScalarType::Byte;
  meta.sizes = {kStateBytes};
  meta.strides = {1};
  const ir::Type state_type = ir::Type::make_tensor(meta);
  ir::Node* state = g.create_placeholder(g.unique_name("rng_state"), ir::InputRole::Buffer, state_type, state_name);
  for (ir::Node* d : drops) {
    if (is_noise_like(*d) || is_factory(*d)) {  // (noise, state) = <op>_rng(..., state); the noise replaces the node
      ir::Target target = d->target() == kRandnLike ? kRandnLikeRng : kRandLikeRng;
      std::vector<ir::Arg> args{d->args()[0]};
      if (d->target() == kBernoulliP) {
        target = {"torch_ext", "bernoulli_p_rng", "default"};
        args.push_back(d->args()[1]);
      }
      // In-place dropout's noise.bernoulli_(1 - p) on noise = empty_like(x) drew in x's strides.
      const bool fills_empty_like = d->target() == kBernoulliP && d->args()[0].kind == ir::Arg::Kind::Node &&
                                    d->args()[0].node->kind() == ir::NodeKind::Call &&
                                    d->args()[0].node->target() == kEmptyLike;
      if (is_factory(*d)) {
        const ir::TensorMeta& meta = d->type().tensor;
        std::vector<ir::Arg> size;
        for (int64_t s : meta.sizes) size.push_back(ir::Arg::of_int(s));
        args = {ir::Arg::of_list(std::move(size)), ir::Arg::of_dtype(meta.dtype)};
        if (d->target() == kRandn) target = {"torch_ext", "randn_rng", "default"};
        if (d->target() == kRand) target = {"torch_ext", "rand_rng", "default"};
        if (d->target() == kRandint || d->target() == kRandintLow) {
          target = {"torch_ext", "randint_rng", "default"};
          const bool low = d->target() == kRandintLow;
          args.insert(args.begin(), {low ? d->args()[0] : ir::Arg::of_int(0), d->args()[low ? 1 : 0]});
        }
      }
      args.push_back(ir::Arg::of_node(state));
      if (fills_empty_like) args.push_back(ir::Arg::of_bool(true));
      ir::Node* rng = g.create_call(g.unique_name(d->name() + "_rng"), target, std::move(args), {},
                                    ir::Type::make_tuple({d->type(), state_type}), d);
      rng->set_module_path(d->module_path());
      ir::Node* noise = g.create_call(g.unique_name(d->name() + "_noise"), ir::Target::getitem(),
                                      {ir::Arg::of_node(rng), ir::Arg::of_int(0)}, {}, d->type(), d);
      noise->set_module_path(d->module_path());
      state = g.create_call(g.unique_name(d->name() + "_rng_state"), ir::Target::getitem(),
                            {ir::Arg::of_node(rng), ir::Arg::of_int(1)}, {}, state_type, d);
      state->set_module_path(d->module_path());
      g.replace_all_uses_with(d, noise);
      g.erase(d);
      continue;
    }
    std::vector<ir::Arg> args = d->args();
    args.push_back(ir::Arg::of_node(state));
    ir::Type type = ir::Type::make_tuple({d->type().elems[0], d->type().elems[1], state_type});
    ir::Node* rng = g.create_call(g.unique_name(d->name() + "_rng"), kDropoutRng, std::move(args), {}, type, d);
    rng->set_module_path(d->module_path());
    state = g.create_call(g.unique_name(d->name() + "_rng_state"), ir::Target::getitem(),
                          {ir::Arg::of_node(rng), ir::Arg::of_int(2)}, {}, state_type, d);
    state->set_module_path(d->module_path());
    g.replace_all_uses_with(d, rng);
    g.erase(d);
  }
  return state;
}

}  // namespace torch_ext::passes
