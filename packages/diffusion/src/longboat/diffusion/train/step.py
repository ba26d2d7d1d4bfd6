"""One flow-matching optimizer step on megatron's DDP + distributed optimizer.

``DiffusionTrainStep`` wraps a diffusion transformer in megatron's
``DistributedDataParallel`` and builds the distributed optimizer (fp32 main weights and
moments sharded over the data x context parallel ranks). A step runs the flow-matching loss on
each of its micro-batches and one optimizer update:

- **Loss**: the mean over every sample of the global batch (all micro-batches, all
  data-parallel ranks) of its timestep-weighted velocity MSE, so a step's loss does not depend
  on how its samples are split into micro-batches and ranks.
- **Noise**: each micro-batch draws its noise levels and noise from a ``torch.Generator``
  seeded by ``(seed, step, j * dp + dp_rank)`` for its ``j``-th micro-batch on data-parallel
  rank ``dp_rank`` (the batch's global position in the step, which is also the position the
  sampler hands it out at), so a resumed run replays the same noise and DP=2 draws what DP=1
  draws for the same batches.
- **Context parallelism**: every rank of a context-parallel group computes the same loss from
  the same full outputs, but holds only its tokens' share of the gradients; megatron's DDP
  averages over data x context parallel ranks, so the backward runs on ``loss * cp``.

``DiffusionTrainStep`` is a core ``MegatronStepEngine``: it gives the engine its optimizer and
the step's forward + loss + backward; the engine owns the update, the NaN gate (lagged where
the update can skip on the device) and the CUDA-graph step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from longboat.core.device.transfer import to_device
from longboat.core.megatron.engine import MegatronStepEngine
from longboat.diffusion.objective.flow_matching import (
    FlowMatchingConfig,
    draw_noise,
    flow_matching_loss,
)
from longboat.diffusion.train.data import model_kwargs, noise_seed

__all__ = ["DiffusionTrainStep"]


def model_inputs(batch: dict[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor, Any]:
    """``(x0, text_embeds, text_mask, latent_mask)`` of a collated batch; the latent mask is
    None when nothing is padded (bucketed batches). Call it on the host batch: on a device
    the padding check would read the mask back."""
    mask = batch.get("latent_mask")
    if mask is not None and bool(mask.all()):
        mask = None
    from longboat.diffusion.models.common.layers import empty_captions

    empty = empty_captions(batch["text_mask"])
    if empty:
        where = batch["indices"][empty].tolist() if "indices" in batch else empty
        raise ValueError(f"text_mask has no caption token for the samples at indices {where}")
    return batch["latents"], batch["text_embeds"], batch["text_mask"], mask


def _on_device(batch: dict[str, Any], device: torch.device) -> tuple[Any, ...]:
    """``model_inputs`` of a host batch, checked on the host and copied to ``device``."""
    return tuple(to_device(v, device) for v in model_inputs(batch))


class DiffusionTrainStep(MegatronStepEngine):
    """Forward / backward over a step's micro-batches; the engine's update and gate."""

    def __init__(
        self,
        model: Any,
        optim: Any,
        *,
        precision: str,
        objective: FlowMatchingConfig,
        seed: int,
        device: torch.device,
        microbatches: int = 1,
        cuda_graph: bool = False,
        caption_dropout: Any = None,
    ) -> None:
        from megatron.core import parallel_state as mps

        from longboat.core.megatron.optimizer import build_optimizer, wrap_ddp
        from longboat.core.megatron.wgrad_fusion import single_pass_grads

        self.model = model
        # One micro-batch and no gradient reduction: each weight gradient lands once in a
        # zeroed buffer, so a bf16 buffer holds exactly what an fp32 one would, in half the
        # memory (2 bytes a parameter less).
        self.single_pass_grads = single_pass_grads(
            precision=precision,
            microbatches=microbatches,
            data_parallel=mps.get_data_parallel_world_size(),
            context_parallel=mps.get_context_parallel_world_size(),
        )
        (self.ddp,) = wrap_ddp(
            [model],
            distributed_optimizer=True,
            grad_reduce_in_fp32=not self.single_pass_grads,
            side_stream=cuda_graph,
        )
        self.graph_ready = cuda_graph
        self.optimizer = build_optimizer(
            [self.ddp], optim, precision=precision, distributed_optimizer=True
        )
        self.objective = objective
        self.caption_dropout = caption_dropout
        """A ``CaptionDropout`` applied to every training micro-batch (None: captions kept)."""
        self.seed = seed
        self.device = device
        self.dp = mps.get_data_parallel_world_size()
        self.dp_rank = mps.get_data_parallel_rank()
        self.cp = mps.get_context_parallel_world_size()
        self.dp_group = mps.get_data_parallel_group()

    def generator(self, step: int, micro: int) -> torch.Generator:
        """The noise generator of micro-batch ``micro`` of this rank at ``step``."""
        position = micro * self.dp + self.dp_rank
        return torch.Generator().manual_seed(noise_seed(self.seed, step, position))

    def _drop_captions(self, batch: dict[str, Any], step: int, micro: int) -> dict[str, Any]:
        """``batch`` after caption dropout (its draws seeded by the batch's global position
        in the step, like the noise)."""
        if self.caption_dropout is None:
            return batch
        return self.caption_dropout.apply(batch, step, micro * self.dp + self.dp_rank)

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp > 1:
            dist.all_reduce(value, group=self.dp_group)
        return value

    def forward_backward(self, step: int, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """Backward of the step's sample-mean loss; returns the loss (0-d, equal on all
        ranks)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        local = float(sum(len(mb["captions"]) for mb in micro_batches))
        # one rank: a host float (a device scalar made from the host would be a blocking copy)
        count: Any = local
        if self.dp > 1:
            count = self._all_reduce(to_device(torch.tensor(local), self.device))
        # DDP averages gradients over dp * cp ranks; this makes them the global sample mean.
        scale = (self.dp * self.cp) / count
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for j, mb in enumerate(micro_batches):
            mb = self._drop_captions(mb, step, j)
            x0, text, text_mask, latent_mask = _on_device(mb, self.device)
            loss, _ = flow_matching_loss(
                self.ddp,
                x0,
                text,
                text_mask,
                config=self.objective,
                generator=self.generator(step, j),
                latent_mask=latent_mask,
                model_kwargs=model_kwargs(mb, self.device),
            )
            summed = loss * len(mb["captions"])  # the micro-batch's mean -> its sum
            (summed * scale).backward()
            total = total + summed.detach()
        self.ddp.finish_grad_sync()
        return self._all_reduce(total) / count

    def loss_and_grads(self, step: int, microbatches: list[dict[str, Any]]) -> torch.Tensor:
        return self.forward_backward(step, microbatches)  # the noise is the step's

    def graph_inputs(self, step: int, microbatches: list[dict[str, Any]]) -> dict[str, Any]:
        """The captured step's inputs: the one micro-batch on the device and its noise levels
        and noise, drawn on the host from the step's generator (the eager step's draws)."""
        (mb,) = microbatches
        mb = self._drop_captions(mb, step, 0)
        x0, text, text_mask, latent_mask = _on_device(mb, self.device)
        sigmas, noise = draw_noise(x0, self.objective, self.generator(step, 0))
        out = {"x0": x0, "text": text, "text_mask": text_mask, "sigmas": sigmas, "noise": noise}
        out |= model_kwargs(mb, self.device)
        if latent_mask is not None:
            out["latent_mask"] = latent_mask
        return out

    def graph_forward_backward(self, inputs: dict[str, Any]) -> torch.Tensor:
        """``forward_backward`` of one micro-batch from ``graph_inputs`` (no host value that
        changes between steps: every rank's micro-batch holds ``micro_batch_size`` samples)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        x0 = inputs["x0"]
        count = float(x0.shape[0] * self.dp)
        loss, _ = flow_matching_loss(
            self.ddp,
            x0,
            inputs["text"],
            inputs["text_mask"],
            config=self.objective,
            latent_mask=inputs.get("latent_mask"),
            drawn=(inputs["sigmas"], inputs["noise"]),
            model_kwargs={k: inputs[k] for k in ("pooled_embeds",) if k in inputs},
        )
        summed = loss * x0.shape[0]
        (summed * ((self.dp * self.cp) / count)).backward()
        self.ddp.finish_grad_sync()
        return self._all_reduce(summed.detach()) / count

    def graph_modules(self) -> Any:
        return self.model.modules()

    @torch.no_grad()
    def held_out(
        self, batches: list[dict[str, Any]], noise_of: Any, sigmas: list[float]
    ) -> torch.Tensor:
        """``[len(sigmas) + 1]``: the summed velocity MSE of this rank's held-out samples at
        each noise level (fixed noise per sample: ``noise_of(batch)``), and their count."""
        out = torch.zeros(len(sigmas) + 1, dtype=torch.float64)
        steps = self.objective.num_train_timesteps
        for batch in batches:
            noise = noise_of(batch)
            x0, text, text_mask, latent_mask = _on_device(batch, self.device)
            kwargs = model_kwargs(batch, self.device)
            n = x0.shape[0]
            eps = torch.stack(noise).to(self.device, x0.dtype)
            for k, sigma in enumerate(sigmas):
                x_t = (1.0 - sigma) * x0 + sigma * eps
                t = torch.full((n,), sigma * steps, device=self.device)
                pred = self.model(x_t, t, text, text_mask, **kwargs)
                err = (pred.float() - (eps - x0).float()) ** 2
                if latent_mask is None:
                    per = err.flatten(1).mean(1)
                else:
                    m = latent_mask[:, None].float()
                    per = (err * m).flatten(1).sum(1) / (m.flatten(1).sum(1) * err.shape[1])
                out[k] += float(per.sum())
            out[-1] += n
        return out
