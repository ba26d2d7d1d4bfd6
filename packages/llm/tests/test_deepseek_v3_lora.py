"""LoRA on DeepSeek-V3: the family's default targets (latent-attention projections, dense and
shared-expert MLPs), a PEFT adapter in and out at TP=1 and TP=2 with ``peft.PeftModel`` on
transformers' ``DeepseekV3ForCausalLM`` computing longboat's logits (fp32, within 1e-4), a
LoRA run that trains adapters only and whose merged export is the base plus the exported
adapter, DeepSeek-V3.2's refused ``linear_kv_up_proj``, and the Moonlight recipes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deepseek_v3 import VARIANTS, hf_logits, make_hf_checkpoint, tiny

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess

TOL = 1e-4  # max |logits| difference in fp32
# What the default targets adapt in transformers' model: the attention projections by module
# name, the dense and shared-expert MLPs by weight (PEFT maps the names gate_proj / up_proj /
# down_proj of a DeepSeek-V3 to its fused routed experts).
HF_MODULES = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
HF_PARAMETERS = [f"{m}.{p}_proj.weight" for m in ("mlp", "shared_experts")
                 for p in ("down", "gate", "up")]  # fmt: skip
DEFAULT = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
           "linear_proj", "mlp.linear_fc1", "mlp.linear_fc2", "shared_experts.linear_fc1",
           "shared_experts.linear_fc2"]  # fmt: skip


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))


def _peft_logits(hf_dir: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        return model(_tokens()).logits


def _adapter_worker(
    rank: int, world: int, hf_dir: Path, start: Path, back: Path, merged: Path
) -> dict[str, Any] | None:
    """Adapters on the default targets set from PEFT's ``start``, their logits, the adapter
    written back to ``back`` and the merged model exported to ``merged``."""
    from pipeline_testkit import forward_logits

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.lora import apply_lora, lora_parameters
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config
    from longboat.llm.models.deepseek_v3.lora import default_targets
    from longboat.llm.peft import load_peft, save_peft
    from longboat.llm.train.export import export_hf

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(tensor_parallel=world), get_accelerator("cpu"))
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir)
        adapted = apply_lora(chunks, rank=4, alpha=8.0, targets=default_targets(cfg), seed=3)
        loaded = load_peft(chunks, cfg, start)
        params = lora_parameters(chunks)
        trainable = {id(p) for c in chunks for p in c.parameters() if p.requires_grad}
        names = sorted(n.split(".", 1)[1].rsplit(".", 1)[0] for n in params)
        logits = forward_logits(chunks, _tokens())
        save_peft(chunks, cfg, back, rank=4, alpha=8.0, base_model=str(hf_dir))
        export_hf(chunks, cfg, merged)
        if rank != 0:
            return None
        return {
            "logits": logits,
            "adapted": adapted,
            "loaded": loaded,
            "names": names,
            "adapters_only": trainable == {id(p) for p in params.values()},
        }
    finally:
        parallel_state.destroy()


@pytest.fixture(scope="module")
def peft_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """(tiny DeepSeek-V3 HF dir, an adapter PEFT made on its default targets, PEFT's logits)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dsv3_lora")
    hf_dir = make_hf_checkpoint(tiny(), root / "hf")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_cfg = LoraConfig(r=4, lora_alpha=8, target_modules=HF_MODULES,
                          target_parameters=HF_PARAMETERS, init_lora_weights=False)  # fmt: skip
    model = get_peft_model(base, peft_cfg).eval()
    model.save_pretrained(root / "start")
    with torch.no_grad():
        theirs = model(_tokens()).logits
    return hf_dir, root / "start", theirs


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_peft_adapter_in_and_out_and_merged_export_match(peft_start, tmp_path: Path, tp: int):
    hf_dir, start, theirs = peft_start
    back, merged = tmp_path / "back", tmp_path / "merged"
    (res, *_) = run_multiprocess(_adapter_worker, tp, hf_dir, start, back, merged, timeout=600)
    # 3 layers x 5 attention projections (q down / up, kv down / up, out), then the dense
    # layer's fc1 / fc2 and the two MoE layers' shared-expert fc1 / fc2; routed experts none.
    assert res["adapted"] == res["loaded"] == 3 * 5 + 2 + 2 * 2
    assert res["adapters_only"]
    assert not any(".local_experts." in n or "mlp.experts." in n for n in res["names"])
    ours = res["logits"]
    # PEFT's model and longboat's compute the same (at TP=2 too: the adapters follow the
    # base shards, so TP=2 equals one process).
    assert (ours - theirs).abs().max().item() <= TOL
    assert (hf_logits(hf_dir, _tokens()) - theirs).abs().max().item() > 100 * TOL
    # The adapter written back loads in PEFT with the same logits; the merged export in
    # transformers too.
    assert (_peft_logits(hf_dir, back) - ours).abs().max().item() <= TOL
    assert (hf_logits(merged, _tokens()) - ours).abs().max().item() <= TOL


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    from longboat.core.config.compose import compose_experiment
    from longboat.llm.train.training import train

    result = train(compose_experiment("quickstart", overrides, stack="llm", world_size=world))
    meta = FileSystemReader(str(result.checkpoint)).read_metadata()
    return {"losses": result.losses, "export": str(result.export_dir),
            "keys": sorted(meta.state_dict_metadata)}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["tiny", "v32"])
