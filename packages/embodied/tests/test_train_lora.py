"""LoRA in embodied runs (core's ``lora.*``, ``longboat.embodied.train.lora``): only the
adapters train (the base weights are bit-equal after training, with master weights), the
export holds ``W + scale * B @ A`` for every adapted linear and the base weights elsewhere,
the adapter folder has PEFT's names and shapes and PEFT loads it onto the base policy, a
LoRA run's loss falls, LoRA under FSDP2 matches one process, and bad ``lora.*`` values are
refused naming the key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from embodied_testkit import tiny_run_overrides

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError

RANK, ALPHA = 4, 8.0


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _lora_run(out: Path, *extra: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    from longboat.core.train import Trainer, typed_config
    from longboat.embodied.train.lora import lora_linears
    from longboat.embodied.train.training import build_training

    overrides = tiny_run_overrides(
        out,
        "train.steps=3",
        "train.master_weights=true",  # bf16 weights, fp32 masters of the adapters
        "optim.lr=1e-2",
        "optim.schedule.warmup_steps=0",
        "checkpoint.every_steps=0",
        "lora.enabled=true",
        f"lora.rank={RANK}",
        f"lora.alpha={ALPHA}",
        *extra,
    )
    cfg = typed_config(compose_experiment("groot_n1_6_tiny", overrides, world_size=1))
    training = build_training(cfg)
    model = training.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    base_before = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    try:
        result = Trainer(cfg, training).fit()
    finally:
        training.close()
    return {
        "training": training,
        "trainable": trainable,
        "base_before": base_before,
        "base_after": {k: v for k, v in model.state_dict().items() if "lora_" not in k},
        "linears": sorted(lora_linears(model)),
        "export": Path(result.export_dir),
        "exported": load_file(str(Path(result.export_dir) / "model.safetensors")),
        "adapter": out / "adapter",
        "describe": training.describe(),
        "report": training.report(result),
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _lora_run(tmp_path_factory.mktemp("lora"))


def _base_key(name: str) -> str:
    return name.replace(".base_layer.", ".")


def test_only_adapters_train_and_base_weights_stay(run: dict[str, Any]) -> None:
    assert run["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in run["trainable"])
    # defaults: the LM's attention / MLP and the action head's DiT linears
    leaves = {n.rpartition(".")[2] for n in run["linears"]}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj", "to_q", "to_k", "to_v", "to_out", "ff_in", "ff_out"}  # fmt: skip
    before, after = run["base_before"], run["base_after"]
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert any("LoRA: rank 4, alpha 8" in line for line in run["describe"])
    assert any(str(run["adapter"]) in line for line in run["report"])


def test_export_is_base_plus_scaled_update(run: dict[str, Any]) -> None:
    _check_merge(run, exact=True)


def _check_merge(run: dict[str, Any], *, exact: bool) -> None:
    """The export: ``W + scale * B @ A`` of every adapted linear (bit-equal when merged on
    the CPU like here, else to rounding), the base weights elsewhere."""
    from safetensors.torch import load_file

    adapters = load_file(str(run["adapter"] / "adapter_model.safetensors"))
    exported, base = run["exported"], run["base_before"]
    assert set(exported) == {_base_key(k) for k in base}  # the policy's own keys
    scale = ALPHA / RANK
    trained = 0
    for name in run["linears"]:
        a = adapters[f"base_model.model.{name}.lora_A.weight"]
        b = adapters[f"base_model.model.{name}.lora_B.weight"]
        w = base[f"{name}.base_layer.weight"]
        want = (w.float() + b @ a * scale).to(w.dtype)
        if exact:
            assert torch.equal(exported[f"{name}.weight"], want), name
        else:
            torch.testing.assert_close(exported[f"{name}.weight"], want, msg=name)
        trained += int(b.abs().sum() > 0)
    assert trained == len(run["linears"])  # every B moved off zero
    adapted = {f"{n}.base_layer.weight" for n in run["linears"]}
    for k, v in base.items():
        if k not in adapted:
            assert torch.equal(exported[_base_key(k)], v), k


def test_adapter_folder_is_peft_shaped(run: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    config = json.loads((run["adapter"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK
    assert config["lora_alpha"] == ALPHA and config["bias"] == "none"
    adapters = load_file(str(run["adapter"] / "adapter_model.safetensors"))
    base = run["base_before"]
    want = set()
    for name in run["linears"]:
        out_f, in_f = base[f"{name}.base_layer.weight"].shape
        a, b = f"base_model.model.{name}.lora_A.weight", f"base_model.model.{name}.lora_B.weight"
        assert adapters[a].shape == (RANK, in_f) and adapters[b].shape == (out_f, RANK)
        want |= {a, b}
    assert set(adapters) == want


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed")
def test_peft_loads_the_adapter_onto_the_base_policy(run: dict[str, Any]) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from longboat.embodied.train.export import load_exported_policy

    policy = load_exported_policy(run["export"])  # the architecture; base weights next
    policy.load_state_dict({_base_key(k): v for k, v in run["base_before"].items()})
    peft_model = PeftModel.from_pretrained(policy, str(run["adapter"]))
    adapters = load_file(str(run["adapter"] / "adapter_model.safetensors"))
    loaded = {
        k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if "lora_" in k
    }
    assert loaded.keys() == adapters.keys()
    for k, v in adapters.items():
        assert torch.equal(loaded[k].float(), v), k
    merged = peft_model.merge_and_unload().state_dict()
    for k, v in run["exported"].items():
        torch.testing.assert_close(merged[k], v, msg=k)


def test_lora_run_loss_falls(tmp_path: Path) -> None:
    from longboat.embodied.train.trainer import train

    cfg = compose_experiment(
        "pi05_tiny",
        [
            f"output_dir={tmp_path}",
            "train.steps=80",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "optim.lr=1e-2",
            "optim.schedule.warmup_steps=5",
            "optim.schedule.name=constant",
            "data.synthetic.num_episodes=1",
            "data.synthetic.episode_length=8",
            "logging.progress=false",
            "logging.trackers=[]",
            "checkpoint.save_on_exit=false",
            "checkpoint.every_steps=0",
            "export.enabled=false",
            "lora.enabled=true",
            "lora.dropout=0.05",
        ],
        world_size=1,
    )
    losses = train(cfg).losses
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    # measured at the time of writing: 0.49 (full fine-tuning: 0.12, test_train_overfit)
    assert last < 0.65 * first, losses


_LM = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SMOLVLA_TINY_TARGETS = {
    *(f"joint.layers.{i}.{part}.{leaf}" for i in range(4) for part in ("lm", "expert")
      for leaf in _LM),
    "state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in",
    "action_time_mlp_out",
}  # fmt: skip
"""SmolVLA tiny's linears that ``lora.targets=[]`` adapts: the text model's and the action
expert's attention and MLP in each of its 4 layers, and the state / action / time
projections (not the vision encoder nor its connector)."""


def test_smolvla_default_targets_come_from_its_family() -> None:
    from torch import nn

    from longboat.embodied.models import build_model
    from longboat.embodied.models.registry import policy
    from longboat.embodied.train.lora import apply_lora, lora_targets

    targets = lora_targets("smolvla", [])
    assert targets == list(policy("smolvla").lora_targets)
    model = build_model("smolvla", "tiny")
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears > SMOLVLA_TINY_TARGETS  # the vision encoder and connector stay as they are
    adapted = apply_lora(model, targets, rank=RANK, alpha=ALPHA, dropout=0.0)
    assert set(adapted) == SMOLVLA_TINY_TARGETS
    assert lora_targets("smolvla", ["q_proj"]) == ["q_proj"]  # given targets win


def test_smolvla_lora_run_trains_only_adapters(tmp_path: Path) -> None:
    """A 3-step LoRA run of experiment=smolvla_tiny: its default targets are adapted, only
    the adapters train (every B that reaches the loss moves off zero), the base weights stay
    bit-equal and the adapter folder holds exactly those linears."""
    from safetensors.torch import load_file

    from longboat.core.train import Trainer, typed_config
    from longboat.embodied.train.lora import lora_linears
    from longboat.embodied.train.training import build_training

    overrides = tiny_run_overrides(
        tmp_path,
        "train.steps=3",
        "train.precision=fp32",
        "optim.lr=1e-2",
        "optim.schedule.warmup_steps=0",
        "checkpoint.every_steps=0",
        "lora.enabled=true",
        f"lora.rank={RANK}",
        f"lora.alpha={ALPHA}",
    )
    cfg = typed_config(compose_experiment("smolvla_tiny", overrides, world_size=1))
    training = build_training(cfg)
    model = training.model
    try:
        assert set(lora_linears(model)) == SMOLVLA_TINY_TARGETS
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        base = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
        result = Trainer(cfg, training).fit()
        describe = training.describe()
    finally:
        training.close()
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    after = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    assert base.keys() == after.keys()
    for k in base:
        assert torch.equal(base[k], after[k]), k
    line = next(x for x in describe if x.startswith("LoRA:"))
    assert f"on {len(SMOLVLA_TINY_TARGETS)} linears" in line and "state_proj" in line
    adapters = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(adapters) == {
        f"base_model.model.{n}.lora_{ab}.weight" for n in SMOLVLA_TINY_TARGETS for ab in "AB"
    }
    # The last text layer's query, output and MLP projections never reach the loss (the
    # prefix's last output is not read): their adapters stay at zero, every other one trains.
    dead = {f"joint.layers.3.lm.{leaf}" for leaf in _LM if leaf not in ("k_proj", "v_proj")}
    for n in SMOLVLA_TINY_TARGETS:
        moved = bool(adapters[f"base_model.model.{n}.lora_B.weight"].abs().sum() > 0)
        assert moved is (n not in dead), n


def _compose(tmp_path: Path, *extra: str) -> Any:
    return compose_experiment(
        "groot_n1_6_tiny", tiny_run_overrides(tmp_path, "lora.enabled=true", *extra), world_size=1
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("lora.rank=0", "lora.rank"),
        ("lora.dropout=1.0", "lora.dropout"),
    ],
)
def test_bad_lora_keys_are_refused(tmp_path: Path, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        _compose(tmp_path, override)
    assert key in err.value.keys, err.value


def test_target_matching_no_linear_is_refused(tmp_path: Path) -> None:
    """At compose time (the policy's flavor built on the meta device), and again where the
    run builds its policy (a ``model.init_from`` architecture)."""
    from longboat.core.train import typed_config
    from longboat.embodied.train.training import build_training

    bad = "lora.targets=[q_proj,no_such_linear]"
    with pytest.raises(ConfigError) as err:
        _compose(tmp_path, bad)
    assert err.value.keys == ["lora.targets"] and "no_such_linear" in str(err.value)
    plain = compose_experiment(
        "groot_n1_6_tiny", tiny_run_overrides(tmp_path, "lora.enabled=true", bad), validate=False
    )
    with pytest.raises(ConfigError) as err:
        build_training(typed_config(plain))
    assert err.value.keys == ["lora.targets"] and "no_such_linear" in str(err.value)


def _ddp_rank(rank: int, world: int, out: Path, strategy: str) -> dict[str, Any]:
    from longboat.core.train import Trainer, typed_config
    from longboat.embodied.train.lora import peft_adapter_state
    from longboat.embodied.train.training import build_training

    overrides = tiny_run_overrides(
        out,
        "train.micro_batch_size=1",
        "optim.lr=1e-2",
        "optim.schedule.warmup_steps=0",
        "checkpoint.every_steps=0",
        f"parallel.strategy={strategy}",
        "lora.enabled=true",
    )
    cfg = typed_config(compose_experiment("groot_n1_6_tiny", overrides, world_size=world))
    training = build_training(cfg)
    try:
        model = training.model
        base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
        result = Trainer(cfg, training).fit()
        after = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
        return {
            "adapters": peft_adapter_state(model),
            "base_kept": all(torch.equal(base[k], after[k]) for k in base),
            "export": str(result.export_dir),
            "master_weights": cfg.train.master_weights,
        }
    finally:
        training.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_data_parallel_lora_keeps_ranks_equal(tmp_path: Path, strategy: str) -> None:
    """Two ranks (DDP with master weights, ZeRO-1): the adapters train and agree across
    ranks, the base weights stay, the export and the adapter folder are written once."""
    from longboat.core.distributed import run_multiprocess

    res = run_multiprocess(_ddp_rank, 2, tmp_path, strategy, timeout=600)
    a, b = res[0]["adapters"], res[1]["adapters"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in a.items())
    assert res[0]["base_kept"] and res[1]["base_kept"]
    assert res[0]["master_weights"] is (strategy == "ddp")
    assert (Path(res[0]["export"]) / "model.safetensors").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def _sharded_lora_run(rank: int, world: int, out: Path, strategy: str) -> dict[str, Any]:
    """A 3-step fp32 LoRA run of global batch 2 (micro-batches of 1) at ``world`` ranks."""
    from safetensors.torch import load_file

    from longboat.core.train import Trainer, typed_config
    from longboat.embodied.train.lora import peft_adapter_state
    from longboat.embodied.train.training import build_training

    torch.set_num_threads(1)
    overrides = tiny_run_overrides(
        out,
        "train.steps=3",
        "train.precision=fp32",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "train.log_every=1",
        "optim.lr=1e-2",
        "optim.schedule.warmup_steps=0",
        "checkpoint.every_steps=0",
        f"parallel.strategy={strategy}",
        "lora.enabled=true",
        f"lora.rank={RANK}",
        f"lora.alpha={ALPHA}",
    )
    cfg = typed_config(compose_experiment("groot_n1_6_tiny", overrides, world_size=world))
    training = build_training(cfg)
    try:
        model = training.model
        base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
        result = Trainer(cfg, training).fit()
        after = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
        return {
            "losses": result.losses,
            "adapters": peft_adapter_state(model),  # every rank: FSDP gathers the shards
            "base_kept": all(torch.equal(base[k], after[k]) for k in base),
            "exported": load_file(str(Path(result.export_dir) / "model.safetensors")),
            "adapter_file": load_file(str(out / "adapter" / "adapter_model.safetensors")),
        }
    finally:
        training.close()


@pytest.mark.slow  # 2 ranks and a reference run: about 90 s on 2 cores
@pytest.mark.multiprocess
def test_fsdp_lora_matches_one_process(tmp_path: Path) -> None:
    """LoRA under FSDP2 on 2 ranks (frozen base and trainable adapters sharded in the same
    blocks) gives the losses of one process on the same global batch within 1e-5 relative;
    the base stays, and the export (the gathered state with the adapters merged) and the
    PEFT adapter folder match the one-process run's."""
    from longboat.core.distributed import run_multiprocess

    one = _sharded_lora_run(0, 1, tmp_path / "one", "ddp")
    two = run_multiprocess(_sharded_lora_run, 2, tmp_path / "fsdp", "fsdp", timeout=600)
    torch.testing.assert_close(
        torch.tensor(two[0]["losses"], dtype=torch.float64),
        torch.tensor(one["losses"], dtype=torch.float64),
        rtol=1e-5,
        atol=0.0,
    )
    assert len(set(one["losses"])) == 3
    assert one["base_kept"] and two[0]["base_kept"] and two[1]["base_kept"]
    a, b = two[0]["adapters"], two[1]["adapters"]
    assert a.keys() == b.keys() == one["adapters"].keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the ranks gathered the same adapters
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in a.items())
    for got, want in ((a, one["adapters"]), (two[0]["adapter_file"], one["adapter_file"])):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=k)
    exported, reference = two[0]["exported"], one["exported"]
    assert exported.keys() == reference.keys()
    assert not any("lora_" in k or "base_layer" in k for k in exported)
    for k, v in reference.items():
        torch.testing.assert_close(exported[k], v, rtol=1e-4, atol=1e-6, msg=k)


