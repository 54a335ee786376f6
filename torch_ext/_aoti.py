"""What ``TrainStep.to_aoti`` hands AOTInductor in place of torch_ext's custom ops.

AOTInductor calls a custom op as an opaque extern kernel: no fusion with its neighbours, eager
allocations and eager arithmetic inside. Two kinds sit in every step program:

- the optimizer updates (``torch_ext::<kind>_update``): their ATen forms, torch_ext.optim.aten_updates;
- dropout (``torch_ext::native_dropout_rng``, passes/thread_rng.h): the C++ kernel draws an mt19937
  Bernoulli mask into a bool tensor (scalar generator, then a bool copy), multiplies the input by it
  (a float * bool promotion) and by the scale: on the GPT-2 benchmark step 7 calls, about 10% of the
  AOTInductor step. Here it becomes one 64-bit draw from the explicit state
  (``torch_ext::rng_seed``: the seed, and the state advanced past it) and a counter-based hash of
  each element's index keyed by that seed (counter_bits below: integer ATen ops), which Inductor
  vectorises and fuses with the mask and the scale. The package draws another stream than the
  executor (the issue asks AOTInductor only to stay pure), and still reads no global generator: the
  seed is a function of the state passed in.
- noise like a tensor (``torch_ext::randn_like_rng`` / ``rand_like_rng``) and random factories
  (``randn_rng`` / ``rand_rng`` / ``randint_rng``): uniforms from 24 bits of the same hash, normals by
  Box-Muller over two of them, integers by a modulo; pure in the state, another stream than eager.

Cross-entropy is rewritten too (fuse_cross_entropy below): the joint graph's
``_log_softmax -> nll_loss_forward`` and ``nll_loss_backward -> _log_softmax_backward_data`` become
pointwise ATen math over the logits and their row logsumexp, which Inductor lowers to one forward
reduction and one backward pass. From the ATen ops Inductor also avoided storing the log-softmax and
the scatter, but added a pass computing the row sum of the scattered gradient (on the GPT-2
benchmark, 1024 x 8192, vectorised across rows: about 1% of the AOTInductor step).
"""
from __future__ import annotations

import math

import torch


_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    # (x * c) mod 2**32 for 32-bit values held in int64, with every product below 2**63: Inductor's
    # vector loop would wrap anyway, but its scalar tail is C++ signed arithmetic (overflow is UB).
    if c < 2**31:
        return (x * c) & _M32
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _lowbias32(x):
    # Chris Wellons' lowbias32 (hash-prospector: [16 7feb352d 15 846ca68b 16]), a bijection on 32 bits.
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_bits(shape, seed, device=None):
    """32 random bits per element (int64 in [0, 2**32)), a pure function of ``seed`` (an int64 scalar
    tensor) and the element's flat index: two lowbias32 rounds over the index, keyed with the mixed
    halves of the seed. Integer ATen ops only, which Inductor vectorises and fuses with their consumer; its own
    ``prims.inductor_random`` calls a scalar Philox (10 rounds) per element, ~12 ns each on this VM,
    ~28 ms of the GPT-2 benchmark step's 2.4M dropout draws."""
    numel = 1
    for d in shape:
        numel *= d
    idx = torch.arange(numel, dtype=torch.int64, device=device).reshape(shape)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    # Every seed bit reaches both keys (a bijection of the seed): with raw halves, seeds that differ
    # in k0 only would draw permutations of one stream (idx ^ k0).
    k1 = _lowbias32(k1 ^ _lowbias32(k0))
    k0 = _lowbias32(k0 ^ k1)
    return _lowbias32(_lowbias32((idx & _M32) ^ k0) ^ (idx >> 32) ^ k1)


def _native_dropout_rng(input, p, train, rng_state):
    # aten::native_dropout's semantics (CPU kernel): p in [0, 1] (the C++ op's check runs at export);
    # no draw and the state unchanged when not training or when the input is empty.
    if (train is not None and not train) or input.numel() == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool), rng_state.clone()
    seed, new_state = torch.ops.torch_ext.rng_seed(rng_state)
    # P(keep) = P(bits >= p * 2**32) = 1 - p, to 2**-32; p = 1 keeps nothing
    mask = counter_bits(list(input.shape), seed, input.device) >= round(p * 2**32)
    p1m = 1.0 - p
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    return input * mask * scale, mask, new_state


