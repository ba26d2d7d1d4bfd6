"""Packed rows (varlen attention through longboat.kernels) give the per-document loss exactly.

A tiny causal LM whose attention is ``longboat.kernels.attention(..., cu_seqlens=...)`` and
whose positions come from ``position_ids`` is run three ways on the same documents: each
document alone, unpacked rows (one padded document per row) and packed rows. The summed
token losses agree to 1e-5 relative in fp32; a control without ``cu_seqlens`` differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longboat.core.data.packing import IGNORE_INDEX, PackedDataset, collate_packed
from longboat.kernels import attention

VOCAB, DIM, HEADS, MAX_POS = 64, 32, 4, 64


class TinyCausalLM(nn.Module):
    """Embeddings + learned positions, 2 attention/MLP blocks, LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_POS, DIM)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(DIM),
                    "qkv": nn.Linear(DIM, 3 * DIM),
                    "out": nn.Linear(DIM, DIM),
                    "norm2": nn.LayerNorm(DIM),
                    "mlp": nn.Sequential(
                        nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)
                    ),
                }
            )
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor:
        """``ids``/``positions`` ``[tokens]`` (packed when ``cu_seqlens`` is given)."""
        x = self.embed(ids) + self.pos(positions)
        for b in self.blocks:
            q, k, v = b["qkv"](b["norm1"](x)).view(-1, 3, HEADS, DIM // HEADS).unbind(1)
            if cu_seqlens is None:  # one sequence: plain causal attention on [1, T, H, D]
                a = attention(q[None], k[None], v[None], causal=True)[0]
            else:
                a = attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)
            x = x + b["out"](a.reshape(-1, DIM))
            x = x + b["mlp"](b["norm2"](x))
        return self.head(x)


def _loss_sum(model: TinyCausalLM, batch: dict, *, varlen: bool = True) -> torch.Tensor:
    logits = model(
        batch["input_ids"].flatten(),
        batch["position_ids"].flatten(),
        batch["cu_seqlens"] if varlen else None,
    )
    return F.cross_entropy(
        logits.double(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@pytest.fixture(scope="module")
def setup() -> tuple[TinyCausalLM, list[np.ndarray]]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, VOCAB, size=int(n)) for n in rng.integers(2, 30, size=16)]
    return TinyCausalLM().eval(), docs


def test_packed_equals_unpacked_equals_per_document(setup) -> None:  # type: ignore[no-untyped-def]
    model, docs = setup
    seq_len = 48
    with torch.no_grad():
        reference = torch.zeros((), dtype=torch.float64)
        for d in docs:  # each document alone: the ground truth
            ids = torch.from_numpy(d)
            logits = model(ids, torch.arange(len(d)), None)
            reference += F.cross_entropy(logits.double()[:-1], ids[1:], reduction="sum")
        packed_ds = PackedDataset(docs, seq_len)
        unpacked_ds = PackedDataset(docs, seq_len, packed=False)
        assert len(packed_ds) < len(unpacked_ds) == len(docs)
        packed = sum(
            _loss_sum(model, collate_packed([packed_ds[i], packed_ds[i + 1]]))
            if i + 1 < len(packed_ds)
            else _loss_sum(model, collate_packed([packed_ds[i]]))
            for i in range(0, len(packed_ds), 2)
        )
        unpacked = sum(_loss_sum(model, collate_packed([r])) for r in unpacked_ds)
        # Control: the same packed rows with attention crossing documents must differ.
        leaky = sum(_loss_sum(model, collate_packed([r]), varlen=False) for r in packed_ds)
    n_targets = sum(len(d) - 1 for d in docs)
    assert float(reference) > 0 and n_targets > 150
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(unpacked, reference, rtol=1e-5, atol=0)
    assert abs(float(leaky) - float(reference)) / float(reference) > 1e-3


def test_packed_gradients_match(setup) -> None:  # type: ignore[no-untyped-def]
    model, docs = setup
    ds = PackedDataset(docs[:6], 48)
    model.zero_grad()
    sum(_loss_sum(model, collate_packed([r])) for r in ds).backward()
    packed_grad = model.head.weight.grad.clone()
    model.zero_grad()
    ref = torch.zeros((), dtype=torch.float64)
    for d in docs[:6]:
        ids = torch.from_numpy(d)
        ref = ref + F.cross_entropy(
            model(ids, torch.arange(len(d)), None).double()[:-1], ids[1:], reduction="sum"
        )
    ref.backward()
    torch.testing.assert_close(packed_grad, model.head.weight.grad, rtol=1e-4, atol=1e-6)
