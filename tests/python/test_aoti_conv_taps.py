"""to_aoti's tap-GEMM rewrite of convolutions smaller than their kernel (torch_ext/_conv_taps.py):
the rule, the values against ATen's convolution and its backward, and what is left alone."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import torch_ext
from torch_ext._conv_taps import conv_to_tap_gemms, eligible, tap_major_strides

CONV_OPS = {"aten.convolution.default", "aten.convolution_backward.default"}


def targets(graph):
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def joint(x, w, bias=None, mask_x=True, **kw):
    # loss and the gradients of a convolution, as export's joint graph writes them
    def f(x, w, gy, *bias):
        x = x.detach().requires_grad_(mask_x)
        w = w.detach().requires_grad_(True)
        bias = [b.detach().requires_grad_(True) for b in bias]
        y = F.conv2d(x, w, *bias, **kw)
        grads = torch.autograd.grad(y, ([x, w] if mask_x else [w]) + bias, gy)
        return (y, *grads)

    gy = torch.randn_like(F.conv2d(x, w, bias, **kw))
    args = (x, w, gy) + (() if bias is None else (bias,))
    return make_fx(f, tracing_mode="fake")(*args), args


@pytest.mark.parametrize("hw,k,kw", [
    ((2, 2), 3, dict(padding=1)),                           # ResNet-18's last stage
    ((1, 1), 3, dict(padding=1)),                           # only the centre tap reads the input
    ((2, 3), 3, dict(padding=1, stride=2)),
    ((3, 2), (3, 5), dict(padding=(1, 4), dilation=(1, 2))),
    ((1, 3), 3, dict(padding=(1, 0))),                      # no padding in width: 1x1 output
    ((1, 3), 3, dict(padding=(1, 1), stride=(1, 2))),
])
@pytest.mark.parametrize("mask_x", [True, False])
def test_rewrite_matches_aten(hw, k, kw, mask_x):
    g = torch.Generator().manual_seed(0)
    kh, kw_ = (k, k) if isinstance(k, int) else k
    x = torch.randn(3, 5, *hw, generator=g)
    w = torch.randn(7, 5, kh, kw_, generator=g)
    gm, args = joint(x, w, mask_x=mask_x, **kw)
    want = gm(*args)
    assert CONV_OPS <= set(targets(gm.graph))
    assert len(conv_to_tap_gemms(gm)) == 2
    assert not CONV_OPS & set(targets(gm.graph)), targets(gm.graph)
    assert "aten.mm.default" in targets(gm.graph)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    got = gm(*args)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        # the weight gradient (last) comes tap-major, as to_aoti holds the weight
        want_stride = tuple(tap_major_strides(w.shape)) if a is got[-1] else b.stride()
        assert a.shape == b.shape and a.stride() == want_stride
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["positions_equal_taps", "bias", "groups", "transposed"])
def test_left_alone(case):
    x, w = torch.randn(2, 4, 3, 3), torch.randn(6, 4, 3, 3)
    if case == "positions_equal_taps":       # 9 positions, 9 taps: oneDNN's convolution stays
        gm, args = joint(x, w, padding=1)
    elif case == "bias":
        gm, args = joint(torch.randn(2, 4, 2, 2), w, bias=torch.randn(6), padding=1)
    elif case == "groups":
        gm, args = joint(torch.randn(2, 4, 2, 2), torch.randn(6, 2, 3, 3), padding=1, groups=2)
    else:
        def f(x, w):
            return F.conv_transpose2d(x, w, padding=1)
        x, w = torch.randn(2, 4, 2, 2), torch.randn(4, 6, 3, 3)
        gm, args = make_fx(f, tracing_mode="fake")(x, w), (x, w)
    before = gm.code
    assert conv_to_tap_gemms(gm) == []
    assert gm.code == before
    gm(*args)


def test_rule():
    assert eligible((16, 512, 2, 2), (512, 512, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert not eligible((16, 256, 4, 4), (256, 256, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert not eligible((16, 512, 2, 2), (512, 512, 1, 1), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


class TinyStage(nn.Module):
    # c1 on 8x8 (64 positions >= 9 taps: oneDNN), c2 on 2x2 (4 < 9: tap GEMMs), c3 on 2x2 with a
    # bias (left alone by the rule)
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.c1(x)), 4)
        h = self.c3(torch.relu(self.c2(h)))
        return self.head(h.mean((2, 3)))


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def run(fn, state, bs):
    losses = []
    for x, y in bs:
        loss, state = fn(state, x, y)[:2]
        losses.append(loss.reshape(1))
    return torch.cat(losses), state


def test_package_rewrites_only_the_small_convolution_and_trains_as_the_executor(tmp_path):
    from torch_ext._aoti import aoti_decompositions
    from torch_ext._conv_taps import conv_to_tap_gemms_program
    from torch_ext.deploy import LAYOUT_KEY

    torch.manual_seed(0)
    model = TinyStage()
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(4)]
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ce, bs[0])
    inputs = json.loads(step.program.graph_module.meta["custom"][LAYOUT_KEY])["inputs"]
    program = step.program.run_decompositions(aoti_decompositions())
    rewritten, chosen = conv_to_tap_gemms_program(program, inputs)
    assert chosen == ["model.c2.weight"]
    name_of = dict(zip([n for n in rewritten.graph_module.graph.nodes if n.op == "placeholder"], inputs))
    convs = [n for n in rewritten.graph_module.graph.nodes if str(n.target) in CONV_OPS]
    read = {name_of.get(n.args[1] if str(n.target) == "aten.convolution.default" else n.args[2]) for n in convs}
    assert read == {"model.c1.weight", "model.c3.weight"} and len(convs) == 4  # forward + backward each
    flat = step.flat_inputs(step.init_state(), *bs[0])
    for a, b in zip(rewritten.module()(*flat), program.module()(*flat)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    want_losses, want = run(step, step.init_state(), bs)
    taps = torch_ext.load_step(step.to_aoti(str(tmp_path / "taps.pt2")))
    strides = dict(zip(taps.layout["inputs"], map(tuple, taps.layout["input_strides"])))
    tap_major = ["model.c2.weight", "opt:model.c2.weight:exp_avg", "opt:model.c2.weight:exp_avg_sq"]
    for name in tap_major:
        assert strides[name] == tuple(tap_major_strides((8, 8, 3, 3))), name
    assert strides["model.c3.weight"] == (72, 9, 3, 1)
    got_losses, got = run(taps, step.init_state(), bs)
    assert taps.converted_entries == len(tap_major) + 3  # + c1 and its moments, channels-last
    plain = torch_ext.load_step(step.to_aoti(str(tmp_path / "plain.pt2"), conv_taps=False))
    assert strides["model.c2.weight"] != tuple(plain.layout["input_strides"][inputs.index("model.c2.weight")])
    plain_losses, plain_state = run(plain, step.init_state(), bs)
    donating = torch_ext.load_step(step.to_aoti(str(tmp_path / "don.pt2"), donate=True))
    d_losses, d_state = run(donating, step.init_state(), bs)
    for losses, new in ((got_losses, got), (plain_losses, plain_state), (d_losses, d_state)):
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
        for name in step.state_names:
            torch.testing.assert_close(new.lookup(name), want.lookup(name), rtol=1e-5, atol=1e-5, msg=name)
    assert all(got.lookup(n).stride() == strides[n] for n in tap_major)  # the new state keeps them
    with pytest.raises(TypeError, match="conv_taps must be a bool, got str 'yes'"):
        step.to_aoti(str(tmp_path / "never.pt2"), conv_taps="yes")
