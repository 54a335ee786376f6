"""Bad-input corpus for the IR front end (parse, verify) and the dispatcher Executor.

Every case asserts a clear error that names the culprit (node, argument, input or limit), and
that the object involved is unchanged afterwards: a graph that failed to verify prints exactly
as a freshly parsed one, and an executor that refused an input or failed mid-run still gives
the same answer as a fresh executor on good inputs. Cases that used to crash the process run
in the test process itself: a crash fails the whole run, which is the point.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_ext  # noqa: F401  (registers the fake kernels the verifier uses for torch_ext ops)
from torch_ext import _C
from torch_ext.ir import Graph

from helpers import assert_verifier_and_executor_refuse


def _g(body: str) -> str:
    return "graph:\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "  ") + "\n"


def _lstm(batch_h0: int, weight_rows: int, hidden: int = 8) -> str:
    return _g(f"""
        %x : f32[3,2,4] = input()
        %h0 : f32[1,{batch_h0},{hidden}] = input()
        %c0 : f32[1,{batch_h0},{hidden}] = input()
        %wi : f32[{weight_rows},4] = param("wi")
        %wh : f32[{weight_rows},{hidden}] = param("wh")
        %bi : f32[{weight_rows}] = param("bi")
        %bh : f32[{weight_rows}] = param("bh")
        %l : (f32[3,2,{hidden}], f32[1,2,{hidden}], f32[1,2,{hidden}]) = aten::lstm.input(%x, [%h0, %c0], [%wi, %wh, %bi, %bh], True, 1, 0.0, False, False, False)
        %y : f32[3,2,{hidden}] = getitem(%l, 0)
        return (%y)
    """)


# ------------------------------------------------------------------ parse: refused text
PARSE = {
    "tuple_type_depth": ("graph:\n  %a : " + "(" * 25000, r"tuple types nested deeper than the limit of 64"),
    "list_arg_depth": ("graph:\n  %a : f32[2] = input()\n  %b : f32[2] = aten::cat.default(" + "[" * 30000,
                       r"argument lists nested deeper than the limit of 64"),
    "region_depth": ("graph:\n" + "  %p : b8[] = input()\n  %c : () = higher_order::cond.default(%p, []) {\n graph:\n"
                     * 10000, r"regions nested deeper than the limit of 32"),
    "utf8_near_excerpt": ("graph:\n  %a : f32[2] = input()\n  ?" + "x" * 38 + "€€€\n",
                          r"line 3, column 3: expected '%' \(near '\?x{38}€'\)"),
    "utf8_in_name": ("graph:\n  %é : f32[2] = input()\n  return (%é)\n", r"line 2, column 4: expected a name \(near 'é"),
    "negative_size": (_g("""
        %a : f32[2,-3] = input()
        return (%a)
    """), r"line 2, .*negative size -3 at dim 1"),
    "numel_overflow": (_g("""
        %a : f32[4611686018427387904,4] = input()
        return (%a)
    """), r"line 2, .*the element count overflows int64"),
    "strides_overflow": (_g("""
        %a : f32[2,4611686018427387904,4] = input()
        return (%a)
    """), r"line 2, .*overflows int64"),
    "integer_out_of_range": (_g("""
        %a : f32[99999999999999999999] = input()
        return (%a)
    """), r"malformed integer '99999999999999999999'"),
    "strides_rank": (_g("""
        %a : f32[2,3]{1} = input()
        return (%a)
    """), r"strides and sizes differ in rank"),
    "bad_device": (_g("""
        %a : f32[2]@warp9 = input()
        return (%a)
    """), r"bad device 'warp9'"),
    "unknown_constant": (_g("""
        %a : f32[2] = input()
        %b : f64[2] = aten::to.dtype(%a, torch.float99)
        return (%b)
    """), r"unknown constant 'torch.float99'"),
    "kwarg_before_positional": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::add.Tensor(alpha=2, %a)
        return (%b)
    """), r"positional argument after keyword argument"),
}


@pytest.mark.parametrize("text,pattern", PARSE.values(), ids=PARSE.keys())
def test_parse_refuses(text, pattern):
    with pytest.raises(RuntimeError, match=r"IR parse error (.|\n)*" + pattern) as info:
        Graph.parse(text)
    # The message reached Python intact (no UnicodeDecodeError) and the parser keeps no state.
    assert "IR parse error" in str(info.value)
    ok = _g("""
        %a : f32[2] = input()
        return (%a)
    """)
    assert str(Graph.parse(ok)) == ok


