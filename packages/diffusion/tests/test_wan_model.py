"""Wan DiT on megatron == diffusers' ``WanTransformer3DModel`` (CPU, fp32, tiny config, random
weights); packing, text masks, recompute, diffusers checkpoints in and out, TP=2 == TP=1.

Our model runs in gloo worker processes (megatron's parallel state; world size 1, and 2 for
TP=2); diffusers runs in the test process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusion_testkit import check_recompute, loss_and_grads, randn, tensor_parallel_state

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess
from longboat.diffusion.models.wan.config import flavor, read_config
from longboat.diffusion.models.wan.diffusers import (
    WanCheckpointError,
    from_diffusers_state_dict,
    to_diffusers_state_dict,
)
from longboat.diffusion.models.wan.packing import pack_latents, unpack_tokens

REF_TOL = 1e-4  # max abs difference vs diffusers (fp32)
PACK_TOL = 1e-5  # packed call vs each sample alone
TP_TOL = 1e-5  # TP=2 vs TP=1 (outputs and gradients)
RECOMPUTE_TOL = 1e-6  # recompute vs not (loss and gradients)

CFG = flavor("tiny")
ATTENTION_CALLS = CFG.num_layers  # self-attention kernels of one forward (one per block)
C = CFG.in_channels
# name -> (latent shape, timesteps); text of 7 tokens, no mask
DENSE: dict[str, tuple[tuple[int, ...], list[float]]] = {
    "3x8x8": ((2, C, 3, 8, 8), [10.0, 900.0]),
    "5x6x10": ((1, C, 5, 6, 10), [500.0]),
    "1x4x4": ((1, C, 1, 4, 4), [999.0]),
}
PACKED_SHAPES = [(C, 3, 8, 8), (C, 5, 6, 10)]
TEXT_LENS = [4, 9]  # caption lengths, padded to 9


def _dense_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape, ts = DENSE[name]
    seed = list(DENSE).index(name)
    return randn(*shape, seed=seed), torch.tensor(ts), randn(shape[0], 7, CFG.text_dim, seed=50)


def _masked_text() -> tuple[torch.Tensor, torch.Tensor]:
    text = randn(2, max(TEXT_LENS), CFG.text_dim, seed=60)
    mask = torch.arange(max(TEXT_LENS))[None, :] < torch.tensor(TEXT_LENS)[:, None]
    return text, mask


def _packed_samples() -> tuple[list[torch.Tensor], torch.Tensor]:
    samples = [randn(*s, seed=70 + i) for i, s in enumerate(PACKED_SHAPES)]
    return samples, torch.tensor([250.0, 750.0])


def _ref_model(seed: int = 0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**CFG.to_diffusers()).eval()
    with torch.no_grad():  # random norms and tables too, so a swapped or skipped one shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model


# -- the worker: our model under megatron ------------------------------------------------------


def _loss_and_grads(model: Any, recompute: int, **kw: Any) -> tuple[torch.Tensor, dict, int, int]:
    samples, ts = _packed_samples()
    text, mask = _masked_text()
    tokens, packing = pack_latents(samples, CFG.patch_size)
    target = randn(*tokens.shape, seed=80)

    def forward() -> torch.Tensor:
        return model.forward_packed(tokens, packing, ts, text, mask)

    return loss_and_grads(model, model.blocks[0], forward, target, recompute, **kw)


def _worker(rank: int, world: int, hf_state: dict, tmp: str) -> dict[str, Any]:
    from longboat.core.layer_kernels import LayerKernels
    from longboat.diffusion.models.wan.diffusers import (
        load_diffusers,
        load_state_dict,
        save_diffusers,
    )
    from longboat.diffusion.models.wan.model import build

    with tensor_parallel_state(world):
        full = from_diffusers_state_dict(hf_state, CFG)
        model = build(CFG)  # longboat.kernels' RMSNorm, RoPE, AdaLN, attention dispatch
        load_state_dict(model, full)
        res: dict[str, Any] = {"dense": {}}
        text, mask = _masked_text()
        samples, ts = _packed_samples()
        with torch.no_grad():
            for name in DENSE:
                res["dense"][name] = model(*_dense_inputs(name))
            lat = torch.stack([randn(*PACKED_SHAPES[0], seed=90 + i) for i in range(2)])
            res["masked"] = model(lat, ts, text, mask)
            tokens, packing = pack_latents(samples, CFG.patch_size)
            res["packed"] = unpack_tokens(
                model.forward_packed(tokens, packing, ts, text, mask), packing, CFG.patch_size
            )
            res["packed_list"] = model(samples, ts, text, mask)  # packs the list itself
            res["alone"] = [
                model(x[None], ts[i : i + 1], text[i : i + 1], mask[i : i + 1])[0]
                for i, x in enumerate(samples)
            ]
        res["loss"], res["grads"], res["calls"], res["attn"] = _loss_and_grads(model, recompute=0)
        save_diffusers(model, CFG, Path(tmp) / f"export_tp{world}")
        if world == 1:
            for key, again in (("rc", False), ("rc_full", True)):
                res[f"loss_{key}"], res[f"grads_{key}"], res[f"calls_{key}"], res[f"attn_{key}"] = (
                    _loss_and_grads(model, -1, recompute_attention=again)
                )
            # a diffusers directory with sharded safetensors and an index
            sharded = Path(tmp) / "ref_sharded"
            other = build(read_config(sharded))
            res["loaded_tensors"] = load_diffusers(other, read_config(sharded), sharded)
            with torch.no_grad():
                res["loaded_dense"] = other(*_dense_inputs("3x8x8"))
            res["errors"] = _error_messages(model)
            res["flow_matching"] = _flow_matching_losses(model)
            half = build(CFG, precision="bf16")
            load_state_dict(half, full)
            with torch.no_grad():
                lat, ts3, text3 = _dense_inputs("3x8x8")
                res["bf16"] = half(lat.bfloat16(), ts3, text3.bfloat16())
            plain = build(CFG, kernels=LayerKernels())  # torch references of norm and rotation
            load_state_dict(plain, full)
            with torch.no_grad():
                res["torch_kernels"] = plain(*_dense_inputs("5x6x10"))
        return res


@torch.no_grad()
def _flow_matching_losses(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective's loss with the model as its packed ``ModelFn``, and with one call per
    sample instead (same noise and timesteps from the same generator seed)."""
    from longboat.diffusion.objective.flow_matching import FlowMatchingConfig, flow_matching_loss

    samples, _ = _packed_samples()
    text, mask = _masked_text()

    def one_by_one(x_t: list, ts: torch.Tensor, txt: torch.Tensor, m: torch.Tensor) -> list:
        return [
            model(x[None], ts[i : i + 1], txt[i : i + 1], m[i : i + 1])[0]
            for i, x in enumerate(x_t)
        ]

    losses = []
    for fn in (model, one_by_one):
        gen = torch.Generator().manual_seed(5)
        loss, _ = flow_matching_loss(
            fn, samples, text, mask, config=FlowMatchingConfig(), generator=gen
        )
        losses.append(loss)
    return losses[0], losses[1]


