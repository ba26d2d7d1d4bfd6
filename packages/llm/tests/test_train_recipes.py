"""Every llm recipe composes and validates; the LoRA recipe trains adapters only (tiny)."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_testkit import make_tiny_dataset, make_tiny_sft_dataset, tiny_overrides
from omegaconf import OmegaConf

from longboat.core.config.compose import compose_experiment
from longboat.core.distributed import run_multiprocess
from longboat.llm.stack import STACK
from longboat.llm.train.checks import check_run

FAMILIES = ("llama3", "qwen3", "qwen3_moe")
RECIPES = [f"{f}_{kind}" for f in FAMILIES for kind in ("pretrain", "sft", "lora")]


def test_every_family_has_pretrain_sft_lora_and_quickstart() -> None:
    assert set(RECIPES) | {"quickstart"} <= set(STACK.experiments())


@pytest.mark.parametrize("name", [*RECIPES, "quickstart"])
def test_recipe_composes_and_validates(name: str, tmp_path: Path) -> None:
    world = 1 if name == "quickstart" else 8  # the recipes are laid out for one 8-GPU node
    cfg = OmegaConf.to_object(compose_experiment(name, [], stack="llm", world_size=world))
    assert cfg.stack == "llm" and cfg.experiment == name
    model = cfg.model
    assert model.name == name.rsplit("_", 1)[0] or name == "quickstart"
    # The llm run checks that need no files (sequence length vs model, LoRA rank).
    cfg.model.init_from = None
    if cfg.data.name == "prepared":  # the tokenizer directory is checked at run time
        (tmp_path / "tokenizer.json").write_text("{}")
        cfg.data.tokenizer = str(tmp_path)
    check_run(cfg, model)


@pytest.mark.parametrize("kind", ["sft", "lora"])
def test_finetune_recipes_start_from_hf(kind: str) -> None:
    for fam in FAMILIES:
        cfg = compose_experiment(f"{fam}_{kind}", [], stack="llm")
        assert cfg.model.init_from, f"{fam}_{kind} must start from a Hugging Face checkpoint"
        assert cfg.lora.enabled == (kind == "lora")


def _lora_worker(rank: int, world: int, overrides: list[str]) -> dict[str, object]:
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from longboat.llm.train.training import train as run

    cfg = compose_experiment("qwen3_lora", overrides, stack="llm", world_size=world)
    result = run(cfg)
    meta = FileSystemReader(str(result.checkpoint)).read_metadata()
    from longboat.core.hf import load_safetensors

    exported = load_safetensors(result.export_dir)
    return {
        "losses": result.losses,
        "keys": sorted(meta.state_dict_metadata),
        "exported": {k: v.to(torch.float32) for k, v in exported.items()},
    }


@pytest.mark.multiprocess
def test_lora_recipe_trains_and_saves_adapters_only(
    tmp_path: Path, hf_dirs: dict[str, Path]
) -> None:
    from safetensors.torch import load_file

    data, tok = make_tiny_dataset(tmp_path / "data")
    overrides = [
        "model=qwen3_tiny",
        *tiny_overrides(data, tok, tmp_path, steps=6),
        "model.max_position_embeddings=256",
        "parallel.tensor_parallel=1",
        "parallel.pipeline_parallel=1",
        "parallel.expert_parallel=1",
        "train.precision=fp32",
        "checkpoint.save_on_exit=true",
        f"model.init_from={hf_dirs['qwen3']}",
        "export.enabled=true",
        f"export.dir={tmp_path / 'hf'}",
        "optim.lr=0.01",
    ]
    out = run_multiprocess(_lora_worker, 1, overrides)[0]
    model_keys = [k for k in out["keys"] if k.startswith("model.")]
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys), model_keys
    assert out["losses"][-1] < out["losses"][0]
    base = load_file(str(hf_dirs["qwen3"] / "model.safetensors"))
    exported = out["exported"]
    assert set(exported) == set(base)
    # Norms and embeddings are not adapted: exactly the base; adapted linears moved.
    for name, w in base.items():
        diff = (exported[name] - w.float()).abs().max().item()
        if "norm" in name or "embed" in name:
            assert diff == 0.0, f"{name} changed by {diff}"
    moved = max((exported[n] - base[n].float()).abs().max().item() for n in base if "q_proj" in n)
    assert moved > 1e-4, "merged adapters must change the attention weights"


def _sft_worker(rank: int, world: int, overrides: list[str]) -> tuple[list[float], float]:
    from longboat.llm.train.training import train as run

    result = run(compose_experiment("qwen3_sft", overrides, stack="llm", world_size=world))
    return result.losses, result.eval[result.end_step]["eval_loss"]


@pytest.mark.multiprocess
def test_sft_recipe_trains_on_chat_data(tmp_path: Path) -> None:
    data, tok = make_tiny_sft_dataset(tmp_path / "data")
    overrides = [
        "model=qwen3_tiny",
        *tiny_overrides(data, tok, tmp_path, steps=12),
        "parallel.tensor_parallel=1",
        "parallel.pipeline_parallel=1",
        "model.init_from=null",
        "optim.lr=0.01",
    ]
    losses, held_out = run_multiprocess(_sft_worker, 1, overrides)[0]
    # The loss counts assistant tokens (mask from data prepare): 4 numbers that follow from
    # the question, so it falls far below a random model's ln(256) = 5.5.
    assert losses[0] > 4.0 and losses[-1] < 2.5, losses
    assert held_out < 2.5