def test_parse_invalid_utf8_bytes_give_a_parse_error():
    # Bytes that are not UTF-8 come back as '?' in the excerpt, never as a UnicodeDecodeError.
    with pytest.raises(RuntimeError, match=r"line 2, column 3: expected '%' \(near '\?\?\? oops'\)"):
        _C.Graph.parse(b"graph:\n  \xff\xfe\x80 oops\n")


# ------------------------------------------------------------------ verify: refused graphs
VERIFY = {
    # declared result types against what the operator produces
    # lifted state: a state name names one entry of the step's state (parameters, buffers, optimizer state)
    "duplicate_param_state_name": (_g("""
        %a : f32[2] = param("w")
        %b : f32[2] = param("w")
        %c : f32[2] = aten::add.Tensor(%a, %b)
        return (%c)
    """), r"node %b: param state name 'w' is already held by %a \(param\)"),
    "buffer_reuses_a_param_state_name": (_g("""
        %a : f32[2] = param("w")
        %b : f32[2] = buffer("w")
        %c : f32[2] = aten::add.Tensor(%a, %b)
        return (%c)
    """), r"node %b: buffer state name 'w' is already held by %a \(param\)"),
    "empty_optstate_name": (_g("""
        %a : f32[2] = param("w")
        %m : f32[2] = optstate()
        %c : f32[2] = aten::add.Tensor(%a, %m)
        return (%c)
    """), r"node %m: optstate placeholder has an empty state name"),
    "integer_param": (_g("""
        %a : i64[2] = param("w")
        %c : i64[2] = aten::neg.default(%a)
        return (%c)
    """), r"node %a: param 'w' has dtype Long: a parameter must be floating point or complex"),
    "relu_declared_i64_7": (_g("""
        %a : f32[2] = input()
        %b : i64[7] = aten::relu.default(%a)
        return (%b)
    """), r"node %b \(aten::relu.default\): declared type i64\[7\] differs from f32\[2\]"),
    "relu_of_int_constant": (_g("""
        %b : f32[2] = aten::relu.default(5)
        return (%b)
    """), r"node %b \(aten::relu.default\): declared type f32\[2\] differs from i64\[\]"),
    "tuple_declared_for_tensor": (_g("""
        %a : f32[2] = input()
        %b : (f32[2], f32[2]) = aten::relu.default(%a)
        return (%b)
    """), r"node %b \(aten::relu.default\): declared type \(f32\[2\], f32\[2\]\) differs from f32\[2\]"),
    "wrong_dtype_after_to": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::to.dtype(%a, torch.float64)
        return (%b)
    """), r"node %b \(aten::to.dtype\): declared type f32\[2\] differs from f64\[2\]"),
    "wrong_shape_after_sum": (_g("""
        %a : f32[4,3] = input()
        %b : f32[] = aten::sum.dim_IntList(%a, [1])
        return (%b)
    """), r"node %b \(aten::sum.dim_IntList\): declared type f32\[\] differs from f32\[4\]"),
    "getitem_declared_wrong": (_g("""
        %a : f32[4] = input()
        %s : (f32[2], f32[2]) = aten::split.Tensor(%a, 2)
        %b : f32[4] = getitem(%s, 1)
        return (%b)
    """), r"node %b \(getitem\): declared type f32\[4\] differs from element 1 of %s, f32\[2\]"),
    "split_declares_too_few": (_g("""
        %a : f32[4] = input()
        %s : (f32[2]) = aten::split.Tensor(%a, 2)
        return (%s)
    """), r"node %s \(aten::split.Tensor\): declared type \(f32\[2\]\) differs from \(f32\[2\], f32\[2\]\)"),
    "topk_indices_dtype": (_g("""
        %a : f32[4,3] = input()
        %t : (f32[4,2], f32[4,2]) = aten::topk.default(%a, 2)
        return (%t)
    """), r"node %t \(aten::topk.default\): declared type \(f32\[4,2\], f32\[4,2\]\) differs"),
    # arguments against the schema
    "graph_value_for_int": (_g("""
        %a : f32[2,3] = input()
        %b : f32[3,2] = aten::transpose.int(%a, %a, 1)
        return (%b)
    """), r"node %b \(aten::transpose.int\): argument 'dim0' expects int, got %a of type f32\[2,3\]"),
    "graph_value_for_int_list": (_g("""
        %a : f32[2,3] = input()
        %b : f32[3,2] = aten::permute.default(%a, %a)
        return (%b)
    """), r"node %b \(aten::permute.default\): argument 'dims' expects int\[\], got %a of type f32\[2,3\]"),
    "graph_value_for_bool": (_g("""
        %a : f32[2,3] = input()
        %b : f32[3] = aten::sum.dim_IntList(%a, [0], %a)
        return (%b)
    """), r"node %b \(aten::sum.dim_IntList\): argument 'keepdim' expects bool, got %a of type f32\[2,3\]"),
    "float_value_for_int": (_g("""
        %a : f32[2,3] = input()
        %f : float = input()
        %b : f32[3,2] = aten::transpose.int(%a, %f, 1)
        return (%b)
    """), r"node %b \(aten::transpose.int\): argument 'dim0' expects int, got %f of type float"),
    "tensor_in_int_list": (_g("""
        %a : f32[2,3] = input()
        %b : f32[3,2] = aten::permute.default(%a, [1, %a])
        return (%b)
    """), r"node %b \(aten::permute.default\): argument 'dims': element 1 expects int, got %a"),
    "int_value_for_tensor": (_g("""
        %n : int = input()
        %b : f32[2] = aten::relu.default(%n)
        return (%b)
    """), r"node %b \(aten::relu.default\): argument 'self' expects Tensor, got %n of type int"),
    "tensor_for_scalar": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::add.Scalar(%a, %a)
        return (%b)
    """), r"node %b \(aten::add.Scalar\): argument 'other' expects Scalar, got %a of type f32\[2\]"),
    "string_for_tensor": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::add.Tensor(%a, "x")
        return (%b)
    """), r"node %b \(aten::add.Tensor\): argument 'other': expected a tensor, got \"x\""),
    "int_for_device": (_g("""
        %b : f32[2] = aten::zeros.default([2], device=3)
        return (%b)
    """), r"node %b \(aten::zeros.default\): argument 'device': expected a device, got 3"),
    # declared devices the operator does not produce (before: accepted, devices were not inferred)
    "declared_device_differs_from_inputs": (_g("""
        %a : f32[2] = input()
        %b : f32[2]@cuda:0 = aten::relu.default(%a)
        return (%b)
    """), r"node %b \(aten::relu.default\): declared device cuda:0 differs from cpu, where the operator puts its "
          r"result \(the device of its input %a\)"),
    "declared_device_differs_from_device_argument": (_g("""
        %a : f32[2] = input()
        %b : f32[2] = aten::_to_copy.default(%a, device=device("cuda:0"))
        return (%b)
    """), r"node %b \(aten::_to_copy.default\): declared device cpu differs from cuda:0, where the operator puts its "
          r"result \(its argument 'device'\)"),
    "constant_in_tensor_list": (_g("""
        %a : f32[2] = input()
        %b : f32[4] = aten::cat.default([%a, 1])
        return (%b)
    """), r"node %b \(aten::cat.default\): argument 'tensors': element 1 1 must be a graph value"),
    "tuple_value_for_tensor_list": (_g("""
        %a : f32[4] = input()
        %s : (f32[2], f32[2]) = aten::split.Tensor(%a, 2)
        %b : f32[4] = aten::cat.default(%s)
        return (%b)
    """), r"node %b \(aten::cat.default\): argument 'tensors' expects Tensor\[\], got %s"),
    # inconsistent shapes that used to reach (and crash) kernels
    "lstm_batch_differs_from_h0": (_lstm(batch_h0=5, weight_rows=32),
                                   r"node %l \(aten::lstm.input\): hidden state %h0 of shape f32\[1,5,8\] must have "
                                   r"batch 2 as the input"),
    "lstm_zero_size_weights": (_lstm(batch_h0=2, weight_rows=0),
                               r"node %l \(aten::lstm.input\): parameter %wi is empty"),
    "lstm_c0_with_no_layers": (_g("""
        %x : f32[3,5,8] = input()
        %h0 : f32[1,3,12] = input()
        %c0 : f32[0,3,12] = input()
        %wi : f32[48,8] = param("wi")
        %wh : f32[48,12] = param("wh")
        %bi : f32[48] = param("bi")
        %bh : f32[48] = param("bh")
        %l : (f32[3,5,12], f32[1,3,12], f32[1,3,12]) = aten::lstm.input(%x, [%h0, %c0], [%wi, %wh, %bi, %bh], True, 1, 0.0, False, False, True)
        %y : f32[3,5,12] = getitem(%l, 0)
        return (%y)
    """), r"node %l \(aten::lstm.input\): hidden state %c0 of shape f32\[0,3,12\] must have 1 = num_layers \* directions rows"),
    "lstm_declared_output_wrong": (_lstm(batch_h0=2, weight_rows=32, hidden=8).replace(
        "(f32[3,2,8], f32[1,2,8], f32[1,2,8]) = aten::lstm", "(f32[3,2,9], f32[1,2,8], f32[1,2,8]) = aten::lstm"),
        r"node %l \(aten::lstm.input\): declared type \(f32\[3,2,9\], f32\[1,2,8\], f32\[1,2,8\]\) differs from "
        r"\(f32\[3,2,8\], f32\[1,2,8\], f32\[1,2,8\]\)"),
    "gru_missing_parameters": (_g("""
        %x : f32[3,5,8] = input()
        %h0 : f32[1,3,12] = input()
        %wi : f32[36,8] = param("wi")
        %g : (f32[3,5,12], f32[1,3,12]) = aten::gru.input(%x, %h0, [%wi], True, 1, 0.0, False, False, True)
        %y : f32[3,5,12] = getitem(%g, 0)
        return (%y)
    """), r"node %g \(aten::gru.input\): expects 4 parameters \(4 per layer and direction\), got 1"),
    "batch_norm_empty_running_mean": (_g("""
        %x : f32[2,3,4,4] = input()
        %w : f32[3] = input()
        %m : f32[0] = input()
        %bn : (f32[2,3,4,4], f32[0], f32[0]) = aten::_native_batch_norm_legit_no_training.default(%x, %w, %w, %m, %w, 0.1, 1e-05)
        %y : f32[2,3,4,4] = getitem(%bn, 0)
        return (%y)
    """), r"node %bn \(aten::_native_batch_norm_legit_no_training.default\): running_mean %m of type f32\[0\] must "
          r"have shape \[3\]"),
    "batch_norm_short_running_var": (_g("""
        %x : f32[4,16,4,4] = input()
        %w : f32[16] = param("w")
        %m : f32[16] = buffer("m")
        %v : f32[1] = buffer("v")
        %bn : (f32[4,16,4,4], f32[16], f32[16], f32[16], f32[16]) = aten::_native_batch_norm_legit_functional.default(%x, %w, %w, %m, %v, True, 0.1, 1e-05)
        %y : f32[4,16,4,4] = getitem(%bn, 0)
        return (%y)
    """), r"node %bn \(aten::_native_batch_norm_legit_functional.default\): running_var %v of type f32\[1\] must "
          r"have shape \[16\], the input's channel count"),
    "mm_inner_mismatch": (_g("""
        %a : f32[2,3] = input()
        %b : f32[4,5] = input()
        %c : f32[2,5] = aten::mm.default(%a, %b)
        return (%c)
    """), r"node %c \(aten::mm.default\): the operator refuses .*(cannot be multiplied|same reduction dim)"),
    "view_wrong_numel": (_g("""
        %a : f32[4] = input()
        %b : f32[5] = aten::view.default(%a, [5])
        return (%b)
    """), r"node %b \(aten::view.default\): the operator refuses .*invalid for input of size 4"),
    "dim_out_of_range": (_g("""
        %a : f32[4] = input()
        %b : f32[] = aten::sum.dim_IntList(%a, [3])
        return (%b)
    """), r"node %b \(aten::sum.dim_IntList\): the operator refuses .*out of range"),
    "conv_channel_mismatch": (_g("""
        %x : f32[1,3,8,8] = input()
        %w : f32[4,2,3,3] = param("w")
        %y : f32[1,4,6,6] = aten::conv2d.default(%x, %w)
        return (%y)
    """), r"node %y \(aten::conv2d.default\): the operator refuses"),
    "factory_negative_size": (_g("""
        %b : f32[2] = aten::zeros.default([-2])
        return (%b)
    """), r"node %b \(aten::zeros.default\): the operator refuses .*negative"),
    "cat_rank_mismatch": (_g("""
        %a : f32[2] = input()
        %b : f32[2,2] = input()
        %c : f32[4] = aten::cat.default([%a, %b])
        return (%c)
    """), r"node %c \(aten::cat.default\): the operator refuses"),
    "expand_incompatible": (_g("""
        %a : f32[3] = input()
        %b : f32[2,4] = aten::expand.default(%a, [2, 4])
        return (%b)
    """), r"node %b \(aten::expand.default\): the operator refuses"),
    "split_into_huge_list": (_g("""
        %x : f32[2147483648] = input()
        %s : (f32[1], f32[1]) = aten::split.Tensor(%x, 1)
        return (%s)
    """), r"node %s \(aten::split.Tensor\): cannot infer the result: it may be a list of up to 2147483648 tensors, "
          r"beyond the inference limit of 65536"),
    "tensor_split_huge_sections": (_g("""
        %x : f32[4] = input()
        %s : (f32[2], f32[2]) = aten::tensor_split.sections(%x, 4611686018427387904)
        return (%s)
    """), r"node %s \(aten::tensor_split.sections\): cannot infer the result: .* beyond the inference limit"),
    "cond_branch_types_differ": (_g("""
        %p : b8[] = input()
        %x : f32[2] = input()
        %c : (f32[2]) = higher_order::cond.default(%p, [%x]) {
          graph:
            %a : f32[2] = input()
            return (%a)
        } {
          graph:
            %a : f32[3] = input()
            return (%a)
        }
        %y : f32[2] = getitem(%c, 0)
        return (%y)
    """), r"node %c \(higher_order::cond.default\): false branch takes \(f32\[3\]\) but the operands are \(f32\[2\]\)"),
    "cond_predicate_is_a_tuple": (_g("""
        %p : ((b8[])) = input()
        %x : f32[2] = input()
        %c : (f32[2]) = higher_order::cond.default(%p, [%x]) {
          graph:
            %a : f32[2] = input()
            return (%a)
        } {
          graph:
            %a : f32[2] = input()
            return (%a)
        }
        %y : f32[2] = getitem(%c, 0)
        return (%y)
    """), r"node %c \(higher_order::cond.default\): predicate %p of type \(\(b8\[\]\)\) must be a bool or a "
          r"one-element tensor"),
    "error_inside_region": (_g("""
        %p : b8[] = input()
        %x : f32[2] = input()
        %c : (f32[2]) = higher_order::cond.default(%p, [%x]) {
          graph:
            %a : f32[2] = input()
            %r : i64[2] = aten::relu.default(%a)
            return (%r)
        } {
          graph:
            %a : f32[2] = input()
            return (%a)
        }
        %y : f32[2] = getitem(%c, 0)
        return (%y)
    """), r"%c.region0: node %r \(aten::relu.default\): declared type i64\[2\] differs from f32\[2\]"),
}


@pytest.mark.parametrize("text,pattern", VERIFY.values(), ids=VERIFY.keys())
def test_verify_refuses(text, pattern):
    # Every runtime verifies first, so none of them is built on the graph.
    g = assert_verifier_and_executor_refuse(text, pattern)
    # verify() changed nothing.
    assert str(g) == str(Graph.parse(text))


def test_verify_accepts_repeated_constant_names_and_integer_buffers():
    # A graft copies its block's parameters as constants under their names, once per graft; buffers may be
    # integers (num_batches_tracked, the RNG state); inputs carry no state name.
    Graph.parse(_g("""
        %p : f32[2] = param("weight")
        %a : f32[2] = const("weight")
        %b : f32[2] = const("weight")
        %n : i64[] = buffer("num_batches_tracked")
        %x : f32[2] = input()
        %c : f32[2] = aten::add.Tensor(%a, %b)
        %d : f32[2] = aten::add.Tensor(%c, %p)
        %e : f32[2] = aten::add.Tensor(%d, %x)
        return (%e)
    """)).verify()


def test_graph_with_two_grafts_of_one_block_verifies():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)).eval()
    rg = torch_ext.ReactiveGraph(model, (torch.randn(2, 4),))
    block = torch.nn.Linear(4, 4)  # its parameters "weight" and "bias" become constants of each graft
    rg.graft("relu", block)
    rg.graft("relu", block)
    g = Graph(rg._engine.graph())
    g.verify()
    consts = sorted(n.state_name for n in g.nodes() if n.role == "const")
    assert consts == ["bias", "bias", "weight", "weight"]


def test_corpus_sizes():
    assert len(PARSE) + 1 >= 10 and len(VERIFY) >= 30


def test_verify_accepts_what_the_kernels_accept():
    """The known export/meta disagreements (documented in csrc/ir/type_check.h) still verify."""
    g = Graph.parse(_g("""
        %x : f32[2,3,4,4] = input()
        %w : f32[3] = input()
        %bn : (f32[2,3,4,4], f32[0], f32[0]) = aten::_native_batch_norm_legit_no_training.default(%x, %w, %w, %w, %w, 0.1, 1e-05)
        %y : f32[2,3,4,4] = getitem(%bn, 0)
        %t : f32[4,4,3,2]{1,4,16,48} = aten::permute.default(%x, [3, 2, 1, 0])
        return (%y, %t)
    """))
    g.verify()


# ------------------------------------------------------------------ Executor: refused inputs and failing runs
_EX_TEXT = _g("""
    %a : f32[2,3] = input()
    %n : int = input()
    %f : float = input()
    %flag : bool = input()
    %b : f32[2,3] = aten::mul.Scalar(%a, %f)
    %s : f32[3] = aten::sum.dim_IntList(%b, [0], %flag)
    %v : f32[3] = aten::add.Scalar(%s, %n)
    return (%v)
