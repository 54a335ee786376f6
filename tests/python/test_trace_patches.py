"""The process-global patches torch_ext installs while tracing (torch_ext/_trace_patches.py): one registry, under
one re-entrant lock. Before it, each entry point stacked its context managers by hand, so two threads building at
once saw each other's patches, and the first to finish removed the other's (or the last put the first's back
for good: after two concurrent step builds, ``loss.backward()`` raised the step's "computes a gradient itself").
"""
from __future__ import annotations

import contextlib
import copy
import os
import random
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext import _compat, _env_reads, _trace_patches

from test_train_step_cumprod import CumProd
from test_train_step_prod import Prod


def _process_state() -> dict:
    """Every process-global thing a trace patches, by identity (or a copy of the table)."""
    import torch._decomp.decompositions as decomps
    from torch._export.passes import replace_set_grad_with_hop_pass as grad_pass
    import torch.autograd as autograd_mod
    from torch._functorch import aot_autograd
    from torch._inductor import ir, lowering
    from torch._inductor.graph import SubgraphLowering
    from torch.autograd import function as function_mod
    from torch.autograd import grad_mode
    from torch.fx.experimental import proxy_tensor
    from torch.nn.modules import module as nn_module
    from torch.utils import checkpoint as checkpoint_mod

    ops = [torch.ops.aten.prod.default, torch.ops.aten.prod.dim_int, torch.ops.aten.cumprod_backward.default,
           torch.ops.aten.native_dropout.default, torch.ops.aten.gru_cell.default,
           torch.ops.aten.mkldnn_rnn_layer_backward.default]
    for name in _compat.EAGER_AUTOGRAD_OPS:
        packet = getattr(torch.ops.aten, name, None)
        ops += [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    state = {
        "make_fx": aot_autograd.make_fx, "rnn_helper": decomps._rnn_helper, "should_fold": decomps.should_fold,
        "pack_padded": vars(torch._VF).get("_pack_padded_sequence"),
        "engine": autograd_mod._engine_run_backward,
        "inference_mode": (grad_mode.inference_mode.__enter__, grad_mode.inference_mode.__exit__),
        "autocast": tuple(vars(torch.amp.autocast_mode.autocast)[k] for k in ("__init__", "__enter__", "__exit__")),
        "export_grad_pass": (grad_pass._is_set_grad_enabled_sub_mod, grad_pass.replace_set_grad_with_hop_pass),
        "setup_context": function_mod._is_setup_context_defined, "register_hook": torch.Tensor.register_hook,
        "random": (random.seed, random.setstate, random.random, random.uniform,
                   sorted(k for k, v in vars(random._inst).items() if callable(v))),
        "checkpoint": (checkpoint_mod.CheckpointFunction.__dict__.get("apply"),
                       checkpoint_mod._checkpoint_without_reentrant_generator),
        "environ": type(os.environ).__getitem__,
        "py_kernels": {str(op): dict(op.py_kernels) for op in ops},
        "lowering": lowering.lowerings.get(torch.ops.aten.max_pool2d_with_indices_backward.default),
        "inductor": (ir.Conditional.__dict__["create"], SubgraphLowering.output),
        "stack_tracer": proxy_tensor._ModuleStackTracer.__dict__["__init__"],
        "global_hooks": [set(getattr(nn_module, t)) for t in ("_global_buffer_registration_hooks",
                                                               "_global_module_registration_hooks",
                                                               "_global_parameter_registration_hooks")],
        "global_hook_registration": tuple(getattr(nn_module, f"register_module_{t}_registration_hook")
                                          for t in ("buffer", "module", "parameter")),
        "installed": _trace_patches.installed(),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = (np.random.seed, np.random.set_state, np.random.randn, np.random.uniform)
    return state


def _changed(before: dict, after: dict) -> list[str]:
    return [k for k in before if before[k] != after[k]]


def test_nothing_is_installed_outside_a_trace_and_everything_inside():
    before = _process_state()
    assert before["installed"] == []
    with _trace_patches.patched(*_trace_patches.ORDER):
        inside = _process_state()
        assert inside["installed"] == list(_trace_patches.ORDER)
    # Every patch shows in the snapshot (so the tests below would see one left behind).
    assert sorted(_changed(before, inside)) == sorted(k for k in before if k != "global_hooks"), _changed(before, inside)
    assert _changed(before, _process_state()) == []


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _train(model, steps=4):
    """(losses, final parameters) of ``steps`` AdamW steps of a step built for ``model``."""
    batch = _batch()
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _loss, batch)
    state, losses = step.init_state(), []
    for _ in range(steps):
        loss, state = step(state, *batch)
        losses.append(loss)
    return losses, dict(state.params)


def _seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args)


