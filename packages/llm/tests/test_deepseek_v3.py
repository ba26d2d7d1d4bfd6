"""DeepSeek-V3 (``models/deepseek_v3``): logits equal to transformers' ``DeepseekV3ForCausalLM``
from tiny random checkpoints, HF tensors in and out bit for bit, the aux-loss-free bias update
against its formula, the multi-token prediction loss against its definition, and two steps
of ``longboat-llm train model=deepseek_v3_tiny`` whose export transformers reloads."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.core.family import find_family

TOL = 1e-4  # max |logits - transformers| in fp32
FAMILY = "deepseek_v3"


def tiny(**changes: Any) -> Any:
    """The tiny flavor with ``changes``."""
    return dataclasses.replace(find_family("llm", FAMILY).flavor("tiny"), **changes)


VARIANTS = {
    # q compression, two expert groups (one chosen per token), one shared expert
    "tiny": {},
    # Moonlight's layout: full q projection, no groups, two shared experts, YaRN rotary
    "moonlight_like": dict(
        q_lora_rank=None,
        moe_router_num_groups=1,
        moe_router_group_topk=1,
        moe_topk=3,
        num_shared_experts=2,
        first_k_dense=2,
        num_layers=4,
        moe_routed_scaling_factor=2.446,
        yarn_factor=4.0,
        yarn_original_max_position_embeddings=64,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
    ),
    # DeepSeek-V3.2: the lightning indexer keeps 5 of up to 12 keys per query
    "v32": dict(index_topk=5, index_n_heads=2, index_head_dim=16, num_layers=4),
}


def make_hf_checkpoint(cfg: Any, out: Path, *, seed: int = 0) -> Path:
    """A random ``DeepseekV3ForCausalLM`` of ``cfg`` saved to ``out``, with random norm
    weights and expert biases (so a skipped norm or bias shows in the logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(find_family("llm", FAMILY).to_hf_config(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return out


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _init(layout: dict[str, int]) -> None:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(**layout), get_accelerator("cpu"), seed=1)


def _logits_worker(
    rank: int, world: int, hf_dir: Path, tokens: torch.Tensor, layout: dict, out: Path
) -> torch.Tensor | None:
    from pipeline_testkit import forward_logits

    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config, save_hf

    layout = dict(layout)
    experts = layout.pop("moe_experts", "auto")
    cfg = dataclasses.replace(read_hf_config(hf_dir), moe_experts=experts)
    _init(layout)
    try:
        chunks = build_model(cfg)
        names = [n for n, _ in chunks[0].named_parameters()]
        stacked = any(n.endswith("mlp.experts.linear_fc1.weight") for n in names)
        if any(".mlp.experts." in n for n in names):  # a stage with MoE layers
            assert stacked == (experts != "sequential"), names  # grouped where available
        load_hf(chunks, cfg, hf_dir)
        logits = forward_logits(chunks, tokens)
        save_hf(chunks, cfg, out)
        return logits
    finally:
        parallel_state.destroy()


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return out


LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_parallel": 2}),
    "ep2": (2, {"expert_parallel": 2}),
    "pp2": (2, {"pipeline_parallel": 2}),
    "tp1_sequential": (1, {"moe_experts": "sequential"}),  # megatron's per-expert loop
}
CASES = [("tiny", "tp1"), ("moonlight_like", "tp1"), ("tiny", "ep2"), ("moonlight_like", "pp2")]
CASES += [("tiny", "tp2"), ("moonlight_like", "tp2"), ("tiny", "tp1_sequential")]
CASES += [("v32", "tp1"), ("v32", "ep2"), ("v32", "pp2")]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("variant", "layout"), CASES)
def test_logits_match_transformers_and_the_export_is_the_source(
    variant: str, layout: str, tmp_path: Path
) -> None:
    cfg = tiny(**VARIANTS[variant])
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    want = hf_logits(hf_dir, tokens)
    world, parallel = LAYOUTS[layout]
    outs = run_multiprocess(
        _logits_worker, world, hf_dir, tokens, parallel, tmp_path / "out", timeout=600
    )
    got = [o for o in outs if o is not None]
    assert got
    for logits in got:
        diff = (logits - want).abs().max().item()
        assert diff <= TOL, f"{variant} {layout}: max |logits - transformers| = {diff:.3e}"
    assert want.abs().max().item() > 0.1  # the comparison has teeth
    if cfg.index_topk is not None:  # and the indexer's choice changes what is compared
        dense = make_hf_checkpoint(dataclasses.replace(cfg, index_topk=64), tmp_path / "dense")
        assert (hf_logits(dense, tokens) - want).abs().max().item() > 100 * TOL
    source, saved = _saved(hf_dir), _saved(tmp_path / "out")
    assert sorted(saved) == sorted(source)
    assert [n for n in source if not torch.equal(source[n], saved[n])] == []


