"""Closed-loop evaluation during training (``train.sim_eval``): ``ClosedLoopEval``.

At each of the run's evaluations after the first (every ``train.eval_every`` steps and at the
end) the current weights are written as an export folder (what ``export`` would write at that
step) to ``<output_dir>/sim_eval/policy``, and ``longboat-embodied eval`` runs on it in a
child process, writing ``<output_dir>/sim_eval/step_<N>/`` (results, table, videos,
``eval.log``). Training waits for it, then logs ``sim_success_rate`` (the suite's success
rate), ``sim_episodes`` and ``sim_eval_failed`` beside the loss. A child that crashes (a
simulator fault), exits non-zero or runs past ``train.sim_eval.timeout_s`` is logged as a
failed evaluation (``sim_eval_failed=1``, the log's path in a warning) and training goes on.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longboat.embodied.eval.report import RESULTS_JSON

logger = logging.getLogger(__name__)

SIM_EVAL_DIR = "sim_eval"
POLICY_DIR = "policy"
LOG_NAME = "eval.log"


class ClosedLoopEval:
    """The ``train.sim_eval`` evaluations of one run (module doc)."""

    def __init__(self, cfg: Any, output_dir: str | Path, *, is_main: bool) -> None:
        """``cfg``: the run's ``train.sim_eval`` (a ``SimEvalConfig``)."""
        self.cfg = cfg
        self.root = Path(output_dir) / SIM_EVAL_DIR
        self.is_main = is_main
        self.started = False

    def command(self, policy: Path, out: Path) -> list[str]:
        """The child's command line."""
        c = self.cfg
        cmd = [sys.executable, "-m", "longboat.embodied.cli", "eval", str(policy)]
        cmd += ["--suite", str(c.suite), "--episodes", str(c.episodes)]
        cmd += ["--num-envs", str(c.num_envs), "--seed", str(c.seed), "--videos", str(c.videos)]
        cmd += ["--device", str(c.device), "--out", str(out), "--no-progress"]
        if c.max_steps is not None:
            cmd += ["--max-steps", str(c.max_steps)]
        return cmd

    def run(self, step: int, write_policy: Callable[[Path], Any]) -> dict[str, float]:
        """Evaluate the weights of ``step`` (the run's first call, its starting point, is
        skipped): ``write_policy(dir)`` writes them (every rank calls it: it may gather),
        then rank 0 runs the child. Every rank returns the same row."""
        if not self.started:
            self.started = True
            return {}
        policy = self.root / POLICY_DIR
        write_policy(policy)
        row = self._run_child(step, policy) if self.is_main else {}
        return _broadcast(row)

    def _run_child(self, step: int, policy: Path) -> dict[str, float]:
        out = self.root / f"step_{step:08d}"
        out.mkdir(parents=True, exist_ok=True)
        log = out / LOG_NAME
        failure = None
        try:
            with log.open("w") as sink:
                proc = subprocess.run(
                    self.command(policy, out),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    timeout=self.cfg.timeout_s,
                    check=False,
                )
            if proc.returncode != 0:
                failure = f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"ran past train.sim_eval.timeout_s={self.cfg.timeout_s}"
        except OSError as err:
            failure = f"did not start: {err}"
        finally:
            shutil.rmtree(policy, ignore_errors=True)
        results = out / RESULTS_JSON
        if failure is None and not results.is_file():
            failure = f"wrote no {RESULTS_JSON}"
        if failure is not None:
            logger.warning(
                "closed-loop evaluation of step %d on suite %s failed (%s); training goes on. "
                "Its output: %s",
                step,
                self.cfg.suite,
                failure,
                log,
            )
            return {"sim_eval_failed": 1.0}
        total = json.loads(results.read_text())["total"]
        return {
            "sim_success_rate": float(total["success_rate"]),
            "sim_episodes": float(total["episodes"]),
            "sim_eval_failed": 0.0,
        }

    def describe(self) -> str:
        """The run's summary line."""
        c = self.cfg
        steps = f", at most {c.max_steps} steps each" if c.max_steps is not None else ""
        return (
            f"Closed-loop eval (train.sim_eval): suite {c.suite}, {c.episodes} episode(s) per "
            f"task{steps} on {c.num_envs} environment(s), in a child process at every "
            f"evaluation after the first; results in {self.root}/step_<N>/ (sim_success_rate)."
        )


def closed_loop_eval(cfg: Any, data: Any, is_main: bool) -> ClosedLoopEval | None:
    """``train.sim_eval``'s evaluations of a run (None: off), once the suite is known to
    feed the run's cameras and state (``data``: its ``RunData``); a ``ConfigError`` before
    the model is built otherwise."""
    sim = cfg.train.sim_eval
    if sim.suite is None:
        return None
    import numpy as np

    from longboat.embodied.eval.runner import check_compatible
    from longboat.embodied.eval.suite import load_suite

    suite = load_suite(sim.suite, key="train.sim_eval.suite")
    widths = {
        (int(np.size(s["observation.state"]["min"])), int(np.size(s["action"]["min"])))
        for s in data.norm_stats
    }
    state_dim, action_dim = next(iter(widths)) if len(widths) == 1 else (None, None)
    check_compatible(suite, data.cameras, state_dim, action_dim)
    return ClosedLoopEval(sim, cfg.output_dir, is_main=is_main)


def _broadcast(row: dict[str, float]) -> dict[str, float]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [row]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return row


__all__ = ["ClosedLoopEval", "closed_loop_eval"]