def _assert_same(a, b):
    (la, pa), (lb, pb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


class _Resid(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h + x).cumprod(-1)


def _run_threads(*fns):
    results, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


def test_concurrent_builds_equal_sequential_builds():
    before = _process_state()
    x = torch.randn(4, 8)
    sequential = [_train(_seeded(Prod, -1, True)), _train(_seeded(CumProd, 1, True)),
                  torch_ext.ReactiveGraph(_seeded(_Resid).eval(), (x,)).run(x)]
    # The models are made here, one after the other: torch's default generator is shared by all threads, so
    # seeding and initialising inside the threads would interleave their draws (different weights, not a bug
    # of the registry).
    models = [_seeded(Prod, -1, True), _seeded(CumProd, 1, True), _seeded(_Resid).eval()]
    concurrent = _run_threads(lambda: _train(models[0]), lambda: _train(models[1]),
                              lambda: torch_ext.ReactiveGraph(models[2], (x,)).run(x))
    _assert_same(sequential[0], concurrent[0])
    _assert_same(sequential[1], concurrent[1])
    assert torch.equal(sequential[2], concurrent[2])
    assert _changed(before, _process_state()) == []


class _Waiting(Prod):
    """Prod whose first traced forward waits (up to ``timeout``) for ``other`` to be set: for another thread to be
    inside its own trace. With tracing serialized it never is, and the wait runs out."""

    def __init__(self, arrived, other, timeout):
        torch.manual_seed(0)
        super().__init__(-1, False)
        self.events = (arrived, other, timeout)

    def forward(self, x):
        if self.events is not None:
            arrived, other, timeout = self.events
            self.events = None
            arrived.set()
            other.wait(timeout)
        return super().forward(x)


def test_interleaved_builds_keep_their_patches_and_leave_none():
    """Thread A's trace waits for thread B to be inside its trace, and B's for A to have finished: without the
    lock, A's exit removed B's patches mid-trace and B's exit put A's back for good."""
    before = _process_state()
    expected = _train(_seeded(Prod, -1, False))
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def a():
        try:
            return _train(_Waiting(a_in, b_in, 1.0))
        finally:
            a_done.set()

    def b():
        a_in.wait(60)
        return _train(_Waiting(b_in, a_done, 1.0))

    got_a, got_b = _run_threads(a, b)
    _assert_same(expected, got_a)
    _assert_same(expected, got_b)
    assert _changed(before, _process_state()) == []
    model = _seeded(Prod, -1, False)  # eager training still works (the autograd engine is torch's)
    _loss(model, *_batch()).backward()


def test_a_failing_trace_leaves_no_patch():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            assert _trace_patches.installed(), "traced under the patches"
            raise RuntimeError("boom in forward")

    before = _process_state()
    with pytest.raises(RuntimeError, match="boom in forward"):
        model = Fails()
        torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch())
    assert _changed(before, _process_state()) == []
    with pytest.raises(RuntimeError, match="boom in forward"):
        torch_ext.ReactiveGraph(Fails(), (torch.randn(4, 8),))
    assert _changed(before, _process_state()) == []
    # A refused patch name leaves nothing either.
    with pytest.raises(ValueError, match="unknown trace patch"):
        with _trace_patches.patched("eager_prod_backward", "no_such_patch"):
            pass
    assert _changed(before, _process_state()) == []


