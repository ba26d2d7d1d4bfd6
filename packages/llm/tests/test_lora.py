"""LoRA: a merged HF export gives the unmerged model's logits, at TP=1 and TP=2 (fp32)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from longboat.core.distributed import run_multiprocess

LOGIT_TOL = 1e-5


def _lora_worker(
    rank: int, world: int, hf_dir: Path, out: Path, tokens: torch.Tensor, layout: dict[str, int]
) -> dict[str, object] | None:
    from pipeline_testkit import forward_logits

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.lora import apply_lora, lora_parameters
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config
    from longboat.llm.train.export import export_hf

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(**layout), get_accelerator("cpu"))
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir)
        base = forward_logits(chunks, tokens)
        n = apply_lora(
            chunks,
            rank=4,
            alpha=8.0,
            targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        )
        params = lora_parameters(chunks)
        trainable = {id(p) for c in chunks for p in c.parameters() if p.requires_grad}
        assert trainable == {id(p) for p in params.values()}, "only adapters may train"
        with torch.no_grad():
            for name, p in params.items():  # B starts at zero: give it values so LoRA matters
                # Replicated adapter halves must be equal on every TP rank; shards differ.
                shard = rank if getattr(p, "tensor_model_parallel", False) else 0
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * shard)
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        unmerged = forward_logits(chunks, tokens)
        export_hf(chunks, cfg, out)
        assert not lora_parameters(chunks), "export must merge and remove the adapters"
        if rank != 0:
            return None
        return {
            "base": base,
            "unmerged": unmerged,
            "adapted": n,
            "shapes": {k: tuple(v.shape) for k, v in params.items()},
        }
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_merged_export_matches_unmerged(
    tp: int, hf_dirs: dict[str, Path], tokens: torch.Tensor, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    layout = {"tensor_parallel": tp} if tp > 1 else {}
    res = run_multiprocess(_lora_worker, tp, hf_dirs["qwen3"], out, tokens, layout)[0]
    assert res is not None
    assert res["adapted"] == 4 * 4  # 4 layers x (qkv, proj, fc1, fc2)
    shapes = res["shapes"]
    # Column-parallel qkv: A [r, hidden] whole, B [qkv_out / tp, r] split like the weight.
    qkv_a = next(v for k, v in shapes.items() if k.endswith("0.self_attention.linear_qkv.lora_A"))
    qkv_b = next(v for k, v in shapes.items() if k.endswith("0.self_attention.linear_qkv.lora_B"))
    assert qkv_a == (4, 64) and qkv_b == ((4 + 2 * 2) * 16 // tp, 4)
    # Row-parallel proj: A [r, hidden / tp] split like the weight, B [hidden, r] whole.
    proj_a = next(v for k, v in shapes.items() if k.endswith("0.self_attention.linear_proj.lora_A"))
    assert proj_a == (4, 64 // tp)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        merged = model(tokens).logits
    unmerged, base = res["unmerged"], res["base"]
    assert (unmerged - base).abs().max().item() > 1e-2, "the adapters did not change the model"
    diff = (merged - unmerged).abs().max().item()
    assert diff <= LOGIT_TOL, f"merged export vs unmerged logits: max diff {diff:.2e}"