def _error_messages(model: Any) -> dict[str, str]:
    lat, ts, text = _dense_inputs("3x8x8")
    bad = {
        "channels": lambda: model(lat[:, :3], ts, text),
        "patch": lambda: model(lat[..., :7], ts, text),
        "timesteps": lambda: model(lat, ts[:1], text),
        "text_dim": lambda: model(lat, ts, text[..., :5]),
        "empty_mask": lambda: model(lat, ts, text, torch.zeros(2, 7, dtype=torch.bool)),
    }
    out = {}
    for key, fn in bad.items():
        try:
            fn()
            out[key] = "no error"
        except ValueError as exc:
            out[key] = str(exc)
    return out


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref() -> WanTransformer3DModel:
    return _ref_model()


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory: pytest.TempPathFactory, ref: WanTransformer3DModel) -> Path:
    path = tmp_path_factory.mktemp("wan")
    ref.save_pretrained(path / "ref_sharded", max_shard_size="40KB")
    return path


@pytest.fixture(scope="module")
def ours_tp1(ref: WanTransformer3DModel, tmp_dir: Path) -> dict[str, Any]:
    return run_multiprocess(_worker, 1, ref.state_dict(), str(tmp_dir))[0]


def _ref_call(ref: Any, lat: torch.Tensor, ts: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(lat, ts, text, return_dict=False)[0]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(DENSE))
def test_matches_diffusers(case: str, ref: Any, ours_tp1: dict[str, Any]) -> None:
    want = _ref_call(ref, *_dense_inputs(case))
    assert want.abs().max().item() > 0.5  # a meaningful scale
    diff = _diff(ours_tp1["dense"][case], want)
    assert diff < REF_TOL, f"{case}: max abs diff {diff:.3g} vs diffusers"


