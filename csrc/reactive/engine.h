// Reactive cache over an ir::Graph: every node keeps its value; mutations
// invalidate exactly their downstream cone; demand recomputes only what is
// stale, in topological order, from a dirty set. Counting conventions are those
// of shared/docs/cost-model.md.
//
// Terms. A *countable* node is a Call (getitem and grafted nodes included).
// Placeholders and the output node are never counted. A *pinned* node holds a
// patched value: its in-edges are ignored until it is restored. V+(s) is the
// strict downstream cone of s, D(w) = {w} ∪ V+(w).
//
// Invariants (checked by check_invariants(), which the tests call after every
// step; none of them needs a whole-graph scan at run time):
//   I1 order     node indices are a topological order of the graph.
//   I2 dirty     a countable node is in the dirty set iff it is invalid; the
//                set is keyed by the node's current topological index.
//   I3 closure   if a node is invalid, so is every countable, unpinned strict
//                descendant reached without passing through a pinned node.
//                Hence a valid node has only valid ancestors (through unpinned
//                paths), and demand never needs to look past the dirty set.
//   I4 revision  for every valid, unpinned countable node v and input u:
//                verified_at(v) >= changed_at(u). Pinned and placeholder
//                nodes are always valid.
//   I5 values    every valid node holds a value.
//   I6 overlay   while patches are active, overlay[v] holds v's baseline
//                value for every node whose current value was written since
//                the baseline (by a patch or a recomputation).
//   I7 ledger    stats.evaluations equals the sum of per-node evaluation
//                counts (no drift), and cost the matching weighted sum.
//   I8 integrity every cached tensor (current value and overlay baseline)
//                still has the version counter it had when it was stored.
//                Values handed out (outputs, value(), baseline()) are the
//                cached tensors themselves, so user code could write into
//                them; every read checks the version of what it reads, and a
//                modified value raises, naming the node, after marking it
//                for recomputation (placeholders cannot be recomputed: run()
//                again). A wrong answer never passes silently.
//   I9 journal   inside a transaction, every node whose state differs from
//                the state at begin_transaction() has a journal entry holding
//                that state; rollback() restores exactly those entries.
//   I10 pins     pinned_ lists each pinned node once, in patch order; each has
//                an overlay entry (its displaced baseline), and the overlay is
//                empty while no patch is active (I6).
//   I11 structural  structural_dirty_ holds nodes whose cached value predates
//                their current function (a graft rewired them, or the value
//                was written in place), not recomputed since: each is invalid
//                or pinned, so restore() never revives its old value.
//   I12 baseline baseline_stale_ holds nodes whose baseline the overlay cannot
//                give back (a graft under a patch changed their function, or a
//                saved baseline was written in place; restore() recomputes
//                them instead): it is empty while no patch is active. (Its
//                members may be valid: early cutoff revalidates a node
//                without writing it, so without an overlay entry.)
//   I13 revisions every changed_at and verified_at is at most revision_;
//                every recorded graft's nodes are in the graph (grafts_), and
//                batch_depth_ >= 0.
//   I14 pending  mutations awaiting invalidation (pending_) exist only inside
//                a batch; every read settles them first, so every check above
//                is of the settled state.
//   I15 inputs   every placeholder's value (a parameter, buffer, graft
//                constant or user input), and the baseline of a patched one,
//                has the version counter recorded for it (versions_, the
//                overlay). An input written in place (model.W.mul_(2), a
//                weight edit) is an edit of that input: every read takes it
//                first, in a new revision, invalidating its strict cone and
//                retiring D(input)'s cached values and baselines, as a graft
//                does. Inside a transaction or a sweep (set_inputs_frozen)
//                such a write is refused instead (a patch function or metric
//                wrote into the model); the edit is taken at the first read
//                after rollback(), or after the sweep.
//
// Mutations (mutations.cpp). Every mutation is an input edit in a new
// revision (Salsa): patch, restore, restore(node) and graft validate, apply
// their own change to the inputs (a pinned value, a baseline put back, a
// spliced block), and describe the rest as a Mutation: what must be
// recomputed, whose strict cone is invalidated, whose cached value no longer
// belongs to its function. apply() runs that one invalidation rule. Inside a
// batch it is deferred: mutations are recorded, and the rule runs once at
// end_batch() or at the first read (demand, value, stats, ...), whichever
// comes first, so a batch costs one wave and nothing is evaluated before the
// demand. Reads inside a batch see exactly the state that applying the
// mutations one by one would give.
//
// Control flow. A higher_order::cond or while_loop node is one evaluation unit: its regions run
// inside it (only the chosen branch, or the loop's iterations) and it counts once, like any call.
// Patching its predicate invalidates it like any other input, so the other branch runs at the
// next demand.
//
// Cost. stats.cost sums a per-node estimate from tensor metadata: 2·M·N·K for
// matrix products (mm, addmm, bmm, linear, matmul), 2·out·(Cin/groups)·k for
// convolutions, 4·B·H·Lq·Lk·D for scaled-dot-product attention, and the output
// element count (at least 1) for everything else.
#pragma once

