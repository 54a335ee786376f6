"""Backward ops that torch 2.9's ONNX exporter has no translation for, written as ops it has (``to_onnx``).

torch has no decomposition of these either (``torch._decomp`` lists none), so a step whose model has a
convolution, a pooling layer or nearest upsampling could not be exported. Each form below is the op's
mathematical definition in ops the exporter translates (``aten.convolution`` forward or transposed, ``matmul``,
``scatter_add``, ``arange`` arithmetic), not its kernel: the values agree with the kernels to float32 rounding
(the order of the sums differs), which is what an ONNX step promises and what ``to_onnx`` checks against the
program after the export.

- ``convolution_backward``: the input gradient is the transposed convolution of the output gradient with the same
  weight (a regular convolution for a transposed layer); the weight gradient is a convolution of the input with the
  output gradient, the batch as channels, stride and dilation swapped, one group per group.
- ``_adaptive_avg_pool2d_backward``, ``avg_pool2d_backward``: separable: ``A_h^T @ grad @ A_w``, where ``A[o, i]``
  is 1 / (the window's size along that dim) for every input index ``i`` in output ``o``'s window (ATen's window
  bounds and divisors, with ``ceil_mode``, ``count_include_pad`` and ``divisor_override``).
- ``max_pool2d_with_indices_backward``: the output gradient scattered (added) to the indices the forward chose.
- upsampling (nearest, nearest-exact, linear, bilinear, trilinear, bicubic): separable like the average pools, with
  ATen's source indices and weights.
- the CPU attention kernel and its backward: from q, k, v and the mask, a fully masked row giving 0 as the kernel.
"""
from __future__ import annotations

import struct

import torch

aten = torch.ops.aten


