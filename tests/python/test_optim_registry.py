"""The optimizer registry seen from Python: descriptors agree with the registered schemas, the
generated fake kernels, state names built and parsed in C++, and registration errors."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_ext
from torch_ext import optim


def _example_args(d, shape=(3, 2)):
    args = [torch.randn(shape), torch.randn(shape)]
    args += [torch.tensor(1.0) if init in ("step", "one")
             else torch.zeros(torch_ext._C.optimizer_slot_shape(d["kind"], s, list(shape))) if init == "factored"
             else torch.zeros(shape) for s, init in d["slots"]]
    args.append(torch.tensor(0.1, dtype=torch.float64))
    args += [{"float": 0.5, "int": 2, "bool": False}[t] for _, t in d["scalars"]]
    return args


@pytest.mark.parametrize("kind", [d["kind"] for d in torch_ext._C.optimizer_descriptors()])
def test_descriptor_matches_schema_and_fake_kernel(kind):
    d = optim.descriptor(kind)
    for op_name, n_out in ((d["op"], 1 + len(d["slots"])), (d["inplace_op"], 0)):
        schema = getattr(torch.ops.torch_ext, op_name).default._schema
        names = [a.name for a in schema.arguments]
        assert names == ["param", "grad", *(s for s, _ in d["slots"]), "lr", *(s for s, _ in d["scalars"])]
        assert len(schema.returns) == n_out
    args = _example_args(d)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = getattr(torch.ops.torch_ext, d["op"])(*fake)
    out = out if isinstance(out, tuple) else (out,)
    want = [args[0], *args[2:2 + len(d["slots"])]]
    assert [(o.shape, o.dtype) for o in out] == [(w.shape, w.dtype) for w in want]


@pytest.mark.parametrize("kind", [d["kind"] for d in torch_ext._C.optimizer_descriptors() if d["schedulable"]])
def test_the_scheduled_overload_takes_its_schedulable_scalars_as_tensors(kind):
    # Its fake kernel too (torch.export and AOTInductor trace it), with the results of the constant overload.
    d = optim.descriptor(kind)
    schema = getattr(torch.ops.torch_ext, d["op"]).scheduled._schema
    tensors = [a.name for a in schema.arguments if a.type.kind() == "TensorType"]
    assert tensors == ["param", "grad", *(s for s, _ in d["slots"]), "lr", *d["schedulable"]]
    constant = _example_args(d)
    args = [torch.tensor(a, dtype=torch.float64) if x.name in d["schedulable"] else a
            for a, x in zip(constant, schema.arguments)]
    want = getattr(torch.ops.torch_ext, d["op"]).default(*constant)
    got = getattr(torch.ops.torch_ext, d["op"]).scheduled(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with FakeTensorMode() as mode:
        fake = getattr(torch.ops.torch_ext, d["op"]).scheduled(
            *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    assert [(o.shape, o.dtype) for o in fake] == [(w.shape, w.dtype) for w in want]


def test_state_names_round_trip():
    name = optim.state_name("model.fc.weight", "exp_avg")
    assert name == "opt:model.fc.weight:exp_avg"
    assert optim.parse_state_name(name) == ("slot", "model.fc.weight", "exp_avg")
    assert optim.parse_state_name(optim.lr_name(2)) == ("lr", 2)
    assert optim.group_input_name("beta1", 3) == "opt:beta1:group3"
    assert optim.parse_state_name("opt:beta1:group3") == ("hyper", "beta1", 3)
    assert optim.parse_state_name("opt:model.w:group3") == ("slot", "model.w", "group3")
    for other in ("model.fc.weight", "rng", "batch:0", "opt:"):
        assert optim.parse_state_name(other) is None


def test_unknown_kind_and_unsupported_optimizer_are_named():
    with pytest.raises(ValueError, match=r"unknown update kind 'lamb' \(registered: .*lion"):
        optim.descriptor("lamb")
    with pytest.raises(TypeError, match=r"optimizer LBFGS is not supported \(supported: .*Lion"):
        optim.registration_for(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))]))
    with pytest.raises(TypeError, match=r"optimizer SparseAdam is not supported \(supported: .*NAdam"):
        optim.registration_for(torch.optim.SparseAdam([torch.nn.Parameter(torch.zeros(2))]))


def test_nadam_mu_product_is_a_scalar_slot_starting_at_one():
    d = optim.descriptor("nadam")
    assert dict(d["slots"]) == {"exp_avg": "zeros", "exp_avg_sq": "zeros", "mu_product": "one", "step": "step"}
    p = torch.nn.Parameter(torch.zeros(3, 2))
    init = optim.registration_for(torch.optim.NAdam([p])).initial_state("nadam", {}, p, {})
    assert init["mu_product"].shape == () and init["mu_product"].dtype == torch.float32
    assert float(init["mu_product"]) == 1.0 and float(init["step"]) == 0.0


def test_adafactor_factored_slots_take_shapes_the_descriptor_derives():
    d = optim.descriptor("adafactor")
    assert dict(d["slots"]) == {"row_var": "factored", "col_var": "factored", "step": "step"}
    assert not d["elementwise"] and not optim.descriptor("adafactor_vector")["elementwise"]
    assert dict(optim.descriptor("adafactor_vector")["slots"]) == {"variance": "zeros", "step": "step"}
    shape = torch_ext._C.optimizer_slot_shape
    assert shape("adafactor", "row_var", [4, 2, 3, 5]) == [4, 2, 3, 1]
    assert shape("adafactor", "col_var", [4, 2, 3, 5]) == [4, 2, 1, 5]
    assert shape("adafactor", "step", [4, 2]) == []
    with pytest.raises(RuntimeError, match=r"slot 'row_var' is factored over dim -1 and needs a parameter of 2 or "
                                           r"more dims, got shape \[5\]"):
        shape("adafactor", "row_var", [5])
    # The kernel checks the factored shapes, naming the slot and the shape it needs.
    p, lr = torch.randn(4, 3), torch.tensor(0.1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"col_var has shape \[4, 1\] but a parameter of shape \[4, 3\] needs "
                                           r"\[1, 3\]"):
        torch.ops.torch_ext.adafactor_update(p, p, torch.zeros(4, 1), torch.zeros(4, 1), torch.tensor(0.0), lr,
                                             -0.8, 1e-30, 1e-3, 1.0, 0.0, False)


def test_register_refuses_bad_registrations():
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer subclass, got <class 'int'>"):
        optim.register(optim.Registration(int, lambda *a: {}))
    with pytest.raises(ValueError, match="SGD is registered twice"):
        optim.register(optim.Registration(torch.optim.SGD, lambda *a: {}))


def test_register_refuses_an_onnx_form_the_exporter_would_bind_otherwise():
    # torch.onnx's dynamo exporter binds a translation's parameters to the op's arguments by name and reads
    # annotations as ONNX types (an annotated float becomes an attribute): either would break the form.
    class Mine(torch.optim.SGD):
        pass

    def renamed(param, gradient, lr, weight_decay, maximize):
        return param

    def annotated(param, grad, lr, weight_decay: float, maximize):
        return param

    before = optim.registrations()
    with pytest.raises(ValueError, match=r"ONNX form of 'sgd' \(.*renamed\) takes \(param, gradient, lr, "
                                         r"weight_decay, maximize\).*\(param, grad, lr, weight_decay, maximize\)"):
        optim.register(optim.Registration(Mine, lambda *a: {}, onnx={"sgd": renamed}))
    with pytest.raises(ValueError, match="ONNX form of 'sgd' annotates weight_decay"):
        optim.register(optim.Registration(Mine, lambda *a: {}, onnx={"sgd": annotated}))
    with pytest.raises(ValueError, match="unknown update kind 'nope'"):
        optim.register(optim.Registration(Mine, lambda *a: {}, onnx={"nope": renamed}))
    assert optim.registrations() == before  # nothing registered


def test_every_onnx_form_is_in_the_translation_table():
    from torch_ext.optim import _registry

    table = optim.onnx_updates()
    for reg in optim.registrations():
        for kind, fn in reg.onnx.items():
            op = getattr(torch.ops.torch_ext, optim.descriptor(kind)["op"])
            assert table[op.default] is fn
            if optim.descriptor(kind)["schedulable"]:
                assert table[op.scheduled] is fn
    assert set(table.values()) == {fn for r in optim.registrations() for fn in r.onnx.values()}
    assert "Muon" not in " ".join(_registry.onnx_kinds())


def test_import_torch_ext_needs_neither_onnx_nor_onnxscript():
    import subprocess
    import sys

    code = "import sys, torch_ext; print(sorted(m for m in ('onnx', 'onnxscript') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