def test_patches_act_on_the_tracing_thread_only():
    """An eager backward and pack_padded_sequence in another thread while a step is traced run torch's own code."""
    seen = {}

    def other_thread():
        w = torch.ones(3, requires_grad=True)
        (w * 2).sum().backward()  # the trace refuses autograd in forward; here it must run
        seen["grad"] = w.grad.clone()
        packed = nn.utils.rnn.pack_padded_sequence(torch.randn(2, 3, 4), torch.tensor([3, 2]), batch_first=True)
        seen["packed"] = packed.batch_sizes.tolist()

    class Traced(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            if "grad" not in seen:
                t = threading.Thread(target=other_thread)
                t.start()
                t.join(60)
            return self.fc(x)

    model = Traced()
    torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch())
    assert torch.equal(seen["grad"], torch.full((3,), 2.0))
    assert seen["packed"] == [2, 2, 1]


def test_nested_traces(monkeypatch):
    """A build inside a trace's patches on one thread (the registry held, environment reads recorded around
    it): the inner trace enters only what is not installed, leaves the outer's in place, and builds what a
    build outside gives; each level records the environment variables read inside it."""
    before = _process_state()
    monkeypatch.setenv("TORCH_EXT_TEST_NESTED", "2")  # undone at teardown: later tests see no such variable

    class Scaled(_Resid):
        def forward(self, x):
            return super().forward(x) * float(os.environ["TORCH_EXT_TEST_NESTED"])

    x = torch.randn(4, 8)
    expected = _train(_seeded(Prod, -1, True)), torch_ext.ReactiveGraph(_seeded(Scaled).eval(), (x,), cache=False).run(x)
    with _env_reads.recording() as reads, _trace_patches.patched(*_trace_patches.INFERENCE_TRACE):
        outer = _trace_patches.installed()
        with _env_reads.recording() as inner_reads:
            got = torch_ext.ReactiveGraph(_seeded(Scaled).eval(), (x,), cache=False).run(x)
        assert _trace_patches.installed() == outer
        trained = _train(_seeded(Prod, -1, True))
        assert _trace_patches.installed() == outer == ["env_reads", *_trace_patches.INFERENCE_TRACE]
    assert torch.equal(expected[1], got)
    _assert_same(expected[0], trained)
    assert reads == inner_reads == {"TORCH_EXT_TEST_NESTED": "2"}
    assert _changed(before, _process_state()) == []


class _Meanwhile(nn.Module):
    """A model whose first traced forward lets another thread run ``work`` (started by the test) and waits for
    it to finish: ``work`` runs while this thread holds the trace's patches, deterministically (events, no
    sleeps)."""

    def __init__(self, work):
        super().__init__()
        self.fc, self.work = nn.Linear(8, 3), work
        self.inside, self.done, self.errors = threading.Event(), threading.Event(), []

    def start(self):
        def other():
            self.inside.wait(60)
            try:
                self.work()
            except BaseException as e:  # noqa: BLE001 - asserted by the test
                self.errors.append(e)
            finally:
                self.done.set()

        t = threading.Thread(target=other)
        t.start()
        return t

    def forward(self, x):
        if not self.inside.is_set():
            self.inside.set()
            assert self.done.wait(60), "the other thread did not finish"
        return self.fc(x)


def test_global_module_hooks_other_threads_register_during_a_trace_are_kept():
    """The trace removes the global module hooks it leaves behind (torch.export's buffer-registration hook when
    it raises), not those another thread registers meanwhile: these were deleted, silently."""
    from torch.nn.modules import module as nn_module

    handles = []

    def register():
        hook = lambda module, name, value: None  # noqa: E731
        handles.extend([nn_module.register_module_buffer_registration_hook(hook),
                        nn_module.register_module_module_registration_hook(hook),
                        nn_module.register_module_parameter_registration_hook(hook)])

    tables = (nn_module._global_buffer_registration_hooks, nn_module._global_module_registration_hooks,
              nn_module._global_parameter_registration_hooks)
    try:
        for build in (lambda m: torch_ext.make_train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), _loss, _batch()),
                      lambda m: torch_ext.ReactiveGraph(m.eval(), (_batch()[0],), cache=False)):
            model = _Meanwhile(register)
            t = model.start()
            build(model)
            t.join(60)
            assert not model.errors, model.errors
            assert [h.id in table for h, table in zip(handles, tables)] == [True] * 3
            for h in handles:
                h.remove()
            handles.clear()
    finally:
        for h in handles:
            h.remove()