def _uniform(shape, device, rng_state):
    # 24 hash bits per element as a float in [0, 1) (float32's mantissa), pure in the state.
    seed, new_state = torch.ops.torch_ext.rng_seed(rng_state)
    bits = counter_bits(list(shape), seed, device)
    return (bits >> 8).to(torch.float32) * (2.0 ** -24), new_state


def _normal(shape, device, rng_state):
    # Box-Muller over two hashed uniforms: 1 - u1 in (0, 1] keeps the log finite.
    u1, state = _uniform(shape, device, rng_state)
    u2, new_state = _uniform(shape, device, state)
    return torch.sqrt(-2.0 * torch.log(1.0 - u1)) * torch.cos((2.0 * math.pi) * u2), new_state


def _rand_like_rng(self, rng_state):
    u, new_state = _uniform(self.shape, self.device, rng_state)
    return u.to(self.dtype), new_state


def _randn_like_rng(self, rng_state):
    z, new_state = _normal(self.shape, self.device, rng_state)
    return z.to(self.dtype), new_state


def _bernoulli_p_rng(self, p, rng_state, fill_in_place=False):
    u, new_state = _uniform(self.shape, self.device, rng_state)
    return (u < p).to(self.dtype), new_state


def _rand_rng(size, dtype, rng_state):
    u, new_state = _uniform(size, rng_state.device, rng_state)
    return u.to(dtype), new_state


def _randn_rng(size, dtype, rng_state):
    z, new_state = _normal(size, rng_state.device, rng_state)
    return z.to(dtype), new_state


def _randint_rng(low, high, size, dtype, rng_state):
    # An integer in [low, high) from the hash bits (a modulo: its bias is below range / 2**32, or below
    # range / 2**63 with two draws for ranges past 2**32).
    span = high - low
    seed, state = torch.ops.torch_ext.rng_seed(rng_state)
    bits = counter_bits(list(size), seed, rng_state.device)
    if span > 2**32:
        seed2, state = torch.ops.torch_ext.rng_seed(state)
        bits = (bits << 31) ^ counter_bits(list(size), seed2, rng_state.device)
    return (low + bits % span).to(dtype), state


_aten = torch.ops.aten


def _mkldnn_rnn_layer(input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, batch_sizes, mode, hidden_size,
                      num_layers, has_biases, bidirectional, batch_first, train):
    # An LSTM layer (traced as eager's oneDNN kernel, _compat.eager_onednn_lstm) as torch_ext's op: the same ATen
    # kernel, run with grad mode on when training (AOTInductor runs a package with it off, where ATen's returns no
    # workspace for the backward) and called with batch_sizes=[] from C++ (below).
    if len(batch_sizes):
        return NotImplemented
    return torch.ops.torch_ext.mkldnn_rnn_layer(input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, mode,
                                                hidden_size, num_layers, has_biases, bidirectional, batch_first, train)


def _mkldnn_rnn_layer_backward(input, weight1, weight2, weight3, weight4, hx_, cx_tmp, output, hy_, cy_, grad_output,
                               grad_hy, grad_cy, reverse, mode, hidden_size, num_layers, has_biases, train,
                               bidirectional, batch_sizes, batch_first, workspace):
    # An LSTM layer's backward (traced as eager's oneDNN kernel, _compat.eager_onednn_lstm) as torch_ext's op: the
    # same ATen kernel, called with batch_sizes=[] from C++, since torch 2.9's AOTInductor proxy executor passes
    # aten's empty batch_sizes as None (pytorch/pytorch#194324; the package failed at run time with "Expected
    # IntList but got None"). Packed sequences, the only non-empty batch_sizes, are refused at trace time.
    if len(batch_sizes):
        return NotImplemented
    return torch.ops.torch_ext.mkldnn_rnn_layer_backward(
        input, weight1, weight2, weight3, weight4, hx_, cx_tmp, output, hy_, cy_, grad_output, grad_hy, grad_cy,
        reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional, batch_first, workspace)


