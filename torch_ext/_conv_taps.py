"""to_aoti's rewrite of convolutions smaller than their kernel into one GEMM per kernel tap.

Rule: a 2-D convolution (groups 1, not transposed, no bias) whose input has fewer positions than
its kernel has taps (H_in * W_in < kh * kw) is rewritten, with its convolution_backward. oneDNN
multiplies the padding too: on ResNet-18's last stage (2x2 input, 3x3 pad 1) 5/9 of its taps read
zeros, and a 512->512 convolution there takes ~8.7 ms forward + backward in the package (batch 16,
one thread). Each tap (a, b) instead connects a rectangle of output positions to a (strided)
rectangle of input positions, so with ``rows(t)`` those positions as (positions * batch, channels):

    y[out rect of t]   += rows_x(t) @ W[:, :, a, b].T          (forward)
    gx[in rect of t]   += rows_gy(t) @ W[:, :, a, b]           (grad input, only if asked)
    gW[:, :, a, b]      = rows_gy(t).T @ rows_x(t)             (grad weight, only if asked)

which multiplies no padding (ResNet-18's 2x2 case: 16 of 36 tap-position pairs). The taps' slices,
sums and the weight's tap-major copy are pointwise ATen ops that Inductor fuses; the GEMMs are its
extern mm. The values equal the convolution's up to float32 summation order.
"""
from __future__ import annotations

import operator

import torch

_aten = torch.ops.aten


def eligible(x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding, groups) -> bool:
    """Whether a convolution with these arguments is rewritten (the rule in the module docstring)."""
    if transposed or groups != 1 or bias is not None or len(x_shape) != 4 or len(w_shape) != 4:
        return False
    if any(o != 0 for o in output_padding):
        return False
    return x_shape[2] * x_shape[3] < w_shape[2] * w_shape[3]


def _tap_span(n_in, n_out, k, stride, pad, dil):
    # Output range [o0, o1) that kernel offset k reads inside the input, and the input start.
    o0 = next((o for o in range(n_out) if 0 <= o * stride - pad + k * dil < n_in), None)
    if o0 is None:
        return None
    o1 = max(o for o in range(n_out) if 0 <= o * stride - pad + k * dil < n_in) + 1
    return o0, o1, o0 * stride - pad + k * dil


class _Builder:
    def __init__(self, graph, x, w, stride, padding, dilation):
        from torch._guards import detect_fake_mode

        self.g = graph
        self.mode = detect_fake_mode([x.meta["val"], w.meta["val"]])
        self.x, self.w = x, w
        xs, ws = x.meta["val"].shape, w.meta["val"].shape
        self.B, self.C, self.H, self.W = xs
        self.O, _, self.kh, self.kw = ws
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.Ho = (self.H + 2 * padding[0] - dilation[0] * (self.kh - 1) - 1) // stride[0] + 1
        self.Wo = (self.W + 2 * padding[1] - dilation[1] * (self.kw - 1) - 1) // stride[1] + 1
        self.taps = []  # (a, b, (i0, i1, r0), (j0, j1, c0)) for the taps that read the input
        for a in range(self.kh):
            rs = _tap_span(self.H, self.Ho, a, stride[0], padding[0], dilation[0])
            for b in range(self.kw):
                cs = _tap_span(self.W, self.Wo, b, stride[1], padding[1], dilation[1])
                if rs is not None and cs is not None:
                    self.taps.append((a, b, rs, cs))

    def f(self, op, *args, **kwargs):
        # each new node with its fake value (export's verifier and Inductor read them)
        n = self.g.call_function(op, args, kwargs)
        vargs, vkwargs = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with self.mode:
            n.meta["val"] = op(*vargs, **vkwargs)
        return n

    def contiguous(self, n):
        return self.f(_aten.clone.default, n, memory_format=torch.contiguous_format)

    def rect(self, n, hw_rows, hw_cols, step):
        # n[:, :, rows, cols] as (rows * cols * B, channels)
        (r0, nr), (c0, nc) = hw_rows, hw_cols
        s = self.f(_aten.slice.Tensor, n, 2, r0, r0 + (nr - 1) * step[0] + 1, step[0])
        s = self.f(_aten.slice.Tensor, s, 3, c0, c0 + (nc - 1) * step[1] + 1, step[1])
        s = self.contiguous(self.f(_aten.permute.default, s, [2, 3, 0, 1]))
        return self.f(_aten.view.default, s, [nr * nc * self.B, -1])

    def place(self, m, nr, nc, rows, cols, full_h, full_w, step):
        # m (nr * nc * B, X) into zeros (full_h, full_w, B, X) at rows r0::step[0], cols c0::step[1]
        (r0, s0), (c0, s1) = (rows, step[0]), (cols, step[1])
        X = m.meta["val"].shape[1]
        m = self.f(_aten.view.default, m, [nr, nc, self.B, X])
        wide = self.f(_aten.new_zeros.default, m, [nr, full_w, self.B, X])
        wide = self.f(_aten.slice_scatter.default, wide, m, 1, c0, c0 + (nc - 1) * s1 + 1, s1)
        full = self.f(_aten.new_zeros.default, m, [full_h, full_w, self.B, X])
        return self.f(_aten.slice_scatter.default, full, wide, 0, r0, r0 + (nr - 1) * s0 + 1, s0)

    def tap_weight(self, a, b):
        # W[:, :, a, b] as an (O, C) view: a unit-stride GEMM operand when the package holds W
        # tap-major (tap_major_strides), copied by Inductor otherwise
        return self.f(_aten.select.int, self.f(_aten.select.int, self.w, 2, a), 2, b)

    def x_rows(self, t):
        _, _, (i0, i1, r0), (j0, j1, c0) = t
        return self.rect(self.x, (r0, i1 - i0), (c0, j1 - j0), self.stride)

    def gy_rows(self, gy, t):
        _, _, (i0, i1, _), (j0, j1, _) = t
        return self.rect(gy, (i0, i1 - i0), (j0, j1 - j0), (1, 1))

    def sum_to_nchw(self, parts, shape_last):
        total = parts[0]
        for p in parts[1:]:
            total = self.f(_aten.add.Tensor, total, p)
        return self.contiguous(self.f(_aten.permute.default, total, shape_last))

    def forward(self):
        parts = []
        for t in self.taps:
            a, b, (i0, i1, r0), (j0, j1, c0) = t
            w_ab = self.tap_weight(a, b)
            z = self.f(_aten.mm.default, self.x_rows(t), self.f(_aten.t.default, w_ab))
            parts.append(self.place(z, i1 - i0, j1 - j0, i0, j0, self.Ho, self.Wo, (1, 1)))
        if not parts:
            return self.f(_aten.new_zeros.default, self.x, [self.B, self.O, self.Ho, self.Wo])
        return self.sum_to_nchw(parts, [2, 3, 0, 1])

    def grad_input(self, gy):
        parts = []
        for t in self.taps:
            a, b, (i0, i1, r0), (j0, j1, c0) = t
            w_ab = self.tap_weight(a, b)
            z = self.f(_aten.mm.default, self.gy_rows(gy, t), w_ab)
            parts.append(self.place(z, i1 - i0, j1 - j0, r0, c0, self.H, self.W, self.stride))
        if not parts:
            return self.f(_aten.new_zeros.default, self.x, [self.B, self.C, self.H, self.W])
        return self.sum_to_nchw(parts, [2, 3, 0, 1])

    def grad_weight(self, gy):
        by_tap = {(t[0], t[1]): t for t in self.taps}
        pieces = []
        for a in range(self.kh):
            for b in range(self.kw):
                t = by_tap.get((a, b))
                if t is None:  # a tap that only ever reads padding
                    pieces.append(self.f(_aten.new_zeros.default, self.w, [self.O, self.C]))
                else:
                    pieces.append(self.f(_aten.mm.default, self.f(_aten.t.default, self.gy_rows(gy, t)),
                                         self.x_rows(t)))
        stacked = self.f(_aten.stack.default, pieces)
        stacked = self.f(_aten.view.default, stacked, [self.kh, self.kw, self.O, self.C])
        # tap-major strides, as the package holds W: the optimizer update reads both alike
        return self.f(_aten.permute.default, stacked, [2, 3, 0, 1])


