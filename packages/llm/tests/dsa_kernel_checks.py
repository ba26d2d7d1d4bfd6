"""DeepSeek-V3.2 with its sparse attention on longboat's DSA kernels (Triton's interpreter)
against the same model on megatron's DSA path and against transformers.

Not collected by the default run (no ``test_`` prefix): ``test_deepseek_v3.py`` runs this
file in a subprocess with ``TRITON_INTERPRET=1`` set before triton is imported. One process
builds the tiny V3.2 model from a random transformers checkpoint and runs a forward and a
backward twice: ``LONGBOAT_KERNELS_IMPL=triton`` (every longboat kernel on Triton, the DSA
core attention on the indexer and sparse-attention kernels) and ``=torch`` (the torch
references, the DSA core attention on megatron's path). Logits equal transformers' within
1e-4 on both, and each other within 1e-5 (relative); every parameter gradient within 1e-4
(relative), and the indexer's KL loss per layer (1e-3), with that loss off and on.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from test_deepseek_v3 import TOL, VARIANTS, hf_logits, make_hf_checkpoint, tiny

from longboat.core.distributed import run_multiprocess


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def _worker(rank: int, world: int, hf_dir: Path, tokens: torch.Tensor, coeff: float) -> Any:
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config
    from longboat.llm.models.deepseek_v3 import sparse_attention

    cfg = dataclasses.replace(read_hf_config(hf_dir), index_loss_coeff=coeff)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir)
        (model,) = chunks
        model.train()
        b, s = tokens.shape
        out = {}
        for impl in ("torch", "triton"):
            os.environ["LONGBOAT_KERNELS_IMPL"] = impl
            sparse_attention._NOTICED.clear()
            model.zero_grad(set_to_none=True)
            # the indexer-loss tracker, seated as the training step seats it
            tracker = DSAIndexerLossLoggingHelper.tracker
            tracker.update(values=torch.zeros(cfg.num_layers), reduce_group=None, avg_group=None)
            positions = torch.arange(s).expand(b, s)
            logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)
            weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
            (logits.float() * weight).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            notices = sorted(sparse_attention._NOTICED)
            out[impl] = (logits.detach(), grads, notices, tracker.pop("values"))
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.parametrize("coeff", [0.0, 0.05])
def test_kernel_path_equals_megatron_path_and_transformers(coeff: float, tmp_path: Path) -> None:
    cfg = tiny(**VARIANTS["v32"])
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    want = hf_logits(hf_dir, tokens)
    (runs,) = run_multiprocess(_worker, 1, hf_dir, tokens, coeff, timeout=600)
    (ref, ref_grads, ref_notices, ref_kl), (got, got_grads, got_notices, got_kl) = (
        runs["torch"],
        runs["triton"],
    )
    assert got_notices == [], got_notices  # the kernels ran in every layer
    assert ref_notices == ["the Triton kernels do not run on cpu tensors here"], ref_notices
    for logits in (ref, got):
        assert (logits - want).abs().max().item() <= TOL
    assert rel_err(got, ref) <= 1e-5
    # the indexer's KL loss per layer: the same (zero when off); a KL of ~1e-5 between two
    # near-equal distributions moves by ~1e-4 relative with 1e-6 changes of its inputs
    assert bool((ref_kl > 0).all()) == (coeff > 0), ref_kl
    torch.testing.assert_close(got_kl, ref_kl, rtol=1e-3, atol=0.0)
    assert sorted(got_grads) == sorted(ref_grads)
    assert any(".indexer." in n for n in got_grads) == (coeff > 0)
    for name, g in got_grads.items():
        assert rel_err(g, ref_grads[name]) <= 1e-4, f"{name}: {rel_err(g, ref_grads[name]):.2e}"