#include "ir/graph.h"
#include "ir/out_variant.h"
#include "passes/sequence_axis.h"
#include "reactive/row_buffers.h"
#include "runtime/kernel.h"
#include "runtime/run_loop.h"

#include <ATen/core/LegacyTypeDispatch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace torch_ext::reactive {

// The same bits (shape, dtype and device too): -0.0 and 0.0 differ, equal NaNs agree; floating and
// complex tensors compare as integers of their width. Early cutoff's and skip_identical's equality.
bool same_bits(const at::Tensor& x, const at::Tensor& y);

// Same strides in every dim of size > 1 (x and y of one shape). The same bits in another layout
// (v.t().contiguous().t()) are another input downstream: a reduction or a GEMM reads them in another order
// and can round otherwise, as eager, which runs on that layout, does.
bool same_layout(const at::Tensor& x, const at::Tensor& y);

// What a cone cannot tell apart: the same bits in the same layout. skip_identical's and early cutoff's test.
inline bool same_input(const at::Tensor& x, const at::Tensor& y) { return same_layout(x, y) && same_bits(x, y); }

// Row-weighted evaluations, kept exact: an evaluation of k of a node's T rows counts k/T. Summing those
// fractions in a double drifted (a sweep's 2718 read 2718.000000000007, against its closed form in
// docs/cost-model-positions.md); here they are integers per row count T, divided once when read.
struct RowEvaluations {
  int64_t whole = 0;                  // evaluations of every row
  std::map<int64_t, int64_t> partial;  // T -> the sum of k over evaluations of k < T of T rows
  void add(int64_t k, int64_t T) {
    if (k >= T) {
      ++whole;
    } else if (k > 0) {
      partial[T] += k;
    }
  }
  // The exact sum, rounded once to the nearest double (while numerator and denominator fit in 53 bits).
  double value() const;
};

struct Stats {
  int64_t evaluations = 0;  // countable-node executions
  double cost = 0.0;        // FLOP-weighted evaluations (see header comment)
  int64_t cutoffs = 0;      // nodes revalidated by early cutoff without executing
  // Nodes marked invalid by mutations (each marking counts; a node re-marked after a demand counts
  // again). A batch marks once, when it settles: a node that a later mutation of the same batch
  // pins (patches) is never marked, whereas applied one by one it is marked and then pinned. So
  // a batch can count fewer than the same mutations one by one, while evaluations and values
  // agree (tests/python/test_reactive_batch.py).
  int64_t invalidated = 0;
  int64_t restored = 0;     // nodes returned to baseline by restore
  // Row-weighted evaluations: a node evaluated on k of its T rows counts k/T (a whole evaluation
  // counts 1). stats.cost is weighted the same way: the FLOPs of what actually ran.
  RowEvaluations row_evaluations;
};

double node_cost(const ir::Node& node);
// Refuses a graph with a call that reaches no output (`what` names the graph): demand() evaluates
// the whole dirty set, so every call must matter to some output.
void check_no_dead_code(const ir::Graph& g, const std::string& what);
// The version counter of a tensor value, or -1 when it is not tracked (non-tensors, inference tensors).
int64_t version_of(const c10::IValue& v);
// A tensor seen before, by identity and version: a weak reference, so it neither keeps the tensor alive
// nor matches a new tensor at the old address. Inference tensors have no version counter, so an in-place
// write to them could not be seen: they never match.
struct SeenTensor {
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;
  int64_t version = -1;
  bool is(const at::Tensor& t) const {
    return impl && !t.is_inference() && impl->lock().get() == t.unsafeGetTensorImpl() && version_of(t) == version;
  }
  void set(const at::Tensor& t) {
    impl.emplace(t.getIntrusivePtr());
    version = version_of(t);
  }
};

class Engine {
 public:
  // Takes a private copy of `graph`; rejects graphs with mutating ops. `infer_results` false skips the
  // verifier's meta-kernel inference (ir/verifier.h): for graphs that passed it before (build caches).
  explicit Engine(const ir::Graph& graph, bool infer_results = true);

  // Full evaluation from placeholder values (placeholder order). Sets the
  // baseline, drops every patch, counts N evaluations.
  void run(std::vector<c10::IValue> inputs);
  // Values of the output node, recomputing only stale nodes.
  std::vector<c10::IValue> demand();
  // One node's value, recomputing only its stale ancestors.
  c10::IValue value(const std::string& node);
  // A node's id, for a caller that addresses the same node many times (sweep_sites): the *_at forms below
  // take it, and do what the named forms do without looking the name up again. Throws naming the node.
  int64_t node_id(const std::string& node) const { return id_of(node); }
  c10::IValue value_at(int64_t id);
  // The node's value with no patch active (zero evaluations when cached).
  c10::IValue baseline(const std::string& node);

