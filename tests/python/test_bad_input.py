"""Bad input never crashes: malformed IR text, unsupported FX nodes and wrong executor inputs
each raise a Python exception whose message names the offending thing."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx
import torch.nn as nn

import torch_ext
from torch_ext.ir import Graph, UnsupportedNodeError

from helpers import assert_verifier_and_executor_refuse
from zoo import ZOO


def _g(body: str) -> str:
    return "graph:\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "  ") + "\n"


# ------------------------------------------------------------------ malformed text IR
MALFORMED = {
    "undefined_value": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::relu.default(%nope)
        return (%b)
    """), r"line 3, .*use of undefined value %nope"),
    "undefined_in_return": (_g("""
        %a : f32[2] = input()
        return (%a, %ghost)
    """), r"use of undefined value %ghost"),
    "bad_dtype": (_g("""
        %a : q33[2] = input()
        return (%a)
    """), r"line 2, .*unknown type 'q33'"),
    "missing_return": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::relu.default(%a)
    """), r"graph has no return statement"),
    "garbage": ("hello world ~~~", r"line 1, column 1: expected 'graph:'"),
    "empty": ("", r"expected 'graph:'"),
    "binary_garbage": ("graph:\n  \x00\x01\xff\n", r"IR parse error at line 2"),
    "unterminated_string": (_g("""
        %w : f32[2] = param("weight)
        return (%w)
    """), r"unterminated string literal"),
    "redefinition": (_g("""
        %a : f32[2] = input()
        %a : f32[2] = input()
        return (%a)
    """), r"redefinition of %a"),
    "target_without_overload": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::relu(%a)
        return (%b)
    """), r"malformed op target 'aten::relu'"),
    "placeholder_after_call": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::relu.default(%a)
        %c : f32[2] = input()
        return (%b)
    """), r"placeholder %c must come before every call"),
    "text_after_return": (_g("""
        %a : f32[2] = input()
        return (%a)
        %b : f32[2] = input()
    """), r"unexpected text after the graph's return statement"),
    "integer_overflow": (_g("""
        %a : f32[99999999999999999999999] = input()
        return (%a)
    """), r"malformed integer '99999999999999999999999'"),
    "strides_rank": (_g("""
        %a : f32[2,3]{1} = input()
        return (%a)
    """), r"strides and sizes differ in rank"),
    "unknown_constant": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::add.Tensor(%a, %a, alpha=torch.bogus)
        return (%b)
    """), r"unknown constant 'torch.bogus'"),
    "positional_after_keyword": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::add.Tensor(%a, alpha=2, %a)
        return (%b)
    """), r"positional argument after keyword argument"),
}


@pytest.mark.parametrize("text,pattern", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_text(text, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        Graph.parse(text)


# Text that parses but describes an invalid program: verify() lists the problem, and the
# executor refuses to build (it verifies first).
INVALID = {
    "unknown_operator": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::not_an_op.default(%a)
        return (%b)
    """), r"node %b \(aten::not_an_op.default\): unknown operator"),
    "missing_argument": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::add.Tensor(%a)
        return (%b)
    """), r"node %b \(aten::add.Tensor\): missing required argument 'other'"),
    "unknown_keyword": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::relu.default(%a, bogus=1)
        return (%b)
    """), r"node %b \(aten::relu.default\): unknown keyword argument 'bogus'"),
    "too_many_args": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::relu.default(%a, %a, %a)
        return (%b)
    """), r"node %b \(aten::relu.default\): takes at most 1 positional args, got 3"),
    "getitem_of_tensor": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = getitem(%a, 0)
        return (%b)
    """), r"node %b \(getitem\): getitem source %a is not a tuple"),
    "getitem_out_of_range": (_g("""
        %a : f32[4] = input()
        %s : (f32[2], f32[2]) = aten::split.Tensor(%a, 2)
        %b : f32[2] = getitem(%s, 2)
        return (%b)
    """), r"node %b \(getitem\): index 2 out of range for a tuple of 2"),
}


@pytest.mark.parametrize("text,pattern", INVALID.values(), ids=INVALID.keys())
def test_invalid_graph(text, pattern):
    assert_verifier_and_executor_refuse(text, pattern)


UNBINDABLE = {
    "string_for_int_list": (_g("""
        %a : f32[4] = input()
        %b : f32[] = aten::sum.dim_IntList(%a, "x")
        return (%b)
    """), r"node %b \(aten::sum.dim_IntList\): argument 'dim': expected a list for int\[\]"),
    "constant_in_optional_tensor_list": (_g("""
        %a : f32[4] = input()
        %b : f32[] = aten::index.Tensor(%a, [1])
        return (%b)
    """), r"node %b \(aten::index.Tensor\): argument 'indices': constant list of Tensor\? is not supported"),
}


@pytest.mark.parametrize("text,pattern", UNBINDABLE.values(), ids=UNBINDABLE.keys())
def test_unbindable_graph(text, pattern):
    """Constants the runtimes cannot bind are refused by the verifier already (it converts
    constants as the runtimes do), so no executor is built either."""
    assert_verifier_and_executor_refuse(text, pattern)


