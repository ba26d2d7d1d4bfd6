"""bf16 weights with fp32 master weights: flat buffers, one fused AdamW launch per group.

``MasterWeightAdamW`` takes ownership of the trainable parameters' storage:

- every trainable parameter becomes a bf16 view into ONE flat bf16 buffer
  (``flat_param``), and its ``.grad`` a view into ONE flat bf16 buffer (``flat_grad``)
  that autograd accumulates into (``zero_grad`` zeroes the buffer, it never frees it);
- the optimizer keeps fp32 master weights and both Adam moments as flat fp32 buffers;
  ``prepare_grads`` all-reduces the bf16 grads with one collective at world size > 1 and
  measures the global norm (accumulated in fp32) and the clip factor on the device (no host
  sync); ``step`` updates each param group in one pass on CUDA:
  ``longboat.kernels.adamw_master_step_`` (Triton) reads the bf16 grads, the fp32 masters
  and moments, writes them back and writes the bf16 weights (28 bytes a parameter; clipping
  through its ``grad_scale``, and a non-finite grad norm sets its ``found_inf``, so the
  update is skipped on the device). Elsewhere (CPU; or ``LONGBOAT_KERNELS_IMPL=torch``)
  it walks the flat buffers in slices of ``CHUNK`` elements: each slice's grads are cast
  into one reused fp32 scratch buffer and updated by one ``torch._fused_adamw_`` call (same
  ``grad_scale`` / ``found_inf``), then one copy of the master weights back to the bf16
  buffer (~44 bytes a parameter). No full-size fp32 copy of the grads exists: the
  optimizer's memory is that of fp32-weight AdamW (bf16 weights + bf16 grads + fp32
  masters + two fp32 moments = 16 bytes a parameter), plus one ``CHUNK`` of scratch on the
  slice path.

Autocast stays on around the forward: ops autocast runs in fp32 (softmax, norms, losses)
still do; only the per-use casts of fp32 weights to bf16 disappear.

Each parameter starts at an offset aligned to ``ALIGN`` elements (128 bytes of bf16), so
matmuls see aligned operands; the padding stays exactly zero (zero grad, zero weight).
The learning rate and the step count live in device tensors, so ``step_on_device`` is
CUDA-graph capturable; ``sync_hyperparams`` (host -> device lr copy) must run outside
the captured region. ``step`` does both.

The state dict is the standard per-parameter layout (``master``, ``exp_avg``,
``exp_avg_sq``, ``step`` per parameter), so core's DCP checkpoints save and reshard it by
FQN; ``load_state_dict`` copies into the flat buffers (the views stay views).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longboat.kernels import adamw_master_step_
from longboat.kernels._dispatch import resolve_impl

ALIGN = 64
"""Element alignment of every parameter's offset in the flat buffers."""

CHUNK = 1 << 26
"""Elements per slice of the grad norm and of the ``torch._fused_adamw_`` path: the size of
its fp32 grad scratch (256 MB) and of each fused AdamW call (its index math is 32-bit).
1.6B trainable parameters take ~25 slices."""

