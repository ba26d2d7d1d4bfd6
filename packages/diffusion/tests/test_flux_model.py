"""FLUX.1 MMDiT on megatron == diffusers' ``FluxTransformer2DModel`` (CPU, fp32, tiny configs,
random weights): with and without the guidance embedding, at three latent sizes and caption
lengths; text masks, per-sample lists, recompute, diffusers checkpoints in and out, TP=2 ==
TP=1.

Our model runs in gloo worker processes (megatron's parallel state; world size 1, and 2 for
TP=2); diffusers runs in the test process on the same tokens (the FLUX pipelines' 2x2
packing: ``patchify`` with patch (1, 2, 2)) and ids (``txt_ids`` zero, ``img_ids`` (frame,
row, column)).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusion_testkit import check_recompute, loss_and_grads, randn, tensor_parallel_state

import longboat.diffusion.models.flux.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess
from longboat.diffusion.models.common.patches import patchify, unpatchify
from longboat.diffusion.models.flux.config import flavor, read_config
from longboat.diffusion.models.flux.diffusers import (
    FluxCheckpointError,
    from_diffusers_state_dict,
    to_diffusers_state_dict,
)

REF_TOL = 1e-4  # max abs difference vs diffusers (fp32)
TP_TOL = 1e-5  # TP=2 vs TP=1 (outputs and gradients)
RECOMPUTE_TOL = 1e-6  # recompute vs not (loss and gradients)

CONFIGS = {
    "schnell": flavor("tiny"),  # no guidance embedding
    "dev": flavor("tiny").replace(guidance_embeds=True),
}
CFG = CONFIGS["dev"]
ATTENTION_CALLS = CFG.num_blocks  # self-attention kernels of one forward (one per block)
C = CFG.latent_channels
# name -> (latent shape, timesteps in [0, 1000], caption length); timesteps / 1000 are exact
DENSE: dict[str, tuple[tuple[int, ...], list[float], int]] = {
    "1x8x8": ((2, C, 1, 8, 8), [125.0, 750.0], 7),
    "1x6x10": ((1, C, 1, 6, 10), [500.0], 3),
    "2x4x6": ((1, C, 2, 4, 6), [875.0], 5),  # two frames: the rotary frame axis
}
GUIDANCE = [3.5, 1.0]
TEXT_LENS = [4, 9]  # caption lengths, padded to 9


def _dense_inputs(name: str) -> dict[str, Any]:
    shape, ts, text_len = DENSE[name]
    seed, b = list(DENSE).index(name), shape[0]
    return {
        "latents": randn(*shape, seed=seed),
        "timesteps": torch.tensor(ts),
        "text_embeds": randn(b, text_len, CFG.joint_attention_dim, seed=50 + seed),
        "pooled_embeds": randn(b, CFG.pooled_projection_dim, seed=60 + seed),
        "guidance": torch.tensor(GUIDANCE[:b]),
    }


def _call_inputs(kind: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return inputs if kind == "dev" else {k: v for k, v in inputs.items() if k != "guidance"}


def _masked_inputs() -> dict[str, Any]:
    text = randn(2, max(TEXT_LENS), CFG.joint_attention_dim, seed=70)
    mask = torch.arange(max(TEXT_LENS))[None, :] < torch.tensor(TEXT_LENS)[:, None]
    return {
        "latents": randn(2, C, 1, 6, 6, seed=71),
        "timesteps": torch.tensor([250.0, 625.0]),
        "text_embeds": text,
        "text_mask": mask,
        "pooled_embeds": randn(2, CFG.pooled_projection_dim, seed=72),
        "guidance": torch.tensor(GUIDANCE),
    }


def _ref_model(kind: str, seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**CONFIGS[kind].to_diffusers()).eval()
    with torch.no_grad():  # random norms and heads too, so a swapped or skipped one shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if name.endswith(
                ("norm_q.weight", "norm_k.weight", "added_q.weight", "added_k.weight")
            ):
                p.add_(1.0)
    return model


def _ref_call(ref: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """diffusers' forward on the same latents, as the FLUX pipelines call it."""
    lat = inputs["latents"]
    t, h, w = lat.shape[2], lat.shape[3] // 2, lat.shape[4] // 2
    ids = torch.zeros(t, h, w, 3)
    ids[..., 0] = torch.arange(t)[:, None, None]
    ids[..., 1] = torch.arange(h)[None, :, None]
    ids[..., 2] = torch.arange(w)[None, None, :]
    text = inputs["text_embeds"]
    guidance = inputs.get("guidance") if ref.config.guidance_embeds else None
    with torch.no_grad():
        out = ref(
            hidden_states=patchify(lat, (1, 2, 2)),
            encoder_hidden_states=text,
            pooled_projections=inputs["pooled_embeds"],
            timestep=inputs["timesteps"] / 1000.0,
            img_ids=ids.reshape(-1, 3),
            txt_ids=torch.zeros(text.shape[1], 3),
            guidance=guidance,
            return_dict=False,
        )[0]
    return unpatchify(out, (t, h, w), (1, 2, 2))


