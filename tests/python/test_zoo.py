"""Foundation checks over the model zoo (tests/python/zoo.py).

For every zoo program (as exported, and after ``run_decompositions()``):
  * ``torch_ext.Executor(ep)(*inputs)`` equals ``ep.module()(*inputs)``;
  * the printed IR survives ``Graph.parse`` unchanged and still computes the same thing;
  * ``graph.verify()`` passes and the placeholders follow the export signature;
  * ``graph.to_graph_module()`` on flat lifted inputs reproduces ``ep.module()``.

Exactness: every comparison against ``ep.module()`` (and between executor / GraphModule /
re-parsed graph) is bit-exact (``torch.equal``): all of them dispatch the very same ATen
kernels on the same inputs, in the same order, on CPU. The only comparison that needs a
tolerance is the joint graph against eager autograd (``test_joint_matches_eager``):
export_joint decomposes to core ATen (cross_entropy -> log_softmax + gather/where/sum/div,
linear -> addmm, backward formulas from the decomposition table), which are different
kernels from eager's fused ones; there atol = rtol = 1e-6 (observed: loss and logits
bit-exact, parameter gradients off by up to ~4e-8).

"""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import torch_ext
from torch_ext._compat import export_joint
from torch_ext.ir import Graph

from zoo import ZOO, assert_bit_exact, flat_lifted_inputs, make_executor

FORWARD = [n for n, e in ZOO.items() if not e.joint]
JOINT = [n for n, e in ZOO.items() if e.joint]


def _state(ep):
    return {**ep.state_dict, **ep.constants}


def _tol(name, decomposed):
    return 1e-6 if ZOO[name].inexact and not decomposed else None


def _user_output_indices(ep):
    return [i for i, s in enumerate(ep.graph_signature.output_specs)
            if s.kind.name in ("USER_OUTPUT", "LOSS_OUTPUT")]


# ------------------------------------------------------------------ Executor vs ep.module()
def _check_executor(export_cache, name, decomposed):
    ep, _, inputs = export_cache.get(name, decomposed)
    ex = make_executor(ep)  # before ep.module() runs: both start from the exported state
    ref = ep.module()(*inputs)
    out = ex(*inputs)
    assert_bit_exact(out, ref, tol=_tol(name, decomposed))
    # A second call gives the same answer (no state leaks between runs of a pure program).
    if not ZOO[name].mutates_buffers:
        assert_bit_exact(ex(*inputs), out, "second call")


@pytest.mark.parametrize("name", FORWARD)
def test_executor_matches_module(export_cache, name):
    _check_executor(export_cache, name, decomposed=False)


@pytest.mark.parametrize("name", FORWARD)
def test_executor_matches_module_decomposed(export_cache, name):
    _check_executor(export_cache, name, decomposed=True)