def _mtp_export_worker(rank: int, world: int, out1: Path, out2: Path, tokens: torch.Tensor) -> Any:
    from pipeline_testkit import forward_logits

    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, save_hf

    cfg = tiny(mtp_num_layers=1)
    _init({})
    try:
        first = build_model(cfg)
        save_hf(first, cfg, out1)  # the random init, MTP layer included
        logits = forward_logits(first, tokens)
        second = build_model(cfg)
        load_hf(second, cfg, out1)
        save_hf(second, cfg, out2)
        return logits
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_an_mtp_model_exports_deepseeks_layout_and_loads_back(tmp_path: Path) -> None:
    tokens = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    out1, out2 = tmp_path / "a", tmp_path / "b"
    (logits,) = run_multiprocess(_mtp_export_worker, 1, out1, out2, tokens, timeout=600)
    first, second = _saved(out1), _saved(out2)
    assert sorted(first) == sorted(second)
    assert [n for n in first if not torch.equal(first[n], second[n])] == []
    # DeepSeek's layout: the prediction depth is layer num_layers, with copies of the shared
    # embedding and head, which transformers' model (no MTP) leaves unused.
    assert torch.equal(
        first["model.layers.3.embed_tokens.weight"], first["model.embed_tokens.weight"]
    )
    assert torch.equal(first["model.layers.3.shared_head.head.weight"], first["lm_head.weight"])
    assert "model.layers.3.eh_proj.weight" in first
    assert (hf_logits(out1, tokens) - logits).abs().max().item() <= TOL


def _bias_worker(rank: int, world: int, rate: float, steps: int) -> dict[str, Any]:
    """``steps`` optimizer steps of the tiny model (two microbatches each) through the llm
    stack's step; each router's bias after every step and the tokens each expert got."""
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron import parallel_state
    from longboat.llm.train.lm_step import build_train_step

    _init({})
    try:
        cfg = tiny(moe_router_bias_update_rate=rate)
        step = build_train_step(cfg, OptimConfig(lr=1e-3), precision="fp32", device="cpu",
                                microbatches=2, one_pass_adamw=False)  # fmt: skip
        routers = [m for m in step.chunks[0].modules() if hasattr(m, "expert_bias")
                   and m.expert_bias is not None]  # fmt: skip
        counts: list[list[torch.Tensor]] = [[] for _ in routers]
        for i, router in enumerate(routers):
            router.register_forward_hook(
                lambda mod, args, out, i=i: counts[i].append(out[1].sum(0).float())
            )
        biases = [[r.expert_bias.detach().clone()] for r in routers]
        loads = [[] for _ in routers]
        g = torch.Generator().manual_seed(5)
        for _ in range(steps):
            micro = []
            for _ in range(2):
                tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
                micro.append(step.batch(tokens, torch.roll(tokens, -1, 1)))
            for c in counts:
                c.clear()
            step.forward_backward(micro)
            step.update()
            for i, r in enumerate(routers):
                loads[i].append(torch.stack(counts[i]).sum(0))
                biases[i].append(r.expert_bias.detach().clone())
        return {"biases": biases, "loads": loads}
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_the_expert_bias_follows_the_aux_loss_free_update_over_ten_steps() -> None:
    rate = 0.01
    (out,) = run_multiprocess(_bias_worker, 1, rate, 10, timeout=600)
    assert len(out["biases"]) == 2  # the two MoE layers (layer 0 is dense)
    for biases, loads in zip(out["biases"], out["loads"], strict=True):
        assert torch.equal(biases[0], torch.zeros(8))
        for before, after, load in zip(biases, biases[1:], loads, strict=False):
            assert load.sum().item() == 2 * 2 * 16 * 2  # microbatches x tokens x top-2
            # b <- b + rate * sign(mean load - load): up for the underloaded experts
            want = before + torch.sign(load.mean() - load) * rate
            assert torch.allclose(after, want, atol=1e-7, rtol=0), (after, want)
        assert not torch.equal(biases[-1], biases[0])
    (fixed,) = run_multiprocess(_bias_worker, 1, 0.0, 2, timeout=600)
    assert all(torch.equal(b, torch.zeros(8)) for layer in fixed["biases"] for b in layer)


