"""``longboat-llm train``: pretrain / SFT / LoRA on megatron-core, end to end.

Order of work: checks of the composed config (done by core before this runs, plus the
llm checks below), process group, data (the quickstart prepares its own), megatron parallel
state, model (random init or an HF directory), LoRA, megatron DDP + distributed optimizer,
resume, the loop (forward/backward through megatron's pipeline schedules, gradient
accumulation to the global batch, NaN guard, LR schedule, metrics, progress, periodic eval
and checkpoints, SIGTERM/SIGUSR1 -> checkpoint and exit), then the HF export.

The loop reads nothing on the host per step where it can: the microbatches go to the device
through pinned memory without waiting, the loss is read at log lines, and the NaN guard's
skip is decided on the device with its host side one step late (``train.lagged_guard``),
except where megatron's step reads on the host anyway (gradient clipping, fp16 loss scaling)
or the update cannot skip on the device (``lagged_guard_blocker``): there the guard reads
the loss every step before the update (the synchronous guard).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.llm.train.checks import check_documents, check_run, model_config, section


@dataclass
class TrainResult:
    """What a run did (the CLI ignores it; tests read it)."""

    start_step: int = 0
    end_step: int = 0
    losses: list[float] = field(default_factory=list)
    """Training loss of every step this run took."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    """Held-out loss by step (step of the start included)."""
    resumed_from: Path | None = None
    stopped_by_signal: str | None = None
    checkpoint: Path | None = None
    hf_dir: Path | None = None
    metrics_path: Path | None = None
    generation: str | None = None


_RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}


def _precision(cfg: Any, accelerator: Any) -> str:
    if accelerator.device_type == "cpu":
        return str(cfg.llm.cpu_precision)
    precision = str(cfg.train.precision)
    if precision == "bf16" and not accelerator.supports_bf16:
        return "fp32"
    return precision


def _own_process_group(accelerator: Any) -> bool:
    """A world-size-1 group when not launched by torchrun (megatron needs process groups)."""
    if dist.is_initialized():
        return False
    from longboat.core.distributed.multiprocess import find_free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(find_free_port())
    dist.init_process_group(accelerator.dist_backend, rank=0, world_size=1)
    return True


def quiet_megatron() -> None:
    """Silence megatron-core's import-time and deprecation chatter (not our users' concern)."""
    import logging

    for name in ("megatron", "megatron.core", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in (
        r"megatron(\..*)?",
        r"transformer_engine(\..*)?",
        r"torch\.utils\.cpp_extension",
    ):
        warnings.filterwarnings("ignore", module=module)
    warnings.filterwarnings("ignore", category=SyntaxWarning)  # escapes in megatron sources
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks.*")
    warnings.filterwarnings(
        "ignore", message=r".*\.grad attribute of a Tensor that is not a leaf.*"
    )


def run(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Train the experiment described by a composed, validated config."""
    quiet_megatron()
    if cfg.train.activation_checkpointing not in _RECOMPUTE:
        raise ConfigError(
            "unknown recompute mode",
            key="train.activation_checkpointing",
            value=cfg.train.activation_checkpointing,
            fix="use none, selective or full",
        )
    model_cfg = model_config(cfg)
    check_run(cfg, model_cfg)
    from longboat.core.device import get_accelerator
    from longboat.core.distributed import init_distributed

    accelerator = get_accelerator()
    threads = torch.get_num_threads()
    if accelerator.device_type == "cpu" and int(cfg.llm.num_threads) > 0:
        torch.set_num_threads(int(cfg.llm.num_threads))
    info = init_distributed(accelerator)
    owns_group = _own_process_group(accelerator)
    try:
        parts, tokenizer_dir = _open_data(cfg, model_cfg, info.rank)
        return _train(cfg, model_cfg, accelerator, info, parts, tokenizer_dir, on_step)
    finally:
        torch.set_num_threads(threads)
        if owns_group:
            dist.destroy_process_group()


def _open_data(cfg: Any, model_cfg: Any, rank: int) -> tuple[list[Any], Path | None]:
    """The prepared datasets (documents) of ``cfg.data`` and the tokenizer directory."""
    from longboat.llm.train.data import open_documents

    data = cfg.data
    if data.name == "quickstart":
        from longboat.llm.quickstart.prepare import prepare_quickstart

        if rank == 0:
            prepare_quickstart(data)
        if dist.is_initialized():
            dist.barrier()
        # Every rank: rank 0's output is up to date now, so this only returns the paths.
        token_dir, tokenizer_dir = prepare_quickstart(data, log=lambda *_: None)
        paths = [token_dir]
    elif data.name == "prepared":
        paths = [Path(p) for p in data.paths]
        tokenizer_dir = Path(data.tokenizer)
    else:
        raise ConfigError(
            "is not a data kind longboat-llm trains on",
            key="data.name",
            value=data.name,
            fix="use data=quickstart or data=prepared",
        )
    parts = []
    for p in paths:
        docs = open_documents(p)
        check_documents(docs, "data.paths", str(p), model_cfg.vocab_size)
        parts.append(docs)
    return parts, tokenizer_dir