@pytest.mark.parametrize("decomposed", [False, True], ids=["training_ir", "decomposed"])
def test_bn_train_buffers_follow_module(export_cache, decomposed):
    """Train-mode BN: 3 calls; outputs and every buffer match ep.module() after each call.

    As exported, the program updates the buffers in place (aten::batch_norm on the running
    stats, aten::add_ on num_batches_tracked); decomposed, it returns them as
    BUFFER_MUTATION outputs. Both paths must update ``ex.state``.
    """
    ep, _, inputs = export_cache.get("cnn_bn_train", decomposed)
    ex = torch_ext.Executor(ep)
    mod = ep.module()
    buffers = [s.target for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER"]
    assert len(buffers) == 6
    initial = {k: ex.state[k].clone() for k in buffers}
    for step in range(3):
        x = torch.randn_like(inputs[0]) * (step + 1) + step
        assert_bit_exact(ex(x), mod(x), f"step {step} output")
        ref_state = mod.state_dict()
        for k in buffers:
            assert_bit_exact(ex.state[k], ref_state[k], f"step {step} buffer {k}")
    for k in buffers:
        assert not torch.equal(ex.state[k], initial[k]), f"{k} was never updated"
    assert ex.state["bn1.num_batches_tracked"].item() == initial["bn1.num_batches_tracked"].item() + 3


def test_tied_weight_feeds_both_uses(export_cache):
    """The tied embedding/projection weight is one placeholder used by both ops."""
    ep, model, inputs = export_cache.get("tied_embedding")
    assert model.emb.weight is model.head.weight
    g = Graph.from_exported(ep)
    users = {}
    for n in g.nodes():
        if n.kind == "placeholder" and n.role == "param":
            users[n.state_name] = {g.node(u).target for u in n.users}
    shared = [k for k, u in users.items() if {"aten::embedding.default", "aten::linear.default"} <= u]
    assert shared, f"no parameter feeds both embedding and the projection: {users}"
    ex = torch_ext.Executor(ep)
    assert_bit_exact(ex(*inputs), model(*inputs).detach())


# ------------------------------------------------------------------ IR text, verifier, FX export
ALL = [pytest.param(n, d, id=f"{n}-{'decomposed' if d else 'exported'}")
       for n in ZOO for d in ([False] if ZOO[n].joint else [False, True])]


@pytest.mark.parametrize("name,decomposed", ALL)
def test_text_round_trip(export_cache, name, decomposed):
    ep, _, _ = export_cache.get(name, decomposed)
    g = Graph.from_exported(ep)
    text = str(g)
    parsed = Graph.parse(text)
    assert str(parsed) == text
    assert len(parsed) == len(g)
    assert [(n.kind, n.name, n.type) for n in parsed.nodes()] == \
           [(n.kind, n.name, n.type) for n in g.nodes()]
    parsed.verify()


@pytest.mark.parametrize("name,decomposed", ALL)
def test_verify_and_placeholders(export_cache, name, decomposed):
    ep, _, _ = export_cache.get(name, decomposed)
    g = Graph.from_exported(ep)
    g.verify()
    phs = [n for n in g.nodes() if n.kind == "placeholder"]
    roles = {"PARAMETER": "param", "BUFFER": "buffer", "CONSTANT_TENSOR": "const", "USER_INPUT": "input"}
    expected = [(s.arg.name, roles[s.kind.name], s.target or "") for s in ep.graph_signature.input_specs]
    assert [(n.name, n.role, n.state_name) for n in phs] == expected
    order = ["param", "buffer", "const", "input"]
    ranks = [order.index(n.role) for n in phs]
    assert ranks == sorted(ranks), f"placeholder roles out of order: {[n.role for n in phs]}"
    assert g.nodes()[-1].kind == "output"
    n_out = len(g.nodes()[-1].args[0])
    assert n_out == len(ep.graph_signature.output_specs)


def _run_graph_module(g, ep, inputs):
    gm = g.to_graph_module()
    flat = flat_lifted_inputs(g, _state(ep), inputs)  # fresh clones: mutation-safe
    return list(gm(*flat)), flat


@pytest.mark.parametrize("name,decomposed", [p for p in ALL if not ZOO[p.values[0]].joint])
def test_graph_module_matches_module(export_cache, name, decomposed):
    ep, _, inputs = export_cache.get(name, decomposed)
    g = Graph.from_exported(ep)
    outs, flat = _run_graph_module(g, ep, inputs)
    mod = ep.module()
    ref = mod(*inputs)
    user = [outs[i] for i in _user_output_indices(ep)]
    assert_bit_exact(pytree.tree_unflatten(user, ep.call_spec.out_spec), ref, tol=_tol(name, decomposed))
    # Buffer updates: returned (decomposed) or applied in place to the flat inputs (training IR).
    ref_state = mod.state_dict()
    by_name = {n.state_name: x for n, x in zip([n for n in g.nodes() if n.kind == "placeholder"], flat)}
    for i, s in enumerate(ep.graph_signature.output_specs):
        if s.kind.name == "BUFFER_MUTATION":
            by_name[s.target] = outs[i]
    for s in ep.graph_signature.input_specs:
        if s.kind.name == "BUFFER":
            assert_bit_exact(by_name[s.target], ref_state[s.target], f"buffer {s.target}")


@pytest.mark.parametrize("name,decomposed", ALL)
def test_reparsed_graph_computes_the_same(export_cache, name, decomposed):
    """Parsing the printed text keeps every argument: the re-parsed graph's FX export agrees bitwise."""
    ep, _, inputs = export_cache.get(name, decomposed)
    g = Graph.from_exported(ep)
    a, _ = _run_graph_module(g, ep, inputs)
    b, _ = _run_graph_module(Graph.parse(str(g)), ep, inputs)
    assert_bit_exact(b, a, "re-parsed graph outputs")


# ------------------------------------------------------------------ joint forward/backward
def test_joint_requirements():
    """What torch 2.9's _export_forward_backward (via _compat.export_joint) requires.

    * output ``loss_index`` (default 0) must be a scalar (0-dim) tensor;
    * every other output must not require grad (detach it);
    * the joint program's outputs are: the forward outputs (the loss as LOSS_OUTPUT), then one
      GRADIENT_TO_PARAMETER output per parameter. ``ep.module()`` of a joint program is not
      usable (it unflattens all outputs, gradients included, against the forward's out_spec
      and raises ValueError), so joint graphs are checked against eager autograd instead.
    """
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)

    class NotScalar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x)

    class ExtraGradOutput(NotScalar):
        def forward(self, x):
            y = self.lin(x)
            return y.sum(), y

    with pytest.raises(RuntimeError, match="scalar"):
        export_joint(torch.export.export(NotScalar(), (x,)))
    with pytest.raises(RuntimeError, match="requires gradients"):
        export_joint(torch.export.export(ExtraGradOutput(), (x,)))

    class Ok(NotScalar):
        def forward(self, x):
            y = self.lin(x)
            return y.sum(), y.detach()

    j = export_joint(torch.export.export(Ok(), (x,)))
    kinds = [(s.kind.name, s.target) for s in j.graph_signature.output_specs]
    assert kinds == [("LOSS_OUTPUT", None), ("USER_OUTPUT", None),
                     ("GRADIENT_TO_PARAMETER", "lin.weight"), ("GRADIENT_TO_PARAMETER", "lin.bias")]


