"""``longboat-diffusion train`` end to end on a small synthetic squares set (CPU, tiny Wan).

A run assembled as the command line assembles it (``build_training`` + core's ``Trainer``)
trains, evaluates the held-out loss, checkpoints, exports a diffusers directory whose
``WanTransformer3DModel`` gives the trained model's outputs, and writes the preview GIF,
decoded by the squares' VAE; a run
killed with SIGKILL after a checkpoint resumes and reproduces the uninterrupted per-step losses
exactly; bad configs exit 2 naming the key before anything is built.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess

STEPS, SAVE_EVERY, KILL_AT = 8, 3, 5
EXPORT_TOL = 1e-4  # our trained model vs diffusers loading its export (fp32)
SAMPLE_TOL = 1e-4  # our sampler on our model vs diffusers' scheduler on the export (fp32)
SAMPLE_STEPS, SAMPLE_SHIFT = 4, 3.0
RUN = "quickstart_diffusion"


def tiny_overrides(out: Path, data: Path, steps: int = STEPS) -> list[str]:
    """The quickstart shrunk to seconds: the tiny flavor, a 32-sample set of small shapes."""
    return [
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_samples=32",
        "data.num_eval_samples=20",  # samples 16.. are the moving 3x4x4 clips
        "data.shapes=[[1,4,4],[3,4,4]]",
        "model.overrides.num_layers=2",
        "model.overrides.num_attention_heads=2",
        "model.overrides.ffn_dim=64",
        "train.micro_batch_size=4",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.log_every=1",
        "optim.lr=1e-2",
        "optim.schedule.warmup_steps=2",
        "logging.progress=false",
        "logging.trackers=[]",
        f"checkpoint.every_steps={SAVE_EVERY}",
        "checkpoint.keep_last=0",
        "diffusion.preview_captions=2",
        "diffusion.sample_steps=2",
    ]


def compose(overrides: list[str]) -> Any:
    from longboat.core.config.compose import compose_experiment

    return compose_experiment("quickstart", overrides, stack="diffusion")


def _probe() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return (
        torch.randn(2, 16, 3, 4, 6, generator=g),
        torch.tensor([300.0, 800.0]),
        torch.randn(2, 5, 32, generator=g),
    )


def _held_out_text(training: Any) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], list]:
    """The held-out moving clips' caption embeddings as the preview batches them, the latent
    batch shape and the captions."""
    from longboat.diffusion.data.batching import collate_latents
    from longboat.diffusion.train.preview import pick_captions

    held_out = training.data.held_out
    samples = [held_out[i] for i in pick_captions(held_out, 2)]
    batch = collate_latents(samples)
    shape = tuple(batch["latents"].shape)
    return batch["text_embeds"], batch["text_mask"], shape, [s["caption"] for s in samples]


def _run_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.objective import sample
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose(overrides))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        with torch.no_grad():
            probe = training.step_fn.model(*_probe())
        text, mask, shape, captions = _held_out_text(training)
        again = training.write_preview(result.end_step)  # the end-of-run preview, once more
        sampled = sample(
            training.step_fn.model,
            shape,
            text,
            mask,
            steps=SAMPLE_STEPS,
            shift=SAMPLE_SHIFT,
            generator=torch.Generator().manual_seed(11),
        )
        return {
            "start": result.start_step,
            "losses": result.losses,
            "eval": result.eval,
            "export": str(result.export_dir) if result.export_dir else None,
            "extra": dict(result.extra),
            "describe": training.describe(),
            "probe": probe,
            "text": text,
            "captions": captions,
            "sampled": sampled,
            "preview_again": again,
            "report": training.report(result),
        }
    finally:
        training.close()


def _killed_run(overrides: list[str]) -> None:
    from longboat.diffusion.train.training import train

    torch.set_num_threads(1)

    def on_step(step: int) -> None:
        if step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    train(compose(overrides), on_step=on_step)


def _full_run(overrides: list[str]) -> None:
    from longboat.diffusion.train.training import train

    torch.set_num_threads(1)
    train(compose(overrides))


def _logged_losses(metrics: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("diffusion_run")
    out = run_multiprocess(
        _run_worker, 1, tiny_overrides(root / "reference", root / "data"), timeout=400
    )[0]
    out["root"] = root
    return out


@pytest.mark.multiprocess
def test_a_run_trains_evaluates_exports_and_previews(reference: dict[str, Any]) -> None:
    ref = reference
    assert ref["start"] == 0 and len(ref["losses"]) == STEPS
    first, last = ref["eval"][0]["eval_loss"], ref["eval"][STEPS]["eval_loss"]
    assert last < 0.9 * first, f"the held-out loss must fall: {first} -> {last}"
    assert set(ref["eval"][STEPS]) == {
        "eval_loss", "eval_loss_sigma_0.25", "eval_loss_sigma_0.5", "eval_loss_sigma_0.75",
    }  # fmt: skip
    assert (Path(ref["export"]) / "config.json").is_file()
    gif = Path(ref["extra"]["preview"])
    assert gif.is_file() and gif.parent.parent == ref["root"] / "reference"
    from PIL import Image

    with Image.open(gif) as im:  # PIL merges repeated frames into longer ones
        durations = [im.seek(k) or im.info["duration"] for k in range(im.n_frames)]
    # the longest held-out clips: 3 latent frames decoded into 4 (3 - 1) + 1 of 125 ms (a
    # GIF counts in 10 ms: 120)
    assert sum(round(d / 125) for d in durations) == 9, durations
    assert len(ref["extra"]["preview_captions"]) == 2
    assert 0 <= ref["extra"]["preview_colour_right"] <= 2
    assert ref["extra"]["preview_moving"] == 2
    assert "tp=1 cp=1 dp=1" in ref["describe"][0]


@pytest.mark.multiprocess
def test_the_quickstart_preview_is_video_decoded_by_the_sets_vae(
    reference: dict[str, Any],
) -> None:
    """The held-out set carries its VAE; the preview decodes the samples and their held-out
    clips with it into RGB video of 4 (T - 1) + 1 frames, equal to diffusers decoding the same
    latents, the held-out clip showing the square drawn in its colour."""
    import numpy as np
    from diffusers import AutoencoderKLWan
    from PIL import Image

    from longboat.diffusion.data.synthetic import BACKGROUND, COLOURS

    res = reference["preview_again"]
    assert res.path == Path(reference["extra"]["preview"])
    assert any("decoded by the data set's VAE" in line for line in reference["report"])
    vae_dir = reference["root"] / "data_eval" / "vae"
    vae = AutoencoderKLWan.from_pretrained(vae_dir).eval()
    assert len(res.samples) == len(res.pixels) == 2
    for z, pixels in zip(res.samples, res.pixels, strict=True):
        assert tuple(z.shape) == (16, 3, 4, 4)
        assert pixels.shape == (9, 32, 32, 3) and pixels.dtype == np.uint8
        with torch.no_grad():
            direct = vae.decode(z[None]).sample[0]  # [3, 9, 32, 32] in [-1, 1]
        direct = ((direct + 1) / 2).clamp(0, 1).permute(1, 2, 3, 0).numpy() * 255
        assert np.abs(pixels - direct).max() <= 0.51  # rounding only
    # the sheet: each 32 px clip scaled x3 to 96 px, sample left, held-out clip right of it
    with Image.open(res.path) as im:
        frames = []  # every 125 ms frame (PIL merges repeated frames into longer ones)
        for k in range(im.n_frames):
            im.seek(k)
            frame = np.asarray(im.convert("RGB")).astype(float)
            frames += [frame] * round(im.info["duration"] / 125)
    assert len(frames) == 9
    for k in range(9):
        shown = frames[k][:96, :96]
        want = res.pixels[0][k].repeat(3, 0).repeat(3, 1)
        assert np.abs(shown - want).mean() < 8, k  # a GIF's palette, nothing more
    held = frames[0][:96, 98 : 98 + 96]  # the held-out clip of "a red square moving left"
    colours = {tuple(np.round(255 * np.asarray(c))) for c in (BACKGROUND, COLOURS["red"])}
    seen = {tuple(p) for p in held.reshape(-1, 3)}
    assert seen == colours, seen
    red = np.all(held == 255 * np.asarray(COLOURS["red"]), axis=-1)
    assert red.sum() == (2 * 8 * 3) ** 2  # a square of 2 latent cells, 8 px each, x3


@pytest.mark.multiprocess
def test_export_loads_in_diffusers_with_equal_outputs(reference: dict[str, Any]) -> None:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(reference["export"]).eval()
    lat, ts, text = _probe()
    with torch.no_grad():
        theirs = model(lat, ts, text, return_dict=False)[0]
    diff = (theirs - reference["probe"]).abs().max().item()
    assert diff < EXPORT_TOL, diff
    assert reference["probe"].abs().max() > 0.01  # the trained head is no longer zero


@pytest.mark.multiprocess
def test_preview_sampler_equals_diffusers_scheduler_on_the_export(
    reference: dict[str, Any],
) -> None:
    """The preview's Euler sampler on the trained model == diffusers'
    ``FlowMatchEulerDiscreteScheduler`` driving the exported ``WanTransformer3DModel`` from the
    same noise (same sigma convention, shift, velocity sign and timestep scale)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    from longboat.diffusion.data.synthetic import caption_embedding

    model = WanTransformer3DModel.from_pretrained(reference["export"]).eval()
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SAMPLE_SHIFT)
    # Wan's schedule: 1, 1 - 1/N, ..., 1/N before the shift (diffusers' default ends at 1/1000)
    sched.set_timesteps(sigmas=[1.0 - i / SAMPLE_STEPS for i in range(SAMPLE_STEPS)])
    ours, text = reference["sampled"], reference["text"]
    x = torch.randn(ours.shape, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        for t in sched.timesteps:
            v = model(x, t.expand(x.shape[0]), text, return_dict=False)[0]
            x = sched.step(v, t, x, return_dict=False)[0]
    diff = (x - ours).abs().max().item()
    assert diff < SAMPLE_TOL, diff
    assert ours.abs().max() > 0.1 and torch.isfinite(ours).all()
    # the preview conditions on the embeddings the training set gives each caption
    assert reference["captions"] == ["a red square moving left", "a green square moving left"]
    for row, caption in zip(text, reference["captions"], strict=True):
        assert torch.equal(row, caption_embedding(caption, row.shape[-1]))


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_sigkill_then_resume_continues_the_loss_curve(reference: dict[str, Any]) -> None:
    ref, root = reference, reference["root"]
    out = root / "interrupted"
    overrides = tiny_overrides(out, root / "data")
    proc = mp.get_context("fork").Process(target=_killed_run, args=(overrides,))
    proc.start()
    proc.join(300)
    hung = proc.exitcode is None
    if hung:
        proc.kill()
        proc.join()
    assert not hung, f"the run did not reach its kill at step {KILL_AT}"
    assert proc.exitcode == -signal.SIGKILL
    last = (KILL_AT // SAVE_EVERY) * SAVE_EVERY

    resumed = run_multiprocess(_run_worker, 1, overrides, timeout=400)[0]
    assert resumed["start"] == last
    assert resumed["losses"] == ref["losses"][last:], "resumed losses must equal the reference"
    assert _logged_losses(out / "logs" / RUN / "metrics.jsonl") == _logged_losses(
        root / "reference" / "logs" / RUN / "metrics.jsonl"
    )
    assert torch.equal(resumed["probe"], ref["probe"])  # the same weights at the end


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_loader_workers_resume_the_loss_curve_exactly(reference: dict[str, Any]) -> None:
    """Steps built ahead by loader processes: a run killed with its workers prefetching
    resumes at its checkpoint's step on the reference's batches (the plan needs only the
    step), so it logs the reference's losses."""
    root = reference["root"]
    out = root / "interrupted_workers"
    overrides = [*tiny_overrides(out, root / "data"), "data.num_workers=2"]
    for run in (_killed_run, _full_run):  # loader workers need a non-daemon process
        proc = mp.get_context("fork").Process(target=run, args=(overrides,))
        proc.start()
        proc.join(300)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        assert proc.exitcode == (-signal.SIGKILL if run is _killed_run else 0)
    assert _logged_losses(out / "logs" / RUN / "metrics.jsonl") == _logged_losses(
        root / "reference" / "logs" / RUN / "metrics.jsonl"
    )


@pytest.mark.multiprocess
def test_init_from_the_export_starts_where_the_run_ended(reference: dict[str, Any]) -> None:
    root = reference["root"]
    overrides = [
        o for o in tiny_overrides(root / "finetune", root / "data") if "model.overrides" not in o
    ]
    overrides += [
        "~model.overrides",  # the checkpoint's config.json gives the architecture
        f"model.init_from={reference['export']}",
        "train.steps=1",
        "checkpoint.every_steps=0",
        "checkpoint.save_on_exit=false",
        "export.enabled=false",
        "diffusion.preview=false",
    ]
    out = run_multiprocess(_run_worker, 1, overrides, timeout=400)[0]
    assert "diffusers " in out["describe"][0]
    # the held-out loss before the first step is the reference's after its last
    assert abs(out["eval"][0]["eval_loss"] - reference["eval"][STEPS]["eval_loss"]) < 1e-6


def _main_weights_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.megatron.optimizer import main_weight_shards
    from longboat.core.train import typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose(overrides))
    training = build_training(cfg)
    family = training.family.load()
    exact = family.build(training.model_cfg, precision="fp32")
    family.load_diffusers(exact, training.model_cfg, cfg.model.init_from)
    want = dict(exact.named_parameters())
    model = training.step_fn.model
    bf16 = sum(p.dtype == torch.bfloat16 for p in model.parameters())
    out: dict[str, Any] = {"set": training.exact_main_weights, "params": bf16,
                           "describe": training.describe(), "main_equal": True,
                           "off_grid": 0, "dtypes": {p.dtype for p in model.parameters()}}  # fmt: skip
    for name, (start, end, shard) in main_weight_shards(training.step_fn.optimizer, model).items():
        value = want[name].detach().reshape(-1)[start:end]
        out["main_equal"] &= torch.equal(shard, value)
        out["off_grid"] += int((value.bfloat16().float() != value).sum())
    return out


@pytest.mark.multiprocess
def test_bf16_training_starts_its_main_weights_from_the_checkpoints_fp32_values(
    reference: dict[str, Any],
) -> None:
    """The fp32 main weights of a bf16 run from an fp32 diffusers directory hold the file's
    values, not their bf16 rounding (which the model's own parameters hold)."""
    root = reference["root"]
    overrides = [
        o for o in tiny_overrides(root / "finetune", root / "data") if "model.overrides" not in o
    ]
    overrides += [
        "~model.overrides",
        f"model.init_from={reference['export']}",
        "diffusion.cpu_precision=bf16",
    ]
    out = run_multiprocess(_main_weights_worker, 1, overrides, timeout=400)[0]
    assert out["dtypes"] == {torch.bfloat16, torch.float32}  # fp32: the tables and norms
    assert out["set"] == out["params"] > 0  # every bf16 parameter's main weight
    assert out["main_equal"] and out["off_grid"] > 0  # the values are not on the bf16 grid
    assert "fp32 main weights from the checkpoint's values" in out["describe"][0]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from longboat.diffusion.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["model.flavor=nope"], ["model.flavor"]),
        (["model.init_from=/no/such/dir"], ["model.init_from"]),
        (["model.overrides.num_layerz=3", "objective.weighting=sqrt"],
         ["model.overrides.num_layerz", "objective.weighting"]),
        (
            ["model.overrides.patch_size=[1,2,2]", "data.patch_size=[1,2,2]",
             "data.text_dim=8", "data.latent_channels=4", "data.shapes=[[3,5,8]]",
             "parallel.context_parallel=3", "diffusion.eval_sigmas=[0]"],
            ["data.text_dim", "data.latent_channels", "data.shapes", "parallel.context_parallel",
             "diffusion.eval_sigmas"],
        ),
    ],
    ids=["flavor", "init_from", "overrides", "data_and_layout"],
)  # fmt: skip
def test_config_errors_exit_2_naming_every_key(
    overrides: list[str], keys: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, text = _cli(["train", "quickstart", f"output_dir={tmp_path}", *overrides], capsys)
    assert code == 2, text
    for key in keys:
        assert key in text, (key, text)
    assert "Fix:" in text
    assert not (tmp_path / "data").exists()  # refused before anything was written


def test_init_from_a_directory_without_config_json_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "ckpt").mkdir()
    code, text = _cli(["train", "quickstart", f"model.init_from={tmp_path / 'ckpt'}"], capsys)
    assert code == 2 and "model.init_from" in text and "config.json" in text, text


def test_data_from_another_latent_space_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from longboat.diffusion.data import SyntheticSquaresDataConfig, generate_squares

    other = generate_squares(
        SyntheticSquaresDataConfig(
            out_dir=str(tmp_path / "other"), num_samples=4, shapes=[[1, 4, 4]], text_dim=12
        )
    )
    code, text = _cli(["train", "quickstart", "data=latents", f"data.paths=[{other}]"], capsys)
    assert code == 2 and "data.paths" in text and "text_dim is 32" in text, text