def test_constant_in_tensor_list_is_rejected_at_bind_time():
    # In a subprocess: without the bind-time check this was an out-of-bounds read, which may crash.
    code = textwrap.dedent(f"""
        import torch, torch_ext
        from torch_ext.ir import Graph
        g = Graph.parse({_g('''
            %a : f32[2] = input()
            %b : f32[4] = aten::cat.default([%a, 1])
            return (%b)
        ''')!r})
        try:
            torch_ext.Executor(g)
        except RuntimeError as e:
            print("BIND ERROR:", e)
        else:
            print("BOUND")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "BIND ERROR:" in r.stdout and "node %b (aten::cat.default): argument 'tensors'" in r.stdout, r.stdout


def test_runtime_type_mismatch_names_the_node():
    """The declared type says tuple, the op returns a tensor: the verifier's type inference
    refuses it before anything runs, naming the node."""
    g = Graph.parse(_g("""
        %a : f32[2] = input()
        %b : (f32[2], f32[2]) = aten::relu.default(%a)
        %c : f32[2] = getitem(%b, 0)
        return (%c)
    """))
    with pytest.raises(RuntimeError, match=r"node %b \(aten::relu.default\): declared type \(f32\[2\], f32\[2\]\) "
                                           r"differs from f32\[2\]"):
        torch_ext.Executor(g)


# ------------------------------------------------------------------ unsupported FX nodes
def plain_python_function(x):
    return x * 2


def _fx_graph_with_plain_function():
    fx = torch.fx.Graph()
    x = fx.placeholder("x")
    x.meta["val"] = torch.empty(3)
    y = fx.call_function(plain_python_function, (x,))
    y.meta["val"] = torch.empty(3)
    fx.output(y)
    return fx


def test_plain_python_call_function():
    fx = _fx_graph_with_plain_function()
    node_name = [n.name for n in fx.nodes if n.op == "call_function"][0]
    with pytest.raises(UnsupportedNodeError, match=rf"node '{node_name}': target 'plain_python_function' "
                                                   r"is not supported"):
        Graph.from_fx(fx)
    assert issubclass(UnsupportedNodeError, NotImplementedError)


def test_symbolic_trace_call_module():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(NotImplementedError, match=r"node '_0': FX op 'call_module' \(target '0'\) is not supported"):
        Graph.from_fx(gm.graph)


def test_symbolic_trace_call_method():
    class M(nn.Module):
        def forward(self, x):
            return x.relu()

    gm = torch.fx.symbolic_trace(M())
    with pytest.raises(NotImplementedError, match=r"node 'relu': FX op 'call_method'"):
        Graph.from_fx(gm.graph)


def test_unsupported_placeholder_dtype():
    fx = torch.fx.Graph()
    x = fx.placeholder("x8")
    x.meta["val"] = torch.empty(3, dtype=torch.float8_e4m3fn)
    fx.output(x)
    with pytest.raises(UnsupportedNodeError, match=r"node 'x8': dtype torch.float8_e4m3fn is not supported"):
        Graph.from_fx(fx)


def test_dynamic_shape_export():
    m = nn.Linear(4, 2)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(m, (torch.randn(3, 4),), dynamic_shapes={"input": {0: batch}})
    with pytest.raises(UnsupportedNodeError, match=r"node 'input': dynamic shape .* is not supported"):
        Graph.from_exported(ep)
    with pytest.raises(UnsupportedNodeError, match=r"dynamic shape"):
        torch_ext.Executor(ep)


def test_not_an_exported_program():
    with pytest.raises(TypeError, match=r"expects a torch.export.ExportedProgram, got Linear"):
        torch_ext.Executor(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"from_exported expects a torch.export.ExportedProgram, got str"):
        Graph.from_exported("graph:")


# ------------------------------------------------------------------ wrong executor inputs
@pytest.fixture(scope="module")
def mlp_executor():
    torch.manual_seed(0)
    model, (x,) = ZOO["mlp"].build()
    ep = torch.export.export(model, (x,))
    return torch_ext.Executor(ep), x


def test_wrong_input_count(mlp_executor):
    ex, x = mlp_executor
    with pytest.raises(TypeError, match=r"inputs do not match the exported signature"):
        ex(x, x)
    with pytest.raises(TypeError, match=r"inputs do not match the exported signature"):
        ex()


def test_wrong_input_structure(mlp_executor):
    ex, x = mlp_executor
    with pytest.raises(TypeError, match=r"inputs do not match the exported signature"):
        ex([x])


class _Keywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, scale=None, shift=None, extra=None):
        h = self.lin(x * scale + shift)
        return h if extra is None else h * extra["w"] + extra["b"]


def test_keywords_and_dict_keys_in_another_order_are_matched_by_name():
    # Python gives keyword order no meaning; the Executor and ReactiveGraph refused run(x, shift=.., scale=..)
    # for a program exported with scale first, and a dict input whose keys came in another order.
    torch.manual_seed(0)
    model = _Keywords()
    x, scale, shift = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    extra = {"w": torch.randn(2, 4), "b": torch.randn(2, 4)}
    kwargs = {"scale": scale, "shift": shift, "extra": extra}
    want = model(x, **kwargs)
    ex = torch_ext.Executor(torch.export.export(model, (x,), kwargs))
    rg = torch_ext.ReactiveGraph(model, (x,), example_kwargs=kwargs)
    for run in (ex, rg.run):
        assert torch.equal(run(x, **kwargs), want)
        assert torch.equal(run(x, extra={"b": extra["b"], "w": extra["w"]}, shift=shift, scale=scale), want)
        with pytest.raises(TypeError, match=r"inputs do not match the exported signature"):
            run(x, scale=scale, offset=shift, extra=extra)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, scale=1.0, flag=False):
        h = self.lin(x) * scale
        return torch.tanh(h) if flag else h


def test_a_non_tensor_input_of_another_value_than_exported_is_refused():
    # export specialises the program to scale=2.0 (ep.module() refuses 3.0): the Executor and a ReactiveGraph
    # of the program computed with 2.0 and returned it as the answer for 3.0.
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(2, 4)
    ep = torch.export.export(model, (x,), {"scale": 2.0, "flag": False})
    ex = torch_ext.Executor(ep)
    rg = torch_ext.ReactiveGraph(ep)
    with torch.no_grad():
        want = model(x, scale=2.0, flag=False)
    for run in (ex, rg.run):
        assert torch.equal(run(x, flag=False, scale=2.0), want)
        with pytest.raises(ValueError, match=r"input \[1\]\['scale'\]: the program was exported with the constant "
                                             r"2.0 there .* got 3.0"):
            run(x, scale=3.0, flag=False)
        with pytest.raises(ValueError, match=r"\['scale'\].*got -0.0"):
            run(x, scale=-0.0, flag=False)
        with pytest.raises(ValueError, match=r"\['flag'\].*False.*got True"):
            run(x, scale=2.0, flag=True)
    assert torch.equal(rg.demand(), want)  # the refused runs left the graph as it was


def test_wrong_input_shape(mlp_executor):
    ex, x = mlp_executor
    with pytest.raises(RuntimeError, match=r"input #\d+ \('x'\): expected shape \[8, 32\], got \[7, 32\]"):
        ex(torch.randn(7, 32))


def test_wrong_input_dtype(mlp_executor):
    ex, x = mlp_executor
    with pytest.raises(RuntimeError, match=r"input #\d+ \('x'\): expected dtype torch.float32, got Double"):
        ex(x.double())


def test_wrong_input_device(mlp_executor):
    ex, x = mlp_executor
    with pytest.raises(RuntimeError, match=r"input #\d+ \('x'\): expected device cpu, got meta"):
        ex(torch.empty(8, 32, device="meta"))


def test_non_tensor_input(mlp_executor):
    ex, _ = mlp_executor
    with pytest.raises(RuntimeError, match=r"input #\d+ \('x'\): expected a tensor f32\[8,32\], got None"):
        ex(None)
    with pytest.raises(RuntimeError, match=r"unsupported input of Python type <class 'str'>"):
        ex("not a tensor")


def test_core_executor_wrong_count():
    g = Graph.parse(_g("""
        %a : f32[2] = input()
        %n : int = input()
        %b : f32[2] = aten::mul.Scalar(%a, %n)
        return (%b)
    """))
    ex = torch_ext.Executor(g)
    with pytest.raises(RuntimeError, match=r"expected 2 inputs, got 1"):
        ex(torch.randn(2))
    with pytest.raises(RuntimeError, match=r"input #1 \('n'\): expected an int, got Tensor"):
        ex(torch.randn(2), torch.randn(1))
    assert torch.equal(ex(torch.ones(2), 3)[0], torch.full((2,), 3.0))


def test_kernel_error_names_the_node():
    """A failing ATen kernel (index out of range) surfaces as RuntimeError naming the node."""
    torch.manual_seed(0)
    model, (x, labels) = ZOO["int_shape"].build()
    ex = torch_ext.Executor(torch.export.export(model, (x, labels)))
    bad = labels.clone()
    bad[2] = 1000
    with pytest.raises(RuntimeError, match=r"while executing node %index: .*out of bounds"):
        ex(x, bad)
    ex(x, labels)  # still usable afterwards


def test_regions_on_an_ordinary_op_are_refused_by_the_verifier():
    g = Graph.parse(_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::relu.default(%a) {
          graph:
            %x : f32[2] = input()
            return (%x)
        }
        return (%b)
    """))
    with pytest.raises(RuntimeError, match=r"node %b: only higher_order::cond and while_loop own regions, not "
                                           r"aten::relu.default"):
        g.verify()
    with pytest.raises(RuntimeError, match=r"only higher_order::cond and while_loop own regions"):
        torch_ext.Executor(g)
