"""LoRA adapters out as PEFT files and PEFT adapters in: ``peft.PeftModel`` on the base HF
model computes what longboat's adapted model computes (fp32 logits within 1e-4), also for
an adapter PEFT itself made (separate q / k / v matrices, stacked into megatron's fused
linear), and a run continues training from one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longboat.core.distributed import run_multiprocess

TOL = 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
pytestmark = pytest.mark.multiprocess


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))


def _adapted_worker(
    rank: int, world: int, hf_dir: str, save_to: str | None, load_from: str | None, tp: int
) -> torch.Tensor | None:
    from pipeline_testkit import forward_logits

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.lora import apply_lora
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config
    from longboat.llm.peft import load_peft, save_peft

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(tensor_parallel=tp), get_accelerator("cpu"), seed=1)
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir)
        targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
        apply_lora(chunks, rank=4, alpha=8.0, targets=targets, seed=5)
        if load_from:
            load_peft(chunks, cfg, load_from)
        else:  # B = 0 at init: give the adapters something to change (the same values on
            # every rank, so a replicated B stays replicated)
            for i, (name, p) in enumerate(chunks[0].named_parameters()):
                if name.endswith("lora_B"):
                    gen = torch.Generator().manual_seed(11 + i)
                    with torch.no_grad():
                        p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        if save_to:
            save_peft(chunks, cfg, save_to, rank=4, alpha=8.0, base_model=hf_dir)
        logits = forward_logits(chunks, _tokens())
        return None if logits is None else logits
    finally:
        parallel_state.destroy()


def _peft_logits(hf_dir: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        return model(_tokens()).logits


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_exported_adapter_loads_in_peft_with_equal_logits(hf_dirs, tmp_path: Path, tp: int):
    hf_dir = hf_dirs["qwen3"]
    out = tmp_path / "adapter"
    outs = run_multiprocess(_adapted_worker, tp, str(hf_dir), str(out), None, tp)
    ours = next(o for o in outs if o is not None)
    theirs = _peft_logits(hf_dir, out)
    assert (ours - theirs).abs().max().item() <= TOL
    # The adapters matter: without them the logits are far off.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (base(_tokens()).logits - theirs).abs().max().item() > 100 * TOL


def test_an_adapter_peft_made_loads_and_goes_back_out_exactly(hf_dirs, tmp_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf_dir = hf_dirs["qwen3"]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, peft_cfg).eval()
    theirs_dir = tmp_path / "peft_made"
    model.save_pretrained(theirs_dir)
    with torch.no_grad():
        theirs = model(_tokens()).logits
    back = tmp_path / "back"
    (ours,) = run_multiprocess(_adapted_worker, 1, str(hf_dir), str(back), str(theirs_dir), 1)
    assert (ours - theirs).abs().max().item() <= TOL
    assert (_peft_logits(hf_dir, back) - theirs).abs().max().item() <= TOL


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from longboat.core.config.compose import compose_experiment
    from longboat.llm.train.training import train

    result = train(compose_experiment("sft", overrides, stack="llm", world_size=world))
    return {"losses": result.losses, "export": str(result.export_dir)}


def test_a_run_continues_training_a_peft_adapter(tmp_path: Path):
    from llm_testkit import make_hf_checkpoint
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ckpt, jsonl = make_hf_checkpoint(tmp_path / "user")
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    peft_cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(base, peft_cfg).save_pretrained(tmp_path / "start")
    overrides = [
        f"model.init_from={ckpt}", f"data.paths=[{jsonl}]", f"data.cache_dir={tmp_path}/cache",
        f"output_dir={tmp_path}/run", "lora.enabled=true", "lora.rank=4", "lora.alpha=8",
        f"lora.init_from={tmp_path}/start", "train.steps=2", "train.global_batch_size=2",
        "optim.lr=1e-2", "logging.progress=false", "logging.trackers=[]",
    ]  # fmt: skip
    (res,) = run_multiprocess(_train_worker, 1, overrides, timeout=300)
    assert len(res["losses"]) == 2
    adapter = tmp_path / "run" / "hf_adapter"
    assert (adapter / "adapter_config.json").is_file()
    # The trained adapter on the base equals the merged export.
    merged = AutoModelForCausalLM.from_pretrained(res["export"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = merged(_tokens()).logits
    assert (_peft_logits(ckpt, adapter) - want).abs().max().item() <= TOL
