"""gpuserve.backends.fused_linear: prepacked oneDNN projections with fused GELU / residual add.

Each fused form is compared with the unfused composition of the same bf16 weights computed
in float32, and a BERT encoder loaded at bf16 on the CPU (packed) with the same encoder
unpacked and with a float64 textbook forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpuserve.backends.fused_linear import FusedLinear, prepack_all, prepack_refusal
from gpuserve.models.bert import Packing, load_bert
from tests.unit.test_bert import TINY, padded_batch, reference_forward, tiny_state, write_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


def layer(in_features: int = 40, out_features: int = 24, seed: int = 0) -> FusedLinear:
    torch.manual_seed(seed)
    lin = FusedLinear(in_features, out_features).to(torch.bfloat16)
    lin.requires_grad_(False)
    return lin


#: Why this CPU cannot run oneDNN's bf16 linear kernels (None: it can). Cores without
#: AVX-512 BW/VL/DQ (or AVX-NE-CONVERT) cannot; there the layers stay unpacked, which the
#: tests below that do not need the kernels cover.
KERNELS_PROBLEM = prepack_all(layer()) if torch.backends.mkldnn.is_available() else "no oneDNN"
needs_kernels = pytest.mark.skipif(
    KERNELS_PROBLEM is not None,
    reason=f"oneDNN's bf16 kernels are unusable on this CPU: {KERNELS_PROBLEM}",
)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 4 bf16 rounding steps of the output's scale."""
    assert got.shape == want.shape
    scale = float(want.abs().max())
    assert float((got.float() - want).abs().max()) <= 4 * scale * 2.0**-8


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 40), (37, 40), (3, 5, 40), (0, 40)])
def test_packed_forms_equal_the_unfused_composition(shape: tuple[int, ...]) -> None:
    lin = layer()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    residual = torch.randn(*shape[:-1], 24, generator=gen).to(torch.bfloat16)
    plain = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert prepack_all(lin) is None and lin.packed
    with torch.inference_mode():
        if x.numel():
            close(lin(x), plain)
            close(lin.forward_gelu(x), F.gelu(plain))
            close(lin.forward_add(x, residual), plain + residual.float())
        else:
            assert lin(x).shape == (0, 24)


def test_unpacked_layer_is_a_plain_linear() -> None:
    lin = layer()
    x = torch.randn(6, 40).to(torch.bfloat16)
    residual = torch.randn(6, 24).to(torch.bfloat16)
    assert not lin.packed
    want = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(lin(x), want)
    assert torch.equal(lin.forward_gelu(x), F.gelu(want))
    assert torch.equal(lin.forward_add(x, residual), residual + want)


@needs_kernels
def test_layer_without_bias_packs() -> None:
    torch.manual_seed(0)
    lin = FusedLinear(16, 8, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(5, 16).to(torch.bfloat16)
    assert prepack_all(lin) is None
    with torch.inference_mode():
        close(lin(x), F.linear(x.float(), lin.weight.float()))


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        (torch.float32, "cpu", "dtype torch.float32 is not among"),
        (torch.bfloat16, "meta", "weights on meta"),
    ],
)
def test_refusals_name_the_reason(dtype: torch.dtype, device: str, expected: str) -> None:
    lin = FusedLinear(8, 4, device=device, dtype=dtype)
    assert expected in (prepack_refusal(lin.weight) or "")
    assert expected in (prepack_all(lin) or "")
    assert not lin.packed


@needs_kernels
def test_a_kernel_that_disagrees_unpacks_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time check is real: a packed weight that is not the layer's is caught."""
    model = torch.nn.Sequential(layer(seed=1), layer(24, 40, seed=2))
    real = torch.ops.mkldnn._reorder_linear_weight

    def wrong_weight(self: FusedLinear) -> None:
        self._packed = real(torch.zeros_like(self.weight), 8)

    monkeypatch.setattr(FusedLinear, "prepack", wrong_weight)
    problem = prepack_all(model)
    assert problem is not None and "linear differs from F.linear" in problem
    assert not any(m.packed for m in model)


