"""Evaluation from a run's native (DCP) checkpoint (``longboat-embodied eval checkpoint=...``).

A tiny policy trained for two steps on the CPU with a checkpoint at step 2 and an export at
the end (the same weights): the policy rebuilt from the checkpoint and the run's stored
config holds the export's weights bit for bit and acts as the export does (fp32:
``atol=1e-6``, measured 0); with ``train.master_weights`` the fp32 masters are what it
loads (the bf16 copies alone differ). On PushT the command gives the same episodes from the
checkpoint as from the export. A folder that is neither an export nor a checkpoint exits 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.embodied.cli import main
from longboat.embodied.data import LeRobotDataset, write_synthetic_dataset
from longboat.embodied.data.synthetic import EmbodimentSpec
from longboat.embodied.eval.checkpoint import (
    checkpoint_policy,
    load_checkpoint_weights,
    resolve_checkpoint,
    run_config,
)
from longboat.embodied.inference import load_policy
from longboat.embodied.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(run: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={run}",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",
        "optim.lr=1e-3",
        "optim.schedule.warmup_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
        "checkpoint.every_steps=2",
        *extra,
    ]


@pytest.fixture(scope="module")
def pusht_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pi0.5 tiny, fp32, on a synthetic dataset shaped like PushT (one 96x96 ``top`` camera,
    2-value state and action); checkpoint and export at step 2."""
    root = tmp_path_factory.mktemp("ckpt_eval")
    (data,) = write_synthetic_dataset(
        root / "data",
        num_episodes=2,
        episode_length=(12, 12),
        cameras=("top",),
        image_size=(96, 96),
        embodiments=(EmbodimentSpec(name="pusht", state_dim=2, action_dim=2),),
        tasks=("Push the T-shaped block onto the T-shaped target.",),
    )
    run = root / "run"
    extra = (f"data.path={data}", "train.precision=fp32")
    assert len(train(compose_experiment("pi05_tiny", _overrides(run, *extra))).losses) == 2
    return run


def _same_weights(policy, export: Path) -> None:
    exported = load_file(str(export / "model.safetensors"))
    state = policy.model.state_dict()
    assert sorted(state) == sorted(exported)
    for name, tensor in exported.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


def _actions(policy, frames: list[dict]) -> torch.Tensor:
    spec = policy.processor.spec
    noise = torch.randn(len(frames), spec.horizon, spec.action_dim,
                        generator=torch.Generator().manual_seed(5))  # fmt: skip
    return policy.predict_action_chunks(frames, noise=noise)


def test_checkpoint_policy_acts_as_the_export(pusht_run: Path) -> None:
    step = pusht_run / "checkpoints" / "step_00000002"
    # a run directory, its checkpoint.dir and the step folder name the same checkpoint
    for given in (pusht_run, pusht_run / "checkpoints", step):
        assert resolve_checkpoint(given) == step
    cfg = run_config(step)
    assert cfg.model.name == "pi05" and cfg.train.steps == 2  # the run's resolved config
    native = checkpoint_policy(pusht_run)
    export = load_policy(pusht_run / "export")
    _same_weights(native, pusht_run / "export")
    assert native.cameras == export.cameras
    data = LeRobotDataset(cfg.data.path)
    frames = [data[0], data[7]]
    got, want = _actions(native, frames), _actions(export, frames)
    assert got.shape == (2, native.processor.spec.horizon, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _eval(policy: str, out: Path) -> dict:
    argv = ["eval", policy, "--suite", "pusht", "--episodes", "2", "--num-envs", "2",
            "--max-steps", "8", "--videos", "0", "--seed", "1", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def test_eval_command_from_the_checkpoint_gives_the_export_episodes(
    pusht_run: Path, tmp_path: Path
) -> None:
    native = _eval(f"checkpoint={pusht_run}", tmp_path / "native")
    exported = _eval(str(pusht_run / "export"), tmp_path / "export")
    assert native["tasks"][0]["per_episode"] == exported["tasks"][0]["per_episode"]
    assert native["total"]["episodes"] == 2
    # a step folder given bare is a checkpoint too (it holds no export)
    step = pusht_run / "checkpoints" / "step_00000002"
    bare = _eval(str(step), tmp_path / "bare")
    assert bare["tasks"][0]["per_episode"] == exported["tasks"][0]["per_episode"]


def test_a_folder_that_is_no_checkpoint_exits_2(pusht_run: Path, tmp_path: Path, capsys) -> None:
    for folder in (tmp_path, pusht_run / "export"):
        rc = main(["eval", f"checkpoint={folder}", "--suite", "pusht", "--no-progress"])
        assert rc == 2
        err = capsys.readouterr().err
        assert "is neither a native checkpoint" in err and "checkpoint=" in err
    rc = main(["eval", "checkpoint=", "--suite", "pusht", "--no-progress"])
    assert rc == 2 and "names no folder" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="holds no exported policy"):
        from longboat.embodied.eval.runner import load_acting_policy
        from longboat.embodied.eval.suite import load_suite

        load_acting_policy(tmp_path, load_suite("pusht"))


def test_master_weights_checkpoint_loads_the_fp32_masters(tmp_path: Path) -> None:
    """bf16 with master weights: the DCP model state holds bf16 copies of the trainable
    weights, the optimizer state their fp32 masters, which the export writes."""
    run = tmp_path / "run"
    extra = ("train.precision=bf16", "train.master_weights=true",
             "data.synthetic.num_episodes=2", "data.synthetic.episode_length=12")  # fmt: skip
    assert len(train(compose_experiment("groot_n1_6_tiny", _overrides(run, *extra))).losses) == 2
    native = checkpoint_policy(run / "checkpoints")
    _same_weights(native, run / "export")
    # the bf16 copies alone are not the trained weights
    copies = load_policy(run / "export").model
    step = resolve_checkpoint(run)
    load_checkpoint_weights(copies, step, master_weights=False)
    exported = load_file(str(run / "export" / "model.safetensors"))
    differ = [n for n, t in copies.state_dict().items() if not torch.equal(t, exported[n])]
    assert differ, "the bf16 copies equal the fp32 masters: the test proves nothing"
