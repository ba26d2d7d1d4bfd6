"""bf16 weights with fp32 master weights: flat buffers, one fused AdamW launch per group.

``MasterWeightAdamW`` takes ownership of the trainable parameters' storage:

- every trainable parameter becomes a bf16 view into ONE flat bf16 buffer
  (``flat_param``), and its ``.grad`` a view into ONE flat bf16 buffer (``flat_grad``)
  that autograd accumulates into (``zero_grad`` zeroes the buffer, it never frees it);
- the optimizer keeps fp32 master weights and both Adam moments as flat fp32 buffers;
  ``prepare_grads`` all-reduces the bf16 grads with one collective at world size > 1 and
  measures the global norm (accumulated in fp32) and the clip factor on the device (no host
  sync); ``step`` updates each param group in one pass on CUDA:
  a one-pass kernel (``longboat.kernels.adamw_master_step_``, Triton, given as ``kernel``) reads the bf16 grads, the fp32 masters
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

Master storage (``master_storage``):

- ``"fp32"``: the masters are one flat fp32 buffer (``master``), as above.
- ``"split"``: no fp32 master buffer. Each fp32 master ``x`` is the bf16 weight ``hi`` (the
  ``flat_param`` the model computes with) plus an int16 buffer ``master_lo`` (same layout):
  ``bits(x) = (bits(hi) << 16) + lo`` on the int32 bit patterns, exactly (see
  ``bf16_split``). ``hi`` is ``x`` rounded to bf16 to nearest with ties away from
  zero, so ``lo`` fits int16. 14 bytes a parameter instead of 16 (-3.2 GB for 1.62B
  trainable parameters); the masters and moments are bit for bit those of ``"fp32"`` for the
  same grads. The bf16 weights differ from ``"fp32"``'s (torch's round-to-nearest-even copy)
  only where a master's low 16 bits are exactly ``0x8000`` (a tie: one bf16 ulp), so a real
  run drifts from an fp32-storage run only through those rare weights' effect on the grads.
  The slice path joins each slice's masters into a second fp32 scratch, runs the same
  ``torch._fused_adamw_`` call and splits them back (integer ops, O(``CHUNK``) scratch); the
  one-pass kernel reads and writes hi and lo itself (26 bytes a parameter). Since the bf16
  weights are the masters' high halves, write the trainable weights only through
  ``load_state_dict`` (a direct write changes the master to the written value plus the old
  low half).

- ``"bf16_sr"``: no masters at all (12 bytes a parameter less than ``"fp32"``'s 4, i.e.
  2 + 2 bytes of weights and grads plus the moments). Each update runs in fp32 from the bf16
  weight and is rounded back to bf16 stochastically with counter-based noise from
  (``seed``, step, flat index) (``stochastic_round``): unbiased, reproducible, and a resume
  draws the noise of an uninterrupted run without any saved generator state. Changes
  numerics: the weights carry no bits below bf16.

Moment storage (``moment_dtype``): fp32 (default), or bf16 (2 bytes a parameter each, as
trainers that keep the moments in the parameters' dtype do): read to fp32, updated in fp32,
stored rounded to nearest even. Changes numerics. The slice path copies each slice's bf16
moments into two more fp32 scratches around the same ``torch._fused_adamw_`` call.

Autocast stays on around the forward: ops autocast runs in fp32 (softmax, norms, losses)
still do; only the per-use casts of fp32 weights to bf16 disappear.

Each parameter starts at an offset aligned to ``ALIGN`` elements (128 bytes of bf16), so
matmuls see aligned operands; the padding stays exactly zero (zero grad, zero weight).
The learning rate and the step count live in device tensors, so ``step_on_device`` is
CUDA-graph capturable; ``sync_hyperparams`` (host -> device lr copy) must run outside
the captured region. ``step`` does both.

The state dict is the standard per-parameter layout (``master``, ``exp_avg``,
``exp_avg_sq``, ``step`` per parameter), so core's DCP checkpoints save and reshard it by
FQN; ``load_state_dict`` copies into the flat buffers (the views stay views). Both storages
write and read the same state dict (fp32 ``master`` entries; with ``"split"`` they are
joined on the host, so a checkpoint costs no device memory), so a checkpoint of one resumes
in the other with the same masters and moments. ``"bf16_sr"`` saves its bf16 weights as
the fp32 ``master`` entries (exact) and resumes them exactly; loading another storage's
masters into it rounds them to nearest. The moments are saved in their own dtype (bf16 with
``moment_dtype=torch.bfloat16``) and load into either dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longboat.core.engine.torch.bf16_split import join_bits_, join_fp32_, split_bits_
from longboat.core.engine.torch.stochastic_round import step_key, stochastic_round_

ALIGN = 64
"""Element alignment of every parameter's offset in the flat buffers."""