def conv_to_tap_gemms(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Rewrites (in place) every convolution of ``gm`` that ``eligible`` accepts, and every
    convolution_backward with eligible arguments, into tap GEMMs. Returns the rewritten nodes'
    weights (one entry per rewritten node); empty when nothing matched."""
    graph, weights = gm.graph, []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _aten.convolution.default:
            x, w, bias, stride, padding, dilation, transposed, out_pad, groups = node.args
            gy = mask = None
        elif node.target is _aten.convolution_backward.default:
            gy, x, w, bias_sizes, stride, padding, dilation, transposed, out_pad, groups, mask = node.args
            bias = None if not mask[2] else bias_sizes
        else:
            continue
        if not all(isinstance(n, torch.fx.Node) and "val" in n.meta for n in (x, w)):
            continue
        xv, wv = x.meta["val"], w.meta["val"]
        if (xv.dtype not in (torch.float32, torch.float64) or wv.dtype != xv.dtype
                or not eligible(xv.shape, wv.shape, bias, stride, padding, dilation, transposed, out_pad, groups)):
            continue
        if gy is not None and any(u.target is not operator.getitem or (not mask[u.args[1]] and u.users)
                                  for u in node.users):
            continue
        with graph.inserting_before(node):
            bld = _Builder(graph, x, w, list(stride), list(padding), list(dilation))
            if gy is None:
                node.replace_all_uses_with(bld.forward())
            else:
                outs = {}
                if mask[0]:
                    outs[0] = bld.grad_input(gy)
                if mask[1]:
                    outs[1] = bld.grad_weight(gy)
                for u in list(node.users):
                    if u.args[1] in outs:  # (export reads the unused bias gradient too)
                        u.replace_all_uses_with(outs[u.args[1]])
                    graph.erase_node(u)
        graph.erase_node(node)
        weights.append(w)
    if weights:
        graph.lint()
        gm.recompile()
    return weights


def tap_major_strides(shape) -> list[int]:
    """Strides of an (O, C, kh, kw) weight held tap by tap: W[:, :, a, b] is one contiguous (O, C) block."""
    o, c, kh, kw = shape
    return [c, 1, kw * o * c, o * c]


def conv_to_tap_gemms_program(ep: torch.export.ExportedProgram, inputs: list[str]):
    """A copy of ``ep`` (its flat input names ``inputs``) with conv_to_tap_gemms applied, or ``ep``
    itself when nothing matches, and the 4-D inputs read only as rewritten convolutions' weights:
    the entries to hold tap-major."""
    from torch.export.experimental import _copy_graph_module_and_signature

    gm, sig = _copy_graph_module_and_signature(ep)
    weights = set(conv_to_tap_gemms(gm))
    if not weights:
        return ep, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    conv_ops = {_aten.convolution.default, _aten.convolution_backward.default}
    still_conv = {a for n in gm.graph.nodes if n.op == "call_function" and n.target in conv_ops
                  for a in n.args if isinstance(a, torch.fx.Node)}  # shared with a convolution left as it is
    chosen = [name for p, name in zip(placeholders, inputs) if p in weights and p not in still_conv]
    return ep._update(gm, sig), chosen