  // Pins `node` to `value` (same type) and invalidates V+(node).
  void patch(const std::string& node, c10::IValue value);
  // Drops every patch; returns every node to its baseline with zero evaluations.
  void restore();
  // Drops the patch at `node`. With other patches active, D(node) is recomputed.
  void restore(const std::string& node);

  // Splices `block` (one user input, one output of the same type as `src`)
  // into the edge src -> dst, or into every consumer of src when dst is empty.
  // Values for the block's other placeholders (its parameters) are given in
  // their order. Returns the names of the new countable nodes.
  std::vector<std::string> graft(const std::string& src, const std::string& dst, const ir::Graph& block,
                                 std::vector<c10::IValue> block_params);

  // Inside a batch, mutations are recorded and their invalidation runs once, at the outermost
  // end_batch() or at the first read before it (see "Mutations" above). Batches nest.
  void begin_batch() { ++batch_depth_; }
  void end_batch();
  bool in_batch() const { return batch_depth_ > 0; }
  int64_t num_pending() const { return static_cast<int64_t>(pending_.size()); }  // mutations not yet settled
  // How many in-place writes to inputs (parameters, buffers, user inputs) the engine has taken as edits
  // (I15): a copy of cached values made before (a batched cone's) is stale when this moved.
  int64_t input_edits() const { return input_edits_; }
  // While frozen (a sweep runs: its patch functions and metrics must not edit the model), an input
  // written in place is refused at the next read instead of taken as an edit (I15).
  void set_inputs_frozen(bool frozen) { inputs_frozen_ = frozen; }

  // A sweep transaction: patch -> demand -> read -> rollback. rollback() puts
  // back exactly the state at begin_transaction() (values, revisions,
  // validity, pins and overlay), with zero evaluations, so standing patches
  // and grafts are left as they were. run, graft and restore are refused
  // inside a transaction; transactions do not nest.
  void begin_transaction(bool restore_counts = false);
  void rollback();
  bool in_transaction() const { return txn_.has_value(); }
  // A refusable mutation (patch(node, f) on a stale node computes f's argument first):
  // begin_transaction(true) also saves the counters (stats and the per-node ledger, I7), which
  // rollback() then puts back, so a refused mutation changes no counter; commit() keeps everything
  // done since begin_transaction (evaluations included) and closes the transaction.
  void commit();
  // Refuses `value` for a patch of `name` (not a tensor, or the node's dtype, shape or device
  // differ), as patch() would, without changing anything.
  void check_patch(const std::string& name, const c10::IValue& value) const {
    check_value_type(*states_[id_of(name)].node, value);
  }
  // The sweep fast path: pins `node` to `value`, evaluates its cone (the nodes
  // reachable from it without passing a pinned node) in topological order,
  // returns the outputs, and puts every value back, as patch -> demand ->
  // rollback would, with the same evaluation counts. The cone's order and the
  // last reader of each value are prepared once per node (and pin set) and
  // reused; the cone runs through the executor's loop (runtime/run_loop.h),
  // intermediate values released at their last use, and those with an out=
  // overload written into planned scratch memory (scratch.cpp), so every site
  // reuses the same hot memory. Needs a graph with nothing stale, no open
  // transaction and early cutoff off.
  std::vector<c10::IValue> evaluate_patched(const std::string& node, c10::IValue value);
  std::vector<c10::IValue> evaluate_patched_at(int64_t id, c10::IValue value);
  // How many cone plans evaluate_patched has prepared: one per patched node (and pin set), reused
  // by every later call on that node until a graft or a change of the pins drops it.
  int64_t plans_built() const { return plans_built_; }
  // Bytes of scratch memory the fast path holds for cone intermediates (scratch.cpp). Off, every
  // intermediate is allocated by its kernel and freed at its last use, and the memory is given back.
  // On, a pointwise cone node whose one input is a cone intermediate that dies there (and that nothing
  // else can alias) runs its in-place variant on that input (ir::find_overwrite, the executor's rule):
  // in that input's scratch buffer, or, for an input its kernel allocated, when at run time nothing
  // else references that input's tensor or storage. The row path then writes
  // linear, gelu, add and its contiguous copies into pooled storages (row_buffers.h).
  int64_t inplace_steps(const std::string& node);  // how many steps of node's plan run in place
  int64_t scratch_bytes() const { return scratch_.defined() ? scratch_.numel() : 0; }
  // Cone nodes whose out= kernel, run into the scratch, resized or re-pointed its result (or failed trying):
  // they run their functional kernel from then on (scratch.cpp). In the order seen, once each per plan.
  const std::vector<std::string>& scratch_fallbacks() const { return scratch_fallbacks_; }
  void set_scratch(bool enabled);
  // The row path's pooled buffers (row_buffers.h) are shared with `other`'s: the batched cones of one
  // sweep reuse the same hot memory unit after unit. Off with set_scratch(false), like the scratch.
  void share_row_buffers(const Engine& other) { row_pool_ = other.row_pool_; }
  // Pooled buffers handed out again, and allocated (row_buffers.h).
  int64_t row_buffers_reused() const { return row_pool_->reused(); }
  int64_t row_buffers_allocated() const { return row_pool_->allocated(); }
  bool scratch() const { return scratch_enabled_; }
  bool can_evaluate_patched() const { return has_run_ && pending_.empty() && dirty_.empty() && !txn_ && !cutoff_; }

