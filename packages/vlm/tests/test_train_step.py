"""The VLM step on megatron's DDP + distributed optimizer (CPU, gloo, tiny Qwen2.5-VL).

From the same HF weights: a fixed batch is learned (the loss falls by more than half in 25
steps); TP=2 and DP=2 give the TP=1 / DP=1 losses and weights within 1e-5 (DP=2 splits the
microbatches of the same global batch), and so do PP=2 and TP=2 x PP=2 (megatron's 1F1B
schedule over three rows padded to one length; every weight compared after 2 steps); a frozen vision tower and projector do not move
while the decoder does; recomputing both components gives the same steps within 1e-6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration
from vlm_testkit import packed_image_row

from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.qwen2_5_vl.model import flavor, to_hf_config

TOL = 1e-5
CFG = flavor("tiny")
V = CFG.vision


BATCH = [packed_image_row(CFG, 0, [[1, 4, 4], [1, 4, 8]]), packed_image_row(CFG, 1, [[1, 8, 4]])]


def _padded(row: dict[str, Any], seq_len: int, pad_id: int = 0) -> dict[str, Any]:
    """``row`` padded to ``seq_len`` tokens as the packer pads (one more segment, no loss)."""
    n = seq_len - row["input_ids"].shape[1]
    out = dict(row)
    out["input_ids"] = torch.cat([row["input_ids"], torch.full((1, n), pad_id)], dim=1)
    out["labels"] = torch.cat([row["labels"], torch.full((1, n), pad_id)], dim=1)
    out["loss_mask"] = torch.cat([row["loss_mask"], torch.zeros(1, n)], dim=1)
    out["cu_seqlens"] = [*row["cu_seqlens"], seq_len]
    return out


PP_BATCH = [_padded(r, 48) for r in (*BATCH, packed_image_row(CFG, 2, [[1, 4, 4]], text=9))]
"""Rows of one length (stages exchange one activation shape), three microbatches."""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(to_hf_config(CFG))
    out = tmp_path_factory.mktemp("vlm_step")
    model.save_pretrained(out)
    return out


def _worker(
    rank: int,
    world: int,
    hf_dir: Path,
    tp: int,
    steps: int,
    frozen: tuple[str, ...],
    recompute: tuple[str, ...] = (),
    pp: int = 1,
    batch: list[dict[str, Any]] = BATCH,
    lr_scale: dict[str, float] | None = None,
) -> dict[str, Any]:
    from megatron.core import parallel_state as mps

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.hf_io import gather_hf_state_dict, rank_coords, tp_shards
    from longboat.vlm.models.qwen2_5_vl.model import build_qwen2_5_vl, load_hf, read_hf_config
    from longboat.vlm.train.step import VLMTrainStep, component_params

    cfg = read_hf_config(hf_dir)
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)
    parallel_state.initialize(parallel, get_accelerator("cpu"))
    try:
        model = build_qwen2_5_vl(cfg, recompute=recompute)
        load_hf(model, cfg, hf_dir)
        before = {c: [p.detach().clone() for p in component_params(model, c)] for c in
                  ("vision", "projector", "language")}  # fmt: skip
        optim = OptimConfig(lr=3e-3, weight_decay=0.0, grad_clip=1.0)
        step = VLMTrainStep(model, optim, precision="fp32", frozen=frozen, lr_scale=lr_scale)
        dp, dp_rank = mps.get_data_parallel_world_size(), mps.get_data_parallel_rank()
        mine = batch[dp_rank::dp]
        losses = []
        for _ in range(steps):
            losses.append(float(step.forward_backward(mine)))
            step.update()
        moved = {
            c: max(
                (float((p - q).abs().max()) for p, q in zip(component_params(model, c), old)),
                default=0.0,
            )
            for c, old in before.items()
        }
        coords = rank_coords()
        head = model.language.shared_embedding_or_output_weight()
        full_head = torch.cat(tp_shards(head.detach(), coords), dim=0)
        # Every weight under its HF name: this stage's decoder layers, the tower (first stage).
        weights = gather_hf_state_dict([model.language], cfg.language)
        if model.vision is not None and tp == 1:
            weights |= {f"visual.{k}": v.detach().clone() for k, v in
                        model.vision.state_dict().items() if isinstance(v, torch.Tensor)}  # fmt: skip
        vision_recompute = model.vision.recompute if model.vision is not None else None
        switches = (vision_recompute, model.language.config.recompute_granularity)
        return {"losses": losses, "moved": moved, "head": full_head, "recompute": switches,
                "weights": weights}  # fmt: skip
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_fixed_batch_is_learned(hf_dir: Path) -> None:
    (out,) = run_multiprocess(_worker, 1, hf_dir, 1, 25, (), timeout=300)
    first, last = out["losses"][0], out["losses"][-1]
    assert last < 0.5 * first, f"loss {first:.3f} -> {last:.3f} in 25 steps"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_parallel_equals_single(layout: str, hf_dir: Path) -> None:
    (ref,) = run_multiprocess(_worker, 1, hf_dir, 1, 3, (), timeout=300)
    outs = run_multiprocess(_worker, 2, hf_dir, 2 if layout == "tp2" else 1, 3, (), timeout=300)
    for out in outs:
        for a, b in zip(out["losses"], ref["losses"], strict=True):
            assert abs(a - b) < TOL * max(1.0, abs(b)), (layout, out["losses"], ref["losses"])
        diff = (out["head"] - ref["head"]).abs().max().item()
        assert diff < TOL, f"{layout}: output weights differ by {diff:.2e} after 3 steps"


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2_pp2"])
def test_pipeline_parallel_equals_single(tp: int, hf_dir: Path) -> None:
    """PP=2 (vision tower and embedding on stage 0, two decoder layers per stage, loss on
    stage 1, tied embedding synced between them) takes the PP=1 steps within 1e-5 (at TP=2,
    those of TP=2 without pipelining)."""
    ref = run_multiprocess(_worker, tp, hf_dir, tp, 2, (), (), 1, PP_BATCH, timeout=300)[0]
    outs = run_multiprocess(_worker, 2 * tp, hf_dir, tp, 2, (), (), 2, PP_BATCH, timeout=300)
    for out in outs:
        for a, b in zip(out["losses"], ref["losses"], strict=True):
            assert abs(a - b) < TOL * max(1.0, abs(b)), (out["losses"], ref["losses"])
    assert ref["losses"][1] < ref["losses"][0]
    stages = [out["weights"] for out in outs if out["weights"]]  # one owner rank per stage
    assert len(stages) == 2
    assert set(stages[0]) & set(stages[1]) == set(), "a tensor on both stages"
    assert set(stages[0]) | set(stages[1]) == set(ref["weights"])
    assert tp > 1 or any(k.startswith("visual.") for k in stages[0])
    last_layer = "model.layers.3."
    assert any(k.startswith(last_layer) for k in stages[1])
    assert not any(k.startswith(last_layer) for k in stages[0])
    diffs = {k: (w[k] - ref["weights"][k]).abs().max().item() for w in stages for k in w}
    diff = max(diffs.values())
    assert diff < TOL, f"PP=2 weights differ from PP=1 by {diff:.2e} after 2 steps"
    # The key bias's true gradient is zero (softmax ignores a shift shared by all keys), so
    # Adam turns its rounding noise into lr-sized steps; every other weight agrees closely.
    rest = max(v for k, v in diffs.items() if not k.endswith("k_proj.bias"))
    assert rest < 1e-6, f"PP=2 weights (key biases aside) differ by {rest:.2e}"
    # Both stages hold the tied embedding; the last stage's copy follows the first's.
    assert (outs[-1]["head"] - ref["head"]).abs().max().item() < TOL
    loss_diff = max(abs(a - b) for o in outs for a, b in zip(o["losses"], ref["losses"]))
    print(f"PP=2 vs PP=1 (tp={tp}): losses within {loss_diff:.1e}, weights {diff:.1e} ({rest:.1e})")


@pytest.mark.multiprocess
def test_frozen_components_do_not_move(hf_dir: Path) -> None:
    (out,) = run_multiprocess(_worker, 1, hf_dir, 1, 2, ("vision", "projector"), timeout=300)
    assert out["moved"]["vision"] == 0.0
    assert out["moved"]["projector"] == 0.0
    assert out["moved"]["language"] > 1e-4


@pytest.mark.multiprocess
def test_lr_scale_sets_each_components_step(hf_dir: Path) -> None:
    """``model.lr_scale``: Adam's first update of a weight is ``lr * g / (|g| + eps)``, so the
    largest move in each component is its own peak LR: 3e-3 for the decoder, a tenth of it
    for the ViT blocks, a quarter for the projector."""
    args = (hf_dir, 1, 1, (), (), 1, BATCH, {"vision": 0.1, "projector": 0.25})
    (out,) = run_multiprocess(_worker, 1, *args, timeout=300)
    moved = out["moved"]
    assert moved["language"] == pytest.approx(3e-3, rel=1e-3)
    assert moved["vision"] == pytest.approx(3e-4, rel=1e-3)
    assert moved["projector"] == pytest.approx(7.5e-4, rel=1e-3)


def test_lr_scale_is_checked_before_the_run() -> None:
    from longboat.core.config.errors import ConfigError
    from longboat.vlm.train.step import check_lr_scale

    check_lr_scale({"vision": 0.1, "projector": 1})
    for bad, frozen, key in (
        ({"tower": 0.1}, (), "model.lr_scale.tower"),
        ({"vision": 0.0}, (), "model.lr_scale.vision"),
        ({"projector": "low"}, (), "model.lr_scale.projector"),
        ({"vision": 0.1}, ("vision",), "model.lr_scale.vision"),
    ):
        with pytest.raises(ConfigError) as err:
            check_lr_scale(bad, frozen)
        assert err.value.keys == [key], (bad, str(err.value))


@pytest.mark.multiprocess
def test_recompute_gives_the_same_steps(hf_dir: Path) -> None:
    """Recomputing the ViT blocks and the decoder layers changes memory, not the math."""
    (ref,) = run_multiprocess(_worker, 1, hf_dir, 1, 3, (), (), timeout=300)
    (out,) = run_multiprocess(_worker, 1, hf_dir, 1, 3, (), ("vision", "language"), timeout=300)
    assert out["recompute"] == (True, "full") and ref["recompute"] == (False, None)
    for a, b in zip(out["losses"], ref["losses"], strict=True):
        assert abs(a - b) < 1e-6, (out["losses"], ref["losses"])
    assert (out["head"] - ref["head"]).abs().max().item() < 1e-6


def _exact_main_worker(rank: int, world: int, hf_dir: Path) -> dict[str, Any]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.optimizer import main_weight_shards
    from longboat.vlm.models.qwen2_5_vl import model as family
    from longboat.vlm.train.step import VLMTrainStep
    from longboat.vlm.train.training import exact_main_weights

    cfg = family.read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        model = family.build(cfg, precision="bf16")
        family.load_hf(model, cfg, hf_dir)
        step = VLMTrainStep(model, OptimConfig(), precision="bf16")
        exact = family.build(cfg, precision="fp32")
        family.load_hf(exact, cfg, hf_dir)
        want = dict(exact.named_parameters())
        out: dict[str, Any] = {
            "set": exact_main_weights(step.optimizer, model, family, cfg, str(hf_dir), "bf16"),
            "fp32_run": exact_main_weights(step.optimizer, model, family, cfg, str(hf_dir), "fp32"),
            "bf16_params": sum(p.dtype == torch.bfloat16 for p in model.parameters()),
            "equal": True,
            "off_grid": 0,
        }
        for name, (start, end, shard) in main_weight_shards(step.optimizer, model).items():
            value = want[name].detach().reshape(-1)[start:end]
            out["equal"] &= torch.equal(shard, value)
            out["off_grid"] += int((value.bfloat16().float() != value).sum())
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_bf16_step_starts_main_weights_from_the_checkpoints_fp32_values(hf_dir: Path) -> None:
    """From an fp32 HF checkpoint, a bf16 run's fp32 main weights hold the file's values (not
    the bf16 model's rounding); an fp32 run leaves them alone."""
    (out,) = run_multiprocess(_exact_main_worker, 1, hf_dir, timeout=300)
    assert out["set"] == out["bf16_params"] > 0 and out["fp32_run"] == 0
    assert out["equal"] and out["off_grid"] > 0