def fuse_cross_entropy_program(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of ``ep`` with fuse_cross_entropy applied (``ep`` itself when nothing matches)."""
    from torch.export.experimental import _copy_graph_module_and_signature

    gm, sig = _copy_graph_module_and_signature(ep)
    if not fuse_cross_entropy(gm):
        return ep
    return ep._update(gm, sig)


def fuse_cross_entropy(gm: torch.fx.GraphModule) -> int:
    """Rewrites each cross-entropy of ``gm`` (a joint step graph, in place) that export left as

        lsm = _log_softmax(x, 1)             loss, tw = nll_loss_forward(lsm, t, None, mean|sum, ii)
        G = nll_loss_backward(g, lsm, t, None, mean|sum, ii, tw)
        dx = _log_softmax_backward_data(G, lsm, 1, float32)

    into pointwise math over x and lse = logsumexp(x, 1): the forward reads ``x - lse``, and
    ``dx = c * valid * (exp(x - lse) - onehot(t))`` with ``c = g / tw`` (mean) or ``g`` (sum), which is
    what the two backward ops compute (G is ``-c`` at the valid targets, its row sum ``-c * valid``).
    Inductor then fuses each side into one pass over the logits and never stores the log-softmax.
    Only 2-D float32 logits with no class weights and lsm used by nothing else are rewritten.
    Returns how many were. Equal to the ATen ops up to float32 rounding (exp(x - lse) for exp(lsm))."""
    done = 0
    aliasing = {_aten.detach.default, _aten.alias.default}
    ce_ops = {_aten.nll_loss_forward.default, _aten.nll_loss_backward.default,
              _aten._log_softmax_backward_data.default}
    for lsm in list(gm.graph.nodes):
        if lsm.op != "call_function" or lsm.target is not _aten._log_softmax.default:
            continue
        x, dim, half_to_float = lsm.args
        val = x.meta.get("val")
        if (half_to_float or val is None or val.dim() != 2 or val.dtype != torch.float32
                or dim not in (1, -1)):
            continue
        # lsm and its aliases (export's joint graph reads the saved value through detach nodes)
        names, aliases, uses = {lsm}, [], []
        frontier = [lsm]
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u.op == "call_function" and u.target in aliasing and len(u.args) == 1:
                    names.add(u)
                    aliases.append(u)
                    frontier.append(u)
                else:
                    uses.append(u)
        if not all(u.op == "call_function" and u.target in ce_ops for u in uses):
            continue
        fwds = [u for u in uses if u.target is _aten.nll_loss_forward.default]
        bwds = [u for u in uses if u.target is _aten.nll_loss_backward.default]
        grads = [u for u in uses if u.target is _aten._log_softmax_backward_data.default]
        if len(fwds) != 1 or len(bwds) > 1 or len(grads) != len(bwds):
            continue
        fwd = fwds[0]
        if len(fwd.args) != 5 or fwd.kwargs:
            continue
        _, target, weight, reduction, ignore_index = fwd.args
        if weight is not None or reduction not in (1, 2):
            continue
        bwd = grads_node = None
        if bwds:
            bwd, grads_node = bwds[0], grads[0]
            if len(bwd.args) != 7 or bwd.kwargs or len(grads_node.args) != 4 or grads_node.kwargs:
                continue
            g, b_lsm, b_t, b_w, b_red, b_ii, b_tw = bwd.args
            if (b_lsm not in names or b_t is not target or b_w is not None or b_red != reduction
                    or b_ii != ignore_index or list(bwd.users) != [grads_node]
                    or grads_node.args[0] is not bwd or grads_node.args[1] not in names
                    or grads_node.args[2] not in (1, -1) or grads_node.args[3] != torch.float32):
                continue
        graph = gm.graph
        with graph.inserting_before(lsm):
            lse = graph.call_function(_aten.logsumexp.default, (x, [1], True))
            shifted = graph.call_function(_aten.sub.Tensor, (x, lse))
        fwd.replace_input_with(fwd.args[0], shifted)
        if bwd is not None:
            with graph.inserting_before(grads_node):
                n_classes = val.shape[1]
                classes = graph.call_function(_aten.arange.start_step, (0, n_classes, 1),
                                              {"dtype": torch.int64, "device": val.device})
                onehot = graph.call_function(_aten.eq.Tensor, (
                    classes, graph.call_function(_aten.unsqueeze.default, (target, 1))))
                probs = graph.call_function(_aten.exp.default, (shifted,))
                diff = graph.call_function(_aten.where.self, (
                    onehot, graph.call_function(_aten.sub.Tensor, (probs, 1.0)), probs))
                c = g if reduction == 2 else graph.call_function(_aten.div.Tensor, (g, b_tw))
                valid = graph.call_function(_aten.ne.Scalar, (target, ignore_index))
                # where, not valid * c: with every target ignored, tw = 0 and c = inf, and ATen's dx is 0
                scale = graph.call_function(_aten.where.ScalarOther, (valid, c, 0.0))
                dx = graph.call_function(_aten.mul.Tensor, (
                    diff, graph.call_function(_aten.unsqueeze.default, (scale, 1))))
            grads_node.replace_all_uses_with(dx)
            graph.erase_node(grads_node)
            graph.erase_node(bwd)
        for n in reversed(aliases):
            graph.erase_node(n)
        graph.erase_node(lsm)
        done += 1
    if done:
        _fill_vals(gm)
        gm.graph.lint()
        gm.recompile()
    return done


def _fill_vals(gm: torch.fx.GraphModule) -> None:
    """meta["val"] (a fake tensor) for the nodes inserted above, from their inputs' fake values, as
    export's own nodes carry (ExportedProgram's verifier and Inductor read them)."""
    from torch._guards import detect_fake_mode

    vals = [n.meta["val"] for n in gm.graph.nodes if "val" in n.meta]
    mode = detect_fake_mode(vals)
    with mode:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "val" not in node.meta:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)


def aoti_decompositions() -> dict:
    """{OpOverload: its form for AOTInductor}: the optimizer updates' ATen forms, the dropout above, and
    ``aten.mkldnn_rnn_layer`` and its backward as torch_ext's ops of the same names (the same kernels). The
    executor and the arena keep running the C++ kernels and ATen's op (bit-exact with eager)."""
    from .optim import aten_updates

    table = aten_updates()
    table[torch.ops.torch_ext.native_dropout_rng.default] = _native_dropout_rng
    table[torch.ops.torch_ext.randn_like_rng.default] = _randn_like_rng
    table[torch.ops.torch_ext.rand_like_rng.default] = _rand_like_rng
    table[torch.ops.torch_ext.randn_rng.default] = _randn_rng
    table[torch.ops.torch_ext.bernoulli_p_rng.default] = _bernoulli_p_rng
    table[torch.ops.torch_ext.rand_rng.default] = _rand_rng
    table[torch.ops.torch_ext.randint_rng.default] = _randint_rng
    table[_aten.mkldnn_rnn_layer.default] = _mkldnn_rnn_layer
    table[_aten.mkldnn_rnn_layer_backward.default] = _mkldnn_rnn_layer_backward
    return table