def _mtp_worker(rank: int, world: int, scale: float) -> dict[str, Any]:
    """Megatron's MTP loss and gradient next to the definition's, on the tiny model."""
    import torch.nn.functional as F
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model

    _init({})
    try:
        (model,) = build_model(tiny(mtp_num_layers=1, mtp_loss_scaling_factor=scale))
        model.train()
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 256, (2, 12), generator=g)
        labels = torch.roll(tokens, -1, 1)
        pos = torch.arange(12).unsqueeze(0).expand(2, -1)
        seen: dict[str, torch.Tensor] = {}
        model.decoder.register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
        MTPLossLoggingHelper.tracker.clear()
        out = model(tokens, pos, None, labels=labels)
        out.mean().backward()
        logged = MTPLossLoggingHelper.tracker["loss_values"][0].item()
        layer = model.mtp.layers[0]
        grad = layer.eh_proj.weight.grad.clone()
        model.zero_grad()
        # The definition: depth 1 combines position i's hidden state with token i+1's
        # embedding and predicts token i+2 through the shared head; positions without a
        # target (the last) are left out.
        h = seen["h"].detach()
        nxt = torch.roll(tokens, -1, 1)
        nxt[:, -1] = 0
        e = model.embedding(input_ids=nxt, position_ids=pos)
        x, _ = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], -1))
        y, _ = layer.mtp_model_layer(hidden_states=x, attention_mask=None)
        logits, _ = model.output_layer(layer.final_layernorm(y))
        target = torch.roll(labels, -1, 1)
        ce = F.cross_entropy(logits.transpose(0, 1).reshape(-1, 256).float(),
                             target.reshape(-1), reduction="none").view(2, 12)  # fmt: skip
        keep = torch.ones(2, 12)
        keep[:, -1] = 0
        loss = (ce * keep).sum() / keep.sum()
        (scale * loss).backward()
        return {"logged": logged, "ref": loss.item(), "grad": grad,
                "ref_grad": layer.eh_proj.weight.grad.clone()}  # fmt: skip
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_multi_token_prediction_loss_and_gradient_follow_the_definition() -> None:
    (out,) = run_multiprocess(_mtp_worker, 1, 0.3, timeout=600)
    assert abs(out["logged"] - out["ref"]) < 1e-5, out
    assert abs(out["ref"] - math.log(256)) < 0.5  # random init: near ln(vocab)
    assert out["grad"].abs().max().item() > 0
    torch.testing.assert_close(out["grad"], out["ref_grad"], atol=1e-6, rtol=1e-5)


def _train(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    """``longboat-llm train`` in this process: its exit code and what it wrote to stderr."""
    import contextlib
    import io

    from longboat.llm.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _reload_worker(rank: int, world: int, run: Path, tokens: torch.Tensor) -> Any:
    """The run's native checkpoint converted to HF (``hf_again``), and longboat's logits of
    the run's export."""
    from pipeline_testkit import forward_logits

    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model
    from longboat.llm.convert import native_to_hf
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config

    native_to_hf(run / "checkpoints", run / "hf_again")
    cfg = read_hf_config(run / "hf")
    _init({})
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, run / "hf")
        return forward_logits(chunks, tokens)
    finally:
        parallel_state.destroy()


