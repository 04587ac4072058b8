"""Packed attention on the CPU: one 4-d attention call per row, equal to the padded forward.

With 3-d inputs ``[heads, L, d]`` torch's CPU ``scaled_dot_product_attention`` leaves its fused
kernel for a path ~4x slower (185 tokens, one core), which made a packed batch of document
chunks ~14% slower per row than the same rows one at a time (issue 20).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuserve.models.bert import BertConfig, BertEncoder, Packing, packed_attention

HEADS, HEAD_SIZE = 4, 8


@pytest.fixture(scope="module")
def encoder() -> BertEncoder:
    torch.manual_seed(3)
    config = BertConfig(
        vocab_size=50,
        hidden_size=HEADS * HEAD_SIZE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return BertEncoder(config).eval()


def test_each_row_is_one_four_dimensional_attention_call(monkeypatch):
    calls: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    lengths = [5, 1, 9]
    qkv = torch.randn(sum(lengths), 3, HEADS, HEAD_SIZE)
    out = packed_attention(qkv, Packing.of(lengths, "cpu"))
    assert calls == [(1, HEADS, n, HEAD_SIZE) for n in lengths]
    assert out.shape == (sum(lengths), HEADS, HEAD_SIZE)


def test_packed_attention_equals_attention_of_each_row_alone():
    lengths = [3, 7, 2]
    qkv = torch.randn(sum(lengths), 3, HEADS, HEAD_SIZE)
    out = packed_attention(qkv, Packing.of(lengths, "cpu"))
    start = 0
    for n in lengths:
        # row alone, [heads, n, d] -> softmax(q k^T / sqrt(d)) v, computed by hand
        q, k, v = qkv[start : start + n].permute(1, 2, 0, 3).unbind(0)
        weights = torch.softmax(q @ k.transpose(-1, -2) / HEAD_SIZE**0.5, dim=-1)
        expected = (weights @ v).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
        start += n


def test_packed_forward_equals_padded_forward(encoder):
    torch.manual_seed(4)
    lengths = [6, 11, 1, 4]
    rows = [torch.randint(1, 50, (n,)) for n in lengths]
    longest = max(lengths)
    ids = torch.zeros(len(rows), longest, dtype=torch.int64)
    mask = torch.zeros(len(rows), longest, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    with torch.inference_mode():
        padded = encoder(ids, mask)
        packed = encoder.forward_packed(torch.cat(rows), Packing.of(lengths, "cpu"))
    start = 0
    for i, n in enumerate(lengths):
        torch.testing.assert_close(packed[start : start + n], padded[i, :n], rtol=1e-4, atol=1e-4)
        start += n


def test_padding_rows_past_the_packing_are_ignored_and_come_back_as_zeros():
    """An encoder pads its packed tokens once for the CPU kernels (row_padded): attention
    reads only the packing's tokens and answers zeros in the rows past them."""
    lengths = [3, 7, 2]
    real = torch.randn(sum(lengths), 3, HEADS, HEAD_SIZE)
    padded = torch.cat([real, torch.full((20, 3, HEADS, HEAD_SIZE), 1e6)])
    packing = Packing.of(lengths, "cpu")
    out = packed_attention(padded, packing)
    assert out.shape == (sum(lengths) + 20, HEADS, HEAD_SIZE)
    torch.testing.assert_close(out[: sum(lengths)], packed_attention(real, packing))
    assert torch.count_nonzero(out[sum(lengths) :]) == 0