  // Token-granular cones (rows.cpp). With positions on, the sequence-axis analysis
  // (passes/sequence_axis.h) is run on the graph (again after a graft). evaluate_patched_rows is
  // evaluate_patched for a value that differs from the cached one only in rows [p, T) of the node's
  // sequence axis (p is found by comparing the two): every node of the cone whose change the
  // analysis bounds to rows [p, T) is computed on those rows alone, its inputs sliced (causal
  // attention: query rows [p, T) against all keys and values, with an explicit offset mask), the
  // rest whole; nothing is written into a cached tensor, and everything is put back afterwards as
  // evaluate_patched does (restore stays free). `read_rows[k]` >= 0 declares that the caller reads
  // only rows [read_rows[k], T) of output k (-1: all of it): rows that reach no read row are not
  // computed, and such an output's rows [p, read_rows[k]) come back as NaN. `read_cols[k]`, when not
  // empty, lists the only columns (last dim) read of output k: an output computed by a linear or a
  // matmul with a constant weight, read by nothing else, computes those columns alone (others NaN). Every node of the cone
  // runs exactly once (a value equal to the cached one runs it whole), so counts are those of
  // evaluate_patched: |V+(node)|. Needs positions on, no standing patch, and what evaluate_patched needs
  // except that early cutoff may be on (see can_evaluate_patched_rows).
  void set_positions(bool enabled, int64_t seq_dim = 1);
  bool positions() const { return positions_; }
  // The node's sequence axis by the analysis (-1: none, positions off, or rows folded into blocks: such a
  // node is not patched by rows, see seq_fold).
  int64_t seq_axis(const std::string& node);
  int64_t seq_axis_at(int64_t id);
  // The analysis's row axis and row blocks (passes::SeqNode::fold) of a node, (-1, 1) without one.
  std::pair<int64_t, int64_t> seq_fold(const std::string& node);
  // Early cutoff may be on: a value equal to the cached one is cut off at the site (zero
  // evaluations, |V+(node)| cutoffs, the cached outputs), any other takes the row path, as with cutoff off.
  bool can_evaluate_patched_rows() const {
    return positions_ && pinned_.empty() && has_run_ && pending_.empty() && dirty_.empty() && !txn_;
  }
  std::vector<c10::IValue> evaluate_patched_rows(const std::string& node, c10::IValue value,
                                                 const std::vector<int64_t>& read_rows = {},
                                                 const std::vector<std::vector<int64_t>>& read_cols = {});
  std::vector<c10::IValue> evaluate_patched_rows_at(int64_t id, c10::IValue value,
                                                    const std::vector<int64_t>& read_rows = {},
                                                    const std::vector<std::vector<int64_t>>& read_cols = {});
  // The first row along the node's sequence axis where `value` differs from its cached value (T if none).
  int64_t first_changed_row(const std::string& node, const c10::IValue& value);

  // Throws (naming the node) if the node's cached value was written in place
  // since it was stored, after marking it for recomputation (I8).
  void check_intact(const std::string& node);

  // V+(node), topological order. With stop_at_pins, only the nodes reached without passing a pinned
  // (patched) node: what patching `node` now invalidates, and what the next demand evaluates.
  std::vector<std::string> cone(const std::string& node, bool stop_at_pins = false) const;
  double cone_cost(const std::string& node) const;               // sum of the cost estimates over V+(node)
  int64_t num_countable() const { return num_countable_; }
  // Reads settle a batch's pending mutations first (I14), so they are not const.
  bool is_valid(const std::string& node);
  int64_t num_dirty() {
    settle();
    return static_cast<int64_t>(dirty_.size());
  }
  std::vector<std::string> pinned() const;

  void set_cutoff(bool enabled) { cutoff_ = enabled; }
  bool cutoff() const { return cutoff_; }
  const Stats& stats() {
    settle();
    return stats_;
  }
  void reset_stats();

  const ir::Graph& graph() const { return *graph_; }
  // Bumped by every change of the graph's structure (a graft): a copy of graph() taken at the same
  // revision is current.
  uint64_t graph_revision() const { return grafts_.size(); }
  // Settles pending mutations, then throws c10::Error naming the first violated invariant (and the
  // set it concerns: dirty, structural_dirty, baseline_stale, overlay, pinned, revision, ...).
  void check_invariants();

 private:
  friend struct EngineTestPeer;  // tests/cpp: corrupts one set at a time to see check_invariants name it