def _train_and_eval_documents(data: Any, parts: list[Any]) -> tuple[Any, Any]:
    """Held-out documents of every source; training documents blended by ``data.weights``."""
    from longboat.core.data.blend import BlendedDataset
    from longboat.llm.train.data import Concat, split_documents

    splits = [split_documents(p, float(data.eval_fraction), int(data.seed)) for p in parts]
    train = [s[0] for s in splits]
    held_out = Concat([s[1] for s in splits])
    weights = getattr(data, "weights", None)
    if len(train) == 1 and weights is None:
        return train[0], held_out
    w = list(weights) if weights is not None else [float(len(t)) for t in train]
    return BlendedDataset(train, w, seed=int(data.seed)), held_out


def _checkpoint_module(chunks: list[torch.nn.Module], lora: bool, layout: Any) -> torch.nn.Module:
    """What the checkpoint saves as ``model``.

    Without model parallelism (and without LoRA) the chunk itself, so the checkpoint is a
    native checkpoint ``longboat-llm convert native-to-hf`` reads. Otherwise a view whose
    names carry this rank's (tp, pp, ep) coordinates, since every rank holds a different
    shard under the same megatron names; with LoRA only the adapters (the base comes from
    ``llm.init_from_hf`` or the seed).
    """
    from megatron.core import parallel_state as mps

    mp = layout.tensor_parallel * layout.pipeline_parallel * layout.expert_parallel
    if not lora and len(chunks) == 1 and mp == 1:
        return chunks[0]
    prefix = (
        f"tp{mps.get_tensor_model_parallel_rank()}_pp{mps.get_pipeline_model_parallel_rank()}"
        f"_ep{mps.get_expert_model_parallel_rank()}"
    )
    view = torch.nn.Module()
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if lora and not p.requires_grad:
                continue
            view.register_parameter(f"{prefix}__c{i}__{name.replace('.', '__')}", p)
    return view