def _like_layout(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` laid out in memory as ``ref`` (a dense permutation: a transposed query, a channels-last input), as the
    kernel's own result is: the program's later views were traced on that layout."""
    if t.is_contiguous() and ref.is_contiguous():
        return t
    order = sorted(range(ref.dim()), key=lambda d: (-ref.stride(d), -ref.shape[d]))
    inverse = [order.index(d) for d in range(ref.dim())]
    return t.permute(order).contiguous().permute(inverse)


def _spatial(values, nd: int) -> list[int]:
    values = [int(v) for v in values]
    return values * nd if len(values) == 1 else values


def _weight_grad(x: torch.Tensor, g: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],
                 dilation: list[int], groups: int) -> torch.Tensor:
    """d(conv(x, W))/dW contracted with g: W [C_g_out * groups, C_in / groups, *kernel] from x [N, C_in, *in] and
    g [N, C_out, *out]. A convolution whose batch is x's channels in a group, whose channels are the batch (one group
    per group), and whose weight is g: stride and dilation swap roles; the result covers at least ``kernel``."""
    nd = len(kernel)
    n, c_in = x.shape[0], x.shape[1]
    c_out = g.shape[1]
    cig, cog = c_in // groups, c_out // groups
    spatial = list(range(3, 3 + nd))
    inp = x.reshape(n, groups, cig, *x.shape[2:]).permute(2, 1, 0, *spatial).reshape(cig, groups * n, *x.shape[2:])
    w = g.reshape(n, groups, cog, *g.shape[2:]).permute(1, 2, 0, *spatial).reshape(groups * cog, n, *g.shape[2:])
    r = aten.convolution.default(inp, w, None, dilation, padding, stride, False, [0] * nd, groups)
    for d, k in enumerate(kernel):
        if r.shape[2 + d] != k:
            r = r.narrow(2 + d, 0, k)
    return r.transpose(0, 1).contiguous()


def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    nd = input.dim() - 2
    stride, padding, dilation = _spatial(stride, nd), _spatial(padding, nd), _spatial(dilation, nd)
    kernel = [int(k) for k in weight.shape[2:]]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, False,
                                                  [0] * nd, groups)
            for d in range(nd):  # an output_padding of at least the stride (allowed below the dilation) added a row
                if grad_input.shape[2 + d] != input.shape[2 + d]:
                    grad_input = grad_input.narrow(2 + d, 0, int(input.shape[2 + d]))
        else:
            # The transposed convolution's output size falls short of the input's by what the forward's floor
            # division dropped: that remainder is its output_padding.
            extra = [int(input.shape[2 + d]) - ((int(grad_output.shape[2 + d]) - 1) * stride[d] - 2 * padding[d]
                                                + dilation[d] * (kernel[d] - 1) + 1) for d in range(nd)]
            grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, True,
                                                  extra, groups)
    if output_mask[1]:
        # A transposed layer's weight gradient is the regular one with the input and the output gradient swapped.
        grad_weight = (_weight_grad(grad_output, input, kernel, stride, padding, dilation, groups) if transposed
                       else _weight_grad(input, grad_output, kernel, stride, padding, dilation, groups))
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    return (None if grad_input is None else _like_layout(grad_input, input),
            None if grad_weight is None else _like_layout(grad_weight, weight), grad_bias)


def _window_matrix(starts: torch.Tensor, ends: torch.Tensor, size: int, divisors: torch.Tensor | None,
                   dtype: torch.dtype, device) -> torch.Tensor:
    """[outputs, size]: 1 / divisor (or 1) where the input index lies in [start, end) of the output's window."""
    idx = torch.arange(size, device=device)
    inside = (idx[None, :] >= starts[:, None]) & (idx[None, :] < ends[:, None])
    if divisors is None:
        return inside.to(dtype)
    return inside.to(dtype) / divisors[:, None].to(dtype)


def _separable(grad: torch.Tensor, *mats: torch.Tensor) -> torch.Tensor:
    """grad [..., o_1, ..., o_k] -> [..., i_1, ..., i_k]: each trailing dim contracted with its [o_d, i_d] matrix
    (``a_h^T @ grad @ a_w`` in 2-D)."""
    k = len(mats)
    for d, a in enumerate(mats):
        dim = grad.dim() - k + d
        grad = torch.matmul(grad.movedim(dim, -1), a).movedim(-1, dim)
    return grad


def adaptive_avg_pool2d_backward(grad_output, self):
    mats = []
    for d in (-2, -1):
        out, size = int(grad_output.shape[d]), int(self.shape[d])
        # ATen's windows (AdaptiveAvgPoolKernel.cpp): [floor(o * size / out), ceil((o + 1) * size / out)), i.e. the i
        # with o * size < (i + 1) * out and i * out < (o + 1) * size: integer products, no division (an int64 floor
        # division becomes a CastLike that ONNX Runtime warns it cannot fold).
        o = torch.arange(out, device=self.device)[:, None]
        i = torch.arange(size, device=self.device)[None, :]
        inside = ((o * size < (i + 1) * out) & (i * out < (o + 1) * size)).to(grad_output.dtype)
        mats.append(inside / inside.sum(1, keepdim=True))
    return _separable(grad_output, *mats)


def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    kernel = _spatial(kernel_size, 2)
    stride = _spatial(stride, 2) if len(stride) else kernel
    padding = _spatial(padding, 2)
    mats = []
    for i, d in enumerate((-2, -1)):
        out, size = int(grad_output.shape[d]), int(self.shape[d])
        # ATen's window (aten/src/ATen/native/cpu/AvgPoolKernel.cpp): [o*s - p, min(o*s - p + k, size + p)),
        # its size before clipping to the input is the divisor with count_include_pad, after it without.
        start = torch.arange(out, device=self.device) * stride[i] - padding[i]
        end = torch.clamp(start + kernel[i], max=size + padding[i])
        padded = end - start
        start, end = torch.clamp(start, min=0), torch.clamp(end, max=size)
        divisors = None if divisor_override else (padded if count_include_pad else end - start)
        mats.append(_window_matrix(start, end, size, divisors, grad_output.dtype, self.device))
    grad = _separable(grad_output, *mats)
    return grad / divisor_override if divisor_override else grad


def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    lead = list(self.shape[:-2])
    plane = int(self.shape[-2]) * int(self.shape[-1])
    flat = grad_output.new_zeros(lead + [plane])
    return flat.scatter_add(-1, indices.flatten(-2), grad_output.flatten(-2)).reshape(self.shape)


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The type ATen's upsampling kernels compute source indices and weights in: double for double, else float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(out: int, size: int, align_corners: bool | None, scale, opmath: torch.dtype) -> float:
    """ATen's ``area_pixel_compute_scale`` (UpSample.h), rounded as its kernels hold it: (size - 1) / (out - 1)
    with align_corners, else 1 / scale when the caller gave one, else size / out."""
    if align_corners:
        value = (size - 1) / (out - 1) if out > 1 else 0.0
    else:
        value = 1.0 / scale if scale is not None and scale > 0 else size / out
    return _float32(value) if opmath == torch.float32 else value


def _one_hot(index: torch.Tensor, size: int, dtype) -> torch.Tensor:
    return (index[:, None] == torch.arange(size, device=index.device)[None, :]).to(dtype)


def _nearest_matrix(out: int, size: int, scale, exact: bool, dtype, device) -> torch.Tensor:
    """[out, size]: 1 at ATen's nearest source (``nearest_idx`` / ``nearest_exact_idx``): floor(o * scale), or
    floor((o + 0.5) * scale) for nearest-exact, in float32, at most size - 1; o // 2 when out is twice size."""
    o = torch.arange(out, device=device)
    if out == size and not exact:
        return _one_hot(o, size, dtype)
    opmath = _opmath(dtype)
    s = 0.5 if out == 2 * size and not exact else _scale(out, size, None, scale, opmath)
    real = (o.to(opmath) + 0.5) * s if exact else o.to(opmath) * s
    return _one_hot(torch.clamp(torch.floor(real).to(torch.int64), max=size - 1), size, dtype)


def _linear_matrix(out: int, size: int, align_corners: bool, scale, dtype, device) -> torch.Tensor:
    """[out, size]: ATen's linear interpolation weights (``compute_source_index_and_lambda``, float32): the source
    index real = s * o (align_corners) or max(s * (o + 0.5) - 0.5, 0); i0 = min(floor(real), size - 1), lambda =
    clamp(real - i0, 0, 1); weight 1 - lambda at i0 and lambda at i0 + 1 (i0 itself at the last row)."""
    o = torch.arange(out, device=device)
    if out == size:
        return _one_hot(o, size, dtype)
    opmath = _opmath(dtype)
    s = _scale(out, size, align_corners, scale, opmath)
    real = o.to(opmath) * s if align_corners else torch.clamp((o.to(opmath) + 0.5) * s - 0.5, min=0)
    i0 = torch.clamp(torch.floor(real).to(torch.int64), max=size - 1)
    lam1 = torch.clamp(real - i0.to(opmath), 0, 1)
    i1 = torch.clamp(i0 + 1, max=size - 1)
    return (_one_hot(i0, size, opmath) * (1 - lam1)[:, None] + _one_hot(i1, size, opmath) * lam1[:, None]).to(dtype)


def _cubic_matrix(out: int, size: int, align_corners: bool, scale, dtype, device) -> torch.Tensor:
    """[out, size]: ATen's bicubic weights (UpSample.h ``get_cubic_upsample_coefficients``, A = -0.75, float32) on
    the four taps floor(real) - 1 .. + 2, clamped into the input (``upsample_increment_value_bounded``); real = s * o
    or s * (o + 0.5) - 0.5, not clamped at 0."""
    opmath = _opmath(dtype)
    o = torch.arange(out, device=device).to(opmath)
    s = _scale(out, size, align_corners, scale, opmath)
    real = o * s if align_corners else (o + 0.5) * s - 0.5
    # guard_index_and_lambda: the tap base at most size - 1, t clamped into [0, 1]
    base = torch.clamp(torch.floor(real), max=size - 1)
    t = torch.clamp(real - base, 0, 1)
    a = -0.75
    x1, x2 = t, 1 - t
    w = [((a * (x1 + 1) - 5 * a) * (x1 + 1) + 8 * a) * (x1 + 1) - 4 * a,
         ((a + 2) * x1 - (a + 3)) * x1 * x1 + 1,
         ((a + 2) * x2 - (a + 3)) * x2 * x2 + 1,
         ((a * (x2 + 1) - 5 * a) * (x2 + 1) + 8 * a) * (x2 + 1) - 4 * a]
    base = base.to(torch.int64)
    m = sum(_one_hot(torch.clamp(base - 1 + k, 0, size - 1), size, opmath) * w[k][:, None] for k in range(4))
    return m.to(dtype)


def _upsample_backward(kind: str, grad_output, output_size, input_size, align_corners=None, scales=()):
    """The backward of upsampling over the trailing len(output_size) dims: separable, one matrix per dim."""
    nd = len(output_size)
    scales = list(scales) + [None] * (nd - len(scales))
    mats = []
    for d in range(nd):
        out, size = int(output_size[d]), int(input_size[2 + d])
        if kind in ("nearest", "nearest_exact"):
            mats.append(_nearest_matrix(out, size, scales[d], kind == "nearest_exact", grad_output.dtype,
                                        grad_output.device))
        elif kind == "linear":
            mats.append(_linear_matrix(out, size, align_corners, scales[d], grad_output.dtype, grad_output.device))
        else:
            mats.append(_cubic_matrix(out, size, align_corners, scales[d], grad_output.dtype, grad_output.device))
    return _separable(grad_output, *mats)


def _nearest(exact: bool):
    def backward(grad_output, output_size, input_size, *scales):
        return _upsample_backward("nearest_exact" if exact else "nearest", grad_output, output_size, input_size,
                                  scales=scales)
    return backward


def _interpolating(kind: str):
    def backward(grad_output, output_size, input_size, align_corners, *scales):
        return _upsample_backward(kind, grad_output, output_size, input_size, align_corners, scales)
    return backward


def _attention_probabilities(query, key, is_causal, attn_mask, scale):
    """(probabilities, logsumexp, scale, groups, repeated key) as the CPU flash kernel computes them: a query row
    whose keys are all masked attends to nothing (probabilities 0, output 0, logsumexp 0), where a plain softmax
    (the exporter's translation of the forward) gives NaN: Hugging Face's left padding makes such rows."""
    scale = (1.0 / float(query.shape[-1]) ** 0.5) if scale is None else float(scale)
    groups = int(query.shape[-3]) // int(key.shape[-3])
    k = key.repeat_interleave(groups, -3) if groups > 1 else key
    scores = torch.matmul(query, k.transpose(-2, -1)) * scale
    rows, cols = int(query.shape[-2]), int(key.shape[-2])
    if is_causal:
        keep = torch.ones(rows, cols, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    e = torch.exp(scores - top)
    total = e.sum(-1, keepdim=True)
    empty = total == 0
    probs = e / torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.zeros_like(total), torch.log(total) + top).squeeze(-1)
    return probs, lse, scale, groups, k


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """[batch, heads, seq, dim] laid out [batch, seq, heads, dim], as the CPU flash kernel returns every gradient
    whatever its inputs' layout (its output follows the query's): the program's later views were traced on that."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _no_attention_dropout(dropout_p) -> None:
    if dropout_p:
        raise NotImplementedError(f"to_onnx: attention with dropout_p={dropout_p} draws its mask from an RNG state "
                                  "ONNX cannot carry; train with attention dropout 0 to export")


def sdpa_flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu`` from its definition (the exporter's own translation gives NaN
    for a fully masked row and zeros for the logsumexp)."""
    _no_attention_dropout(dropout_p)
    probs, lse, _, groups, _ = _attention_probabilities(query, key, is_causal, attn_mask, scale)
    v = value.repeat_interleave(groups, -3) if groups > 1 else value
    return _like_layout(torch.matmul(probs, v), query), lse


def sdpa_flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None,
                            scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu_backward`` from its definition: the probabilities recomputed
    from q, k and the mask, then dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K * scale,
    dK = dS^T Q * scale. Key/value heads fewer than the query's (grouped-query attention) are repeated and their
    gradients summed back."""
    _no_attention_dropout(dropout_p)
    probs, _, scale, groups, k = _attention_probabilities(query, key, is_causal, attn_mask, scale)
    v = value.repeat_interleave(groups, -3) if groups > 1 else value
    grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
    grad_probs = torch.matmul(grad_out, v.transpose(-2, -1))
    grad_scores = probs * (grad_probs - (grad_out * out).sum(-1, keepdim=True))
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), query) * scale
    if groups > 1:
        grad_k = grad_k.unflatten(-3, (int(key.shape[-3]), groups)).sum(-2)
        grad_v = grad_v.unflatten(-3, (int(key.shape[-3]), groups)).sum(-2)
    return _bshd(grad_q), _bshd(grad_k), _bshd(grad_v)


def decompositions() -> dict:
    """{OpOverload: its form here}, for ``ExportedProgram.run_decompositions`` before the ONNX export."""
    table = {
        aten.convolution_backward.default: convolution_backward,
        aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
        aten.avg_pool2d_backward.default: avg_pool2d_backward,
        aten.max_pool2d_with_indices_backward.default: max_pool2d_with_indices_backward,
    }
    for nd, linear in ((1, "upsample_linear1d_backward"), (2, "upsample_bilinear2d_backward"),
                       (3, "upsample_trilinear3d_backward")):
        table[getattr(aten, f"upsample_nearest{nd}d_backward").default] = _nearest(exact=False)
        table[getattr(aten, f"_upsample_nearest_exact{nd}d_backward").default] = _nearest(exact=True)
        table[getattr(aten, linear).default] = _interpolating("linear")
    table[aten.upsample_bicubic2d_backward.default] = _interpolating("cubic")
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = sdpa_flash_cpu
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = sdpa_flash_cpu_backward
    return table