  // What a mutation leaves to the one invalidation rule (see "Mutations" above), recorded with
  // the state it depends on at the time it was applied.
  struct Mutation {
    bool under_patch = false;       // patches were active: new values are not baselines
    std::vector<int64_t> fresh;     // new nodes (a grafted block): invalid, never computed
    std::vector<int64_t> recompute; // invalid themselves, recomputed without cutoff, cones too
    std::vector<int64_t> changed;   // valid, changed values: their strict cones are invalid
    std::vector<int64_t> retired;   // cached values that are no function of the current graph
    std::vector<int64_t> rewired;   // graft consumers w: every node of D(w) is retired too
  };
  // Records `m`; outside a batch, settles it at once.
  void apply(Mutation m);
  // Takes inputs written in place as edits (I15), then settles every pending mutation.
  void settle();
  // Runs every pending mutation's invalidation, in order (also rekeys the dirty set after grafts).
  void settle_pending();
  // I15: a placeholder (or a patched one's baseline) whose version moved since it was stored becomes a
  // pending edit of that input; inside a transaction, while inputs are frozen, or when `refusing` names
  // a sweep fast path (whose caller's callbacks ran since the last read), it is refused.
  void take_written_inputs(const char* refusing = nullptr);
  void invalidate(const Mutation& m);
  // A cached value found written in place: recomputed, never revived by restore() (I8, I11).
  void retire_written(int64_t id);

  struct Baseline {
    c10::IValue value;
    uint64_t changed_at = 0;
    int64_t version = -1;
  };
  struct JournalEntry {
    c10::IValue value;
    uint64_t changed_at = 0;
    uint64_t verified_at = 0;
    int64_t version = -1;
    bool valid = false;
    bool pinned = false;
  };
  struct Transaction {
    std::unordered_map<int64_t, JournalEntry> journal;
    std::vector<int64_t> pinned_before;
    std::vector<int64_t> overlay_added;
    std::set<int64_t> structural_before;      // structural_dirty_ at begin_transaction()
    std::set<int64_t> baseline_stale_before;  // baseline_stale_ at begin_transaction()
    std::optional<Stats> stats_before;        // begin_transaction(true): the counters to put back
    std::vector<int64_t> node_evaluations_before;
  };

  struct NodeState {
    ir::Node* node = nullptr;
    bool countable = false;
    std::optional<runtime::BoundKernel> kernel;
    double cost = 0.0;
    bool valid = false;
    bool pinned = false;
    uint64_t changed_at = 0;
    uint64_t verified_at = 0;
    int64_t evaluations = 0;
  };

  int64_t id_of(const std::string& name) const;  // throws naming the node
  // For the *_at forms: throws, naming `what` and the id, unless `id` is one of this engine's nodes.
  void check_id(int64_t id, const char* what) const;
  int64_t id_of(const ir::Node* node) const { return ids_.at(node); }
  int64_t add_state(ir::Node* node);
  void bind(int64_t id);
  void mark_invalid(int64_t id);
  void invalidate_users(int64_t id);  // strict cone, stops at invalid or pinned nodes
  // Walks the users reachable from `seed` (never the output node): enter(u) says whether to go on
  // through u. Every cone the engine takes is one of these walks.
  template <class Enter>
  void walk_users(int64_t seed, Enter&& enter) const;
  // V+(seed) by stable id; with stop_at_pins, only through unpinned countable nodes (what a patch invalidates).
  std::set<int64_t> downstream(int64_t seed, bool stop_at_pins) const;
  // Evaluates the invalid nodes `ids` (in the dirty set, topological order) through the shared run
  // loop, with early cutoff, the integrity check (I8), the ledger (I7) and the revisions.
  void evaluate_nodes(const std::vector<int64_t>& ids);
  // evaluate_nodes' hooks: before node `id` runs (false: cut off, it stays as it is), and its
  // value `out` replacing `slot`, the cached one.
  bool begin_evaluation(int64_t id, const c10::IValue& current);
  void finish_evaluation(int64_t id, c10::IValue& slot, c10::IValue&& out);
  void save_baseline(int64_t id);
  void rekey_dirty();
  void check_value_type(const ir::Node& node, const c10::IValue& value) const;
  void journal(int64_t id);  // I9: remembers id's state before its first change in a transaction
  void store(int64_t id, c10::IValue value);  // values_[id] = value, with its version recorded (I8)
  void check_intact(int64_t id);
  void refuse_in_transaction(const char* what) const;

