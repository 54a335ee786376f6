"""torch.fft in a trained model: the pure step's joint graph calls eager autograd's derivatives of the FFT ops
(fft_r2c_backward, fft_c2r_backward, fft_c2c's), so it trains bit-exact with an eager torch.optim loop.

torch 2.9's joint export replayed its differentiated graph with autograd recording, and the complex
``slice_scatter`` that fft_r2c_backward's zero padding functionalizes into stopped the export ("slice_scatter does
not support automatic differentiation for outputs with complex dtype"): every model with ``torch.fft.rfft`` failed."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext

from helpers import assert_adamw_steps_bit_exact, joint_of_summed
from torch_ext import _compat


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


class RealFFT(nn.Module):
    """rfft / irfft (r2c and c2r), with a normalisation and the signal zero-padded to ``n``."""

    def __init__(self, norm=None, n=None):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.norm, self.n = norm, n

    def forward(self, x):
        f = torch.fft.rfft(self.fc(x), n=self.n, dim=-1, norm=self.norm)
        return self.head(torch.fft.irfft(f * f.abs(), n=8, dim=-1, norm=self.norm))


class ComplexFFT(nn.Module):
    """fft / ifft of complex intermediates (c2c both ways)."""

    def __init__(self):
        super().__init__()
        self.re, self.im, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 3)

    def forward(self, x):
        f = torch.fft.fft(torch.complex(self.re(x), self.im(x)), dim=-1)
        g = torch.fft.ifft(f * torch.sigmoid(f.real), dim=-1)
        return self.head(torch.cat([g.real, g.imag], -1))


class FFT2(nn.Module):
    """rfft2 / irfft2 with a learned complex-broadcast filter (a parameter times a complex tensor), then fft2 of a
    real tensor (r2c, not onesided)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(32, 3)
        self.filter = nn.Parameter(torch.randn(4, 5))

    def forward(self, x):
        f = torch.fft.rfft2(self.fc(x).view(-1, 4, 8))
        g = torch.fft.irfft2(f * self.filter, s=(4, 8))
        return self.head(torch.fft.fft2(g).abs().flatten(1))


class HermitianFFT(nn.Module):
    """ihfft / hfft (r2c and c2r with a conjugate)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        f = torch.fft.ihfft(self.fc(x))
        return self.head(torch.fft.hfft(f * f.abs(), n=8))


MODELS = {
    "rfft-irfft": (RealFFT, (4, 8)),
    "rfft-ortho": (lambda: RealFFT(norm="ortho"), (4, 8)),
    "rfft-padded-forward": (lambda: RealFFT(norm="forward", n=12), (4, 8)),
    "fft-ifft-complex": (ComplexFFT, (4, 8)),
    "fft2": (FFT2, (8, 8)),
    "hfft-ihfft": (HermitianFFT, (4, 8)),
}


@pytest.mark.parametrize("run", ["executor", "planned"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fft_model_steps_bit_exact_with_eager(name, run):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 3, (x.numel() // 32 if name == "fft2" else shape[0],), generator=g)
    assert_adamw_steps_bit_exact(model, _loss, (x, y), run)


def test_joint_export_leaves_aot_autograd_as_it_found_it():
    """The replay's grad mode is set through a patched name in torch._functorch.aot_autograd: put back after the
    export, and after an export that fails."""
    from torch._functorch import aot_autograd

    before = aot_autograd.make_fx
    ep = torch.export.export(RealFFT(), (torch.randn(4, 8),))
    with pytest.raises(RuntimeError, match="scalar"):  # its output is not a loss
        _compat.export_joint(ep)
    assert aot_autograd.make_fx is before

    joint = joint_of_summed(RealFFT(), torch.randn(4, 8))
    assert aot_autograd.make_fx is before
    # eager's derivatives: fft_c2r_backward is an r2c, fft_r2c_backward an inverse c2c of the zero-padded gradient
    targets = [n.target for n in joint.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten._fft_r2c.default) == 2
    assert torch.ops.aten._fft_c2c.default in targets


def test_fft_step_saved_as_pt2_runs_as_in_memory_and_aoti_refuses_by_name(tmp_path):
    # The .pt2 round trip (torch_ext.load_step, the executor) is exact. torch 2.9's AOTInductor asserts inside its
    # C++ wrapper on the complex zeros it makes lowering the FFT backward: a bare AssertionError before, a message
    # naming the complex ops and the ways that work now.
    torch.manual_seed(0)
    model = RealFFT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = torch_ext.make_train_step(model, opt, _loss, (x, y))
    state = step.init_state()
    path = str(tmp_path / "fft.pt2")
    torch.export.save(step.program, path)
    loaded = torch_ext.load_step(path)
    a = b = state
    for _ in range(3):
        loss_a, a = step(a, x, y)
        loss_b, b = loaded(b, x, y)
        assert torch.equal(loss_a, loss_b)
    with pytest.raises(NotImplementedError, match=r"to_aoti: .*complex-valued ops \(.*_fft_r2c.*\.pt2"):
        step.to_aoti(str(tmp_path / "fft_aoti.pt2"))
