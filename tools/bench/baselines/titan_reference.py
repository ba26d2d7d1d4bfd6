"""The torchtitan baseline (``titan_compiled``, ``titan_float8``): torchtitan's Llama 3 model and
its training pieces, imported from the ``torchtitan`` package, at the benchmark's shape.

torchtitan 0.2.x is the line this module drives (its ``JobConfig`` / ``TrainSpec`` API; checked
with 0.2.2 on torch 2.11 and 2.15). torchtitan 0.3.0 rewrote that API (``Trainer.Config``,
``Configurable``) and imports ``DataParallelMeshDims`` from ``torch.distributed.fsdp``, which
torch 2.11 does not have: with 0.3.0 installed the rows are skipped rows saying so.

What runs is what torchtitan's ``train.py`` (``torchtitan.train.Trainer``) builds for
``--model.name llama3`` on one device, from its own functions: the ``JobConfig`` parsed by its
``ConfigManager`` from command-line flags (``job_flags``), ``Transformer`` built on the meta
device, its model converters (``--model.converters quantize.linear.float8``),
``parallelize_llama`` (compile per ``TransformerBlock``; at world size 1 no FSDP or DDP wrapper
is applied), ``to_empty`` +
``init_weights``, ``build_optimizers`` (fused ``AdamW``), ``build_lr_schedulers``,
``build_cross_entropy_loss`` (compiled), ``maybe_enable_amp`` and ``clip_grad_norm_``. At world
size 1 torchtitan keeps fp32 parameters, gradients and optimizer state and runs the forward and
the loss under ``torch.autocast(bfloat16)`` (``training.mixed_precision_param``); FSDP2's
mixed-precision policy applies only when ``data_parallel_shard_degree > 1``.

``TitanStep`` is ``Trainer.train_step``'s body for one micro-batch: zero the grads, copy the CPU
batch to the device, forward + sum cross-entropy / valid tokens under autocast, backward,
``clip_grad_norm_(max_norm)``, the optimizer step (with the converters' post-step hook) and the
LR step. How the rows differ from ``train.py`` with torchtitan's defaults:

1. Model: the benchmark's shape (hidden, layers, heads / KV heads, SwiGLU width, vocab, RoPE
   theta, norm eps; untied head) as a ``TransformerModelArgs``; the SwiGLU width is set exactly
   (``multiple_of`` = the width) and Llama 3.1's RoPE frequency scaling is off
   (``scaling_factor=1``), as in the other rows. SDPA causal attention (torchtitan's default
   ``attn_type``), so no tokenizer is needed.
2. ``--compile.enable`` (model and loss; torchtitan's default is off, its docs advise it, and
   Float8 is only fast compiled) and ``--activation_checkpoint.mode none`` (its default is
   selective every second block; no other row recomputes at this shape).
3. The optimizer's lr, betas, eps and weight decay, ``max_norm`` and the LR warm-up are the
   benchmark config's; torchtitan decays every parameter (norm weights too) where the HF
   baselines and longboat exempt biases and norms (no effect on the step's time).
4. No ``Trainer`` object: no dataloader, tokenizer, checkpointer, metrics or profiler; the
   loss is kept on the device and read after the timing window (``train.py`` reads it at its
   ``log_freq`` steps); torchtitan's ``GarbageCollection`` (automatic gc off, a collection every
   ``gc_freq`` steps) is not installed.
5. Float8 (``titan_float8``): torchao's ``Float8Linear`` with torchtitan's default recipe
   (tensorwise dynamic scaling, ``recipe_name`` unset), the LM head (``output``) left in bf16
   through ``--quantize.linear.float8.filter_fqns output`` (as torchtitan's Float8 docs advise).
   Without a GPU of compute capability >= 8.9 the converter needs ``emulate`` and no compile:
   on CPU both rows run eagerly and Float8 is emulated (``emulate=True``).
"""

from __future__ import annotations

