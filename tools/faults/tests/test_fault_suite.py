"""Fault injection on every stack: each fault stops the run as specified and loses nothing.

For each stack (llm, vlm, diffusion on megatron-core; embodied torch-native; core's demo as
the quick case) and each case, the stack's real ``train`` command runs at tiny CPU shapes
with one fault injected (``run_stack.py``), the faulty run's exit status and message are
checked, then the same command runs again (what ``torchrun --max-restarts`` does) and must
log, for every step, the loss an uninterrupted run logs: bit for bit. The two-process cases
launch two ranks on gloo the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
rank 0 hosts the store) and check that every rank stops within a bound.

``nox -s faults`` runs them all and writes the summary table (``conftest.py``); the default
run takes the core demo's rank-death case only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "run_stack.py"
STEPS, SAVE_EVERY = 6, 2
COLLECTIVE_TIMEOUT_S = 30
"""``train.collective_timeout_s`` of the two-process runs (the hang case waits it out)."""
LAUNCH_TIMEOUT_S = 900

COMMON = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    f"checkpoint.every_steps={SAVE_EVERY}",
    "checkpoint.keep_last=0",
    "checkpoint.save_on_exit=true",
    "logging.progress=false",
    "logging.trackers=[]",
    "export.enabled=false",
    f"train.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
]


def _stack_args(stack: str, data: Path) -> list[str]:
    """The tiny experiment of ``stack`` (its data generated under ``data`` once)."""
    if stack == "core":
        return ["experiment=demo", "optim.schedule.warmup_steps=2"]
    if stack == "llm":
        return [
            "experiment=quickstart",
            "model=llama3_tiny",
            "data=synthetic",
            "data.seq_len=32",
            "data.num_documents=64",
            "llm.generate_prompt=null",
            "train.micro_batch_size=1",
            "train.global_batch_size=4",
        ]
    if stack == "vlm":
        return [
            "experiment=quickstart",
            f"data.out_dir={data}",
            "data.num_train=40",
            "data.num_eval=8",
            "data.seq_len=256",
            "train.eval_every=0",
            "train.global_batch_size=2",
            "vlm.answer_eval_samples=0",
            "vlm.eval_batches=1",
        ]
    if stack == "diffusion":
        return [
            "experiment=quickstart",
            f"data.out_dir={data}",
            "data.num_samples=32",
            "data.num_eval_samples=20",
            "data.shapes=[[1,4,4],[3,4,4]]",
            "model.overrides.num_layers=2",
            "model.overrides.num_attention_heads=2",
            "model.overrides.ffn_dim=64",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.eval_every=0",
            "optim.lr=1e-2",
            "optim.schedule.warmup_steps=2",
            "diffusion.preview_captions=2",
            "diffusion.sample_steps=2",
        ]
    if stack == "embodied":
        return [
            "experiment=groot_n1_6_tiny",
            "train.micro_batch_size=1",
            "train.global_batch_size=2",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
            "optim.schedule.warmup_steps=2",
        ]
    raise AssertionError(stack)


@dataclass(frozen=True)
class Case:
    """One fault: where it is injected and what the faulty run must do."""

    world: int
    fault: str
    """``run_stack.py --fault`` spec."""
    codes: tuple[int, ...]
    """Exit status of each rank of the faulty run."""
    says: str
    """A line the faulty run prints (on the rank that reports)."""
    fault_doc: str
    expect_doc: str
    before_restart: Callable[[Path], None] | None = None
    """What happens between the faulty run and the restart (corrupting a checkpoint)."""
    resumes_from: int = SAVE_EVERY
    """The step the restart resumes from."""


def _corrupt_latest(out: Path) -> None:
    latest = out / "checkpoints" / f"step_{2 * SAVE_EVERY:08d}"
    shard = sorted(latest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    for i in range(0, min(len(data), 4000), 4):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))


CASES: dict[str, Case] = {
    "rank_raise": Case(
        2,
        "raise@3:1",
        (3, 1),
        "rank 1 failed after step 3 (RuntimeError: fault injected",
        "two ranks (gloo); rank 1 raises after step 3",
        "rank 0 stops naming rank 1 and step 3 (exit 3), rank 1 exits 1; restart resumes at 2",
    ),
    "rank_kill": Case(
        2,
        "kill@3:1",
        (3, -9),
        "rank 1 failed after step 3 (no heartbeat",
        "two ranks (gloo); rank 1 is SIGKILLed after step 3",
        "rank 0 stops within seconds naming rank 1 and step 3 (exit 3); restart resumes at 2",
    ),
    "rank_hang": Case(
        2,
        "hang@3:1",
        (3, 3),
        "rank 1 failed after step 3 (hung outside any collective",
        "two ranks (gloo); rank 1 sleeps inside the loop after step 3",
        f"both ranks print their Python stacks, then stop within "
        f"train.collective_timeout_s={COLLECTIVE_TIMEOUT_S}s + 10s, rank 0 naming rank 1 "
        "(exit 3 each); restart resumes at 2",
    ),
    "kill_mid_save": Case(
        1,
        f"kill_mid_save@{2 * SAVE_EVERY}",
        (-9,),
        "",
        f"SIGKILL while the step-{2 * SAVE_EVERY} checkpoint's shards are on disk, before "
        "its manifest",
        f"the partial folder is never taken: restart resumes at {SAVE_EVERY}",
    ),
    "ctrl_c": Case(
        1,
        "sigint@3",
        (130,),
        "Stopped by SIGINT at step 3",
        "Ctrl-C (SIGINT) after step 3",
        "the step finishes, a checkpoint is saved, exit 130; restart resumes at 3",
        resumes_from=3,
    ),
    "corrupt_latest": Case(
        1,
        f"kill@{2 * SAVE_EVERY + 1}",
        (-9,),
        "",
        f"SIGKILL after step {2 * SAVE_EVERY + 1}, then bytes of the latest checkpoint's "
        "shard flipped",
        f"restart sets the damaged checkpoint aside and resumes at {SAVE_EVERY}",
        before_restart=_corrupt_latest,
    ),
    "disk_full": Case(
        1,
        f"disk_full@{2 * SAVE_EVERY}",
        (2,),
        "no space left",
        f"ENOSPC while the step-{2 * SAVE_EVERY} checkpoint is written",
        f"one line, exit 2, previous checkpoint intact; restart resumes at {SAVE_EVERY}",
    ),
}
STACKS = ["core", "llm", "vlm", "diffusion", "embodied"]
BAD_SHARD_TESTS = {
    "llm": "test_data_faults.py::test_a_corrupted_snappy_parquet_names_the_file_and_rows",
    "vlm": "test_data_readers.py::test_malformed_records_name_the_row",
    "diffusion": "test_latent_integrity.py::test_a_corrupted_shard_is_refused_by_default",
    "embodied": "test_data_checks.py::test_bytes_overwritten_in_the_middle_of_a_parquet",
}
"""bad_shard: each stack's own test of a damaged data file (named, with the row or episode,
exit 2, before any step), run as it is rather than copied here."""
FAST = {("core", "rank_kill")}
"""The cells the default test run takes (seconds on any machine)."""
ROOT = Path(__file__).resolve().parents[3]


def _params() -> list[object]:
    out = []  # case by case: the two-process cases of every stack come first
    for case in CASES:
        for stack in STACKS:
            # A cell runs up to three launches (the reference, the fault, the restart).
            marks = [pytest.mark.faults, pytest.mark.multiprocess, pytest.mark.timeout(3 * 900)]
            if (stack, case) not in FAST:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(stack, case, marks=marks, id=f"{stack}-{case}"))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", LONGBOAT_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@dataclass
class Launch:
    codes: list[int]
    outputs: list[str]
    ended: list[float]
    """Wall time each rank exited at (time.monotonic)."""


def launch(
    stack: str, world: int, out: Path, data: Path, fault: str | None = None, tag: str = "run"
) -> Launch:
    """``world`` ranks of ``run_stack.py STACK train ...`` (torchrun's variables), waited for."""
    cmd = [sys.executable, str(RUNNER), stack]
    cmd += ["--fault", fault] if fault else []
    cmd += ["train", *_stack_args(stack, data), *COMMON, f"output_dir={out}"]
    port, procs = _free_port(), []
    for rank in range(world):
        env = _env()
        if world > 1:
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
        log = (out.parent / f"{out.name}.{tag}.rank{rank}.log").open("w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    ended: list[float | None] = [None] * world
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while any(e is None for e in ended):
            for rank, (proc, _) in enumerate(procs):
                if ended[rank] is None and proc.poll() is not None:
                    ended[rank] = time.monotonic()
            if time.monotonic() > deadline:
                raise AssertionError(f"{stack} {fault}: ranks still running after the deadline")
            time.sleep(0.05)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    outputs = [(out.parent / f"{out.name}.{tag}.rank{r}.log").read_text() for r in range(world)]
    return Launch([p.returncode for p, _ in procs], outputs, [e or 0.0 for e in ended])


def losses(out: Path) -> dict[int, float]:
    """Loss per step of the run in ``out`` (a resumed run replaces the rows after its start)."""
    (metrics,) = out.glob("logs/*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


_REFERENCES: dict[tuple[str, int], dict[int, float]] = {}


@pytest.fixture(scope="session")
def suite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


def reference(stack: str, world: int, root: Path) -> dict[int, float]:
    """The uninterrupted run's per-step losses (one run per stack and world size)."""
    if (stack, world) not in _REFERENCES:
        out = root / f"{stack}-reference-w{world}"
        done = launch(stack, world, out, root / f"{stack}-data")
        assert done.codes == [0] * world, done.outputs[0][-4000:]
        _REFERENCES[stack, world] = losses(out)
        assert sorted(_REFERENCES[stack, world]) == list(range(1, STEPS + 1))
    return _REFERENCES[stack, world]


@pytest.mark.parametrize(("stack", "case"), _params())
def test_fault_stops_as_specified_and_the_restart_loses_nothing(
    stack: str, case: str, suite_dir: Path
) -> None:
    spec = CASES[case]
    data = suite_dir / f"{stack}-data"
    ref = reference(stack, spec.world, suite_dir)
    out = suite_dir / f"{stack}-{case}"

    faulty = launch(stack, spec.world, out, data, fault=spec.fault, tag="fault")
    everything = "\n".join(faulty.outputs)
    assert faulty.codes == list(spec.codes), everything[-6000:]
    assert spec.says in everything, everything[-6000:]
    assert "Traceback" not in faulty.outputs[0], faulty.outputs[0][-4000:]
    if spec.world > 1:
        # Every rank stops within a bound of the first one's exit.
        bound = 10.0 if case != "rank_hang" else 10.0 + 15.0
        assert max(faulty.ended) - min(faulty.ended) < bound, faulty.ended
        reports = [o for o in faulty.outputs if spec.says in o]
        assert len(reports) == 1, "exactly one rank names the failed rank"
    if case == "rank_hang":
        for rank, output in enumerate(faulty.outputs):
            assert f"rank {rank}: step 4 made no progress" in output, output[-4000:]
            assert "most recent call first" in output  # faulthandler's stack dump
    assert not (out / "checkpoints" / f"step_{STEPS:08d}").exists()

    if spec.before_restart is not None:
        spec.before_restart(out)
    restart = launch(stack, spec.world, out, data, tag="restart")
    assert restart.codes == [0] * spec.world, restart.outputs[0][-6000:]
    resumed = f"checkpoints/step_{spec.resumes_from:08d} (step {spec.resumes_from})"
    assert resumed in restart.outputs[0], restart.outputs[0][-4000:]
    if case == "corrupt_latest":
        assert "damaged" in restart.outputs[0]
    assert losses(out) == ref
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # disk: the suite keeps many runs


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["bad_shard"])
@pytest.mark.parametrize("stack", list(BAD_SHARD_TESTS))
def test_a_bad_data_shard_is_named_before_training(stack: str, case: str) -> None:
    test = ROOT / "packages" / stack / "tests" / BAD_SHARD_TESTS[stack]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:]


TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
TORCHRUN_RESTARTS = {"core": 8, "llm": 2}
"""torchrun_restart: the failing attempts before the clean one, per stack. Every attempt joins
the job's store again (torchrun's agent keeps it), so a restart that fails 40% of the time
shows in core's cell with probability 1 - 0.6**8 = 98%."""


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(3 * 900)
@pytest.mark.parametrize("case", ["torchrun_restart"])
@pytest.mark.parametrize("stack", list(TORCHRUN_RESTARTS))
def test_torchrun_max_restarts_resumes_exactly(stack: str, case: str, suite_dir: Path) -> None:
    """torchrun's agent restarts the job each time rank 1 raises: the same run, bit for bit."""
    restarts = TORCHRUN_RESTARTS[stack]
    ref = reference(stack, 2, suite_dir)
    out = suite_dir / f"{stack}-{case}"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts)]
    cmd += [str(RUNNER), stack, "--fault", "raise@3:1", "--fault-attempts", str(restarts)]
    cmd += ["train", *_stack_args(stack, suite_dir / f"{stack}-data"), *COMMON]
    cmd += [f"output_dir={out}"]
    done = subprocess.run(
        cmd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S * 2
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    failed = "rank 1 failed after step 3 (RuntimeError: fault injected"
    assert text.count(failed) == restarts, text[-6000:]
    resumed = f"checkpoints/step_{SAVE_EVERY:08d} (step {SAVE_EVERY})"
    assert text.count(resumed) == restarts, text[-6000:]  # every restart, from step 2
    assert losses(out) == ref
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