def test_missing_operator_leaves_layers_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(self: FusedLinear) -> None:
        raise RuntimeError("No such operator mkldnn::_reorder_linear_weight")

    lin = layer()
    monkeypatch.setattr(FusedLinear, "prepack", missing)
    problem = prepack_all(lin)
    assert problem is not None and "No such operator" in problem and not lin.packed


@needs_kernels
def test_bert_at_bf16_on_cpu_is_packed_and_keeps_its_answer(tmp_path: Path) -> None:
    state = tiny_state()
    folder = write_checkpoint(tmp_path / "tiny", state)
    packed = load_bert(folder, dtype=torch.bfloat16)
    assert all(m.packed for m in packed.modules() if isinstance(m, FusedLinear))
    plain = load_bert(folder, dtype=torch.bfloat16)
    for m in plain.modules():
        if isinstance(m, FusedLinear):
            m._packed = None
    ids, mask = padded_batch()
    want = reference_forward(state, TINY, ids, mask)
    lengths = [int(n) for n in mask.sum(1)]
    with torch.inference_mode():
        got_padded = packed(ids, mask)
        got_plain = plain(ids, mask)
        got_packed = packed.forward_packed(ids[mask.bool()], Packing.of(lengths, "cpu"))
    real = mask.bool()
    scale = float(want.abs().max())
    for got in (got_padded[real], got_plain[real], got_packed):
        # bf16 through two layers: within 3% of the output's scale of the float64 reference
        assert float((got.double() - want[real]).abs().max()) < 0.03 * scale
    assert float((got_padded[real].float() - got_plain[real].float()).abs().max()) < 0.03 * scale


def test_fp32_bert_is_not_packed(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "tiny", tiny_state())
    model = load_bert(folder)
    assert not any(m.packed for m in model.modules() if isinstance(m, FusedLinear))


@pytest.mark.parametrize("tokens", [1, 31, 32, 33, 70])
def test_packed_bert_pads_once_and_returns_the_real_tokens(tmp_path: Path, tokens: int) -> None:
    """At bf16 with packed layers the encoder pads its T tokens to a multiple of ROW_MULTIPLE
    before the first layer (no projection copies its input) and answers exactly T rows, each
    equal to the same tokens run without padding."""
    from gpuserve.backends import fused_linear

    folder = write_checkpoint(tmp_path / "tiny", tiny_state())
    model = load_bert(folder, dtype=torch.bfloat16)
    lengths = [20] * (tokens // 20) + ([tokens % 20] if tokens % 20 else [])
    ids = torch.randint(1, 50, (tokens,), generator=torch.Generator().manual_seed(tokens))
    seen: list[int] = []
    real_pad = F.pad

    def recording(x: torch.Tensor, pad: tuple[int, ...], *args, **kwargs) -> torch.Tensor:
        seen.append(int(x.shape[0]))
        return real_pad(x, pad, *args, **kwargs)

    with torch.inference_mode():
        fused_linear.F.pad = recording  # type: ignore[assignment]
        try:
            got = model.forward_packed(ids, Packing.of(lengths, "cpu"))
        finally:
            fused_linear.F.pad = real_pad  # type: ignore[assignment]
        alone = [model.forward_packed(ids[:n], Packing.of([n], "cpu")) for n in lengths[:1]]
    assert got.shape[0] == tokens
    packed = all(m.packed for m in model.modules() if isinstance(m, FusedLinear))
    assert packed == (KERNELS_PROBLEM is None)
    # unpacked layers (a CPU without the kernels) take the rows as they are
    assert seen == ([tokens] if packed and tokens % fused_linear.ROW_MULTIPLE else [])
    scale = float(alone[0].abs().max())
    assert float((got[: lengths[0]].float() - alone[0].float()).abs().max()) < 0.03 * scale