def test_torch_reference_kernels_match_diffusers(ref: Any, ours_tp1: dict[str, Any]) -> None:
    want = _ref_call(ref, *_dense_inputs("5x6x10"))
    assert _diff(ours_tp1["torch_kernels"], want) < REF_TOL


def test_bf16_weights_stay_close_to_fp32(ours_tp1: dict[str, Any]) -> None:
    half, full = ours_tp1["bf16"], ours_tp1["dense"]["3x8x8"]
    assert half.dtype == torch.bfloat16
    assert _diff(half.float(), full) < 0.03 * full.abs().max().item()


def test_text_mask_equals_each_caption_at_its_length(ref: Any, ours_tp1: dict[str, Any]) -> None:
    text, _ = _masked_text()
    _, ts = _packed_samples()
    lat = torch.stack([randn(*PACKED_SHAPES[0], seed=90 + i) for i in range(2)])
    for i, n in enumerate(TEXT_LENS):
        want = _ref_call(ref, lat[i : i + 1], ts[i : i + 1], text[i : i + 1, :n])[0]
        diff = _diff(ours_tp1["masked"][i], want)
        assert diff < REF_TOL, f"sample {i} ({n} caption tokens): max abs diff {diff:.3g}"
    # The padding is really masked: sample 0 attending to its 5 padded tokens differs.
    padded = _ref_call(ref, lat[:1], ts[:1], text[:1])[0]
    assert _diff(ours_tp1["masked"][0], padded) > 100 * REF_TOL


def test_packed_equals_each_sample_alone_and_diffusers(ref: Any, ours_tp1: dict) -> None:
    samples, ts = _packed_samples()
    text, _ = _masked_text()
    for i, (x, n) in enumerate(zip(samples, TEXT_LENS)):
        packed, alone = ours_tp1["packed"][i], ours_tp1["alone"][i]
        assert packed.shape == x.shape
        assert torch.equal(ours_tp1["packed_list"][i], packed)
        assert _diff(packed, alone) < PACK_TOL, f"sample {i}: packed vs alone"
        want = _ref_call(ref, x[None], ts[i : i + 1], text[i : i + 1, :n])[0]
        assert _diff(packed, want) < REF_TOL, f"sample {i}: packed vs diffusers"


def test_is_the_flow_matching_objectives_packed_model_fn(ours_tp1: dict[str, Any]) -> None:
    packed, one_by_one = ours_tp1["flow_matching"]
    assert packed.item() > 0.1
    assert abs(packed - one_by_one).item() < PACK_TOL


@pytest.mark.parametrize("key", ["rc", "rc_full"])
def test_recompute_gives_the_same_loss_and_grads(ours_tp1: dict[str, Any], key: str) -> None:
    check_recompute(ours_tp1, key, ATTENTION_CALLS, RECOMPUTE_TOL)


