"""Evaluation on the held-out episodes of ``data.eval_episodes``.

One evaluation runs a fixed set of batches: at most ``data.eval_batches`` batches of
``train.micro_batch_size`` samples, spread evenly over the held-out frames. Batch ``k`` is
loaded under a CPU seed of its own and evaluated under RNG seeds of its own (one for the
flow-matching noise and time of the loss, one for the initial noise of the sampled chunk), so
every evaluation of the same weights gives the same numbers: across evaluations of a run,
after a resume and at any data-parallel size (up to the summation order of the all-reduce).

It reports

- ``eval_loss``: the policy's flow-matching training loss, the mean over the batches;
- ``eval_action_mse``: the mean squared error of action chunks sampled by the policy's own
  inference path (``predict_action`` with its default number of denoising steps) against
  the ground-truth normalised actions, over the real (step, dim) entries of ``action_mask``.

The model runs in eval mode (no dropout or state dropout) without grad, under the run's
autocast; every module's train / eval mode is restored afterwards. Under data parallelism rank
``r`` evaluates batches ``r, r + dp, ...`` and the sums are all-reduced, so every rank returns
the same numbers; a rank with fewer batches than another runs a batch with zero weight, so
FSDP's collectives stay in step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.utils.data import Dataset

from longboat.core.engine.torch.step import autocast_context, micro_batch_seed, seeded_rng
from longboat.embodied.parallel import unwrap
from longboat.embodied.train.policy_batch import PolicyCollator, to_device

_EVAL_SALT = 0xE7A1_5EED  # eval RNG streams, apart from the training ones


def eval_sample_indices(num_samples: int, max_batches: int, micro_batch: int) -> list[list[int]]:
    """The held-out positions of each evaluation batch: ``min(num_samples, max_batches x
    micro_batch)`` positions evenly spaced over ``0 .. num_samples-1`` (so every held-out
    episode takes part), cut into batches of ``micro_batch`` (the last one may be short)."""
    total = min(num_samples, max_batches * micro_batch)
    picks = [i * num_samples // total for i in range(total)]
    return [picks[k : k + micro_batch] for k in range(0, total, micro_batch)]


def masked_action_sq_error(
    pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squared errors, number of entries) over the real entries of ``mask``
    (broadcast to ``target``; None: every entry)."""
    err = (pred.float() - target.float()).square()
    if mask is None:
        return err.sum(), torch.tensor(float(err.numel()), device=err.device)
    weight = mask.to(err.dtype).expand_as(err)
    return (err * weight).sum(), weight.sum()


class HeldOutEval:
    """The evaluation of one run (module doc): ``run(model)`` -> ``{"eval_loss",
    "eval_action_mse"}``."""

    def __init__(
        self,
        dataset: Dataset,
        collate: PolicyCollator,
        *,
        max_batches: int,
        micro_batch: int,
        seed: int,
        precision: str,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.dataset = dataset
        self.collate = collate
        self.batches = eval_sample_indices(len(dataset), max_batches, micro_batch)
        self.seed = seed ^ _EVAL_SALT
        self.precision = precision
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.rounds = math.ceil(len(self.batches) / world_size)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self._registered = False

    @property
    def num_samples(self) -> int:
        """Held-out samples one evaluation runs (over all ranks)."""
        return sum(len(b) for b in self.batches)

    def _batch(self, k: int) -> dict[str, torch.Tensor]:
        """Collated batch ``k`` on the device (read once, then kept on the host)."""
        if k not in self._cache:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(micro_batch_seed(self.seed, 0, k))
                self._cache[k] = self.collate([self.dataset[i] for i in self.batches[k]])
        return to_device(self._cache[k], self.device)

    def _sums(self, policy: nn.Module, k: int, dtype: torch.dtype) -> torch.Tensor:
        """(loss, 1, squared action error, entries) of batch ``k`` (its seeds fixed by k)."""
        batch = self._batch(k % len(self.batches))
        device_type = self.device.type
        index = self.device.index if device_type != "cpu" else None
        autocast = autocast_context(self.precision, device_type)
        with seeded_rng(micro_batch_seed(self.seed, 1, k), device_type, index), autocast:
            loss = policy(batch)["loss"]
        autocast = autocast_context(self.precision, device_type)
        with seeded_rng(micro_batch_seed(self.seed, 2, k), device_type, index), autocast:
            pred = policy.predict_action(batch)
        sq, count = masked_action_sq_error(pred, batch["action"], batch.get("action_mask"))
        return torch.stack([loss.detach().float(), torch.ones_like(sq), sq, count]).to(dtype)

    def run(self, model: nn.Module) -> dict[str, float]:
        """Evaluate ``model`` (the run's parallel-wrapped policy) on the held-out batches."""
        # DDP's wrapper would run collectives in forward; the module itself needs none.
        # FSDP2 shards in place: its forward and predict_action gather the parameters.
        policy = unwrap(model)
        if isinstance(policy, FSDPModule) and not self._registered:
            register_fsdp_forward_method(policy, "predict_action")
            self._registered = True
        # float64 on CPU (exact across world sizes, as the training losses); fp32 on devices.
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        sums = torch.zeros(4, dtype=dtype, device=self.device)
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                for r in range(self.rounds):
                    k = r * self.world_size + self.rank
                    # A rank past the last batch runs one with zero weight (FSDP in step).
                    weight = 1.0 if k < len(self.batches) else 0.0
                    sums += weight * self._sums(policy, k, dtype)
        finally:
            for module, training in modes:
                module.train(training)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        loss_sum, n, sq_sum, count = sums.cpu().tolist()
        return {
            "eval_loss": loss_sum / n,
            "eval_action_mse": sq_sum / count if count > 0 else float("nan"),
        }


__all__ = ["HeldOutEval", "eval_sample_indices", "masked_action_sq_error"]