def _two_steps(out: Path, *model: str) -> list[str]:
    """``longboat-llm train`` argv: two steps of the quickstart on synthetic tokens."""
    return [
        "train", "quickstart", *model, "data=synthetic",
        "data.seq_len=32", "data.num_documents=64", "train.steps=2",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_every=1",
        "train.eval_every=0", "optim.schedule.warmup_steps=1", "checkpoint.every_steps=0",
        "logging.progress=false", "logging.trackers=[]", "llm.generate_prompt=null",
        f"output_dir={out}",
    ]  # fmt: skip


def _trained_rows(out: Path, argv: list[str], **launch: Any) -> list[dict[str, Any]]:
    """Run ``argv`` (exit 0) and return its two step rows, each checked: a random init over a
    256-token vocabulary starts at about ln(256), with a finite, positive gradient norm.
    ``launch``: ``run_multiprocess`` options (a CUDA run: nccl in a spawned process)."""
    ((code, err),) = run_multiprocess(_train, 1, argv, timeout=900, **launch)
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert abs(row["loss"] - math.log(256)) < 0.3, row
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0, row
    return rows


@pytest.mark.multiprocess
def test_two_training_steps_through_the_cli_and_the_export_reloads(tmp_path: Path) -> None:
    argv = _two_steps(tmp_path, "model=deepseek_v3_tiny", "model.mtp_num_layers=1")
    for row in _trained_rows(tmp_path, argv):
        assert abs(row["mtp_loss"] - math.log(256)) < 0.3, row  # the step's own, not a sum
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    (ours,) = run_multiprocess(_reload_worker, 1, tmp_path, tokens, timeout=600)
    # The export holds the trained weights: the native checkpoint converts to the same tensors.
    first, second = _saved(tmp_path / "hf"), _saved(tmp_path / "hf_again")
    assert sorted(first) == sorted(second)
    assert [n for n in first if not torch.equal(first[n], second[n])] == []
    assert (hf_logits(tmp_path / "hf", tokens) - ours).abs().max().item() <= TOL
    # The latent ranks fix the checkpoint's shapes: resuming with another is refused.
    ((code, err),) = run_multiprocess(_train, 1, [*argv, "model.kv_lora_rank=8"], timeout=600)
    assert code == 2 and "model.kv_lora_rank=16 (this run: 8)" in err, err[-2000:]


# -- config (no megatron) ------------------------------------------------------------------


def test_flavors_have_the_published_parameter_counts() -> None:
    from longboat.llm.models.deepseek_v3.flops import param_counts

    fam = find_family("llm", FAMILY)
    main = dataclasses.replace(fam.flavor("671b"), mtp_num_layers=0)
    total, active = param_counts(main)
    assert abs(total / 1e9 - 671) < 1.0 and abs(active / 1e9 - 37.5) < 1.0, (total, active)
    total, active = param_counts(fam.flavor("kimi_k2"))
    assert abs(total / 1e12 - 1.03) < 0.01 and abs(active / 1e9 - 32.9) < 0.5
    total, _ = param_counts(fam.flavor("moonlight_16b_a3b"))
    assert abs(total / 1e9 - 15.96) < 0.05  # 15.29B published without the output head


def test_unsupported_layouts_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="moe_router_group_topk"):
        tiny(moe_router_group_topk=2, moe_router_num_groups=4).validate()
    with pytest.raises(ConfigError, match="num_query_groups"):
        tiny(num_query_groups=2).validate()
    with pytest.raises(ConfigError, match="moe_aux_loss"):
        tiny(moe_aux_loss="hf").validate()
    sparse = VARIANTS["v32"]
    with pytest.raises(ConfigError, match=r"model\.index_topk"):
        tiny(**sparse, q_lora_rank=None).validate()
    with pytest.raises(ConfigError, match=r"model\.index_head_dim"):
        tiny(**{**sparse, "index_head_dim": 4}).validate()
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel"):
        tiny(**sparse).validate_parallel(tp=2, pp=1, ep=1)
    fam = find_family("llm", FAMILY)
    hf = fam.to_hf_config(fam.flavor("tiny")).to_dict()
    hf["scoring_func"] = "softmax"
    with pytest.raises(ConfigError, match="scoring_func"):
        fam.from_hf_config(hf)