  std::unique_ptr<ir::Graph> graph_;
  std::vector<NodeState> states_;  // by stable id (creation order)
  runtime::ValueSlots values_;     // by stable id
  std::vector<int64_t> versions_;  // by stable id: tensor version counter when stored, -1 if untracked
  std::vector<int64_t> input_ids_;  // placeholders (graft constants included), by stable id
  int64_t input_edits_ = 0;         // inputs written in place and taken as edits (I15)
  bool inputs_frozen_ = false;      // set_inputs_frozen
  std::optional<Transaction> txn_;
  std::vector<Mutation> pending_;  // I14: only inside a batch
  bool rekey_pending_ = false;     // a graft shifted topological indices: rekey dirty_ when settling
  // Grafts applied so far (their countable nodes), in order; their count names the next block.
  struct Graft {
    std::vector<int64_t> nodes;
    uint64_t revision = 0;
  };
  std::vector<Graft> grafts_;
  // A cone value written by its out= overload into the scratch tensor (scratch.cpp).
  struct ScratchOut {
    size_t step = 0;         // position in PatchPlan::order
    c10::OperatorHandle op;  // the out= overload
    std::string arg;         // its out argument
    int64_t offset = 0;      // bytes into the scratch tensor
    bool fell_back = false;  // its out= kernel changed its planned result: the functional kernel runs
    // >= 0: `op` is the node's in-place variant, run on its one input, the value of plan.scratch[overwrites]
    // (which dies at this step), in that value's buffer (offset is that buffer's).
    int32_t overwrites = -1;
  };
  struct PatchPlan {
    std::vector<int64_t> order;         // the cone's countable nodes, topological order
    std::vector<runtime::Step> steps;   // per order[i]: its kernel, and the values read for the last time
    std::vector<int64_t> external;      // values read from outside the cone (version-checked)
    uint64_t pins_version = 0;
    // Intermediates that never leave one evaluate_patched call, planned once (scratch.cpp).
    std::vector<ScratchOut> scratch;
    std::vector<runtime::BoundKernel> scratch_kernels;  // parallel to scratch, bound to scratch_
    std::vector<at::Tensor> scratch_views;              // parallel to scratch: each kernel's out= view
    std::vector<int32_t> scratch_of;                    // per step: its index in scratch, -1 (empty: none)
    int64_t scratch_bytes = 0;
    uint64_t scratch_generation = 0;  // scratch_generation_ the kernels are bound to (0: unbound)
    // Steps run by their in-place variant on their one input, a cone intermediate that dies there
    // and owns its memory (scratch.cpp): parallel lists, the kernels bound once.
    std::vector<size_t> inplace_steps;
    std::vector<int64_t> inplace_inputs;  // the slot each overwrites, when it alone holds the tensor
    std::vector<runtime::BoundKernel> inplace_kernels;
    bool inplace_bound = false;  // steps point at inplace_kernels (scratch on), else at the functional ones
    // Per step (empty: none): a composite op planned as a fresh result, whose value is copied out if it
    // points into the scratch (unalias_scratch).
    std::vector<uint8_t> alias_checks;
  };
  std::unordered_map<int64_t, PatchPlan> plans_;  // by patched node; dropped by grafts
  uint64_t pins_version_ = 0;                     // bumped whenever the pin set changes
  int64_t plans_built_ = 0;                       // plans prepared so far (each is reused until dropped)
  PatchPlan& plan_for(int64_t id);
  // Scratch memory of the sweep fast path (scratch.cpp): one tensor for every plan, grown to the
  // largest plan's need; plans bind their out= kernels to it at first use after it grows.
  void plan_scratch(PatchPlan& plan);
  // The steps with no out= kernel in the scratch that can overwrite their dying input instead of
  // allocating (scratch.cpp); `end`/`escapes` per position as plan_scratch computes them.
  void plan_inplace(PatchPlan& plan, const std::vector<int64_t>& end, const std::vector<bool>& escapes);
  void bind_scratch(PatchPlan& plan);
  // A value that points into the scratch memory (a composite op handed back its input's buffer) is
  // replaced by a copy, so that no value outside the plan's lifetimes lives in the scratch.
  void unalias_scratch(c10::IValue& v) const;
  // Runs scratch step `i` of `plan` (bound, not fallen back) checked: when its out= kernel fails or leaves
  // its view resized or re-pointed, puts the view back, runs the functional kernel from then on (this plan;
  // later plans leave the operator out of the scratch) and records the node in scratch_fallbacks_.
  c10::IValue run_scratch_step(PatchPlan& plan, size_t i);
  // evaluate_patched's work once its checks passed: pins `id` to `value`, runs its whole cone with the
  // shared loop, returns the outputs and puts every value back. No early cutoff inside the cone (the
  // row path calls it with cutoff on, where cutoff does not act inside a cone either).
  std::vector<c10::IValue> evaluate_cone_whole(int64_t id, c10::IValue value);
  bool other_layout(int64_t id, const c10::IValue& value) const;
  at::Tensor scratch_;
  std::vector<std::string> scratch_fallbacks_;
  bool scratch_enabled_ = true;
  uint64_t scratch_generation_ = 0;
  // Out= overloads by target and result type: the dispatcher scan runs once per kind of node.
  std::unordered_map<std::string, std::optional<ir::OutVariant>> out_variants_;
  // Evaluating a patched cone in place (evaluate_patched, evaluate_patched_rows): checks the values
  // the cone reads from outside it (I8), holds the cone's cached values and the site's aside, puts
  // `value` at the site, and puts everything back when it goes out of scope, on success or error.
  class HeldCone {
   public:
    // `take`: the cached values are moved out of their slots (left empty) rather than copied, for a loop that
    // writes every cone slot before reading it (evaluate_cone_whole): no cached tensor's reference count is
    // touched, where a copy, and the store that drops it, cost two cache misses per cone node on cold tensors.
    HeldCone(Engine& engine, int64_t site, const PatchPlan& plan, c10::IValue value, bool take = false);
    ~HeldCone();
    HeldCone(const HeldCone&) = delete;
    HeldCone& operator=(const HeldCone&) = delete;
    const c10::IValue& cached(size_t i) const { return saved_[i]; }  // plan.order[i]'s cached value