def _train(
    cfg: Any,
    model_cfg: Any,
    accelerator: Any,
    info: Any,
    parts: list[Any],
    tokenizer_dir: Path | None,
    on_step: Callable[[int], None] | None,
) -> TrainResult:
    from megatron.core import parallel_state as mps
    from rich.console import Console

    from longboat.core.checkpoint import CheckpointManager
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.data.packing import PackedDataset
    from longboat.core.loop import (
        GracefulShutdown,
        MetricsSink,
        NaNGuard,
        StepProfiler,
        TrainProgress,
    )
    from longboat.core.megatron import parallel_state as mparallel
    from longboat.core.megatron.optimizer import optimizer_step
    from longboat.core.megatron.wgrad_fusion import grad_plan, install_wgrad_fusion
    from longboat.core.rng import RNGState, seed_everything
    from longboat.llm.build import build_model
    from longboat.llm.hf import load_hf
    from longboat.llm.lora import apply_lora
    from longboat.llm.train.data import GlobalBatchSchedule, microbatch
    from longboat.llm.train.lagged_guard import LaggedLossGuard, lagged_guard_blocker
    from longboat.llm.train.one_pass_adamw import OnePassAdamW
    from longboat.llm.train.optimizer import ChainedLR, MegatronOptimizerState, wrap_and_build
    from longboat.llm.train.step import evaluate, forward_backward
    from longboat.llm.train.train_step import (
        compile_decoder_layers,
        main_weights_from_fp32_init,
        wants_exact_main_weights,
    )

    main = info.rank == 0
    console = Console(quiet=not main)
    data = cfg.data
    seq_len = int(data.seq_len)
    train_docs, eval_docs = _train_and_eval_documents(data, parts)
    train_rows = PackedDataset(train_docs, seq_len)
    eval_rows = PackedDataset(eval_docs, seq_len) if len(eval_docs) else None

    precision = _precision(cfg, accelerator)
    layout = mparallel.initialize(
        ParallelConfig(**section(cfg.parallel)), accelerator, seed=int(cfg.train.seed)
    )
    try:
        dp = layout.data_parallel
        mbs = int(cfg.train.micro_batch_size)
        gbs = int(cfg.train.global_batch_size or mbs * dp)
        if gbs % (mbs * dp):
            raise ConfigError(
                f"is not divisible by micro_batch_size x data_parallel = {mbs * dp}",
                key="train.global_batch_size",
                value=gbs,
                fix=f"use a multiple of {mbs * dp}",
            )
        schedule = GlobalBatchSchedule(len(train_rows), gbs, mbs, dp, seed=int(data.seed))
        dp_rank = mps.get_data_parallel_rank()
        device = accelerator.device()
        cpu = torch.device("cpu")  # microbatches are built here, then sent by _to_device
        doc_attn = bool(data.document_attention)

        seed_everything(int(cfg.train.seed), accelerator)
        # Not with train.compile (see train_step.build_train_step).
        compiled = bool(cfg.train.compile)
        fusion, fp32_grads = (False, True)
        if bool(cfg.llm.wgrad_fusion) and not compiled:
            fusion, fp32_grads = grad_plan(
                precision=precision,
                microbatches=schedule.num_microbatches,
                data_parallel=dp,
                context_parallel=layout.context_parallel,
                pipeline_parallel=layout.pipeline_parallel,
            )
        if fusion:
            install_wgrad_fusion()  # megatron's apex extension, in torch
        chunks = build_model(
            model_cfg,
            precision=precision,
            device_type=accelerator.device_type,
            gradient_accumulation_fusion=fusion,
            **_RECOMPUTE[str(cfg.train.activation_checkpointing)],
        )
        if cfg.llm.init_from_hf:
            load_hf(chunks, model_cfg, cfg.llm.init_from_hf)
        lora = bool(cfg.lora.enabled)
        if lora:
            apply_lora(
                chunks,
                rank=int(cfg.lora.rank),
                alpha=float(cfg.lora.alpha),
                targets=list(cfg.lora.targets),
                seed=int(cfg.train.seed),
            )
        if compiled:
            compile_decoder_layers(chunks)
        model, optimizer = wrap_and_build(
            chunks, cfg.optim, precision=precision, grad_reduce_in_fp32=fp32_grads
        )
        if cfg.llm.init_from_hf and wants_exact_main_weights(cfg.llm.init_from_hf, precision, lora):
            # An fp32 checkpoint: start the fp32 main weights from its exact values, not
            # from the bf16 model copy (the warm-up's first updates would round away).
            main_weights_from_fp32_init(
                optimizer,
                model_cfg,
                accelerator.device(),
                lambda c: load_hf(c, model_cfg, cfg.llm.init_from_hf),
                {"gradient_accumulation_fusion": fusion,
                 **_RECOMPUTE[str(cfg.train.activation_checkpointing)]},
            )  # fmt: skip
        total = int(cfg.train.steps)
        lr = ChainedLR(optimizer, cfg.optim.schedule, total)
        one_pass = OnePassAdamW(optimizer) if bool(cfg.llm.one_pass_adamw) else None
        guard = NaNGuard(cfg.train.nan_guard)
        state: dict[str, Any] = {
            "model": _checkpoint_module(chunks, lora, layout),
            "optimizer": MegatronOptimizerState(optimizer),
            "lr_scheduler": lr,
            "nan_guard": guard,
            "rng": RNGState(accelerator),
            "step": 0,
        }
        ckpt = CheckpointManager(cfg.checkpoint, section(cfg))
        resumed = ckpt.resume(state)
        step = int(state["step"]) if resumed is not None else 0
        result = TrainResult(start_step=step, end_step=step)
        result.resumed_from = ckpt.last_loaded if resumed is not None else None
        # After the resume: it switches the param groups it loaded to fused AdamW.
        why_sync = lagged_guard_blocker(
            optimizer,
            guard.cfg,
            one_pass=one_pass,
            fused=bool(getattr(cfg.optim, "fused", True)),
        )
        lagged = None
        if why_sync is None:
            lagged = LaggedLossGuard(
                guard, optimizer, lr, accelerator, one_pass=one_pass is not None
            )
        _print_start(console, cfg, model_cfg, layout, precision, schedule, train_rows, result)
        if guard.cfg.enabled:
            how = (
                "reads the loss" if lagged is None else "skips on the device, checked one step late"
            )
            console.print(f"NaN guard: {how}{f' every step ({why_sync})' if why_sync else ''}.")

        def eval_loss() -> float:
            if eval_rows is None:
                return math.nan
            es = GlobalBatchSchedule(len(eval_rows), gbs, mbs, dp, seed=0, shuffle=False)
            micro = [
                microbatch([eval_rows[i] for i in rows], device, document_attention=doc_attn)
                for s in range(max(1, int(cfg.llm.eval_batches)))
                for rows in es.rows(s, dp_rank)
            ]
            return evaluate(model, micro, device, fused_ce=bool(cfg.llm.fused_linear_ce))

        result.eval_losses[step] = eval_loss()
        metrics = MetricsSink(
            cfg.logging.dir,
            str(cfg.logging.run_name),
            tensorboard=bool(cfg.logging.tensorboard),
            enabled=main,
        )
        log_every = max(1, int(cfg.train.log_every))
        eval_every = int(cfg.train.eval_every)
        fused_ce = bool(cfg.llm.fused_linear_ce)
        pending: list[torch.Tensor] = []  # step losses not yet read on the host
        last_saved = resumed
        t0 = time.perf_counter()
        with (
            GracefulShutdown() as stop,
            StepProfiler(
                cfg.train.profiler, Path(cfg.logging.dir) / str(cfg.logging.run_name) / "profile"
            ) as prof,
            TrainProgress(
                total,
                unit="tokens",
                enabled=bool(cfg.logging.progress) and main,
                initial_step=step,
            ) as progress,
        ):
            while step < total:
                prof.step(step + 1)
                micro = [
                    _to_device(
                        microbatch([train_rows[i] for i in rows], cpu, document_attention=doc_attn),
                        device,
                    )
                    for rows in schedule.rows(step, dp_rank)
                ]
                optimizer.zero_grad()
                loss_t = forward_backward(model, micro, device, fused_ce=fused_ce)
                log_now = (step + 1) % log_every == 0 or step + 1 == total
                grad_norm = None
                if lagged is not None:
                    # No host read: the update skips on the device for a non-finite loss;
                    # the previous step's verdict is resolved here (it steps the LR schedule
                    # before this update reads it).
                    lagged.before_update(step, loss_t)
                    if one_pass is not None:
                        one_pass.step(found_inf=lagged.found_inf)
                    else:
                        optimizer_step(optimizer)
                # The synchronous guard reads the loss every step (one device sync); with the
                # guard off the loss is read only when logged.
                elif guard.check(loss_t):
                    if one_pass is not None and one_pass.step():
                        if log_now:
                            grad_norm = one_pass.logged_grad_norm()
                    else:
                        _, grad_norm = optimizer_step(optimizer)
                        if grad_norm is None and log_now:
                            grad_norm = optimizer.get_grad_norm()  # kept until zero_grad
                    lr.step()
                step += 1
                state["step"] = step
                pending.append(loss_t)
                row: dict[str, Any] = {}
                eval_now = bool(eval_every) and step % eval_every == 0 and step < total
                flush = log_now or eval_now or ckpt.should_save(step) or on_step is not None
                if lagged is not None and flush:
                    # Exact counters and LR schedule for the log line, eval, checkpoint.
                    verdicts = lagged.flush()
                    if log_now and verdicts and verdicts[-1].stepped:  # this step's
                        if one_pass is not None:
                            grad_norm = one_pass.logged_grad_norm()
                        else:
                            grad_norm = optimizer.get_grad_norm()  # kept until zero_grad
                if eval_now:
                    row["eval_loss"] = result.eval_losses[step] = eval_loss()
                if flush or (guard.cfg.enabled and lagged is None):
                    # One stacked host read for every loss since the last flush.
                    result.losses.extend(torch.stack(pending).tolist())
                    pending.clear()
                    progress.update(step, loss=result.losses[-1], items=gbs * seq_len)
                else:
                    progress.update(step, items=gbs * seq_len)
                if log_now or row:
                    metrics.log(
                        step,
                        {
                            "loss": result.losses[-1],
                            "lr": lr.get_last_lr(),
                            "grad_norm": None if grad_norm is None else float(grad_norm),
                            "tokens": step * gbs * seq_len,
                            "skipped_steps": guard.total_skipped,
                            **row,
                        },
                    )
                if on_step is not None:
                    on_step(step)
                if ckpt.should_save(step):
                    ckpt.save(step, state)
                    last_saved = step
                if stop.should_stop():
                    result.stopped_by_signal = stop.signal_name
                    break
            if lagged is not None:
                lagged.flush()  # the end or an interruption: before the final save
                lagged.close()
            if pending:
                result.losses.extend(torch.stack(pending).tolist())
                pending.clear()
        elapsed = time.perf_counter() - t0
        if result.losses:
            result.eval_losses[step] = eval_loss()
            metrics.log(step, {"eval_loss": result.eval_losses[step]})
        if (cfg.checkpoint.save_on_exit or result.stopped_by_signal) and last_saved != step:
            ckpt.save(step, state)
        ckpt.close()
        metrics.close()
        result.end_step = step
        result.checkpoint = ckpt.latest() if main else None
        result.metrics_path = metrics.jsonl_path
        if cfg.llm.export_hf and not result.stopped_by_signal:
            from longboat.llm.train.export import export_hf

            result.hf_dir = export_hf(
                chunks, model_cfg, cfg.llm.export_dir, tokenizer_dir=tokenizer_dir
            )
        _print_end(console, result, elapsed, gbs * seq_len)
        prompt = cfg.llm.generate_prompt
        if main and result.hf_dir is not None and prompt:
            from longboat.llm.train.export import describe_generation, greedy_generate

            penalty = float(cfg.llm.generate_repetition_penalty)
            result.generation = greedy_generate(
                result.hf_dir, str(prompt), int(cfg.llm.generate_tokens), repetition_penalty=penalty
            )
            how = f", repetition penalty {penalty}" if penalty != 1.0 else ""
            console.print(f"Greedy generation from the export (transformers{how}):")
            console.print(describe_generation(result.generation, str(prompt)))
        return result
    finally:
        mparallel.destroy()


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A host microbatch on ``device`` without a host sync on CUDA: a copy from pageable memory
    waits for everything queued on the stream, one from pinned memory does not (the caching
    host allocator keeps the pinned block until the copy is done)."""
    if device.type != "cuda":
        return {k: None if v is None else v.to(device) for k, v in batch.items()}
    return {
        k: None if v is None else v.pin_memory().to(device, non_blocking=True)
        for k, v in batch.items()
    }


def _print_start(
    console: Any, cfg: Any, m: Any, layout: Any, precision: str, sched: Any, rows: Any, r: Any
) -> None:
    if r.resumed_from is not None:
        console.print(f"[bold green]Resumed[/] from {r.resumed_from} (step {r.start_step}).")
    elif str(cfg.checkpoint.resume) == "auto":
        console.print(f"No checkpoint in {cfg.checkpoint.dir}: starting fresh.")
    console.print(
        f"Model {m.name}/{m.flavor}: {m.num_layers} layers, hidden {m.hidden_size}, "
        f"vocab {m.vocab_size}; {precision}; tp={layout.tensor_parallel} "
        f"pp={layout.pipeline_parallel} dp={layout.data_parallel}. Data: {len(rows)} packed "
        f"rows of {rows.seq_len} tokens ({rows.fill:.0%} filled); global batch "
        f"{sched.global_batch} = {sched.num_microbatches} microbatch(es) x "
        f"{sched.micro_batch} x dp {sched.data_parallel}."
    )
    if r.start_step >= int(cfg.train.steps):
        console.print(
            f"Already at train.steps={cfg.train.steps}: nothing to train (add "
            f"train.steps={2 * int(cfg.train.steps)} to continue, or checkpoint.resume=none "
            "to start over)."
        )


def _print_end(console: Any, r: TrainResult, elapsed: float, tokens_per_step: int) -> None:
    took = r.end_step - r.start_step
    if r.stopped_by_signal:
        console.print(
            f"[bold yellow]Stopped by {r.stopped_by_signal}[/] at step {r.end_step}; checkpoint "
            "saved. Run the same command again to resume."
        )
    if took > 0:
        head = sum(r.losses[:5]) / len(r.losses[:5])
        tail = sum(r.losses[-5:]) / len(r.losses[-5:])
        console.print(
            f"Trained steps {r.start_step + 1}..{r.end_step} in {elapsed:.1f}s "
            f"({took * tokens_per_step / max(elapsed, 1e-9):,.0f} tokens/s). Train loss (mean of "
            f"first/last 5 steps): {head:.3f} -> {tail:.3f}"
        )
        first, last = r.eval_losses.get(r.start_step), r.eval_losses.get(r.end_step)
        if first is not None and last is not None and not math.isnan(first):
            console.print(f"Held-out loss: {first:.3f} -> {last:.3f}")
    elif not math.isnan(r.eval_losses.get(r.end_step, math.nan)):
        console.print(f"Held-out loss at step {r.end_step}: {r.eval_losses[r.end_step]:.3f}")
    console.print(
        f"Checkpoints: {r.checkpoint.parent if r.checkpoint else '-'} "
        f"(latest: {r.checkpoint.name if r.checkpoint else '-'})"
    )
    console.print(f"Metrics:     {r.metrics_path}")
    if r.hf_dir is not None:
        console.print(f"HF export:   {r.hf_dir}")