CHUNK = 1 << 25
"""Elements per slice of the grad norm and of the ``torch._fused_adamw_`` path: the size of
its fp32 grad scratch (128 MB; ``"split"`` storage adds an fp32 master scratch of the same
size) and of each fused AdamW call (its index math is 32-bit). 1.6B trainable parameters
take ~49 slices. Both storages slice alike: on CPU the fused AdamW's results depend on
where a slice ends (its vectorized loop and scalar tail round differently)."""

MASTER_STORAGES = ("fp32", "split", "bf16_sr")
"""``master_storage`` values: a flat fp32 master buffer, bf16 weights + int16 low halves, or
bf16 weights alone with stochastic rounding (changes numerics)."""

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``optim.moment_dtype`` values and the dtype of the AdamW moments they store."""

_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over bf16 params with fp32 master weights in flat buffers (see module doc).

    ``groups``: ``[{"params": [...], "weight_decay": wd}, ...]`` as from ``param_groups``.
    ``process_group``: grads are averaged over it in ``prepare_grads`` (None: the default
    group when one with more than one rank is initialized).
    ``kernel_impl``: None, the ``torch._fused_adamw_`` slices; ``"triton"`` / ``"torch"``,
    one ``kernel(..., impl=kernel_impl)`` pass per param group in that implementation (the
    Triton kernel is what ``train.master_weight_update=kernel`` picks on CUDA; the torch
    reference allocates full-size temporaries: for checks on small models).
    ``kernel``: the one-pass update, with ``longboat.kernels.adamw_master_step_``'s signature
    (required with ``kernel_impl``; core does not import the kernels package, so the caller
    hands it over, as the embodied stack's ``MasterWeightAdamW`` does).
    ``master_storage``: ``"fp32"`` (a flat fp32 master buffer) or ``"split"`` (the bf16
    weights plus int16 low halves: the same masters in 2 bytes a parameter less; needs
    ``param_dtype=torch.bfloat16``) or ``"bf16_sr"`` (bf16 weights, no masters, stochastic
    rounding seeded by ``seed``), see the module doc.
    ``moment_dtype``: the moments' dtype, ``torch.float32`` or ``torch.bfloat16``.
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
        kernel: Callable[..., None] | None = None,
        master_storage: str = "fp32",
        moment_dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        if master_storage not in MASTER_STORAGES:
            raise ValueError(
                f"MasterWeightAdamW: master_storage={master_storage!r}; use one of "
                f"{MASTER_STORAGES}"
            )
        if master_storage != "fp32" and param_dtype != torch.bfloat16:
            raise ValueError(
                f"MasterWeightAdamW: master_storage={master_storage!r} keeps the weights in "
                f"bfloat16, got param_dtype={param_dtype}; use param_dtype=torch.bfloat16 or "
                "master_storage='fp32'"
            )
        if moment_dtype not in MOMENT_DTYPES.values():
            raise ValueError(
                f"MasterWeightAdamW: moment_dtype={moment_dtype}; use torch.float32 or "
                "torch.bfloat16"
            )
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
        self._offsets = offsets
        self.param_dtype = param_dtype
        self.master_storage = master_storage
        self.process_group = process_group
        self.moment_dtype = moment_dtype
        self.seed = int(seed)
        split = master_storage == "split"
        self.stochastic = master_storage == "bf16_sr"
        self._master: Tensor | None = None
        self.master_lo: Tensor | None = None
        if self.stochastic:
            self.flat_param = torch.zeros(total, dtype=param_dtype, device=device)
            for p, off in zip(params, offsets):
                self.flat_param[off : off + p.numel()].copy_(p.detach().reshape(-1))
            if self._world_size() > 1:  # as int32 words (gloo has no bf16)
                src = dist.get_global_rank(self._group(), 0)
                dist.broadcast(self.flat_param.view(torch.int32), src=src, group=self._group())
        elif split:
            self.flat_param = torch.zeros(total, dtype=param_dtype, device=device)
            self.master_lo = torch.zeros(total, dtype=torch.int16, device=device)
            for p, off in zip(params, offsets):
                n = p.numel()
                self._split_into(p.detach().reshape(-1), off, off + n)
            if self._world_size() > 1:
                # Identical starting weights on every rank (what DDP's constructor guarantees).
                # As int32 bit patterns: gloo has no bf16 / int16 (the length is a multiple
                # of ALIGN, so even).
                src = dist.get_global_rank(self._group(), 0)
                for buf in (self.flat_param, self.master_lo):
                    dist.broadcast(buf.view(torch.int32), src=src, group=self._group())
        else:
            self._master = torch.zeros(total, dtype=torch.float32, device=device)
            for p, off in zip(params, offsets):
                self._master[off : off + p.numel()].copy_(p.detach().reshape(-1))
            if self._world_size() > 1:
                dist.broadcast(
                    self._master, src=dist.get_global_rank(self._group(), 0), group=self._group()
                )
            self.flat_param = self._master.to(param_dtype)
        # The params become views now: their own (fp32) storage is freed before the
        # moments are allocated.
        for p, off in zip(params, offsets):
            p.data = self.flat_param[off : off + p.numel()].view(p.shape)
        self.exp_avg = torch.zeros(total, dtype=moment_dtype, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.flat_grad = torch.zeros(total, dtype=param_dtype, device=device)
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # Per group: slices of at most CHUNK elements of
        # (master or None, bf16 grad, exp_avg, exp_avg_sq, bf16 param, master_lo or None).
        self._chunks = [
            [
                tuple(
                    None if buf is None else buf[a : min(a + CHUNK, end)]
                    for buf in self._flat_buffers()
                )
                for a in range(start, end, CHUNK)
            ]
            for start, end in self._segments
        ]
        self._chunk_starts = [list(range(start, end, CHUNK)) for start, end in self._segments]
        if kernel_impl not in (None, "torch", "triton"):
            raise ValueError(
                f"MasterWeightAdamW: kernel_impl={kernel_impl!r}; use None, 'torch' or 'triton'"
            )
        if kernel_impl is not None and kernel is None:
            raise ValueError(
                f"MasterWeightAdamW: kernel_impl={kernel_impl!r} needs the one-pass update "
                "kernel (kernel=longboat.kernels.adamw_master_step_)"
            )
        self.kernel_impl = kernel_impl
        self.kernel = kernel
        # Per group for the one-pass kernel, the same buffers over the whole segment.
        self._segment_views = [
            tuple(None if buf is None else buf[start:end] for buf in self._flat_buffers())
            for start, end in self._segments
        ]
        slice_path = kernel_impl is None
        scratch = min(CHUNK, max(total, 1)) if slice_path else 0
        # fp32 grads of a slice (then, with split storage, its NaN mask), and with split
        # storage the slice's joined fp32 masters.
        self._scratch = torch.empty(scratch, dtype=torch.float32, device=device)
        self._master_scratch = torch.empty(
            scratch if split or self.stochastic else 0, dtype=torch.float32, device=device
        )
        # bf16 moments: the slice's moments in fp32 around the fused call.
        low_moments = moment_dtype != torch.float32
        self._moment_scratch = torch.empty(
            (2, scratch if low_moments else 0), dtype=torch.float32, device=device
        )
        n_slices = sum(len(c) for c in self._chunks)
        self._slice_norms = torch.zeros(max(n_slices, 1), dtype=torch.float32, device=device)
        self.lr_tensors = [
            torch.full((), float(g["lr"]), dtype=torch.float32, device=device)
            for g in self.param_groups
        ]
        self._views: list[tuple[nn.Parameter, Tensor]] = []
        for p, off in zip(params, offsets):
            n = p.numel()
            grad_view = self.flat_grad[off : off + n].view(p.shape)
            p.grad = grad_view
            self._views.append((p, grad_view))
            self.state[p] = {"step": self.step_count}
            if self._master is not None:
                self.state[p]["master"] = self._master[off : off + n].view(p.shape)
            self.state[p]["exp_avg"] = self.exp_avg[off : off + n].view(p.shape)
            self.state[p]["exp_avg_sq"] = self.exp_avg_sq[off : off + n].view(p.shape)

    def _flat_buffers(self) -> tuple[Tensor | None, ...]:
        return (
            self._master,
            self.flat_grad,
            self.exp_avg,
            self.exp_avg_sq,
            self.flat_param,
            self.master_lo,
        )

    # ------------------------------------------------------------------ masters

    @property
    def master(self) -> Tensor:
        """The flat fp32 master buffer (``master_storage="fp32"`` only)."""
        if self._master is None:
            raise AttributeError(
                f"MasterWeightAdamW(master_storage={self.master_storage!r}) keeps no fp32 master "
                "buffer; use flat_master() for an fp32 copy, master_params() or state_dict()"
            )
        return self._master

    @torch.no_grad()
    def flat_master(self) -> Tensor:
        """A new flat fp32 tensor of the master weights (full size, on the device): a copy of
        ``master``, or with split storage ``flat_param`` and ``master_lo`` joined."""
        if self._master is not None:
            return self._master.clone()
        if self.master_lo is None:
            return self.flat_param.float()
        return join_fp32_(self.flat_param, self.master_lo)

    def _split_into(self, src: Tensor, start: int, end: int) -> None:
        """Split storage: ``flat_param[start:end]`` / ``master_lo[start:end]`` := the fp32
        values ``src`` (flat, any float dtype and device; not modified), ``CHUNK`` at a time."""
        for a in range(0, end - start, CHUNK):
            piece = src[a : a + CHUNK]
            bits = torch.empty(piece.numel(), dtype=torch.int32, device=self.flat_param.device)
            bits.view(torch.float32).copy_(piece)
            b = start + a
            split_bits_(
                bits, self.flat_param[b : b + bits.numel()], self.master_lo[b : b + bits.numel()]
            )

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
            for chunk in chunks:
                grad = chunk[1]
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
        sr = {"sr_key": step_key(self.seed, self.step_count)} if self.stochastic else {}
        for group, views, lr, (start, _) in zip(
            self.param_groups, self._segment_views, self.lr_tensors, self._segments
        ):
            master, grad, exp_avg, exp_avg_sq, param, lo = views
            beta1, beta2 = group["betas"]
            if sr:
                sr["sr_start"] = start
            self.kernel(
                master if master is not None else param,
                grad,
                exp_avg,
                exp_avg_sq,
                param if master is not None else None,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=self.step_count,
                grad_scale=self.grad_scale,
                found_inf=self.found_inf,
                master_lo=lo,
                impl=self.kernel_impl,
                **sr,
            )

    def _slice_update(self) -> None:
        """Grads cast slice by slice into the fp32 scratch, ``torch._fused_adamw_`` per slice,
        then one master -> bf16 copy. Split storage: each slice's masters are joined into
        the master scratch before the same call and split back after it."""
        key = step_key(self.seed, self.step_count) if self.stochastic else None
        low_moments = self.moment_dtype != torch.float32
        for group, chunks, lr, starts in zip(
            self.param_groups, self._chunks, self.lr_tensors, self._chunk_starts
        ):
            beta1, beta2 = group["betas"]
            for (master, grad, exp_avg, exp_avg_sq, param, lo), a in zip(chunks, starts):
                n = grad.numel()
                grad32 = self._scratch[:n]
                if lo is not None:
                    bits = self._master_scratch[:n].view(torch.int32)
                    master = join_bits_(bits, param, lo)
                elif key is not None:
                    master = self._master_scratch[:n]
                    master.copy_(param)
                m, v = exp_avg, exp_avg_sq
                if low_moments:
                    m, v = self._moment_scratch[0, :n], self._moment_scratch[1, :n]
                    m.copy_(exp_avg)
                    v.copy_(exp_avg_sq)
                grad32.copy_(grad)
                torch._fused_adamw_(
                    [master],
                    [grad32],
                    [m],
                    [v],
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
                if low_moments:  # a skipped step copies back the same values
                    exp_avg.copy_(m)
                    exp_avg_sq.copy_(v)
                if lo is not None:
                    # The grads are spent: their scratch holds the NaN mask.
                    split_bits_(bits, param, lo, nan=grad32.view(torch.bool)[:n])
                elif key is not None:  # a skipped step's bf16-exact values round to themselves
                    stochastic_round_(master, param, key, a)
        if self._master is not None:
            self.flat_param.copy_(self._master)

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
        """Inside: every trainable param is its fp32 master weight (a view of ``master``; with
        split storage a joined copy, 4 bytes a parameter allocated for the duration), as
        fp32-weight training would have it, e.g. to export the model; after: the bf16
        views again. Do not train inside."""
        bf16 = [(p, p.data) for p, _ in self._views]
        with torch.no_grad():
            for i, (p, _) in enumerate(self._views):
                p.data = self._master_of(i, device=p.device)
        try:
            yield
        finally:
            for p, view in bf16:
                p.data = view

    def _master_of(self, i: int, device: torch.device | str) -> Tensor:
        """The fp32 master of the ``i``-th trainable param: the view of ``master``, or with
        split storage joined on ``device`` (the halves are copied there first)."""
        p = self._views[i][0]
        if self._master is not None:
            return self.state[p]["master"]
        off, n = self._offsets[i], p.numel()
        if self.master_lo is None:  # bf16_sr: the weights are the only copy
            return (
                self.flat_param[off : off + n].to(device=device, dtype=torch.float32).view(p.shape)
            )
        hi = self.flat_param[off : off + n].to(device)
        lo = self.master_lo[off : off + n].to(device)
        return join_fp32_(hi, lo).view(p.shape)

    def state_dict(self) -> dict[str, Any]:
        """The standard per-parameter layout (``step``, ``master``, ``exp_avg``,
        ``exp_avg_sq``); with split storage the ``master`` entries are the joined fp32
        masters, on the host (no device memory), so both storages save the same values."""
        sd = super().state_dict()
        if self._master is None:
            with torch.no_grad():
                sd["state"] = {
                    i: {
                        "step": s["step"],
                        "master": self._master_of(i, device="cpu"),
                        "exp_avg": s["exp_avg"],
                        "exp_avg_sq": s["exp_avg_sq"],
                    }
                    for i, s in sd["state"].items()
                }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a ``state_dict()`` (same params, same groups) into the flat buffers; the
        fp32 ``master`` entries are split with split storage (either storage's state dict
        loads into either)."""
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
            for i, (p, idx) in enumerate(zip(params, saved_ids)):
                saved = state_dict["state"][idx]
                missing = [k for k in (*_STATE_KEYS, "step") if k not in saved]
                if missing:
                    raise ValueError(
                        f"the optimizer state of parameter {idx} lacks {missing}: it was not "
                        "saved by MasterWeightAdamW (train.master_weights=true); resume with "
                        "the optimizer that wrote it"
                    )
                if saved["master"].numel() != p.numel():
                    raise ValueError(
                        f"the optimizer state of parameter {idx} has {saved['master'].numel()} "
                        f"master values for a parameter of {p.numel()}; resume with the same "
                        "model and freezing config"
                    )
                for key in ("exp_avg", "exp_avg_sq"):
                    self.state[p][key].copy_(saved[key])
                if self._master is not None:
                    self.state[p]["master"].copy_(saved["master"])
                elif self.master_lo is None:  # bf16_sr: exact for its own checkpoints
                    off = self._offsets[i]
                    self.flat_param[off : off + p.numel()].copy_(saved["master"].reshape(-1))
                else:
                    off = self._offsets[i]
                    self._split_into(saved["master"].reshape(-1), off, off + p.numel())
                self.step_count.copy_(saved["step"])
            if self._master is not None:
                self.flat_param.copy_(self._master)
        for group, saved in zip(self.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        self.sync_hyperparams()
