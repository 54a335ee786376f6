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
- ``upsample_nearest2d_backward``: separable like the average pools, with ATen's nearest source index.
"""
from __future__ import annotations

import struct

import torch

aten = torch.ops.aten


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
    return grad_input, grad_weight, grad_bias


def _window_matrix(starts: torch.Tensor, ends: torch.Tensor, size: int, divisors: torch.Tensor | None,
                   dtype: torch.dtype, device) -> torch.Tensor:
    """[outputs, size]: 1 / divisor (or 1) where the input index lies in [start, end) of the output's window."""
    idx = torch.arange(size, device=device)
    inside = (idx[None, :] >= starts[:, None]) & (idx[None, :] < ends[:, None])
    if divisors is None:
        return inside.to(dtype)
    return inside.to(dtype) / divisors[:, None].to(dtype)


def _separable(grad: torch.Tensor, a_h: torch.Tensor, a_w: torch.Tensor) -> torch.Tensor:
    """grad [..., oh, ow] -> [..., H, W]: a_h^T @ grad @ a_w."""
    return torch.matmul(torch.matmul(a_h.transpose(0, 1), grad), a_w)


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


def _nearest_sources(out: int, size: int, scale) -> torch.Tensor:
    """ATen's nearest source index (UpSample.h ``nearest_idx``): the float scale size / out (or 1 / scale when
    given), floor(o * scale) in float32, at most size - 1."""
    o = torch.arange(out)
    if out == size:
        return o
    if out == 2 * size:
        return torch.div(o, 2, rounding_mode="floor")
    s = float(1.0 / scale) if scale is not None and scale > 0 else size / out
    s = struct.unpack("f", struct.pack("f", s))[0]  # ATen's scale is a float: this product rounds as its does
    return torch.clamp(torch.floor(o.to(torch.float32) * s).to(torch.int64), max=size - 1)


def upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    mats = []
    for d, scale in ((-2, scales_h), (-1, scales_w)):
        out, size = int(output_size[d]), int(input_size[d])
        src = _nearest_sources(out, size, scale).to(grad_output.device)
        mats.append((src[:, None] == torch.arange(size, device=grad_output.device)[None, :]).to(grad_output.dtype))
    return _separable(grad_output, *mats)


def decompositions() -> dict:
    """{OpOverload: its form here}, for ``ExportedProgram.run_decompositions`` before the ONNX export."""
    table = {
        aten.convolution_backward.default: convolution_backward,
        aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
        aten.avg_pool2d_backward.default: avg_pool2d_backward,
        aten.max_pool2d_with_indices_backward.default: max_pool2d_with_indices_backward,
        aten.upsample_nearest2d_backward.default: upsample_nearest2d_backward,
    }
    return table
