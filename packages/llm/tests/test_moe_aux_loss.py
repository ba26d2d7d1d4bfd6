"""``model.moe_aux_loss``: Qwen3-MoE trains with transformers' load-balancing loss (``hf``)
or megatron's (``megatron``); both checked against transformers' model on the same weights
and tokens (fp32, CPU, the tiny flavor: 4 experts, top-2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from llm_testkit import compose

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess

COEFF = 0.5  # large, so the load-balancing term moves the router gradients far above GRAD_TOL
AUX_RTOL = 1e-5  # relative, aux loss vs transformers' aux_loss
LOSS_TOL = 1e-5  # absolute, total loss vs transformers' loss (fp32 reduction order only)
GRAD_TOL = 1e-6  # absolute, router weight gradients (theirs are ~1e-2)


@pytest.fixture(scope="module")
def moe_dir(hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE checkpoint with a non-zero ``router_aux_loss_coef``."""
    out = tmp_path_factory.mktemp("moe") / "qwen3_moe"
    shutil.copytree(hf_dirs["qwen3_moe"], out)
    config = json.loads((out / "config.json").read_text())
    config["router_aux_loss_coef"] = COEFF
    (out / "config.json").write_text(json.dumps(config))
    return out


def _step_worker(
    rank: int, world: int, hf_dir: Path, tokens: torch.Tensor, mode: str
) -> dict[str, object]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config
    from longboat.llm.train.lm_step import build_train_step

    cfg = read_hf_config(hf_dir)
    cfg.moe_aux_loss = mode
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        step = build_train_step(
            cfg,
            OptimConfig(name="adamw", lr=0.0, weight_decay=0.0),
            precision="fp32",
            device="cpu",
            init_weights=lambda c: load_hf(c, cfg, hf_dir),
        )
        lm = step.forward_backward([step.batch(tokens[:, :-1], tokens[:, 1:])])
        layers = step.chunks[0].decoder.layers
        return {
            "lm": float(lm),
            "aux": float(step.metrics["moe_aux_loss"]) if step.metrics else None,
            "router_grads": [layer.mlp.router.weight.main_grad.clone() for layer in layers],
            "coeff": step.chunks[0].config.moe_aux_loss_coeff,
            "megatron_type": step.chunks[0].config.moe_router_load_balancing_type,
        }
    finally:
        parallel_state.destroy()