""")
_GOOD = [torch.arange(6.0).reshape(2, 3), 2, 0.5, False]

EXECUTOR_INPUTS = {
    "too_few_inputs": ([torch.ones(2, 3)], r"expected 4 inputs, got 1"),
    "too_many_inputs": (_GOOD + [1], r"expected 4 inputs, got 5"),
    "no_inputs": ([], r"expected 4 inputs, got 0"),
    "wrong_dtype": ([torch.ones(2, 3, dtype=torch.float64), 2, 0.5, False],
                    r"input #0 \('a'\): expected dtype torch.float32, got Double"),
    "wrong_int_dtype": ([torch.ones(2, 3, dtype=torch.int64), 2, 0.5, False], r"input #0 \('a'\): expected dtype"),
    "wrong_shape": ([torch.ones(3, 2), 2, 0.5, False], r"input #0 \('a'\): expected shape \[2, 3\], got \[3, 2\]"),
    "wrong_rank": ([torch.ones(6), 2, 0.5, False], r"input #0 \('a'\): expected shape \[2, 3\], got \[6\]"),
    "scalar_tensor_for_matrix": ([torch.tensor(1.0), 2, 0.5, False], r"input #0 \('a'\): expected shape"),
    "empty_tensor": ([torch.ones(0, 3), 2, 0.5, False], r"input #0 \('a'\): expected shape \[2, 3\], got \[0, 3\]"),
    "meta_tensor": ([torch.ones(2, 3, device="meta"), 2, 0.5, False], r"input #0 \('a'\): expected device cpu"),
    "int_for_tensor": ([1, 2, 0.5, False], r"input #0 \('a'\): expected a tensor f32\[2,3\], got Int"),
    "float_for_tensor": ([1.5, 2, 0.5, False], r"input #0 \('a'\): expected a tensor f32\[2,3\], got Double"),
    "none_for_tensor": ([None, 2, 0.5, False], r"input #0 \('a'\): expected a tensor f32\[2,3\], got None"),
    "bool_for_tensor": ([True, 2, 0.5, False], r"input #0 \('a'\): expected a tensor"),
    "string_for_tensor": (["x", 2, 0.5, False], r"unsupported input of Python type <class 'str'>"),
    "list_for_tensor": ([[1.0, 2.0], 2, 0.5, False], r"unsupported input of Python type <class 'list'>"),
    "dict_for_tensor": ([{}, 2, 0.5, False], r"unsupported input of Python type <class 'dict'>"),
    "object_for_tensor": ([object(), 2, 0.5, False], r"unsupported input of Python type <class 'object'>"),
    "tensor_for_int": ([_GOOD[0], torch.ones(1), 0.5, False], r"input #1 \('n'\): expected an int, got Tensor"),
    "float_for_int": ([_GOOD[0], 2.5, 0.5, False], r"input #1 \('n'\): expected an int, got Double"),
    "none_for_int": ([_GOOD[0], None, 0.5, False], r"input #1 \('n'\): expected an int, got None"),
    "bool_for_int": ([_GOOD[0], True, 0.5, False], r"input #1 \('n'\): expected an int, got Bool"),
    "huge_int": ([_GOOD[0], 2**70, 0.5, False], r"int|overflow"),
    "tensor_for_float": ([_GOOD[0], 2, torch.ones(1), False], r"input #2 \('f'\): expected a float, got Tensor"),
    "none_for_float": ([_GOOD[0], 2, None, False], r"input #2 \('f'\): expected a float, got None"),
    "bool_for_float": ([_GOOD[0], 2, True, False], r"input #2 \('f'\): expected a float, got Bool"),
    "int_for_bool": ([_GOOD[0], 2, 0.5, 1], r"input #3 \('flag'\): expected a bool, got Int"),
    "none_for_bool": ([_GOOD[0], 2, 0.5, None], r"input #3 \('flag'\): expected a bool, got None"),
    "tensor_for_bool": ([_GOOD[0], 2, 0.5, torch.tensor(True)], r"input #3 \('flag'\): expected a bool, got Tensor"),
    "requires_grad_wrong_shape": ([torch.ones(2, 2, requires_grad=True), 2, 0.5, False],
                                  r"input #0 \('a'\): expected shape"),
}


@pytest.fixture(scope="module")
def ex_and_reference():
    ex = torch_ext.Executor(Graph.parse(_EX_TEXT))
    return ex, ex(*_GOOD)


@pytest.mark.parametrize("inputs,pattern", EXECUTOR_INPUTS.values(), ids=EXECUTOR_INPUTS.keys())
def test_executor_refuses_input(ex_and_reference, inputs, pattern):
    ex, reference = ex_and_reference
    with pytest.raises((RuntimeError, TypeError), match=pattern):
        ex(*inputs)
    # The executor is unchanged: same answer as before and as a fresh executor.
    again = ex(*_GOOD)
    fresh = torch_ext.Executor(Graph.parse(_EX_TEXT))(*_GOOD)
    assert torch.equal(again[0], reference[0]) and torch.equal(fresh[0], reference[0])


# Graphs that verify but fail while running, on values only run time sees.
RUN_FAILURES = {
    "length_error_from_kernel": (_g("""
        %x : f32[4] = input()
        %n : int = input()
        %s : (f32[2], f32[2]) = aten::tensor_split.sections(%x, %n)
        return (%s)
    """), [torch.ones(4), 2**62], [torch.ones(4), 2], r"while executing node %s: .*std::vector"),
    "index_out_of_range": (_g("""
        %w : f32[10,4] = input()
        %i : i64[3] = input()
        %e : f32[3,4] = aten::embedding.default(%w, %i)
        return (%e)
    """), [torch.ones(10, 4), torch.tensor([1, 2, 99])], [torch.ones(10, 4), torch.tensor([1, 2, 3])],
        r"while executing node %e: .*index out of range"),
    "gather_out_of_range": (_g("""
        %x : f32[4] = input()
        %i : i64[2] = input()
        %g : f32[2] = aten::gather.default(%x, 0, %i)
        return (%g)
    """), [torch.ones(4), torch.tensor([0, 7])], [torch.ones(4), torch.tensor([0, 3])],
        r"while executing node %g: .*out of bounds"),
    "integer_division_by_zero": (_g("""
        %x : i64[2] = input()
        %y : i64[2] = input()
        %d : i64[2] = aten::div.Tensor_mode(%x, %y, rounding_mode="floor")
        return (%d)
    """), [torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)],
        [torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long)], r"while executing node %d: .*ZeroDivisionError"),
    "view_of_runtime_size": (_g("""
        %x : f32[4] = input()
        %n : int = input()
        %v : f32[4] = aten::view.default(%x, [%n])
        return (%v)
    """), [torch.ones(4), 5], [torch.ones(4), 4], r"while executing node %v: .*invalid for input of size 4"),
    "cholesky_not_positive_definite": (_g("""
        %x : f32[2,2] = input()
        %c : f32[2,2]{1,2} = aten::linalg_cholesky.default(%x)
        return (%c)
    """), [-torch.eye(2)], [torch.eye(2)], r"while executing node %c: .*not positive-definite"),
}


@pytest.mark.parametrize("text,bad,good,pattern", RUN_FAILURES.values(), ids=RUN_FAILURES.keys())
def test_executor_run_failure_names_the_node(text, bad, good, pattern):
    g = Graph.parse(text)
    g.verify()
    ex = torch_ext.Executor(g)
    with pytest.raises(RuntimeError, match=pattern):
        ex(*bad)
    out = ex(*good)
    fresh = torch_ext.Executor(Graph.parse(text))(*good)
    assert len(out) == len(fresh)
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(fresh)):
        assert torch.equal(a, b)


_ENDLESS_LOOP = _g("""
    %x : f32[] = input()
    %w : (f32[]) = higher_order::while_loop.default([%x], []) {
      graph:
        %a : f32[] = input()
        %c : b8[] = aten::ge.Scalar(%a, 0.0)
        return (%c)
    } {
      graph:
        %a : f32[] = input()
        %b : f32[] = aten::add.Scalar(%a, 1.0)
        return (%b)
    }
    %y : f32[] = getitem(%w, 0)
    return (%y)