def test_export_loads_in_diffusers_with_equal_outputs(
    ref: Any, tmp_dir: Path, ours_tp1: dict
) -> None:
    path = tmp_dir / "export_tp1"
    config = json.loads((path / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel"
    loaded = WanTransformer3DModel.from_pretrained(path).eval()
    ref_state = ref.state_dict()
    assert loaded.state_dict().keys() == ref_state.keys()
    assert all(torch.equal(v, ref_state[k]) for k, v in loaded.state_dict().items())
    for case in DENSE:
        out = _ref_call(loaded, *_dense_inputs(case))
        assert _diff(out, ours_tp1["dense"][case]) < REF_TOL, case
    assert read_config(path) == CFG


def test_loads_a_sharded_diffusers_directory(tmp_dir: Path, ours_tp1: dict[str, Any]) -> None:
    sharded = tmp_dir / "ref_sharded"
    assert (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("diffusion_pytorch_model-*.safetensors"))) > 2
    assert ours_tp1["loaded_tensors"] == len(
        from_diffusers_state_dict(_ref_model().state_dict(), CFG)
    )
    diff = _diff(ours_tp1["loaded_dense"], ours_tp1["dense"]["3x8x8"])
    assert diff == 0.0


@pytest.mark.multiprocess
def test_tp2_equals_tp1(ref: Any, tmp_dir: Path, ours_tp1: dict[str, Any]) -> None:
    outs = run_multiprocess(_worker, 2, ref.state_dict(), str(tmp_dir))
    for rank, out in enumerate(outs):
        for case in DENSE:
            diff = _diff(out["dense"][case], ours_tp1["dense"][case])
            assert diff < TP_TOL, f"rank {rank} {case}: {diff:.3g}"
        assert _diff(out["masked"], ours_tp1["masked"]) < TP_TOL
        for a, b in zip(out["packed"], ours_tp1["packed"]):
            assert _diff(a, b) < TP_TOL
        assert abs(out["loss"] - ours_tp1["loss"]).item() < TP_TOL
        for name, g in ours_tp1["grads"].items():  # the qk-norm's all-reduce backward too
            assert _diff(out["grads"][name], g) < TP_TOL, f"rank {rank} grad {name}"
    # The export gathered the shards: exactly the weights that were loaded.
    exported = WanTransformer3DModel.from_pretrained(tmp_dir / "export_tp2").state_dict()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in exported.items())


def test_state_dict_round_trip_is_exact(ref: Any) -> None:
    state = ref.state_dict()
    back = to_diffusers_state_dict(from_diffusers_state_dict(state, CFG), CFG)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_checkpoint_errors_name_every_tensor(ref: Any) -> None:
    state = dict(ref.state_dict())
    del state["blocks.1.attn2.to_k.bias"]
    state["blocks.7.norm2.weight"] = torch.ones(CFG.hidden_size)
    state["proj_out.weight"] = torch.ones(3, 3)
    with pytest.raises(WanCheckpointError) as err:
        from_diffusers_state_dict(state, CFG)
    msg = str(err.value)
    assert "missing: blocks.1.attn2.to_k.bias" in msg
    assert "unexpected: blocks.7.norm2.weight" in msg
    assert "shape: proj_out.weight is [3, 3]" in msg


def test_bad_inputs_raise_clear_errors(ours_tp1: dict[str, Any]) -> None:
    errors = ours_tp1["errors"]
    assert "latents must be [B, 16, T, H, W]" in errors["channels"]
    assert "not divisible by the patch (1, 2, 2)" in errors["patch"]
    assert "timesteps must be [2]" in errors["timesteps"]
    assert f"text_embeds must be [2, L, {CFG.text_dim}]" in errors["text_dim"]
    assert "no caption token for samples [0, 1]" in errors["empty_mask"]