def _resumable(out: Path, steps: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from longboat.core.train import Trainer, typed_config
    from longboat.embodied.train.training import build_training

    overrides = tiny_run_overrides(
        out,
        f"train.steps={steps}",
        "checkpoint.every_steps=2",
        "optim.lr=1e-2",
        "optim.schedule.name=constant",  # the same LR whatever train.steps is (resume)
        "optim.schedule.warmup_steps=0",
        "lora.enabled=true",
        "lora.dropout=0.1",  # the dropout masks too follow the step's seed
    )
    cfg = typed_config(compose_experiment("groot_n1_6_tiny", overrides, world_size=1))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
    finally:
        training.close()
    return {
        "start": result.start_step,
        "exported": load_file(str(Path(result.export_dir) / "model.safetensors")),
        "adapter": load_file(str(out / "adapter" / "adapter_model.safetensors")),
    }


def test_lora_run_resumes_bit_exact(tmp_path: Path) -> None:
    whole = _resumable(tmp_path / "a", 4)
    _resumable(tmp_path / "b", 2)
    resumed = _resumable(tmp_path / "b", 4)
    assert resumed["start"] == 2
    for part in ("exported", "adapter"):
        assert whole[part].keys() == resumed[part].keys()
        for k, v in whole[part].items():
            assert torch.equal(resumed[part][k], v), (part, k)


@pytest.mark.gpu
def test_cuda_graph_lora_run_trains_only_adapters(tmp_path: Path) -> None:
    """On CUDA, master weights and the step replayed as one CUDA graph (captured after the
    eager warm-up steps): still only the adapters move, and the export is the merge."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run = _lora_run(tmp_path, "train.steps=6", "train.cuda_graph=true")
    assert any("graph" in line.lower() for line in run["describe"]), run["describe"]
    for k, v in run["base_before"].items():
        assert torch.equal(run["base_after"][k].cpu(), v.cpu()), k
    base = {k: v.cpu() for k, v in run["base_before"].items()}
    _check_merge({**run, "base_before": base}, exact=False)