def test_the_cli_refuses_what_the_family_cannot_run_before_any_work() -> None:
    from llm_testkit import compose

    with pytest.raises(ConfigError, match=r"lora\.targets"):
        compose(["model=deepseek_v3_v32_tiny", "lora.enabled=true",
                 "lora.targets=[linear_kv_up_proj]"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"model\.moe_router_group_topk"):
        compose(["model=deepseek_v3_tiny", "model.moe_router_group_topk=2"])
    from longboat.core.train import typed_config

    cfg = typed_config(compose(["model=deepseek_v3_tiny", "parallel.expert_parallel=1"]))
    assert type(cfg.model).__name__ == "DeepseekV3Config" and cfg.model.kv_lora_rank == 16


def test_kimi_k2_and_yarn_configs_read_back() -> None:
    fam = find_family("llm", FAMILY)
    for flavor in ("671b", "kimi_k2"):
        cfg = fam.flavor(flavor)
        hf = fam.to_hf_config(cfg).to_dict()
        assert hf["rope_parameters"]["rope_type"] == "yarn"
        hf["model_type"] = "kimi_k2" if flavor == "kimi_k2" else hf["model_type"]
        back = fam.from_hf_config(hf)
        assert back.architecture() == cfg.architecture()


def _seq_aux_worker(rank: int, world: int, coeff: float) -> dict[str, Any]:
    """megatron's sequence-wise balance loss of the first MoE layer, its gradient on the
    router, and DeepSeek-V3's definition of both from the router's input."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model

    _init({})
    try:
        cfg = tiny(moe_aux_loss_coeff=coeff)
        (model,) = build_model(cfg)
        model.train()
        router = model.decoder.layers[1].mlp.router
        seen: dict[str, torch.Tensor] = {}
        router.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach()))
        tokens = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(6))
        pos = torch.arange(10).unsqueeze(0).expand(3, -1)
        tracker = get_moe_metrics_tracker()
        tracker.metrics.clear()
        model(tokens, pos, None)  # with autograd: megatron forms the loss only then
        logged = tracker.metrics["seq_load_balancing_loss"].values[1].item()
        x = seen["x"]  # [s, b, h]
        model.zero_grad()
        probs, _ = router(x)
        (probs * 0).sum().backward()  # the balance loss's gradient alone
        grad = router.weight.grad.clone()
        router.weight.grad = None
        # The definition: per sequence of T tokens, f_i = E / (K T) * (tokens whose top-K
        # scores hold expert i), P_i = mean over tokens of s_i / sum_j s_j; the loss is
        # sum_i f_i P_i, averaged over the sequences.
        e, k = cfg.num_experts, cfg.moe_topk
        scores = torch.sigmoid(x.float() @ router.weight.float().t())  # [s, b, E]
        losses = []
        for b in range(scores.shape[1]):
            s = scores[:, b]
            count = torch.zeros(e).index_add_(0, s.topk(k, -1).indices.reshape(-1),
                                              torch.ones(s.shape[0] * k))  # fmt: skip
            f = e / (k * s.shape[0]) * count
            p = (s / s.sum(-1, keepdim=True)).mean(0)
            losses.append((f * p).sum())
        ref = torch.stack(losses).mean()
        (coeff * ref).backward()
        return {"logged": logged, "ref": ref.item(), "grad": grad, "ref_grad": router.weight.grad}
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_the_sequence_wise_balance_loss_follows_the_definition() -> None:
    (out,) = run_multiprocess(_seq_aux_worker, 1, 0.01, timeout=600)
    assert abs(out["logged"] - out["ref"]) < 1e-5, out
    assert out["ref"] > 0.5  # sum_i f_i P_i is about 1 for a balanced router
    assert out["grad"].abs().max().item() > 0
    torch.testing.assert_close(out["grad"], out["ref_grad"], atol=1e-7, rtol=1e-5)


def test_a_deepseek_v3_checkpoint_is_the_model_of_any_experiment(tmp_path: Path) -> None:
    from llm_testkit import compose

    from longboat.core.train import typed_config

    cfg = tiny(kv_lora_rank=8, mtp_num_layers=1)
    find_family("llm", FAMILY).to_hf_config(cfg).save_pretrained(tmp_path)
    # quickstart's model group is a Qwen3: config.json replaces it, every MLA field included
    run = typed_config(compose([f"model.init_from={tmp_path}"]))
    assert type(run.model).__name__ == "DeepseekV3Config"
    assert run.model.architecture() == cfg.architecture()
    assert run.model.moe_aux_loss == "megatron"  # the group's auto is this family's one term
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        compose([f"model.init_from={tmp_path}", "model.kv_lora_rank=16"])


@pytest.mark.multiprocess
def test_sparse_attention_trains_through_the_cli_and_exports_v32(tmp_path: Path) -> None:
    argv = _two_steps(tmp_path, "model=deepseek_v3_v32_tiny", "model.index_loss_coeff=0.01")
    for row in _trained_rows(tmp_path, argv):
        # 0.01 x a KL divergence between distributions over at most 32 keys: positive, and
        # at most 0.01 x ln(32) per layer unless the indexer is far off.
        assert 0 < row["indexer_loss"] < 0.01 * 2 * math.log(32), row
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "deepseek_v32" and hf_config["index_topk"] == 8
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))
    (ours,) = run_multiprocess(_reload_worker, 1, tmp_path, tokens, timeout=600)
    # transformers' DeepseekV32ForCausalLM runs the export (24 keys, 8 chosen) as longboat does.
    assert (hf_logits(tmp_path / "hf", tokens) - ours).abs().max().item() <= TOL


def _norm_eps_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Every RMSNorm's epsilon of models at ``norm_eps=1e-5`` (Moonlight-like on the longboat
    layers; V3.2's absorbed MLA on the longboat and local layers), by module name."""
    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model

    builds = {
        "longboat": tiny(**VARIANTS["moonlight_like"], norm_eps=1e-5),
        "v32": tiny(**VARIANTS["v32"], norm_eps=1e-5),
        "v32_local": tiny(**VARIANTS["v32"], norm_eps=1e-5, layer_backend="local"),
    }
    _init({})
    try:
        out = {}
        for name, cfg in builds.items():
            (model,) = build_model(cfg)
            out[name] = {n: float(m.eps) for n, m in model.named_modules()
                         if n.endswith("norm") and hasattr(m, "eps")}  # fmt: skip
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_the_latent_norms_keep_deepseeks_epsilon_whatever_rms_norm_eps_says() -> None:
    """DeepSeek-V3's code and transformers build MLA's q / kv latent norms at 1e-6 and only the
    layer norms at ``rms_norm_eps`` (Moonlight: 1e-5). With the latent norms at 1e-5 a tiny
    Moonlight-like model trained 30 steps 2.5e-3 away from transformers in fp32 (1.4e-6
    with 1e-6: tools/bench's alignment test)."""
    (out,) = run_multiprocess(_norm_eps_worker, 1, timeout=600)
    for name, eps in out.items():
        latent = {n: e for n, e in eps.items() if n.endswith(("q_layernorm", "kv_layernorm"))}
        layer = {n: e for n, e in eps.items() if n.endswith(("input_layernorm",
                 "pre_mlp_layernorm", "final_layernorm"))}  # fmt: skip
        assert latent and set(latent.values()) == {1e-6}, (name, latent)
        assert layer and set(layer.values()) == {1e-5}, (name, layer)
    assert not any(n.endswith("q_layernorm") for n in out["longboat"])  # no q latent
    assert any(n.endswith("q_layernorm") for n in out["v32"])


def test_the_indexer_key_norm_runs_bf16_keys_on_fp32_weights_in_fp32() -> None:
    """The indexer's key LayerNorm keeps fp32 weights (as megatron builds torch norms) and
    takes bf16 keys, which CUDA's layer_norm refuses mixed: it normalises in fp32 and
    returns the key's dtype, equal to the fp32 norm rounded once."""
    from longboat.llm.models.deepseek_v3.model import IndexerKeyNorm

    norm = IndexerKeyNorm(config=None, hidden_size=16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        norm.bias.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(2))
    k = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = norm(k)
    ref = torch.nn.functional.layer_norm(k.float(), (16,), norm.weight, norm.bias, 1e-6)
    assert norm.weight.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16))


