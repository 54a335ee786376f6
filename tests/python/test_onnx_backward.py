"""The backward ops to_onnx writes out for torch's ONNX exporter (torch_ext/_onnx_backward.py) against ATen's kernels,
in float64 (so a wrong window, stride or group shows as an O(1) difference, rounding as 1e-15): convolutions regular
and transposed in 1-D to 3-D over strides, paddings, dilations, groups and output paddings; average, max and
adaptive average pooling; nearest, nearest-exact, linear, bilinear, trilinear and bicubic upsampling; the CPU
attention kernel and its backward."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from torch_ext import _onnx_backward as ob

aten = torch.ops.aten


def _close(got, want, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = float((got - want).abs().max() / (want.abs().max() + 1e-300))
    assert err < 1e-12, (what, err)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_backward_equals_atens(nd, transposed):
    torch.manual_seed(0)
    seen = 0
    for groups, stride, padding, dilation in [(1, 1, 0, 1), (2, 2, 1, 1), (4, 1, 2, 2), (1, 3, 1, 2), (2, 2, 0, 3)]:
        for output_padding in ([0, 1, 2] if transposed else [0]):
            if output_padding >= max(stride, dilation):
                continue
            c_in, c_out, k, size = 4, 8, 3, (9 if nd < 3 else 7)
            x = torch.randn(3, c_in, *[size] * nd, dtype=torch.float64)
            wshape = (c_in, c_out // groups) if transposed else (c_out, c_in // groups)
            w = torch.randn(*wshape, *[k] * nd, dtype=torch.float64)
            args = ([stride] * nd, [padding] * nd, [dilation] * nd, transposed, [output_padding] * nd, groups)
            y = aten.convolution(x, w, torch.randn(c_out, dtype=torch.float64), *args)
            gy = torch.randn_like(y)
            for mask in ([True, True, True], [True, False, False], [False, True, True]):
                want = aten.convolution_backward(gy, x, w, [c_out], *args, mask)
                got = ob.convolution_backward(gy, x, w, [c_out], *args, mask)
                for g, wv, on, name in zip(got, want, mask, ("input", "weight", "bias")):
                    if on:
                        _close(g, wv, (groups, stride, padding, dilation, output_padding, name))
                    else:
                        assert g is None
            seen += 1
    assert seen >= 5


def test_depthwise_convolution_backward_with_per_dim_options_equals_atens():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 10, 11, dtype=torch.float64)
    w = torch.randn(12, 1, 3, 2, dtype=torch.float64)  # depthwise, channel multiplier 2
    args = ([2, 1], [1, 0], [1, 2], False, [0, 0], 6)
    gy = torch.randn_like(aten.convolution(x, w, None, *args))
    want = aten.convolution_backward(gy, x, w, None, *args, [True, True, False])
    got = ob.convolution_backward(gy, x, w, None, *args, [True, True, False])
    _close(got[0], want[0], "input")
    _close(got[1], want[1], "weight")
    assert got[2] is None


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [False, True])
def test_pooling_backward_equals_atens(ceil_mode, count_include_pad):
    torch.manual_seed(0)
    for h, w, k, s, p, divisor in itertools.product([7, 8], [5, 9], [2, 3], [1, 2, None], [0, 1], [None, 3]):
        if p > k // 2:
            continue
        x = torch.randn(2, 3, h, w, dtype=torch.float64, requires_grad=True)
        y = F.avg_pool2d(x, k, s, p, ceil_mode, count_include_pad, divisor)
        gy = torch.randn_like(y)
        want, = torch.autograd.grad(y, x, gy)
        got = ob.avg_pool2d_backward(gy, x.detach(), [k, k], [] if s is None else [s, s], [p, p], ceil_mode,
                                     count_include_pad, divisor)
        _close(got, want, ("avg", h, w, k, s, p, divisor))
        y, indices = F.max_pool2d(x, k, s, p, 1, ceil_mode, return_indices=True)
        gy = torch.randn_like(y)
        want, = torch.autograd.grad(y, x, gy)
        got = ob.max_pool2d_with_indices_backward(gy, x.detach(), [k, k], [s or k] * 2, [p, p], [1, 1], ceil_mode,
                                                  indices)
        _close(got, want, ("max", h, w, k, s, p))


@pytest.mark.parametrize("h,w,oh,ow", [(7, 9, 3, 4), (8, 8, 8, 8), (5, 7, 1, 1), (6, 10, 4, 3), (3, 3, 5, 7)])
@pytest.mark.parametrize("batched", [True, False])
def test_adaptive_average_pooling_backward_equals_atens(h, w, oh, ow, batched):
    torch.manual_seed(0)
    x = torch.randn(*([2] if batched else []), 3, h, w, dtype=torch.float64, requires_grad=True)
    y = F.adaptive_avg_pool2d(x, (oh, ow))
    gy = torch.randn_like(y)
    want, = torch.autograd.grad(y, x, gy)
    _close(ob.adaptive_avg_pool2d_backward(gy, x.detach()), want, (h, w, oh, ow))


_UPSAMPLE_OPS = {"nearest": "upsample_nearest{nd}d_backward", "nearest-exact": "_upsample_nearest_exact{nd}d_backward",
                 "linear": "upsample_linear1d_backward", "bilinear": "upsample_bilinear2d_backward",
                 "trilinear": "upsample_trilinear3d_backward", "bicubic": "upsample_bicubic2d_backward"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sizes,kw", [((5, 7), dict(scale_factor=2)), ((5, 7), dict(scale_factor=1.7)),
                                      ((6, 4), dict(size=(4, 3))), ((4, 4), dict(size=(9, 13))),
                                      ((8, 8), dict(scale_factor=0.5)), ((3, 5), dict(scale_factor=3)),
                                      ((7, 6), dict(size=(7, 6))), ((1, 5), dict(size=(4, 1)))])
def test_upsampling_backward_equals_atens(dtype, sizes, kw):
    # Source indices and weights are computed in ATen's opmath type (float for float32), so float64 shows any
    # misplaced tap or weight as O(1) and float32 matches to rounding.
    torch.manual_seed(0)
    table = ob.decompositions()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for nd in (1, 2, 3):
        shape = {1: sizes[:1], 2: sizes, 3: (sizes[0], sizes[1], sizes[0])}[nd]
        kwd = {k: (tuple((v * 2)[:nd]) if isinstance(v, tuple) else v) for k, v in kw.items()}
        modes = ["nearest", "nearest-exact"] + {1: ["linear"], 2: ["bilinear", "bicubic"], 3: ["trilinear"]}[nd]
        for mode in modes:
            for align_corners in ((None,) if mode.startswith("nearest") else (False, True)):
                x = torch.randn(2, 3, *shape, dtype=dtype, requires_grad=True)
                extra = {} if align_corners is None else dict(align_corners=align_corners)
                y = F.interpolate(x, mode=mode, **kwd, **extra)
                gy = torch.randn_like(y)
                want, = torch.autograd.grad(y, x, gy)
                scale = kwd.get("scale_factor")
                op = getattr(aten, _UPSAMPLE_OPS[mode].format(nd=nd)).default
                args = (gy, list(y.shape[2:]), list(x.shape), *([align_corners] if align_corners is not None else []),
                        *[scale] * nd)
                got = table[op](*args)
                assert got.shape == want.shape
                err = float((got - want).abs().max() / want.abs().max())
                assert err < tol, (mode, nd, kwd, align_corners, err)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("is_causal,mask,rows,cols", [(False, None, 6, 6), (True, None, 6, 6), (False, "float", 5, 7),
                                                      (False, "padded", 6, 6), (True, None, 5, 7)])
def test_cpu_attention_and_its_backward_equal_the_kernels(layout, is_causal, mask, rows, cols):
    # Values, logsumexp and the layout of every result (the program's views were traced on the kernel's): a fully
    # masked query row (left padding) gives 0 as the kernel does, where a plain softmax gives NaN.
    torch.manual_seed(0)

    def make(n):
        if layout == "contiguous":
            return torch.randn(2, 3, n, 8, dtype=torch.float64)
        if layout == "transposed":
            return torch.randn(2, n, 3, 8, dtype=torch.float64).transpose(1, 2)
        return torch.randn(2, n, 3, 24, dtype=torch.float64)[..., 8:16].transpose(1, 2)

    q, k, v = make(rows), make(cols), make(cols)
    attn_mask = None
    if mask == "float":
        attn_mask = torch.randn(2, 1, rows, cols, dtype=torch.float64)
    elif mask == "padded":
        attn_mask = torch.zeros(2, 1, rows, cols, dtype=torch.float64)
        attn_mask[1, 0, :, :2] = float("-inf")
        attn_mask[1, 0, :2, :] = float("-inf")
    for scale in (None, 0.3):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask,
                                                                    scale=scale)
        got_out, got_lse = ob.sdpa_flash_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
        assert got_out.stride() == out.stride()
        _close(got_out, out, "out")
        _close(got_lse, lse, "logsumexp")
        grad_out = torch.randn_like(out)
        want = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, is_causal,
                                                                         attn_mask=attn_mask, scale=scale)
        got = ob.sdpa_flash_cpu_backward(grad_out, q, k, v, out, lse * 0, 0.0, is_causal, attn_mask=attn_mask,
                                         scale=scale)  # (the exporter's forward gave zeros for the logsumexp)
        for g, w, name in zip(got, want, "qkv"):
            assert g.stride() == w.stride(), name
            _close(g, w, name)


def test_attention_dropout_is_refused_by_name():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        ob.sdpa_flash_cpu(q, q, q, 0.1)


def test_every_form_is_in_the_table_to_onnx_uses():
    table = ob.decompositions()
    upsampling = {getattr(aten, op.format(nd=nd)).default for op in _UPSAMPLE_OPS.values() for nd in (1, 2, 3)
                  if hasattr(aten, op.format(nd=nd))}
    assert set(table) == {aten.convolution_backward.default, aten._adaptive_avg_pool2d_backward.default,
                          aten.avg_pool2d_backward.default, aten.max_pool2d_with_indices_backward.default,
                          aten._scaled_dot_product_flash_attention_for_cpu.default,
                          aten._scaled_dot_product_flash_attention_for_cpu_backward.default} | upsampling
    assert len(upsampling) == 10