import importlib.metadata as md
import tempfile
from typing import Any

import torch

RUNS = ("titan_compiled", "titan_float8")
"""The torchtitan rows of ``llm_throughput``."""
NOT_INSTALLED = (
    "skipped: torchtitan is not installed (0.2.x; benchmarks/notes/llm.md lists its wheels)"
)


def unavailable(name: str) -> str | None:
    """Why the row ``name`` cannot be built here (a ``skipped:`` error), or ``None``."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        return NOT_INSTALLED
    version = versions()["torchtitan"]
    if not version.startswith("0.2."):
        return (f"skipped: torchtitan {version} is installed; the rows drive its 0.2 line "
                "(0.3 changed the API and needs a torch newer than 2.11)")  # fmt: skip
    if name == "titan_float8" and importlib.util.find_spec("torchao") is None:
        return "skipped: torchao is not installed (torchtitan's Float8 converter needs it)"
    return None


def versions() -> dict[str, str]:
    """The installed torchtitan and torchao versions ("absent" where missing)."""
    out = {}
    for dist in ("torchtitan", "torchao"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def job_flags(m: Any, optim: Any, *, seq: int, micro_batch: int, float8: bool, compiled: bool,
              dump_folder: str) -> list[str]:  # fmt: skip
    """torchtitan's command-line flags for the row (``m``: the benchmark's ``model`` section,
    ``optim``: its ``optim`` section)."""
    flags = [
        "--job.dump_folder", dump_folder,
        "--model.name", "llama3",
        "--model.hf_assets_path", dump_folder,  # no tokenizer or weights are read
        "--training.local_batch_size", str(micro_batch),
        "--training.seq_len", str(seq),
        "--training.max_norm", str(float(optim.grad_clip)),
        "--training.mixed_precision_param", "bfloat16",
        "--optimizer.name", "AdamW",
        "--optimizer.lr", str(optim.lr),
        "--optimizer.beta1", str(float(optim.betas[0])),
        "--optimizer.beta2", str(float(optim.betas[1])),
        "--optimizer.eps", str(optim.eps),
        "--optimizer.weight_decay", str(optim.weight_decay),
        "--lr_scheduler.warmup_steps", str(max(1, optim.schedule.warmup_steps)),
        "--activation_checkpoint.mode", "none",
    ]  # fmt: skip
    if compiled:
        flags += ["--compile.enable", "--compile.components", "model", "loss"]
    if float8:
        flags += ["--model.converters", "quantize.linear.float8",
                  "--quantize.linear.float8.filter_fqns", "output"]  # fmt: skip
        if not compiled:  # no Float8 kernels without compile below sm89: emulate
            flags += ["--quantize.linear.float8.emulate"]
    return flags


def model_args(m: Any) -> Any:
    """torchtitan's ``TransformerModelArgs`` with the shape of ``m`` (a Llama-family
    ``DecoderModelConfig``: hidden = heads x head_dim, untied head)."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    if m.name != "llama3" or m.tie_embeddings:
        raise ValueError(f"model.name={m.name}: the torchtitan rows run the untied Llama shape")
    if m.hidden_size != m.num_attention_heads * m.head_dim:
        raise ValueError("torchtitan's Llama 3 needs hidden_size == heads x head_dim")
    base = int(2 * 4 * m.hidden_size / 3)  # torchtitan's FeedForward width before rounding
    return TransformerModelArgs(
        dim=m.hidden_size,
        n_layers=m.num_layers,
        n_heads=m.num_attention_heads,
        n_kv_heads=m.num_query_groups,
        vocab_size=m.vocab_size,
        multiple_of=m.ffn_hidden_size,  # rounds int(base x ratio) up to exactly the width
        ffn_dim_multiplier=m.ffn_hidden_size / base,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
        max_seq_len=m.max_position_embeddings,
    )


