"""The CUDA-graph-ready step (``GraphableStep`` + ``run_step``) on CPU: the same numbers as
``train_step``, no capture hazards after the first batches, and a capture/replay simulation
through core's ``GraphedStep`` (static inputs, outputs overwritten per replay, RNG seeded
outside) that reproduces the eager run bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embodied_testkit import cpu_train_step, schedule_gate, tiny_groot, tiny_groot_batches

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import OptimConfig
from longboat.core.engine.torch.graphable import GraphableStep, run_step
from longboat.core.loop.capture_check import capture_hazards, find_capture_hazards
from longboat.core.loop.cuda_graph import GraphedStep
from longboat.embodied.train.trainer import train

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], grad_clip=0.2)
STEPS = 5


pytestmark = pytest.mark.usefixtures("one_thread")


def _setup():
    model, optimizer = tiny_groot(OPTIM)
    # A schedule that changes the lr every step: it must reach the device each step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / STEPS)
    return model, optimizer, scheduler


def _eager_reference(batches):
    model, opt, sched = _setup()
    gate = schedule_gate(sched)
    results = [
        cpu_train_step(model, opt, b, i, OPTIM.grad_clip, gate=gate) for i, b in enumerate(batches)
    ]
    return [(r.loss, r.grad_norm) for r in results], opt.master.clone()


def _run_factored(batches, wrap=lambda fn, opt: fn):
    model, opt, sched = _setup()
    fn = wrap(
        GraphableStep(model, opt, precision="bf16", device_type="cpu", grad_clip=OPTIM.grad_clip),
        opt,
    )
    gate = schedule_gate(sched)
    results = []
    for i, b in enumerate(batches):
        results.append(
            run_step(fn, opt, b, step=i, seed=3, rank_offset=0, device_type="cpu", gate=gate)
        )
        gate.end_step()  # as core's trainer does after each step
    return [(r.loss, r.grad_norm) for r in results], opt.master.clone(), fn


def test_factored_step_equals_train_step():
    batches = tiny_groot_batches(STEPS)
    ref, ref_master = _eager_reference(batches)
    got, master, _ = _run_factored(batches)
    assert len({loss for loss, _ in ref}) == STEPS
    assert min(norm for _, norm in ref) > OPTIM.grad_clip  # clipping is exercised
    assert got == ref  # bit-identical floats
    assert torch.equal(master, ref_master)


def test_step_has_no_capture_hazards_after_the_value_check_batches():
    model, opt, _ = _setup()
    fn = GraphableStep(model, opt, precision="bf16", device_type="cpu", grad_clip=OPTIM.grad_clip)
    batch = tiny_groot_batches(STEPS)[0]
    first = find_capture_hazards(fn, batch)
    # The first batches validate embodiment ids / placeholder counts on the host (and build
    # the per-device image constants): the detector sees them, so it can fail.
    assert {h.where.split(":")[0].rsplit("/", 1)[-1] for h in first} >= {"model.py", "backbone.py"}
    # On an accelerator the model stops value-checking after its first batches (on CPU it
    # always checks): emulate that, then the whole step must be clean.
    model._check_values = lambda: False
    assert find_capture_hazards(fn, batch) == []


def test_hazard_detector_flags_syncs_shapes_copies_and_reseeds():
    x = torch.randn(4)
    with capture_hazards() as found:
        float(x.sum())
        _ = x[x > 0]
        torch.nonzero(x)
        torch.tensor([1.0, 2.0])
        torch.manual_seed(0)
        _ = x * torch.tensor(2.0)  # a 0-dim wrapped scalar: fine
    whys = [h.why for h in found]
    assert len(whys) == 5, whys
    assert "host" in whys[0] and "boolean" in whys[1] and "nonzero" in whys[2]
    assert "Python data" in whys[3] and "reseeds" in whys[4]


class _SimulatedGraph:
    """A ``GraphedStep`` backend that behaves like CUDA-graph capture + replay on CPU.

    capture: runs ``fn`` once under the hazard detector (failing on any hazard), then
    restores every piece of state the run changed (a real capture records kernels without
    running them and leaves the RNG where it was); replay: reruns ``fn`` on the static
    inputs and copies its results into the static outputs (what a replay overwrites).
    """

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.captures = 0

    def run_on_side_stream(self, fn):
        return fn()

    def run_and_find_syncs(self, fn):
        return fn(), []  # the capture below checks hazards; the warm-up may still have some

    def _buffers(self):
        o = self.optimizer
        return [o.master, o.exp_avg, o.exp_avg_sq, o.flat_param, o.flat_grad, o.step_count]

    def capture(self, fn):
        self.captures += 1
        saved = [b.clone() for b in self._buffers()]
        rng = torch.get_rng_state()
        with capture_hazards() as found:
            out = fn()
        assert found == [], found
        for buf, old in zip(self._buffers(), saved):
            buf.copy_(old)
        torch.set_rng_state(rng)

        def replay() -> None:
            for key, value in fn().items():
                out[key].copy_(value)

        return replay, out


def test_simulated_capture_and_replay_reproduce_the_eager_run():
    batches = tiny_groot_batches(STEPS)
    ref, ref_master = _eager_reference(batches)
    backends = []

    def graphed(fn, opt):
        fn.model._check_values = lambda: fn.model._value_checks_left > 0  # as on a GPU
        backends.append(_SimulatedGraph(fn.model, opt))
        return GraphedStep(fn, accelerator=None, warmup=2, backend=backends[0])

    got, master, step = _run_factored(batches, graphed)
    assert backends[0].captures == 1 and step.replays == STEPS - 2
    assert got == ref
    assert torch.equal(master, ref_master)


def _trainer_overrides(out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        "train.steps=3",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # one micro-batch a step
        "train.log_every=2",
        "train.precision=bf16",
        "train.master_weights=true",
        "logging.progress=false",
        "logging.trackers=[]",
        "export.enabled=false",
        "checkpoint.save_on_exit=false",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        *extra,
    ]


def test_trainer_cuda_graph_falls_back_to_the_same_eager_run_on_cpu(tmp_path: Path, capsys):
    runs, said = {}, {}
    for graph in ("false", "true"):
        cfg = compose_experiment(
            "groot_n1_6_tiny",
            _trainer_overrides(tmp_path / graph, f"train.cuda_graph={graph}"),
            world_size=1,
        )
        runs[graph] = train(cfg).losses
        said[graph] = capsys.readouterr().out
    # The start of the run says which step runs and that the graph fell back.
    assert "train.cuda_graph: eager (the cpu accelerator has no CUDA graphs)" in said["true"]
    assert "GraphableStep" in said["false"] and "train.cuda_graph" not in said["false"]
    assert len(runs["true"]) == 3
    # The graph run pads the text to the fixed maximum length; masked positions change
    # the matmul shapes only (measured difference 0).
    torch.testing.assert_close(
        torch.tensor(runs["true"]), torch.tensor(runs["false"]), rtol=1e-5, atol=0
    )


def test_cuda_graph_config_errors(tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        compose_experiment(
            "groot_n1_6_tiny",
            [
                f"output_dir={tmp_path}",
                "train.cuda_graph=true",
                "train.micro_batch_size=16",
                "train.global_batch_size=64",
            ],
            world_size=1,
        )
    text = str(err.value)
    assert "train.cuda_graph" in text and "train.master_weights=true" in text
    assert "train.global_batch_size=16" in text


def _resolve(device: str = "cuda", accum: int = 1, strategy: str = "ddp", optim: str = "adamw",
             dp_size: int = 1, **train: object):  # fmt: skip
    from dataclasses import replace

    from longboat.embodied.config import EmbodiedTrainConfig, resolve_fast_path

    t = replace(EmbodiedTrainConfig(), **{"precision": "bf16", **train})
    return resolve_fast_path(
        t, strategy=strategy, optim_name=optim, device_type=device, accum=accum, dp_size=dp_size
    )


def test_fast_path_defaults_resolve_on_where_they_apply_and_say_why_not():
    """Null train.master_weights / train.cuda_graph: on for bf16 + ddp + AdamW with one
    micro-batch a step on CUDA; each reason to leave one off is one notice naming the key."""
    on = _resolve()
    assert (on.master_weights, on.cuda_graph, on.graph_auto, on.notices) == (True, True, True, ())
    cases = {
        "train.cuda_graph: eager steps (gradient accumulation of 2": _resolve(accum=2),
        "train.cuda_graph: eager steps (the cpu device has no CUDA graphs)": _resolve("cpu"),
        "train.cuda_graph: eager steps (train.recompute=full); set": _resolve(recompute="full"),
        "train.cuda_graph: eager steps (train.compile=true)": _resolve(compile=True),
        "train.cuda_graph: eager steps (data parallel over 2 ranks); set": _resolve(dp_size=2),
    }
    for notice, fp in cases.items():
        assert fp.master_weights and not fp.cuda_graph and not fp.graph_auto
        assert len(fp.notices) == 1 and fp.notices[0].startswith(notice), fp.notices
    whys = {"fsdp": "parallel.strategy=fsdp shards or wraps the params", "sgd": "optim.name=sgd"}
    for fp, why in (
        (_resolve(strategy="fsdp"), whys["fsdp"]),
        (_resolve(optim="sgd"), whys["sgd"]),
    ):
        assert not fp.master_weights and not fp.cuda_graph
        assert fp.notices == (
            f"train.master_weights: off ({why}); fp32 params under bf16 autocast.",
        )
    fp32 = _resolve(precision="fp32")  # master weights are a bf16 layout: nothing to say
    assert (fp32.master_weights, fp32.cuda_graph, fp32.notices) == (False, False, ())
    # Explicit values stay as given, and an explicit graph fails loudly on a host sync.
    off = _resolve(master_weights=False)
    assert (off.master_weights, off.cuda_graph, off.notices) == (False, False, ())
    forced = _resolve(cuda_graph=True, recompute="full")
    assert forced.cuda_graph and not forced.graph_auto and forced.notices == ()
    assert not _resolve(cuda_graph=False).cuda_graph


def test_bf16_run_defaults_to_master_weights_and_says_the_graph_is_off_on_cpu(
    tmp_path: Path, capsys
):
    """The CLI's defaults at bf16 build the master-weight step; on the CPU the run's start
    says in one line why the step is not graphed, and trains."""
    over = [o for o in _trainer_overrides(tmp_path) if not o.startswith("train.master_weights")]
    cfg = compose_experiment("groot_n1_6_tiny", over, world_size=1)
    assert cfg.train.master_weights is None and cfg.train.cuda_graph is None
    losses = train(cfg).losses
    out = capsys.readouterr().out
    assert "step: GraphableStep (master weights)" in out
    assert out.count("train.cuda_graph: eager steps (the cpu device has no CUDA graphs).") == 1
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