# -- the worker: our models under megatron -----------------------------------------------------


def _loss_and_grads(model: Any, recompute: int, **kw: Any) -> tuple[torch.Tensor, dict, int, int]:
    inputs = _masked_inputs()
    target = randn(*inputs["latents"].shape, seed=80)
    return loss_and_grads(
        model, model.double_blocks[0], lambda: model(**inputs), target, recompute, **kw
    )


def _worker(rank: int, world: int, hf_states: dict, tmp: str) -> dict[str, Any]:
    from longboat.diffusion.models.flux.diffusers import (
        load_diffusers,
        load_state_dict,
        save_diffusers,
    )
    from longboat.diffusion.models.flux.model import build

    with tensor_parallel_state(world):
        res: dict[str, Any] = {}
        for kind, cfg in CONFIGS.items():
            model = build(cfg)  # longboat.kernels' RMSNorm, RoPE, AdaLN, attention dispatch
            load_state_dict(model, from_diffusers_state_dict(hf_states[kind], cfg))
            with torch.no_grad():
                res[kind] = {n: model(**_call_inputs(kind, _dense_inputs(n))) for n in DENSE}
            save_diffusers(model, cfg, Path(tmp) / f"export_{kind}_tp{world}")
        # the guidance model: masks, lists, gradients
        with torch.no_grad():
            masked = _masked_inputs()
            res["masked"] = model(**masked)
            lat = masked.pop("latents")
            res["list"] = model(list(lat), **masked)
        res["loss"], res["grads"], res["calls"], res["attn"] = _loss_and_grads(model, recompute=0)
        if world == 1:
            for key, again in (("rc", False), ("rc_full", True)):
                res[f"loss_{key}"], res[f"grads_{key}"], res[f"calls_{key}"], res[f"attn_{key}"] = (
                    _loss_and_grads(model, -1, recompute_attention=again)
                )
            sharded = Path(tmp) / "ref_sharded"  # sharded safetensors with an index
            other = build(read_config(sharded))
            res["loaded_tensors"] = load_diffusers(other, read_config(sharded), sharded)
            with torch.no_grad():
                res["loaded_dense"] = other(**_dense_inputs("1x8x8"))
            res["errors"] = _error_messages(model)
        return res


def _error_messages(model: Any) -> dict[str, str]:
    x = _dense_inputs("1x8x8")
    bad = {
        "channels": x | {"latents": x["latents"][:, :3]},
        "patch": x | {"latents": x["latents"][..., :7]},
        "timesteps": x | {"timesteps": x["timesteps"][:1]},
        "text_dim": x | {"text_embeds": x["text_embeds"][..., :5]},
        "pooled": x | {"pooled_embeds": x["pooled_embeds"][:, :5]},
    }
    out = {}
    for key, inputs in bad.items():
        try:
            model(**inputs)
            out[key] = "no error"
        except ValueError as exc:
            out[key] = str(exc)
    return out


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refs() -> dict[str, FluxTransformer2DModel]:
    return {kind: _ref_model(kind, seed=i) for i, kind in enumerate(CONFIGS)}


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory: pytest.TempPathFactory, refs: dict) -> Path:
    path = tmp_path_factory.mktemp("flux")
    refs["dev"].save_pretrained(path / "ref_sharded", max_shard_size="40KB")
    return path


def _states(refs: dict) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: ref.state_dict() for kind, ref in refs.items()}


@pytest.fixture(scope="module")
def ours_tp1(refs: dict, tmp_dir: Path) -> dict[str, Any]:
    return run_multiprocess(_worker, 1, _states(refs), str(tmp_dir))[0]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("case", list(DENSE))
def test_matches_diffusers(kind: str, case: str, refs: dict, ours_tp1: dict) -> None:
    want = _ref_call(refs[kind], _dense_inputs(case))
    assert want.abs().max().item() > 0.5  # a meaningful scale
    diff = _diff(ours_tp1[kind][case], want)
    assert diff < REF_TOL, f"{kind} {case}: max abs diff {diff:.3g} vs diffusers"


def test_guidance_changes_the_prediction(refs: dict, ours_tp1: dict) -> None:
    inputs = _dense_inputs("1x8x8")
    other = _ref_call(refs["dev"], inputs | {"guidance": torch.tensor([1.0, 3.5])})
    assert _diff(ours_tp1["dev"]["1x8x8"], other) > 100 * REF_TOL


def test_text_mask_equals_each_caption_at_its_length(refs: dict, ours_tp1: dict) -> None:
    inputs = _masked_inputs()
    for i, n in enumerate(TEXT_LENS):
        one = {k: v[i : i + 1] for k, v in inputs.items() if k != "text_mask"}
        one["text_embeds"] = one["text_embeds"][:, :n]
        want = _ref_call(refs["dev"], one)[0]
        diff = _diff(ours_tp1["masked"][i], want)
        assert diff < REF_TOL, f"sample {i} ({n} caption tokens): max abs diff {diff:.3g}"
        assert _diff(ours_tp1["list"][i], ours_tp1["masked"][i]) < 1e-5
    # The padding is really masked: sample 0 attending to its 5 padded tokens differs.
    padded = _ref_call(refs["dev"], {k: v[:1] for k, v in inputs.items()})[0]
    assert _diff(ours_tp1["masked"][0], padded) > 100 * REF_TOL