_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over bf16 params with fp32 master weights in flat buffers (see module doc).

    ``groups``: ``[{"params": [...], "weight_decay": wd}, ...]`` as from ``param_groups``.
    ``process_group``: grads are averaged over it in ``prepare_grads`` (None: the default
    group when one with more than one rank is initialized).
    ``kernel_impl``: None picks the update: the ``torch._fused_adamw_`` slices, or the
    one-pass Triton kernel on CUDA when ``LONGBOAT_ADAMW_KERNEL=1`` (opt-in: not yet run on
    a GPU; ``LONGBOAT_KERNELS_IMPL=torch`` also keeps it off);
    ``"torch"`` / ``"triton"`` force ``adamw_master_step_`` with that implementation (its
    torch reference allocates full-size temporaries: for checks on small models).
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        param_dtype: torch.dtype = torch.bfloat16,
        process_group: Any = None,
        kernel_impl: str | None = None,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0}
        super().__init__(groups, defaults)
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            raise ValueError("MasterWeightAdamW needs at least one parameter")
        if any(not p.requires_grad for p in params):
            raise ValueError("MasterWeightAdamW got a parameter that does not require grad")
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("MasterWeightAdamW needs every parameter on one device")
        # Segments: one contiguous, aligned range of the flat buffers per param group.
        self._segments: list[tuple[int, int]] = []
        offsets: list[int] = []
        total = 0
        for group in self.param_groups:
            start = total
            for p in group["params"]:
                offsets.append(total)
                total += _aligned(p.numel())
            self._segments.append((start, total))
        self.param_dtype = param_dtype
        self.master = torch.zeros(total, dtype=torch.float32, device=device)
        for p, off in zip(params, offsets):
            self.master[off : off + p.numel()].copy_(p.detach().reshape(-1))
        self.process_group = process_group
        if self._world_size() > 1:
            # Identical starting weights on every rank (what DDP's constructor guarantees).
            dist.broadcast(
                self.master, src=dist.get_global_rank(self._group(), 0), group=self._group()
            )
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.flat_param = self.master.to(param_dtype)
        self.flat_grad = torch.zeros(total, dtype=param_dtype, device=device)
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # Per group: (master, bf16 grad, exp_avg, exp_avg_sq) slices of at most CHUNK elements.
        self._chunks = [
            [
                tuple(
                    buf[a : min(a + CHUNK, end)]
                    for buf in (self.master, self.flat_grad, self.exp_avg, self.exp_avg_sq)
                )
                for a in range(start, end, CHUNK)
            ]
            for start, end in self._segments
        ]
        # Opt-in until the one-pass kernel has run on a GPU (it was written and checked in
        # Triton's CPU interpreter only): LONGBOAT_ADAMW_KERNEL=1 turns it on for CUDA.
        if (
            kernel_impl is None
            and device.type == "cuda"
            and os.environ.get("LONGBOAT_ADAMW_KERNEL", "0") == "1"
            and resolve_impl(None, self.master) == "triton"
        ):
            kernel_impl = "triton"
        if kernel_impl not in (None, "torch", "triton"):
            raise ValueError(
                f"MasterWeightAdamW: kernel_impl={kernel_impl!r}; use None, 'torch' or 'triton'"
            )
        self.kernel_impl = kernel_impl
        # Per group for the one-pass kernel: (master, bf16 grad, exp_avg, exp_avg_sq, bf16 param).
        self._segment_views = [
            tuple(
                buf[start:end]
                for buf in (
                    self.master,
                    self.flat_grad,
                    self.exp_avg,
                    self.exp_avg_sq,
                    self.flat_param,
                )
            )
            for start, end in self._segments
        ]
        scratch = 0 if kernel_impl is not None else min(CHUNK, max(total, 1))
        self._scratch = torch.empty(scratch, dtype=torch.float32, device=device)
        n_slices = sum(len(c) for c in self._chunks)
        self._slice_norms = torch.zeros(max(n_slices, 1), dtype=torch.float32, device=device)
        self.lr_tensors = [
            torch.full((), float(g["lr"]), dtype=torch.float32, device=device)
            for g in self.param_groups
        ]
        self._views: list[tuple[nn.Parameter, Tensor]] = []
        for p, off in zip(params, offsets):
            n = p.numel()
            p.data = self.flat_param[off : off + n].view(p.shape)
            grad_view = self.flat_grad[off : off + n].view(p.shape)
            p.grad = grad_view
            self._views.append((p, grad_view))
            self.state[p] = {
                "step": self.step_count,
                "master": self.master[off : off + n].view(p.shape),
                "exp_avg": self.exp_avg[off : off + n].view(p.shape),
                "exp_avg_sq": self.exp_avg_sq[off : off + n].view(p.shape),
            }

    # ------------------------------------------------------------------ distributed

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self._group())

    # ------------------------------------------------------------------ grads

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffer (``set_to_none`` is ignored: the views must persist)."""
        self.flat_grad.zero_()
        for p, view in self._views:
            if p.grad is not view:  # someone (model.zero_grad, a hook) replaced it
                p.grad = view

    @torch.no_grad()
    def prepare_grads(self, max_norm: float = 0.0) -> Tensor:
        """Average the accumulated bf16 grads over ranks (one all-reduce, in bf16), and set
        the clip factor used by the next ``step``. Returns the global grad norm (before
        clipping, accumulated in fp32 slice by slice) as a device tensor; no host sync."""
        world = self._world_size()
        if world > 1:
            dist.all_reduce(self.flat_grad, group=self._group())
            self.flat_grad.div_(world)
        i = 0
        for chunks in self._chunks:
            for _, grad, _, _ in chunks:
                torch.linalg.vector_norm(grad, dtype=torch.float32, out=self._slice_norms[i])
                i += 1
        norm = torch.linalg.vector_norm(self._slice_norms)
        # A non-finite norm makes the fused kernel skip the update (masters and moments
        # untouched) and ``step_on_device`` undo the step count: bad grads never land.
        torch.logical_not(torch.isfinite(norm), out=self.found_inf)
        if max_norm > 0:
            # fused AdamW divides the grads by grad_scale: 1/clip_coef, >= 1.
            torch.clamp((norm + 1e-6) / max_norm, min=1.0, out=self.grad_scale)
        else:
            self.grad_scale.fill_(1.0)
        return norm

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def sync_hyperparams(self) -> None:
        """Copy each group's (scheduler-set) float ``lr`` into its device tensor. Host ->
        device: run it outside a captured CUDA graph, before the replay."""
        for group, lr in zip(self.param_groups, self.lr_tensors):
            value = group["lr"]
            if isinstance(value, Tensor):
                lr.copy_(value)
            else:
                lr.fill_(float(value))

    @torch.no_grad()
    def step_on_device(self) -> None:
        """The update from the flat bf16 grads (after ``prepare_grads``): device-only work,
        a fixed sequence of launches (capturable)."""
        self.step_count.add_(1.0)
        if self.kernel_impl is not None:
            self._kernel_update()
        else:
            self._slice_update()
        self.step_count.sub_(self.found_inf)
        self._opt_called = True  # what LRScheduler's step() wrapper records (no warning)

    def _kernel_update(self) -> None:
        """One ``adamw_master_step_`` pass per param group (it writes the bf16 weights)."""
        for group, views, lr in zip(self.param_groups, self._segment_views, self.lr_tensors):
            master, grad, exp_avg, exp_avg_sq, param = views
            beta1, beta2 = group["betas"]
            adamw_master_step_(
                master,
                grad,
                exp_avg,
                exp_avg_sq,
                param,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=self.step_count,
                grad_scale=self.grad_scale,
                found_inf=self.found_inf,
                impl=self.kernel_impl,
            )

    def _slice_update(self) -> None:
        """Grads cast slice by slice into the fp32 scratch, ``torch._fused_adamw_`` per slice,
        then one master -> bf16 copy."""
        for group, chunks, lr in zip(self.param_groups, self._chunks, self.lr_tensors):
            beta1, beta2 = group["betas"]
            for master, grad, exp_avg, exp_avg_sq in chunks:
                grad32 = self._scratch[: grad.numel()]
                grad32.copy_(grad)
                torch._fused_adamw_(
                    [master],
                    [grad32],
                    [exp_avg],
                    [exp_avg_sq],
                    [],
                    [self.step_count],
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                    grad_scale=self.grad_scale,
                    found_inf=self.found_inf,
                )
        self.flat_param.copy_(self.master)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One AdamW update. ``prepare_grads`` must have run since the last backward."""
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        self.sync_hyperparams()
        self.step_on_device()

    # ------------------------------------------------------------------ state

    @contextmanager
    def master_params(self) -> Iterator[None]:
        """Inside: every trainable param is its fp32 master weight (a view of ``master``), as
        fp32-weight training would have it, e.g. to export the policy; after: the bf16
        views again. Do not train inside."""
        bf16 = [(p, p.data) for p, _ in self._views]
        for p, _ in self._views:
            p.data = self.state[p]["master"]
        try:
            yield
        finally:
            for p, view in bf16:
                p.data = view

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a ``state_dict()`` (same params, same groups) into the flat buffers."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "the optimizer state has a different parameter layout than this model's "
                "trainable parameters; resume with the same model and freezing config"
            )
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in saved_groups for i in g["params"]]
        with torch.no_grad():
            for p, idx in zip(params, saved_ids):
                saved = state_dict["state"][idx]
                for key in _STATE_KEYS:
                    self.state[p][key].copy_(saved[key])
                self.step_count.copy_(saved["step"])
            self.flat_param.copy_(self.master)
        for group, saved in zip(self.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        self.sync_hyperparams()