""")


def test_endless_while_loop_hits_the_iteration_limit():
    # In a subprocess: the limit is read once per process from TORCH_EXT_MAX_LOOP_ITERATIONS.
    code = textwrap.dedent(f"""
        import torch, torch_ext
        from torch_ext.ir import Graph
        ex = torch_ext.Executor(Graph.parse({_ENDLESS_LOOP!r}))
        try:
            ex(torch.tensor(0.0))
        except RuntimeError as e:
            print("ERROR", e)
        # Still usable: a loop that ends runs.
        print("OK", ex(torch.tensor(-3.0))[0].item())
    """)
    env = {**os.environ, "TORCH_EXT_MAX_LOOP_ITERATIONS": "50"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert re.search(r"ERROR while executing node %w: while_loop %w: still running after 50 iterations, the limit "
                     r"\(set TORCH_EXT_MAX_LOOP_ITERATIONS to raise it\)", out.stdout), out.stdout
    assert "OK -3.0" in out.stdout, out.stdout


def test_executor_corpus_size():
    assert len(EXECUTOR_INPUTS) + len(RUN_FAILURES) + 1 >= 30


# ------------------------------------------------------------------ Graph builder API
def test_builder_refusals_leave_the_graph_unchanged():
    g = _C.Graph()
    g.add_placeholder("x", "input", ("tensor", "f32", [2], [1], "cpu"), "")
    before = str(g)
    cases = [
        (lambda: g.add_placeholder("x", "input", ("tensor", "f32", [2], [1], "cpu"), ""), r"duplicate node name '%x'"),
        (lambda: g.add_placeholder("y", "nope", ("tensor", "f32", [2], [1], "cpu"), ""), r"unknown input role 'nope'"),
        (lambda: g.add_placeholder("y", "input", ("tensor", "q8", [2], [1], "cpu"), ""), r"unsupported dtype 'q8'"),
        (lambda: g.add_placeholder("y", "input", ("tensor", "f32", [4, 2**62, 4], [], "cpu"), ""), r"overflows int64"),
        (lambda: g.add_call("r", "aten::relu.default", [_C.NodeRef("ghost")], [], ("tensor", "f32", [2], [1], "cpu"), ""),
         r"reference to unknown node %ghost"),
        (lambda: g.add_call("r", "aten::relu", [_C.NodeRef("x")], [], ("tensor", "f32", [2], [1], "cpu"), ""),
         r"malformed op target 'aten::relu'"),
    ]
    deep_list, deep_type = [], ("tensor", "f32", [2], [1], "cpu")
    for _ in range(100000):
        deep_list, deep_type = [deep_list], ("tuple", [deep_type])
    cases += [
        (lambda: g.add_call("r", "aten::cat.default", [deep_list], [], ("tensor", "f32", [2], [1], "cpu"), ""),
         r"argument lists nested deeper than the limit of 64"),
        (lambda: g.add_placeholder("y", "input", deep_type, ""), r"tuple types nested deeper than the limit of 64"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
        assert str(g) == before