def test_a_lora_run_trains_adapters_only_and_exports_base_plus_adapter(
    variant: str, tmp_path: Path
) -> None:
    import json

    from llm_testkit import make_tiny_dataset, tiny_overrides
    from safetensors.torch import load_file

    # v32: DeepSeek-V3.2's sparse attention, whose kv up projection takes no adapter
    cfg = tiny(**VARIANTS[variant])
    modules = [m for m in HF_MODULES if variant != "v32" or m != "kv_b_proj"]
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "base")
    data, tok = make_tiny_dataset(tmp_path / "data")
    overrides = [
        *[o for o in tiny_overrides(data, tok, tmp_path, steps=8) if not o.startswith("model.")],
        f"model.init_from={hf_dir}", "train.precision=fp32", "optim.lr=0.02",
        "checkpoint.save_on_exit=true", "export.enabled=true", f"export.dir={tmp_path / 'hf'}",
        f"output_dir={tmp_path / 'run'}", "lora.enabled=true", "lora.rank=4", "lora.alpha=8",
    ]  # fmt: skip
    (res,) = run_multiprocess(_train_worker, 1, overrides, timeout=900)
    losses = res["losses"]
    assert losses[-1] < losses[0] - 0.2, losses
    model_keys = [k for k in res["keys"] if k.startswith("model.")]
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys), model_keys
    base, merged = (
        load_file(str(hf_dir / "model.safetensors")),
        load_file(str(Path(res["export"]) / "model.safetensors")),
    )
    adapter_dir = tmp_path / "run" / "hf_adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == modules
    assert config["target_parameters"] == sorted(HF_PARAMETERS)
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    adapted = set()
    for key in adapter:
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            a, b = adapter[key], adapter[key.replace("lora_A", "lora_B")]
            adapted.add(f"{module}.weight")
            want = base[f"{module}.weight"].float() + scale * b @ a
            torch.testing.assert_close(merged[f"{module}.weight"], want, atol=1e-6, rtol=1e-6)
    # The base weights stayed bit for bit: every tensor without an adapter is the base's.
    assert set(merged) == set(base)
    assert [n for n in base if n not in adapted and not torch.equal(merged[n], base[n])] == []
    assert any(".mlp.experts.0." in n for n in base) and not any(".experts." in n for n in adapted)
    moe = cfg.num_layers - cfg.first_k_dense  # attention; dense and shared gate / up / down
    assert len(adapted) == cfg.num_layers * len(modules) + 3 * cfg.first_k_dense + 3 * moe
    # The adapter on the base in PEFT is the merged export.
    assert (_peft_logits(hf_dir, adapter_dir) - hf_logits(Path(res["export"]), _tokens())).abs(
    ).max().item() <= TOL  # fmt: skip


# -- config (no megatron) ------------------------------------------------------------------