@pytest.mark.parametrize("key", ["rc", "rc_full"])
def test_recompute_gives_the_same_loss_and_grads(ours_tp1: dict[str, Any], key: str) -> None:
    check_recompute(ours_tp1, key, ATTENTION_CALLS, RECOMPUTE_TOL)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_export_loads_in_diffusers_with_equal_outputs(
    kind: str, refs: dict, tmp_dir: Path, ours_tp1: dict
) -> None:
    path = tmp_dir / f"export_{kind}_tp1"
    config = json.loads((path / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel"
    assert config["guidance_embeds"] is (kind == "dev")
    loaded = FluxTransformer2DModel.from_pretrained(path).eval()
    ref_state = refs[kind].state_dict()
    assert loaded.state_dict().keys() == ref_state.keys()
    assert all(torch.equal(v, ref_state[k]) for k, v in loaded.state_dict().items())
    for case in DENSE:
        out = _ref_call(loaded, _dense_inputs(case))
        assert _diff(out, ours_tp1[kind][case]) < REF_TOL, case
    assert read_config(path) == CONFIGS[kind]


def test_loads_a_sharded_diffusers_directory(tmp_dir: Path, ours_tp1: dict[str, Any]) -> None:
    sharded = tmp_dir / "ref_sharded"
    assert (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("diffusion_pytorch_model-*.safetensors"))) > 2
    assert read_config(sharded) == CFG
    n = len(from_diffusers_state_dict(_ref_model("dev", seed=1).state_dict(), CFG))
    assert ours_tp1["loaded_tensors"] == n
    assert _diff(ours_tp1["loaded_dense"], ours_tp1["dev"]["1x8x8"]) == 0.0


@pytest.mark.multiprocess
def test_tp2_equals_tp1(refs: dict, tmp_dir: Path, ours_tp1: dict[str, Any]) -> None:
    outs = run_multiprocess(_worker, 2, _states(refs), str(tmp_dir))
    for rank, out in enumerate(outs):
        for kind in CONFIGS:
            for case in DENSE:
                diff = _diff(out[kind][case], ours_tp1[kind][case])
                assert diff < TP_TOL, f"rank {rank} {kind} {case}: {diff:.3g}"
        assert _diff(out["masked"], ours_tp1["masked"]) < TP_TOL
        assert abs(out["loss"] - ours_tp1["loss"]).item() < TP_TOL
        for name, g in ours_tp1["grads"].items():  # the shared qk-norm weights' all-reduce too
            assert _diff(out["grads"][name], g) < TP_TOL, f"rank {rank} grad {name}"
    # The export gathered the shards: exactly the weights that were loaded.
    for kind in CONFIGS:
        exported = FluxTransformer2DModel.from_pretrained(tmp_dir / f"export_{kind}_tp2")
        want = refs[kind].state_dict()
        assert all(torch.equal(v, want[k]) for k, v in exported.state_dict().items())


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_state_dict_round_trip_is_exact(kind: str, refs: dict) -> None:
    state, cfg = refs[kind].state_dict(), CONFIGS[kind]
    back = to_diffusers_state_dict(from_diffusers_state_dict(state, cfg), cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_checkpoint_errors_name_every_tensor(refs: dict) -> None:
    state = dict(refs["dev"].state_dict())
    del state["transformer_blocks.1.attn.add_k_proj.bias"]
    state["single_transformer_blocks.7.norm.linear.weight"] = torch.ones(3)
    state["proj_out.weight"] = torch.ones(3, 3)
    with pytest.raises(FluxCheckpointError) as err:
        from_diffusers_state_dict(state, CFG)
    msg = str(err.value)
    assert "missing: transformer_blocks.1.attn.add_k_proj.bias" in msg
    assert "unexpected: single_transformer_blocks.7.norm.linear.weight" in msg
    assert "shape: proj_out.weight is [3, 3]" in msg
    with pytest.raises(FluxCheckpointError, match=r"missing: time_text_embed\.guidance_embedder"):
        from_diffusers_state_dict(refs["schnell"].state_dict(), CFG)  # no guidance weights


def test_bad_inputs_raise_clear_errors(ours_tp1: dict[str, Any]) -> None:
    errors = ours_tp1["errors"]
    assert f"latents must be [B, {C}, T, H, W]" in errors["channels"]
    assert "not divisible by the patch (1, 2, 2)" in errors["patch"]
    assert "timesteps must be [2]" in errors["timesteps"]
    assert f"text_embeds must be [2, L, {CFG.joint_attention_dim}]" in errors["text_dim"]
    assert f"pooled_embeds must be [2, {CFG.pooled_projection_dim}]" in errors["pooled"]