@pytest.mark.gpu
def test_sparse_attention_trains_in_bf16_on_cuda(tmp_path: Path) -> None:
    """V3.2 on the DSA kernels in bf16 on CUDA (the CLI's GPU defaults): two steps train."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    argv = _two_steps(tmp_path, "model=deepseek_v3_v32_tiny", "train.precision=bf16")
    # gloo workers train on the CPU; a forked child cannot use CUDA once the parent has.
    _trained_rows(tmp_path, argv, backend="nccl", start_method="spawn")


def test_sparse_attention_runs_its_step_eagerly_with_the_reason() -> None:
    """The engine's graph check finds the DSA layer's declared reason among the model's
    modules: ``train.cuda_graph`` unset runs eagerly and says why; other modules pass."""
    pytest.importorskip("megatron.core")
    from longboat.core.megatron.engine.graphed_step import graph_blocker
    from longboat.llm.models.deepseek_v3.sparse_attention import kernel_dsattention

    layer = kernel_dsattention().__new__(kernel_dsattention())
    torch.nn.Module.__init__(layer)
    kwargs = dict(microbatches=1, pipeline_parallel=1, optimizer=object(), one_pass=None,
                  grad_clip=0.0, fused=True)  # fmt: skip
    why = graph_blocker(**kwargs, modules=[torch.nn.Linear(2, 2), layer])
    assert why is not None and why.startswith("DeepSeek-V3.2's sparse attention")
    assert graph_blocker(**kwargs, modules=[torch.nn.Linear(2, 2)]) is None


def test_sparse_attention_counts_the_indexer_and_only_the_chosen_keys() -> None:
    from transformers import AutoModelForCausalLM

    from longboat.llm.models.deepseek_v3.flops import flops_per_sample, param_counts

    fam = find_family("llm", FAMILY)
    v32 = fam.flavor("v32_tiny")
    hf = AutoModelForCausalLM.from_config(fam.to_hf_config(v32))
    assert param_counts(v32)[0] == sum(p.numel() for p in hf.parameters())
    # DeepSeek-V3.2-Exp: DeepSeek-V3 plus an indexer in each of its 61 layers and the MTP
    # layer, each wq_b 1536 x 64*128, wk 7168 x 128, a LayerNorm of 128, weights_proj 7168 x 64.
    extra = param_counts(fam.flavor("v32"))[0] - param_counts(fam.flavor("671b"))[0]
    assert extra == 62 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64), extra
    # Beyond index_topk keys, attention FLOPs stop growing with the sequence: at 4x the
    # sequence a token's cost grows by the indexer's scores only.
    dense = dataclasses.replace(v32, index_topk=None)
    per_token = [flops_per_sample(v32, s) / s for s in (64, 256)]
    dense_per_token = [flops_per_sample(dense, s) / s for s in (64, 256)]
    assert per_token[1] - per_token[0] < dense_per_token[1] - dense_per_token[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sparse_attention_on_the_dsa_kernels_in_the_interpreter() -> None:
    """``dsa_kernel_checks.py`` in a subprocess with Triton's interpreter: the V3.2 model with
    its sparse attention on longboat's DSA kernels equals megatron's path (logits, every
    gradient, the indexer's KL loss) and transformers (logits). ~3 minutes on 2 cores: every
    longboat kernel of the model runs through the interpreter."""
    import os
    import subprocess
    import sys

    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "2"}
    env.pop("LONGBOAT_KERNELS_IMPL", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
           str(here / "dsa_kernel_checks.py")]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=here.parents[2], env=env, capture_output=True, text=True, timeout=900
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "2 passed" in proc.stdout, tail