def test_other_threads_random_draws_during_a_trace_are_not_refused():
    """A step's trace refuses a forward that draws from Python's ``random`` or ``numpy.random`` (the draw would be
    baked in). Another thread drawing from them meanwhile is not the forward's draw: it was refused ("draws
    from Python's random module"), as the check compared the global generators' states before and after."""
    import numpy as np

    def draw():
        random.random(), random.uniform(0, 1), random.randint(0, 9), random.getrandbits(8)
        np.random.randn(3), np.random.uniform(size=2), np.random.randint(0, 9, size=2)
        random.seed(5), np.random.seed(5)

    torch.manual_seed(0)
    model = _Meanwhile(draw)
    t = model.start()
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch())
    t.join(60)
    assert not model.errors, model.errors
    assert step is not None


class _Draws(nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.fc, self.draw = nn.Linear(8, 3), draw

    def forward(self, x):
        return self.fc(x) * self.draw()


@pytest.mark.parametrize("draw, match", [
    (lambda: random.random(), "Python's random module"),
    (lambda: random.uniform(0.5, 1.5), "Python's random module"),
    (lambda: float(sys.modules["numpy"].random.rand()), "numpy.random"),
], ids=["random.random", "random.uniform", "numpy.random.rand"])
@pytest.mark.parametrize("meanwhile", [False, True], ids=["alone", "other-thread-draws"])
def test_the_trace_own_random_draws_are_refused_also_while_other_threads_draw(draw, match, meanwhile):
    """A forward that draws is refused, also when another thread draws during its trace."""
    import numpy as np

    class Model(_Draws):
        def forward(self, x):
            if meanwhile:  # another thread draws from both generators while this thread traces
                t = threading.Thread(target=lambda: (random.random(), np.random.randn(2)))
                t.start()
                t.join(60)
            return super().forward(x)

    torch.manual_seed(0)
    model = Model(draw)
    with pytest.raises((TypeError, NotImplementedError), match=match):
        torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch())


_EARLY_RANDOM = random.random  # bound before any trace: `from random import random`


class _OwnRng(nn.Module):
    """Draws from a generator object of its own, held as an attribute, a global or in a closure."""

    def __init__(self, where, kind):
        super().__init__()
        import numpy as np

        self.fc, self.where = nn.Linear(8, 3), where
        rng = {"random.Random": lambda: random.Random(0), "numpy Generator": lambda: np.random.default_rng(0),
               "numpy RandomState": lambda: np.random.RandomState(0)}[kind]()
        draw = (lambda g: g.random()) if kind != "numpy RandomState" else (lambda g: g.rand())
        if where == "attribute":
            self.rng, self.draw = rng, lambda: float(draw(self.rng))
        elif where == "global":
            globals()["_GLOBAL_RNG"] = rng
            self.draw = lambda: float(draw(_GLOBAL_RNG))  # noqa: F821 - set just above
        else:
            self.draw = lambda: float(draw(rng))  # a closure variable
        self.rng_obj = rng

    def forward(self, x):
        return self.fc(x) * self.draw()


def _rng_state(g):
    return g.getstate() if isinstance(g, random.Random) else repr(g.bit_generator.state if hasattr(
        g, "bit_generator") else g.get_state(legacy=False))


_BUILDS = {"step": lambda m: torch_ext.make_train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), _loss, _batch()),
           "ReactiveGraph": lambda m: torch_ext.ReactiveGraph(m.eval(), (_batch()[0],), cache=False)}


@pytest.mark.parametrize("build", list(_BUILDS))
@pytest.mark.parametrize("draw, match", [
    (lambda: _EARLY_RANDOM(), "Python's random module"),
    (lambda: float(sys.modules["numpy"].random.mtrand._rand.rand()), "numpy.random"),  # `from numpy.random import rand`
], ids=["from-random-import-random", "from-numpy-random-import-rand"])
def test_draws_through_early_bound_names_are_refused_and_leave_the_generator_as_found(draw, match, build):
    """A ReactiveGraph did not look at Python draws at all: a forward drawing through any name was traced with the
    number drawn once, and every run replayed it, silently. The refused build puts the global generator back."""
    import numpy as np

    torch.manual_seed(0)
    model = _Draws(draw)
    py, npst = random.getstate(), np.random.get_state()
    with pytest.raises(TypeError, match=match):
        _BUILDS[build](model)
    assert random.getstate() == py
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(np.random.get_state(), npst))


