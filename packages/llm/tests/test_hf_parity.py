"""Logits of longboat's megatron model loaded from an HF dir == transformers (fp32).

Every layout runs in real gloo processes; each rank reads only its own shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longboat.core.distributed import run_multiprocess

TOL = 1e-4  # max abs logit difference allowed vs transformers in fp32


def _logits_worker(
    rank: int,
    world: int,
    hf_dir: Path,
    tokens: torch.Tensor,
    layout: dict[str, int],
    export_dir: Path,
) -> torch.Tensor | None:
    from pipeline_testkit import forward_logits

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config, save_hf

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(**layout), get_accelerator("cpu"))
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir)
        logits = forward_logits(chunks, tokens)
        save_hf(chunks, cfg, export_dir)  # gathers TP shards, PP stages and EP experts
        return logits
    finally:
        parallel_state.destroy()


LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_parallel": 2}),
    "pp2": (2, {"pipeline_parallel": 2}),
}
CASES = [(f, name) for f in ("llama3", "qwen3", "qwen3_moe") for name in LAYOUTS]
CASES += [("qwen3_moe", "ep2"), ("qwen3_moe", "tp2_ep2"), ("llama3", "pp2_vpp2")]
LAYOUTS |= {
    "ep2": (2, {"expert_parallel": 2}),
    "tp2_ep2": (2, {"tensor_parallel": 2, "expert_parallel": 2}),
    "pp2_vpp2": (2, {"pipeline_parallel": 2, "virtual_pipeline_parallel": 2}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_logits_match_transformers(
    family: str,
    layout: str,
    hf_dirs: dict[str, Path],
    tokens: torch.Tensor,
    reference_logits: dict[str, torch.Tensor],
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    world, parallel = LAYOUTS[layout]
    export = tmp_path / "export"
    outs = run_multiprocess(_logits_worker, world, hf_dirs[family], tokens, parallel, export)
    got = [o for o in outs if o is not None]
    assert got, "no rank returned logits (last pipeline stage missing?)"
    want = reference_logits[family]
    for logits in got:
        assert logits.shape == want.shape
        diff = (logits - want).abs().max().item()
        assert diff <= TOL, f"{family} {layout}: max |logits - transformers| = {diff:.3e}"
    # The comparison has teeth: the logits are far from trivial.
    assert want.abs().max().item() > 0.1

    # Saving back from this layout reproduces the source tensors bit for bit.
    source = load_file(str(hf_dirs[family] / "model.safetensors"))
    saved: dict[str, torch.Tensor] = {}
    files = sorted(f.name for f in export.glob("model*.safetensors"))
    n = len(files)  # transformers' names: one file, or n numbered shards with an index
    assert files == (["model.safetensors"] if n == 1 else [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]), files  # fmt: skip
    assert (export / "model.safetensors.index.json").is_file() == (n > 1)
    for f in files:
        saved.update(load_file(str(export / f)))
    assert sorted(saved) == sorted(source)
    changed = [n for n in source if not torch.equal(source[n], saved[n])]
    assert not changed, f"{family} {layout}: export differs in {changed}"