   private:
    Engine& engine_;
    const int64_t site_;
    const PatchPlan& plan_;
    std::vector<c10::IValue> saved_;
    c10::IValue saved_site_;
    at::AutoDispatchBelowAutograd no_autograd_;  // graph values are data, never autograd history
  };
  // One execution of node st's kernel (or `compute`, for the row paths) for the ledger (I7): `rows` of
  // its `of` rows, costing `cost_fraction` of its estimate.
  void count_evaluation(NodeState& st, int64_t rows = 1, int64_t of = 1, double cost_fraction = 1.0);
  // The ledger (I7) for the first `done` nodes of a plan that ran whole: what count_evaluation
  // would record node by node, added once per run.
  void count_plan(const PatchPlan& plan, size_t done);
  // Rethrows an error from evaluating `st`, naming the node (and `where`, e.g. its rows).
  [[noreturn]] static void rethrow_evaluating(const NodeState& st, const std::exception& e,
                                              const std::string& where = "");
  // Token-granular plan for one patched node and one set of read rows (rows.cpp).
  struct RowInput {
    int64_t slot = -1;
    passes::SeqRel rel = passes::SeqRel::None;
    int64_t dim = -1;
    int64_t pos = -1;  // position in the plan when the input is a cone node, else -1
    int64_t fold = 1;  // the input's row blocks (passes::SeqNode::fold): its size along dim is fold * T
  };
  struct RowStep {
    bool suffix = false;  // computed on rows [start, T) of its row axis, stored as those rows alone
    // Row-wise in every changed input (the patched node's or cone nodes'): its change stays within
    // the rows its inputs changed, so it computes rows [start, hi) alone, the cached rows after.
    bool local = false;
    int64_t row_axis = -1;
    int64_t length = 0;
    int64_t fold = 1;  // rows in blocks along row_axis (passes::SeqNode::fold): rows [s, e) of each block
    int64_t need = 0;  // first row any reader needs (0 when read whole)
    int special = 0;   // 0 kernel, 1 causal SDPA, 2 view, 3 _unsafe_view, 4 reshape, 5 expand
    bool dense_inputs = false;  // sliced inputs are made contiguous first (GEMMs, norms, attention)
    // Rows given whole but strided are made contiguous first (linear, the norms: they would copy them
    // densely themselves, into fresh memory, linear by matmul + add_ instead of addmm).
    bool dense_whole = false;
    bool causal_sdpa = false;   // scaled_dot_product_attention reading its keys and values causally
    // A kernel step whose value is written into a pooled buffer (row_buffers.h) by the out= form of what
    // the functional kernel runs, when its inputs allow it (run_pooled): 1 linear, 2 gelu, 3 add.Tensor.
    int pooled = 0;
    std::vector<int64_t> cols;  // special 6 (linear) / 7 (matmul): the only output columns computed
    at::Tensor cols_index;      // cols as a long tensor on the weight's device
    int64_t width = 0;          // the output's last dim when cols is set
    std::vector<RowInput> inputs;
    // Whole on the row path though the analysis bounds it to rows (its readers see the whole value):
    // 1, a node whose recomputed rows are joined with its cached ones right where they are computed,
    // because every reader is a view chain ending in causal attention, which reads keys and values
    // whole (the fused qkv projection: one join, and q, k and v are views of it as in a full run);
    // 2, a view in such a chain, run on the whole value (counted as the rows it would have computed).
    int whole = 0;
  };
  struct RowPlan {
    std::vector<RowStep> steps;  // parallel to PatchPlan::order
    std::unordered_map<int64_t, size_t> pos;
    int64_t source_axis = -1;
    int64_t source_length = 0;
    uint64_t pins_version = 0;
    // Some step computes fewer rows than a changed input gives it, or only some columns (read rows or
    // columns were declared): without it, a value changed in its first and last rows runs the cone whole.
    bool narrows = false;
  };
  // A node value assembled from cached rows and recomputed ones (an output, or a value read whole),
  // kept across sweep sites so that each site writes only the rows that differ from the last one.
  // It is reused only while the engine holds the sole reference to it (a caller that kept an output,
  // or a view of it, gets a fresh buffer next time), it is unwritten since, and it was assembled from
  // the same cached tensor (same version); `state` says what each row holds.
  struct RowScratch {
    at::Tensor buf;
    SeenTensor source;  // the cached tensor it was assembled from
    int64_t version = -1;
    std::vector<uint8_t> state;  // per row: 0 unknown, 1 cached, 2 NaN, 3 NaN but `cols`, 4 other
    std::vector<int64_t> cols;
  };
  std::unordered_map<int64_t, RowScratch> row_scratch_;  // by node id
  std::shared_ptr<RowBufferPool> row_pool_ = std::make_shared<RowBufferPool>();
  // Step `step`'s value written into a buffer of `pool`, or an undefined tensor where its inputs do not
  // allow it (the functional kernel runs then). Bit for bit what the functional kernel gives.
  at::Tensor run_pooled(const RowStep& step, const ir::Node& node, RowBufferPool& pool);
  // x.contiguous() / x.reshape(sizes), their copies (if any) written into a pooled buffer.
  static at::Tensor pooled_contiguous(const at::Tensor& x, RowBufferPool* pool);
  static at::Tensor pooled_reshape(const at::Tensor& x, at::IntArrayRef sizes, RowBufferPool* pool);
  // The largest magnitude in a node's cached value, for the attention overflow check of the row path
  // (rows.cpp): computed once per cached tensor and version, as the cached values outlive many sites.
  struct CleanMax {
    SeenTensor source;
    double max_abs = 0.0;
  };
  std::unordered_map<int64_t, CleanMax> clean_max_;  // by node id
  double cached_max_abs(int64_t slot, const at::Tensor& cached);
  // Whether a causal SDPA step of the row path could see a score overflow to inf, or a non-finite
  // input: then a full kernel and the row path disagree (see rows.cpp), and the cone runs whole.
  bool attention_may_overflow(const RowStep& step, const NodeState& st, const HeldCone& held, const RowPlan& rp,
                              int64_t p);
  // Rows [0, p) of `cached`, NaN for rows [p, start), then `suffix` (rows [start, stop), stop -1: T), then
  // rows [stop, T) of `cached`; with `cols`, suffix holds only those columns of the last dim (the others NaN).
  at::Tensor assemble_rows(int64_t id, const at::Tensor& cached, const at::Tensor& suffix, int64_t dim, int64_t p,
                           int64_t start, const std::vector<int64_t>& cols, const at::Tensor& cols_index,
                           int64_t stop = -1);
  std::map<std::tuple<int64_t, int64_t, int64_t, int, int>, at::Tensor> sdpa_masks_;  // (s, T, Lk, dtype, device)
  const RowPlan& row_plan_for(int64_t id, const std::vector<int64_t>& read_rows,
                              const std::vector<std::vector<int64_t>>& read_cols);
  const passes::SeqAxisAnalysis& seq_analysis();
  // [first, last + 1) of the rows along the node's sequence axis where `value` differs from the cached value ({T, T} if none).
  // first_only: the second is not asked for (a dense value is then scanned no further than its first changed
  // row, and the second is T).
  std::pair<int64_t, int64_t> changed_rows(int64_t id, const c10::IValue& value, bool first_only = false);
  std::map<std::tuple<int64_t, std::vector<int64_t>, std::vector<std::vector<int64_t>>>, RowPlan> row_plans_;
  // Per node, the plan row_plan_for returned last for it, found again without building row_plans_'s key (a
  // sweep asks for a node's plan at each of its sites, and its sites on other nodes come between); cleared
  // with row_plans_.
  struct RowPlanMemo {
    int64_t id = -1;
    const RowPlan* plan = nullptr;
    std::vector<int64_t> read_rows;
    std::vector<std::vector<int64_t>> read_cols;
  };
  std::unordered_map<int64_t, RowPlanMemo> row_plan_memo_;
  void clear_row_plans() {
    row_plans_.clear();
    row_plan_memo_.clear();
  }
  std::optional<passes::SeqAxisAnalysis> seq_;
  bool positions_ = false;
  int64_t seq_dim_ = 1;
  std::unordered_map<const ir::Node*, int64_t> ids_;
  std::set<std::pair<int64_t, int64_t>> dirty_;  // (topological index, id)
  // Baseline (value, changed_at) of every node written while patched; restore puts both back, so
  // revisions after a restore are exactly those of the baseline.
  std::unordered_map<int64_t, Baseline> overlay_;
  std::set<int64_t> baseline_stale_;     // nodes whose overlay baseline a graft made stale
  std::set<int64_t> structural_dirty_;   // nodes a graft invalidated, not yet recomputed
  std::vector<int64_t> pinned_;
  std::vector<c10::IValue> stack_;
  std::vector<runtime::Step> demand_steps_;  // evaluate_nodes' steps, reused (no release lists)
  Stats stats_;
  uint64_t revision_ = 0;
  int64_t num_countable_ = 0;
  int batch_depth_ = 0;
  bool cutoff_ = false;
  bool has_run_ = false;
};

}  // namespace torch_ext::reactive