class TitanStep:
    """torchtitan's one-device training step at the benchmark's shape:
    ``step(tokens, labels) -> loss`` (CPU int64 batches, as its dataloader yields them)."""

    def __init__(self, m: Any, optim: Any, device: torch.device, *, seq: int,
                 micro_batch: int, float8: bool) -> None:  # fmt: skip
        import torchtitan.components.quantization  # noqa: F401 (registers the converters)
        from torchtitan.components.loss import build_cross_entropy_loss
        from torchtitan.components.lr_scheduler import build_lr_schedulers
        from torchtitan.components.optimizer import build_optimizers
        from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama3 import Transformer, parallelize_llama
        from torchtitan.protocols.model_converter import build_model_converters
        from torchtitan.tools import utils as titan_utils

        self._dump = tempfile.TemporaryDirectory(prefix="titan_bench_")
        compiled = device.type == "cuda"
        flags = job_flags(m, optim, seq=seq, micro_batch=micro_batch, float8=float8,
                          compiled=compiled, dump_folder=self._dump.name)  # fmt: skip
        self.flags = flags
        job = ConfigManager().parse_args(flags)
        self.job = job
        self.parallel_dims = ParallelDims(
            dp_shard=job.parallelism.data_parallel_shard_degree,
            dp_replicate=job.parallelism.data_parallel_replicate_degree,
            cp=job.parallelism.context_parallel_degree,
            tp=job.parallelism.tensor_parallel_degree,
            pp=job.parallelism.pipeline_parallel_degree,
            ep=job.parallelism.expert_parallel_degree,
            etp=job.parallelism.expert_tensor_parallel_degree,
            world_size=1,
        )
        args = model_args(m)
        args.update_from_config(job)
        with (
            torch.device("meta"),
            titan_utils.set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]),
        ):
            model = Transformer(args)
        converters = build_model_converters(job, self.parallel_dims)
        converters.convert(model)
        model = parallelize_llama(model, self.parallel_dims, job)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model = model
        self.optimizers = build_optimizers([model], job.optimizer, self.parallel_dims)
        self.lr_schedulers = build_lr_schedulers(
            self.optimizers, job.lr_scheduler, job.training.steps
        )
        self.optimizers.register_step_post_hook(
            lambda *a, **k: converters.post_optimizer_hook([model])
        )
        self.loss_fn = build_cross_entropy_loss(job)
        self.amp = dist_utils.maybe_enable_amp(
            self.parallel_dims, job.training.mixed_precision_param, device.type
        )
        self.clip = dist_utils.clip_grad_norm_
        self.device = device
        self.ffn_width = model.layers["0"].feed_forward.w1.out_features
        if self.ffn_width != m.ffn_hidden_size:
            raise ValueError(
                f"torchtitan built SwiGLU width {self.ffn_width}, not {m.ffn_hidden_size}"
            )
        self.linear = type(model.layers["0"].feed_forward.w1).__name__
        self.head = type(model.output).__name__
        self.compiled = compiled

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.optimizers.zero_grad()
        valid = (labels != -100).sum().to(self.device).float()
        inputs, targets = tokens.to(self.device), labels.to(self.device)
        with self.amp:
            pred = self.model(inputs)
            loss = self.loss_fn(pred, targets) / valid
        del pred
        loss.backward()
        self.clip(list(self.model.parameters()), self.job.training.max_norm, foreach=True,
                  pp_mesh=None, ep_enabled=False)  # fmt: skip
        self.optimizers.step()
        self.lr_schedulers.step()
        return loss.detach()

    def notes(self) -> dict[str, Any]:
        """What the row ran: versions, torchtitan's flags, precision, the linears' class."""
        return {
            "versions": versions(),
            "flags": " ".join("<tmp>" if f == self._dump.name else f for f in self.flags),
            "precision": "fp32 params + bf16 autocast (torchtitan at world size 1)",
            "compiled": self.compiled,
            "block_linear": self.linear,
            "lm_head": self.head,
        }

    def close(self) -> None:
        self._dump.cleanup()