@pytest.mark.parametrize("build", list(_BUILDS))
@pytest.mark.parametrize("kind", ["random.Random", "numpy Generator", "numpy RandomState"])
@pytest.mark.parametrize("where", ["attribute", "global", "closure"])
def test_draws_from_the_model_own_generator_objects_are_refused_by_name(where, kind, build):
    """``self.rng = np.random.default_rng(0)`` drawn from in forward (or a global, or a closure's generator): its
    state is no process-global one, so neither the step nor a ReactiveGraph saw the draw; both baked the number
    in and replayed it at every call, silently. Refused naming the generator; its state is left as found."""
    torch.manual_seed(0)
    model = _OwnRng(where, kind)
    before = _rng_state(model.rng_obj)
    want = {"attribute": "model.rng", "global": "_GLOBAL_RNG", "closure": "closure variable rng"}[where]
    with pytest.raises(TypeError, match=want):
        _BUILDS[build](model)
    assert _rng_state(model.rng_obj) == before


def test_a_model_holding_a_generator_it_does_not_draw_from_in_forward_builds():
    torch.manual_seed(0)
    model = _OwnRng("attribute", "numpy Generator")
    model.draw = lambda: 1.0
    _BUILDS["step"](model)
    _BUILDS["ReactiveGraph"](model)


def _building_thread(errors, done=None):
    def build():
        try:
            torch_ext.ReactiveGraph(_seeded(_Resid).eval(), (torch.randn(4, 8),), cache=False)
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            errors.append(e)
        finally:
            if done is not None:
                done.set()
    return threading.Thread(target=build, name="builder")


def test_a_build_in_a_thread_the_trace_joins_raises_instead_of_deadlocking():
    """A traced forward that joins a thread which builds a graph: tracing is serialized, so the thread waited for
    the trace's lock while the trace waited for the thread, forever. Now the thread raises, naming the holder."""
    errors, joined = [], []
    before = _process_state()

    class Joins(_Resid):
        def forward(self, x):
            if not joined:
                t = _building_thread(errors)
                t.start()
                t.join(20)  # the test's own bound: before the fix the thread was still waiting here
                joined.append(not t.is_alive())
            return super().forward(x)

    x = torch.randn(4, 8)
    got = torch_ext.ReactiveGraph(_seeded(Joins).eval(), (x,), cache=False).run(x)
    assert joined == [True], "the building thread still waited for the trace's lock"
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "MainThread" in str(errors[0]) and "waits on this thread" in str(errors[0]), str(errors[0])
    assert torch.equal(got, torch_ext.ReactiveGraph(_seeded(_Resid).eval(), (x,), cache=False).run(x))
    assert _changed(before, _process_state()) == []


def test_a_build_waited_on_through_an_event_raises_after_the_holder_stays_blocked(monkeypatch):
    """The trace waits on an event the building thread sets once built (not a join: who sets an event cannot be
    known). The building thread raises once the holder has stayed blocked in a wait for HOLDER_BLOCKED_LIMIT_S."""
    monkeypatch.setattr(_trace_patches, "HOLDER_BLOCKED_LIMIT_S", 0.5)
    errors, done, waited = [], threading.Event(), []

    class Waits(_Resid):
        def forward(self, x):
            if not waited:
                _building_thread(errors, done).start()
                waited.append(done.wait(20))
            return super().forward(x)

    x = torch.randn(4, 8)
    torch_ext.ReactiveGraph(_seeded(Waits).eval(), (x,), cache=False)
    assert waited == [True], "the building thread still waited for the trace's lock"
    assert len(errors) == 1 and "blocked" in str(errors[0]) and "MainThread" in str(errors[0]), errors


def _transposed(*shape):
    """A CPU tensor of ``shape`` whose dims 1 and 2 are swapped in memory (not contiguous; its suggested memory
    format is contiguous)."""
    return torch.randn(shape[0], shape[2], shape[1], *shape[3:]).transpose(1, 2)


def _bn_forward(*tail):
    return [_transposed(4, 3, 5), torch.randn(3), torch.randn(3), torch.zeros(3), torch.ones(3), *tail]