def _eager_joint(model, ep, inputs):
    """Eager reference for a joint program's outputs, in output_specs order."""
    loss, *rest = model(*inputs)
    params = dict(model.named_parameters())
    grad_targets = [s.target for s in ep.graph_signature.output_specs if s.kind.name == "GRADIENT_TO_PARAMETER"]
    grads = dict(zip(grad_targets, torch.autograd.grad(loss, [params[t] for t in grad_targets])))
    fwd = iter([loss.detach(), *[r.detach() for r in rest]])
    return [grads[s.target] if s.kind.name == "GRADIENT_TO_PARAMETER" else next(fwd)
            for s in ep.graph_signature.output_specs]


@pytest.mark.parametrize("name", JOINT)
def test_joint_matches_eager(export_cache, name):
    ep, model, inputs = export_cache.get(name)
    g = Graph.from_exported(ep)
    outs, _ = _run_graph_module(g, ep, inputs)
    ref = _eager_joint(model, ep, inputs)
    assert len(outs) == len(ref) == len(ep.graph_signature.output_specs)
    assert sum(s.kind.name == "GRADIENT_TO_PARAMETER" for s in ep.graph_signature.output_specs) == 4
    for i, (a, e) in enumerate(zip(outs, ref)):
        # Tolerance: decomposed core-ATen kernels vs eager's fused ones (see module docstring).
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6, msg=lambda m: f"output {i}: {m}")
        assert a.abs().sum() > 0, f"output {i} is all zeros"


@pytest.mark.parametrize("name", JOINT)
def test_joint_executor(export_cache, name):
    """Executor on a joint program returns the forward outputs (loss first); the core executor's
    flat outputs (gradients included) equal the GraphModule's bitwise."""
    ep, _, inputs = export_cache.get(name)
    ex = make_executor(ep)
    g = Graph.from_exported(ep)
    ref, flat = _run_graph_module(g, ep, inputs)
    n_fwd = len(_user_output_indices(ep))
    assert_bit_exact(ex(*inputs), tuple(ref[:n_fwd]))
    assert_bit_exact(torch_ext.Executor(g)(*flat), ref, "flat joint outputs")