# to_aoti(channels_last="auto") stores a convolution's weight channels-last only when the
# convolution's input has at least this many positions (H * W). One thread here, ResNet-18 at 64x64,
# batch 16 (scripts/bench_conv_layout.py): oneDNN's channels-last kernels
# are 10-40% faster forward + backward on 16x16 and 8x8 inputs, and 10-55% slower on 4x4 and 2x2,
# where ATen's mkldnn backward also copies each weight gradient from oneDNN's contiguous result into
# the weight's channels-last strides (1 ms per 512x512x3x3 gradient).
CHANNELS_LAST_MIN_POSITIONS = 64


def has_higher_order_ops(program: torch.export.ExportedProgram) -> bool:
    """Whether ``program`` calls a higher-order operator (torch.cond, while_loop, ...)."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
               for n in program.graph_module.graph.nodes)


def conv_weight_entries(program: torch.export.ExportedProgram, inputs: list[str],
                        min_positions: int = 0) -> list[str]:
    """The state entries of ``program`` (its flat input names ``inputs``) stored channels-last in the
    AOTInductor package: every 4-D input read as a convolution's weight whose input has at least
    ``min_positions`` positions (H * W) in every convolution reading it, and the optimizer slots of
    those parameters with the weight's shape (AdamW's moments: the update reads them with the weight)."""
    placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    name_of = dict(zip(placeholders, inputs))
    weights, small = set(), set()
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is _aten.convolution.default:
            x, w = node.args[0], node.args[1]
            if w in name_of and w.meta["val"].dim() == 4:
                positions = math.prod(x.meta["val"].shape[2:])
                (weights if positions >= min_positions else small).add(name_of[w])
    weights -= small  # shared with a convolution too small to gain: stays contiguous
    return with_slots(program, inputs, weights)


def with_slots(program: torch.export.ExportedProgram, inputs: list[str], weights) -> list[str]:
    """``weights`` (state entry names) and the optimizer slots of those parameters with the weight's
    shape (AdamW's moments: the update reads them with the weight), in input order."""
    from . import optim

    placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    shape = {name: tuple(p.meta["val"].shape) for p, name in zip(placeholders, inputs)}
    slots = [name for name in inputs if (optim.parse_state_name(name) or ("",))[0] == "slot"
             and optim.parse_state_name(name)[1] in weights
             and shape[name] == shape[optim.parse_state_name(name)[1]]]
    return [name for name in inputs if name in weights] + slots


def with_input_layout(program: torch.export.ExportedProgram, inputs: list[str], channels_last: set[str],
                      tap_major: set[str] = frozenset()):
    """A copy of ``program`` whose inputs named in ``channels_last`` are channels-last and those in
    ``tap_major`` (weights of convolutions rewritten into tap GEMMs, torch_ext/_conv_taps.py, and
    their slots) tap-major (same values, other strides; not both empty), and each input's strides. AOTInductor compiles for the strides of the program's
    placeholder values (their fake tensors, not the example inputs), so those and every value after
    them are recomputed: ATen's CPU convolution returns channels-last for a channels-last weight,
    and every later stride must say so.

    A convolution (and its backward) whose weight stays contiguous reads a contiguous copy of a
    channels-last input: ATen would otherwise run it channels-last (either operand decides), copying
    the weight and its gradient every call, which is what keeping that weight contiguous avoids.
    Inductor fuses the copy into the kernel that produces the input."""
    from torch._guards import detect_fake_mode
    from torch.export.experimental import _copy_graph_module_and_signature

    gm, sig = _copy_graph_module_and_signature(program)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([n.meta["val"] for n in placeholders])
    conv_args = {_aten.convolution.default: (0, 1), _aten.convolution_backward.default: (1, 2)}  # (input, weight)
    copies = {}
    with mode:
        for node, name in zip(placeholders, inputs):
            if name in channels_last:
                node.meta["val"] = _channels_last(node.meta["val"])
            elif name in tap_major:
                node.meta["val"] = _tap_major(node.meta["val"])
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in conv_args:
                xi, wi = conv_args[node.target]
                x, w = node.args[xi], node.args[wi]
                if (w.meta["val"].dim() == 4 and w.meta["val"].is_contiguous()
                        and not x.meta["val"].is_contiguous()):
                    if x not in copies:
                        with gm.graph.inserting_before(node):
                            copies[x] = gm.graph.call_function(_aten.clone.default, (x,),
                                                               {"memory_format": torch.contiguous_format})
                        copies[x].meta = {**x.meta, "val": x.meta["val"].contiguous()}
                    node.update_arg(xi, copies[x])
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)
    gm.recompile()
    out = program._update(gm, sig)
    args, kwargs = program.example_inputs
    args = tuple(_channels_last(a) if name in channels_last else _tap_major(a) if name in tap_major else a
                 for name, a in zip(inputs, args))
    out.example_inputs = (args, kwargs)
    return out, [list(n.meta["val"].stride()) for n in placeholders]


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    # empty_like's strides, not contiguous(memory_format=): a (16, 16, 1, 1) weight counts as
    # channels-last already with strides (16, 1, 1, 1), and the package's new value comes out
    # (16, 1, 16, 16); one spelling keeps the state in the compiled strides from call to call.
    return torch.empty_like(t, memory_format=torch.channels_last).copy_(t)


def _tap_major(t: torch.Tensor) -> torch.Tensor:
    from ._conv_taps import tap_major_strides

    return torch.empty_strided(t.shape, tap_major_strides(t.shape), dtype=t.dtype, device=t.device).copy_(t)