def _bn_backward(*tail):
    return [_transposed(4, 3, 5), _transposed(4, 3, 5), torch.randn(3), torch.zeros(3), torch.ones(3), torch.randn(3),
            torch.rand(3) + 0.5, True, 1e-5, [True, True, True], *tail]


def _layer_norm_backward():
    x = _transposed(4, 3, 4)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [4], None, None, 1e-5)
    return [_transposed(4, 3, 4), x, [4], mean, rstd, torch.randn(4), torch.randn(4), [True, True, True]]


# Arguments for each entry of the CPU layout table, the input at its position transposed.
_CPU_LAYOUT_SAMPLES = {
    "native_batch_norm.default": lambda: _bn_forward(True, 0.1, 1e-5),
    "_native_batch_norm_legit.default": lambda: _bn_forward(True, 0.1, 1e-5),
    "_native_batch_norm_legit.no_stats": lambda: _bn_forward(True, 0.1, 1e-5)[:3] + [True, 0.1, 1e-5],
    "_native_batch_norm_legit_functional.default": lambda: _bn_forward(True, 0.1, 1e-5),
    "_native_batch_norm_legit_no_training.default": lambda: _bn_forward(0.1, 1e-5),
    "_batch_norm_with_update.default": lambda: _bn_forward(0.1, 1e-5),
    "_batch_norm_with_update_functional.default": lambda: _bn_forward(0.1, 1e-5),
    "_batch_norm_no_update.default": lambda: _bn_forward(0.1, 1e-5),
    "native_batch_norm_backward.default": _bn_backward,
    "batch_norm_backward.default": lambda: _bn_backward(torch.empty(0, dtype=torch.uint8)),
    "native_layer_norm.default": lambda: [_transposed(4, 3, 4), [4], torch.randn(4), torch.randn(4), 1e-5],
    "native_layer_norm_backward.default": _layer_norm_backward,
    "mse_loss_backward.default": lambda: [torch.randn(()), _transposed(4, 4, 3), _transposed(4, 4, 3), 1],
    "huber_loss_backward.default": lambda: [torch.randn(()), _transposed(4, 4, 3), _transposed(4, 4, 3), 1, 1.0],
    "_log_softmax_backward_data.default": lambda: [_transposed(4, 4, 3), torch.randn(4, 4, 3).log_softmax(1), 1,
                                                   torch.float32],
    # the elementwise backwards: a transposed gradient beside a contiguous mask or self
    "native_dropout_backward.default": lambda: [_transposed(4, 4, 3), torch.rand(4, 4, 3) > 0.5, 2.0],
    "softplus_backward.default": lambda: [_transposed(4, 4, 3), torch.randn(4, 4, 3), 1.0, 20.0],
    "elu_backward.default": lambda: [_transposed(4, 4, 3), 1.0, 1.0, 1.0, False, torch.randn(4, 4, 3)],
    "hardswish_backward.default": lambda: [_transposed(4, 4, 3), torch.randn(4, 4, 3) * 4],
    "hardsigmoid_backward.default": lambda: [_transposed(4, 4, 3), torch.randn(4, 4, 3) * 4],
    "hardtanh_backward.default": lambda: [_transposed(4, 4, 3), torch.randn(4, 4, 3), -1.0, 1.0],
    "logit_backward.default": lambda: [_transposed(4, 4, 3), torch.rand(4, 4, 3) * 0.8 + 0.1, None],
}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_every_cpu_layout_op_is_traced_and_checked_in_the_cpu_kernels_layout():
    """The ops whose CPU kernels lay their first result out otherwise than their meta kernels have one table, the C++
    type checker's (``_C.cpu_layout_ops``), which the trace patch (``_compat.eager_batch_norm_layouts``) reads. For
    each entry, on a transposed input: a trace under the patch records the real CPU kernel's layout and the checker
    accepts it; a trace without it records the meta kernel's, and the checker refuses it wherever that differs. An
    entry one side ignored (traced in the meta layout, or inferred in it) fails here."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_ext import _C
    from torch_ext.ir import Graph

    table = _C.cpu_layout_ops()
    names = [f"{name}.{overload}" for name, overload, _, _ in table]
    assert sorted(names) == sorted(_CPU_LAYOUT_SAMPLES), "every entry needs a sample here (and no stale sample)"
    assert set(_compat._batch_norm_layout_ops()) == {getattr(getattr(torch.ops.aten, n), o) for n, o, _, _ in table}
    torch.manual_seed(0)
    meta_differs = set()
    for (name, overload, at, _), key in zip(table, names):
        op = getattr(getattr(torch.ops.aten, name), overload)
        args = _CPU_LAYOUT_SAMPLES[key]()
        assert isinstance(args[at], torch.Tensor) and not args[at].is_contiguous(), key
        cpu = _first(op(*args)).stride()
        where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def call(*tensors, args=args, where=where, op=op):
            given = list(args)
            for i, t in zip(where, tensors):
                given[i] = t
            return op(*given)

        for patched in (True, False):
            inputs = [args[i].clone() for i in where]
            with _trace_patches.patched("eager_batch_norm_layouts") if patched else contextlib.nullcontext():
                gm = make_fx(call, tracing_mode="fake", pre_dispatch=True)(*inputs)
            (node,) = [n for n in gm.graph.nodes if n.target == op]
            traced = _first(node.meta["val"]).stride()
            graph = Graph.from_fx(gm.graph)
            if patched:
                assert traced == cpu, (key, traced, cpu)
                graph.verify()
            elif traced != cpu:
                meta_differs.add(key)
                with pytest.raises(Exception, match=rf"node %\w+ \(aten::{name}\.{overload}\): declared type"):
                    graph.verify()
    # If the meta kernels stop differing for these samples, the entries may be dead. Layer norm's forward meta
    # kernel already lays its result out contiguous in torch 2.9 (transposed, permuted, channels-last or sliced
    # inputs alike): its entry only guards a release whose meta kernel keeps the input's layout.
    assert meta_differs == set(names) - {"native_layer_norm.default"}


# The elementwise entries' arguments around (grad, other): other is the mask or `self`.
_ELEMENTWISE_CALLS = {
    "native_dropout_backward": lambda g, o: (g, o > 0, 2.0),
    "softplus_backward": lambda g, o: (g, o, 1.0, 20.0),
    "elu_backward": lambda g, o: (g, 1.0, 1.0, 1.0, False, o),
    "hardswish_backward": lambda g, o: (g, o * 4),
    "hardsigmoid_backward": lambda g, o: (g, o * 4),
    "hardtanh_backward": lambda g, o: (g, o, -1.0, 1.0),
    "logit_backward": lambda g, o: (g, o.sigmoid(), None),
}


def _layouts(shape):
    """Tensors of ``shape`` in every dim order, dense and sliced (gaps between elements), and expanded along each
    dim (stride 0)."""
    import itertools

    n = len(shape)
    for perm in itertools.permutations(range(n)):
        back = [perm.index(i) for i in range(n)]
        yield torch.randn([shape[p] for p in perm]).permute(back)
        yield torch.randn([2 * shape[p] for p in perm]).permute(back)[(slice(None, None, 2),) * n]
    for d in range(n):
        yield torch.randn([1 if i == d else s for i, s in enumerate(shape)]).expand(shape)


def test_elementwise_layout_rule_is_the_cpu_kernels_over_a_sweep_of_layouts():
    """The one rule for the layout of an elementwise entry's result (``_C.elementwise_strides``: TensorIterator on
    meta tensors, which the C++ type checker infers and ``_compat._elementwise_layout`` traces) against each
    elementwise entry's CPU kernel, on every pair of layouts of a sweep of shapes (permuted, sliced, expanded, dims
    of size 1): equal in every dim of size > 1 (strides of size-1 dims do not matter, and the checker ignores
    them)."""
    from torch_ext import _C

    elementwise = sorted(n for n, _, _, kind in _C.cpu_layout_ops() if kind == "elementwise")
    assert elementwise == sorted(_ELEMENTWISE_CALLS), "every elementwise entry needs a call here"
    torch.manual_seed(0)
    pairs = 0
    for shape in [(4, 3, 2), (1, 3, 2), (4, 1, 2), (3, 1, 1), (1, 1, 2), (2, 3), (3, 1), (5,)]:
        layouts = list(_layouts(shape))
        for g in layouts:
            for o in layouts:
                assert _compat._elementwise_layout((g, 2.0, o), {}) == _C.elementwise_strides(g.shape, g.stride(),
                                                                                             o.shape, o.stride())
                for name in elementwise:
                    args = _ELEMENTWISE_CALLS[name](g, o)
                    # (the mask, o * 4 or o.sigmoid() are new tensors: the rule over the arguments as given)
                    rule = _compat._elementwise_layout(args, {})
                    got = getattr(torch.ops.aten, name).default(*args).stride()
                    assert all(a == b for a, b, s in zip(got, rule, shape) if s > 1), (name, shape, g.stride(),
                                                                                      o.stride(), got, rule)
                pairs += 1
    assert pairs > 1000
    # Not exactly two tensors (the rule is TensorIterator's over two), or two that do not broadcast: no rule.
    assert _compat._elementwise_layout((torch.randn(2, 3),), {}) is None
    assert _C.elementwise_strides([2, 3], [3, 1], [4, 3], [3, 1]) is None


class _CallOp(nn.Module):
    def __init__(self, op, args):
        super().__init__()
        self.op, self.args = op, args
        self.where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def forward(self, *tensors):
        given = list(self.args)
        for i, t in zip(self.where, tensors):
            given[i] = t
        return self.op(*given)


@pytest.mark.parametrize("key", ["mse_loss_backward.default", "huber_loss_backward.default",
                                 "_log_softmax_backward_data.default", "native_layer_norm_backward.default"])
def test_a_program_declaring_the_meta_layout_is_retraced_in_the_cpu_layout(key):
    """A torch.export program decomposed to ATen declares these ops' results in the meta kernels' layout; the
    Executor retraces it in the CPU kernels' (``_compat.batch_norm_in_cpu_layout``) and computes what eager does.
    An op with one result (a tensor, not a tuple) was never found stale, and the IR checker refused the program
    ("declared type f32[4,4,3]{12,1,4} differs from f32[4,4,3]")."""
    name, overload = key.split(".")
    op = getattr(getattr(torch.ops.aten, name), overload)
    torch.manual_seed(0)
    args = _CPU_LAYOUT_SAMPLES[key]()
    module = _CallOp(op, args)
    tensors = [args[i] for i in module.where]
    ep = torch.export.export(module, tuple(tensors)).run_decompositions({})
    (node,) = [n for n in ep.graph.nodes if n.target == op]
    want = _first(op(*args))
    assert _first(node.meta["val"]).stride() != want.stride()  # the program declares the meta layout
    got = _first(torch_ext.Executor(ep)(*tensors))
    assert got.stride() == want.stride() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("scale", [1.0, None, -0.3])
@pytest.mark.parametrize("bias_batch", [1, 2])
def test_sdpa_math_with_a_drawn_mask_is_eagers_math_kernel_bit_for_bit(dtype, p, scale, bias_batch):
    # _bias_branch's T5 cond replays SDPA's CPU math kernel op by op with the dropout mask drawn before the cond
    # (a native_dropout on the weights' shape): forward and the q/k/v/bias gradients torch.equal to eager's
    # F.scaled_dot_product_attention (math: its float mask requires grad), which draws the same numbers itself.
    B, H, L, D = 2, 3, 7, 8
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, L, D, generator=g) for _ in range(3)] + [torch.randn(bias_batch, H, L, L, generator=g)]
    weight = torch.randn(B, H, L, D, generator=g).to(dtype)

    def run(fn):
        q, k, v, bias = (t.to(dtype).requires_grad_() for t in base)
        out = fn(q, k, v, bias)
        out.backward(weight)
        return [out] + [t.grad for t in (q, k, v, bias)]

    torch.manual_seed(5)
    ref = run(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, scale=scale))
    torch.manual_seed(5)
    keep = torch.ops.aten.native_dropout.default(torch.zeros(B, H, L, L), p, True)[1]
    got = run(lambda q, k, v, m: _compat._sdpa_math_with_mask(q, k, v, m, p, scale, keep))
    for name, a, b in zip(("out", "q", "k", "v", "bias"), ref, got):
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()}"
    if p:  # the mask matters: another one gives another output
        torch.manual_seed(5)
        other = run(lambda q, k, v, m: _compat._sdpa_math_with_mask(q, k, v, m, p, scale, keep.flip(-1)))
        assert not torch.equal(other[0], ref[0])