def _transformers(hf_dir: Path, tokens: torch.Tensor) -> tuple[object, object]:
    """transformers' model (train mode) and its output with router logits, labels shifted as
    longboat's (``tokens[:, 1:]`` for inputs ``tokens[:, :-1]``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    inputs = tokens[:, :-1]
    out = model(
        input_ids=inputs,
        labels=inputs,
        shift_labels=tokens[:, 1:].contiguous(),
        output_router_logits=True,
    )
    return model, out


def _router_grads(model: object) -> list[torch.Tensor]:
    return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.multiprocess
def test_hf_setting_equals_transformers_loss_aux_loss_and_router_grads(
    moe_dir: Path, tokens: torch.Tensor
) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    (ours,) = run_multiprocess(_step_worker, 1, moe_dir, tokens, "hf")
    assert ours["megatron_type"] == "none"  # megatron's own term is off
    assert ours["coeff"] == COEFF

    model, out = _transformers(moe_dir, tokens)
    cfg = model.config
    reference = load_balancing_loss_func(
        out.router_logits, cfg.num_experts, cfg.num_experts_per_tok
    )
    assert torch.allclose(reference, out.aux_loss)
    aux_rel = abs(ours["aux"] - out.aux_loss.item()) / out.aux_loss.item()
    print(f"aux ours={ours['aux']:.8f} hf={out.aux_loss.item():.8f} rel diff={aux_rel:.2e}")
    assert aux_rel <= AUX_RTOL
    assert out.aux_loss.item() > 1.0  # E * sum f P >= 1 (topk-scaled); not a trivial zero

    total = ours["lm"] + COEFF * ours["aux"]
    loss_diff = abs(total - out.loss.item())
    print(f"loss ours={total:.8f} hf={out.loss.item():.8f} abs diff={loss_diff:.2e}")
    assert loss_diff <= LOSS_TOL

    out.loss.backward()
    grad_diff = _max_diff(ours["router_grads"], _router_grads(model))
    print(f"router grads max abs diff={grad_diff:.2e}")
    assert grad_diff <= GRAD_TOL

    # The term has teeth: without it the router gradients are far from transformers'.
    model, out = _transformers(moe_dir, tokens)
    (out.loss - COEFF * out.aux_loss).backward()
    without = _max_diff(ours["router_grads"], _router_grads(model))
    largest = max(g.abs().max().item() for g in ours["router_grads"])
    print(f"router grads: largest={largest:.2e}, max abs diff to the LM-only grads={without:.2e}")
    assert without > 1000 * GRAD_TOL, without


@pytest.mark.multiprocess
def test_megatron_setting_keeps_megatrons_per_layer_loss(
    moe_dir: Path, tokens: torch.Tensor
) -> None:
    (ours,) = run_multiprocess(_step_worker, 1, moe_dir, tokens, "megatron")
    assert ours["megatron_type"] == "aux_loss"
    assert ours["aux"] is None  # nothing pooled to report

    model, out = _transformers(moe_dir, tokens)
    cfg = model.config
    experts, topk = cfg.num_experts, cfg.num_experts_per_tok
    # megatron's objective: lm + sum over layers of coeff * E / topk * sum_e f_e P_e, with
    # f_e = a layer's top-k picks of e per token and P_e its mean probability.
    lm = out.loss - COEFF * out.aux_loss
    assert abs(ours["lm"] - lm.item()) <= LOSS_TOL
    per_layer = []
    for logits in out.router_logits:
        probs = torch.softmax(logits, dim=-1)
        picks = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
        f, p = picks.mean(dim=0), probs.mean(dim=0)
        per_layer.append(COEFF * experts / topk * (f * p).sum())
    (lm + sum(per_layer)).backward()
    grad_diff = _max_diff(ours["router_grads"], _router_grads(model))
    print(f"megatron setting: router grads max abs diff={grad_diff:.2e}")
    assert grad_diff <= GRAD_TOL

    # ... and differs from the hf setting's objective by far more than the tolerance.
    model, out = _transformers(moe_dir, tokens)
    out.loss.backward()
    to_hf = _max_diff(ours["router_grads"], _router_grads(model))
    print(f"megatron setting: router grads max abs diff to the hf objective's={to_hf:.2e}")
    assert to_hf > 1000 * GRAD_TOL


def test_hf_setting_refuses_layouts_where_it_cannot_be_hf() -> None:
    from longboat.core.family import find_family
    from longboat.llm.moe_aux_loss import (
        check_pooled_aux_loss,
        pooled_aux_loss_applies,
        pooled_aux_loss_notice,
    )

    cfg = find_family("llm", "qwen3_moe").flavor("tiny")
    assert cfg.moe_aux_loss == "auto"  # the default
    cfg.moe_aux_loss, cfg.moe_aux_loss_coeff = "hf", 0.01
    cases = {
        "pipeline_parallel": {"pipeline_parallel": 2},
        "context_parallel": {"context_parallel": 2},
        "sequence_parallel": {"sequence_parallel": True},
        "recompute=full": {"full_recompute": True},
    }
    for name, layout in cases.items():
        with pytest.raises(ConfigError) as err:
            check_pooled_aux_loss(cfg, **layout)
        text = str(err.value)
        assert "model.moe_aux_loss" in text and name in text, text
        assert "model.moe_aux_loss=megatron" in text, text
    # auto: the same layouts fall back to megatron's term, said in one line naming the cause.
    cfg.moe_aux_loss = "auto"
    for name, layout in cases.items():
        check_pooled_aux_loss(cfg, **layout)
        assert not pooled_aux_loss_applies(cfg, **layout)
        notice = pooled_aux_loss_notice(cfg, **layout)
        assert notice.startswith("model.moe_aux_loss: megatron's per-layer") and name in notice
    assert pooled_aux_loss_applies(cfg) and pooled_aux_loss_notice(cfg) is None
    cfg.moe_aux_loss = "hf"
    # Where it does not apply, nothing to refuse: megatron's setting, or no coefficient.
    check_pooled_aux_loss(cfg, pipeline_parallel=1)
    cfg.moe_aux_loss = "megatron"
    check_pooled_aux_loss(cfg, pipeline_parallel=2, sequence_parallel=True)
    cfg.moe_aux_loss, cfg.moe_aux_loss_coeff = "hf", 0.0
    check_pooled_aux_loss(cfg, pipeline_parallel=2)
    cfg.moe_aux_loss = "switch"
    with pytest.raises(ConfigError, match=r"model\.moe_aux_loss"):
        check_pooled_aux_loss(cfg)


def test_validator_names_the_key_before_the_run_starts() -> None:
    base = ["model=qwen3_moe_tiny", "model.moe_aux_loss_coeff=0.01"]
    with pytest.raises(ConfigError) as err:
        compose([*base, "model.moe_aux_loss=hf", "parallel.pipeline_parallel=2"], world_size=2)
    assert "model.moe_aux_loss" in str(err.value) and "pipeline_parallel=2" in str(err.value)
    for mode in ("megatron", "auto"):  # auto falls back to megatron's term there
        cfg = compose(
            [*base, f"model.moe_aux_loss={mode}", "parallel.pipeline_parallel=2"], world_size=2
        )
        assert cfg.model.moe_aux_loss == mode
    assert compose(base).model.moe_aux_loss == "auto"  # the default


def _hazards_worker(rank: int, world: int, mode: str) -> list[tuple[str, str]]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.loop.capture_check import capture_hazards
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.engine.lagged_gate import use_fused_adamw as _use_fused
    from longboat.core.megatron.optimizer import inner_optimizers
    from longboat.llm.train.lm_step import build_train_step

    cfg = find_family("llm", "qwen3_moe").flavor("tiny")
    cfg.moe_aux_loss, cfg.moe_aux_loss_coeff = mode, COEFF
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        # As train.cuda_graph builds it; without clipping (megatron's clipped step reads the
        # grad norm on the host) and with the fused AdamW that CUDA runs.
        step = build_train_step(
            cfg, OptimConfig(lr=1e-3, grad_clip=0.0), precision="bf16", device="cpu",
            cuda_graph=True,
        )  # fmt: skip
        for inner in inner_optimizers(step.optimizer):
            _use_fused(inner)
        seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        for _ in range(2):  # lazy optimizer state exists before the checked step
            step.step(tokens, labels)
        with capture_hazards() as found:
            step.step(tokens, labels)
        assert ("moe_aux_loss" in step.metrics) == (mode == "hf")
        return sorted({(h.op, h.where.split("/")[-1]) for h in found})
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["hf", "megatron"])
def test_the_moe_step_has_no_capture_hazards(mode: str) -> None:
    """The MoE step of either setting (for hf: its routers' records, the pooled term and the
    reported metric) reads nothing on the host, makes no data-dependent shape and copies no
    Python data to the device (core's capture_check sees every aten op on CPU), so
    ``train.cuda_graph`` can capture it."""
    (found,) = run_multiprocess(_hazards_worker, 1, mode)
    assert found == [], found


def _train_worker(rank: int, world: int, overrides: list[str]) -> tuple[list[dict], int]:
    import gc

    from longboat.llm.train.training import train

    result = train(compose(overrides))
    gc.collect()
    params_left = sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects())
    return [json.loads(line) for line in result.metrics_path.read_text().splitlines()], params_left


@pytest.mark.multiprocess
def test_training_logs_the_hf_aux_loss(tmp_path: Path) -> None:
    """``longboat-llm train`` on the tiny MoE logs transformers' aux loss with ``hf`` (it is
    E * sum_e f_e P_e >= 1, at most E) and nothing of the kind with ``megatron``."""
    base = [
        "model=qwen3_moe_tiny", "model.moe_aux_loss_coeff=0.01", "data=synthetic",
        "data.seq_len=16", "data.num_documents=64", "train.steps=2", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.eval_every=0", "train.log_every=1",
        "checkpoint.every_steps=0", "checkpoint.save_on_exit=false", "checkpoint.resume=none",
        f"checkpoint.dir={tmp_path}/ckpt", "logging.progress=false",
        "logging.trackers=[]", "export.enabled=false", "llm.generate_prompt=null",
    ]  # fmt: skip
    for mode in ("hf", "megatron"):
        rows, params_left = run_multiprocess(
            _train_worker,
            1,
            [*base, f"model.moe_aux_loss={mode}", f"logging.dir={tmp_path}/{mode}"],
        )[0]
        assert params_left == 0  # the finished run's model is freed (core's release_ddp)
        steps = [r for r in rows if "loss" in r]
        assert len(steps) == 2, rows
        aux = [r.get("moe_aux_loss") for r in steps]
        if mode == "hf":
            assert all(1.0 <= a <= 4.0 for a in aux), aux
        else:
            assert aux == [None, None], aux