def test_default_targets_follow_the_model() -> None:
    from llm_testkit import compose

    def targets(*overrides: str) -> list[str]:
        return list(compose(["lora.enabled=true", *overrides]).lora.targets)

    assert targets("model=deepseek_v3_tiny") == DEFAULT
    moonlight = targets("model=deepseek_v3_moonlight_16b_a3b")  # no q latent: one q projection
    assert moonlight == ["linear_q_proj", *DEFAULT[2:]]
    v32 = targets("model=deepseek_v3_v32_tiny")  # sparse attention: kv up weight is read
    assert v32 == [t for t in DEFAULT if t != "linear_kv_up_proj"]
    no_dense = targets("model=deepseek_v3_tiny", "model.first_k_dense=0")
    assert no_dense == [t for t in DEFAULT if not t.startswith("mlp.")]
    # A run's own list wins; Llama-style families keep core's default.
    assert targets("model=deepseek_v3_tiny", "lora.targets=[linear_proj]") == ["linear_proj"]
    assert targets("model=qwen3_tiny") == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_bad_targets_are_refused_naming_lora_targets() -> None:
    from llm_testkit import compose

    with pytest.raises(ConfigError, match=r"lora\.targets.*reads linear_kv_up_proj's weight"):
        compose(["model=deepseek_v3_v32_tiny", "lora.enabled=true",
                 "lora.targets=[linear_kv_up_proj,linear_proj]"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"lora\.targets.*\['linear_qkv'\] name no linear"):
        compose(["model=deepseek_v3_tiny", "lora.enabled=true", "lora.targets=[linear_qkv]"])
    # Routed experts as in Qwen3-MoE: plain linear_fc1 / fc2 reach them, which grouped
    # experts cannot carry.
    with pytest.raises(ConfigError, match=r"model\.moe_experts"):
        compose(["model=deepseek_v3_tiny", "lora.enabled=true", "model.moe_experts=grouped",
                 "lora.targets=[linear_proj,linear_fc1]"])  # fmt: skip
    compose(["model=deepseek_v3_tiny", "lora.enabled=true", "model.moe_experts=grouped"])


def test_routed_experts_take_adapters_only_when_named_and_then_run_per_expert() -> None:
    from longboat.core.config.schema import LoRAConfig
    from longboat.llm.moe_experts import moe_experts_for_run

    cfg = tiny()
    resolved, notice = moe_experts_for_run(cfg, LoRAConfig(enabled=True, targets=DEFAULT))
    assert resolved.moe_experts == "auto" and notice is None
    lora = LoRAConfig(enabled=True, targets=["linear_proj", "linear_fc1", "linear_fc2"])
    resolved, notice = moe_experts_for_run(cfg, lora)
    assert resolved.moe_experts == "sequential" and "per-expert" in notice


def test_the_family_check_guards_a_run_built_without_composition() -> None:
    from longboat.llm.validate import lora_frozen_base, lora_target_problems

    v32 = tiny(index_topk=8, index_n_heads=2, index_head_dim=16)
    (problem,) = lora_target_problems(v32, ["linear_kv_up_proj"])
    assert problem.key == "lora.targets" and "drop linear_kv_up_proj" in problem.fix
    assert lora_target_problems(dataclasses.replace(v32, index_topk=None), DEFAULT) == []
    # A LoRA run holds the aux-loss-free routing bias: the base stays as loaded.
    from longboat.llm.peft import peft_export_problem

    assert peft_export_problem(tiny(), DEFAULT) is None
    assert "fused tensors" in peft_export_problem(tiny(), ["linear_proj", "linear_fc2"])
    held, notice = lora_frozen_base(tiny())
    assert held.moe_router_bias_update_rate == 0.0 and "0.001 -> 0" in notice
    assert lora_frozen_base(held) == (held, None)


MOONLIGHT = ("moonlight_sft", "moonlight_lora")


@pytest.mark.parametrize("name", MOONLIGHT)
def test_moonlight_recipes_compose_and_validate(name: str, tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from longboat.core.config.compose import compose_experiment
    from longboat.llm.stack import STACK
    from longboat.llm.train.checks import check_run

    assert name in STACK.experiments()
    cfg = OmegaConf.to_object(compose_experiment(name, [], stack="llm", world_size=8))
    assert cfg.experiment == name and cfg.model.name == "deepseek_v3"
    assert cfg.model.flavor == "moonlight_16b_a3b" and cfg.model.init_from
    assert cfg.lora.enabled == (name == "moonlight_lora")
    if cfg.lora.enabled:
        assert list(cfg.lora.targets) == ["linear_q_proj", *DEFAULT[2:]]
    cfg.model.init_from = None  # the checks that need no files
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg.data.tokenizer = str(tmp_path)
    check_run(cfg, cfg.model)
