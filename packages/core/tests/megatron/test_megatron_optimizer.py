"""core.megatron.optimizer helpers on megatron-shaped optimizer wrappers (CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")


def _wrapped(lr: float = 1e-3):
    """A megatron-like chained optimizer around two torch optimizers (AdamW + SGD)."""
    w = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.zeros(2))
    adamw = torch.optim.AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=lr)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=lr)
    parts = [SimpleNamespace(optimizer=adamw), SimpleNamespace(optimizer=sgd)]
    return SimpleNamespace(chained_optimizers=parts), adamw, sgd


def test_capturable_adamw_puts_the_lr_in_a_device_tensor_the_scheduler_fills() -> None:
    from longboat.core.megatron.optimizer import capturable_torch_adamw

    opt, adamw, sgd = _wrapped(1e-3)
    # Parameters on CPU are left alone by default (capturable AdamW is a CUDA feature).
    assert capturable_torch_adamw(opt) == 0
    assert not adamw.param_groups[0].get("capturable")
    # The scheduler first (its initial_lr stays a Python float), then the switch.
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    assert capturable_torch_adamw(opt, device_types=("cpu",)) == 2  # both AdamW groups
    lrs = [g["lr"] for g in adamw.param_groups]
    assert all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in lrs)
    assert all(g["capturable"] for g in adamw.param_groups)
    assert isinstance(sgd.param_groups[0]["lr"], float)  # not an Adam: untouched
    assert all(isinstance(g["initial_lr"], float) for g in adamw.param_groups)
    for step in range(1, 4):
        sched.step()
        for g, tensor in zip(adamw.param_groups, lrs):
            assert g["lr"] is tensor  # updated in place: a captured graph reads the new value
            assert float(tensor) == pytest.approx(1e-3 * 0.5**step, rel=1e-6)
    # idempotent: a second call keeps the same tensors
    assert capturable_torch_adamw(opt, device_types=("cpu",)) == 2
    assert all(g["lr"] is t for g, t in zip(adamw.param_groups, lrs))


@contextmanager
def _bf16_megatron() -> Iterator[object]:
    """megatron's parallel state on this CPU rank; yields a bf16 ``TransformerConfig``."""
    from megatron.core.transformer import TransformerConfig

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        yield TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                bf16=True, params_dtype=torch.bfloat16)  # fmt: skip
    finally:
        parallel_state.destroy()


def _tiny(config: object, scale: bool = True) -> torch.nn.Module:
    """A bf16 megatron module of two linears of odd sizes (so optimizer shards cut parameters)
    and, with ``scale``, an fp32 parameter."""
    from megatron.core.transformer.module import MegatronModule

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            torch.manual_seed(0)
            self.a = torch.nn.Linear(8, 13, dtype=torch.bfloat16)
            self.b = torch.nn.Linear(13, 5, bias=False, dtype=torch.bfloat16)
            if scale:
                self.scale = torch.nn.Parameter(torch.ones(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x))).float() * self.scale

    return Tiny()


def _fused_copy_worker(rank: int, world: int, fused: bool) -> dict[str, torch.Tensor]:
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.optimizer import build_optimizer, optimizer_step, wrap_ddp

    with _bf16_megatron() as config:
        (ddp,) = wrap_ddp([_tiny(config)], distributed_optimizer=True)
        opt = build_optimizer([ddp], OptimConfig(name="adamw", lr=1e-2, grad_clip=0.1),
                              precision="bf16", distributed_optimizer=True)  # fmt: skip
        parts = getattr(opt, "chained_optimizers", None) or [opt]
        swapped = sum("_copy_main_params_to_model_params" in vars(p) for p in parts)
        if not fused:
            for p in parts:
                vars(p).pop("_copy_main_params_to_model_params", None)
        init = {k: v.detach().float().clone() for k, v in ddp.module.state_dict().items()}
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            loss = ddp(torch.randn(4, 8, generator=g, dtype=torch.bfloat16)).square().mean()
            loss.backward()
            optimizer_step(opt)
        out = {k: v.detach().float().clone() for k, v in ddp.module.state_dict().items()}
        out.update({f"init.{k}": v for k, v in init.items()})
        out["swapped"] = torch.tensor(swapped)
        return out


def _main_weights_worker(rank: int, world: int) -> dict[str, object]:
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.optimizer import (
        build_optimizer,
        main_weight_shards,
        start_main_weights,
        wrap_ddp,
    )

    with _bf16_megatron() as config:
        model = _tiny(config, scale=False)
        # fp32 values off the bf16 grid (what an fp32 checkpoint holds)
        g = torch.Generator().manual_seed(5)
        exact = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()
                 if n != "a.bias"}  # fmt: skip
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in exact:
                    p.copy_(exact[n])  # the model holds their bf16 rounding
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        (ddp,) = wrap_ddp([model], distributed_optimizer=True)
        opt = build_optimizer([ddp], OptimConfig(name="adamw"), precision="bf16",
                              distributed_optimizer=True)  # fmt: skip
        out: dict[str, object] = {"set": start_main_weights(opt, model, exact)}
        # this rank's shard of every main weight, NaN elsewhere
        for n, p in model.named_parameters():
            out[n] = torch.full(p.shape, float("nan"))
        for n, (start, end, shard) in main_weight_shards(opt, model).items():
            out[n].view(-1)[start:end] = shard
        out["model_unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        out["exact"] = exact
        out["rounded"] = {n: t.detach().float() for n, t in before.items()}
        (plain,) = wrap_ddp([_tiny(config, scale=False)], distributed_optimizer=False)
        other = build_optimizer([plain], OptimConfig(name="adamw"), precision="bf16")
        try:
            start_main_weights(other, plain.module, exact)
            out["plain_error"] = ""
        except ValueError as exc:
            out["plain_error"] = str(exc)
        return out


@pytest.mark.multiprocess
def test_start_main_weights_writes_each_ranks_shard_of_the_exact_values() -> None:
    from longboat.core.distributed import run_multiprocess

    ranks = run_multiprocess(_main_weights_worker, 2)
    exact, rounded = ranks[0]["exact"], ranks[0]["rounded"]
    for name in ("a.weight", "a.bias", "b.weight"):
        shards = [r[name] for r in ranks]
        held = [~torch.isnan(s) for s in shards]
        assert torch.equal(held[0] ^ held[1], held[0] | held[1])  # each element on one rank
        full = torch.where(held[0], shards[0], shards[1])
        want = exact[name] if name in exact else rounded[name]
        assert not torch.isnan(full).any() and torch.equal(full, want), name
    names = ("a.weight", "a.bias", "b.weight")
    assert all(any(not torch.isnan(r[n]).all() for n in names) for r in ranks)  # both hold some
    assert not torch.equal(exact["a.weight"], rounded["a.weight"])  # off the bf16 grid
    assert all(r["model_unchanged"] for r in ranks)
    assert all(r["set"] >= 1 for r in ranks) and sum(r["set"] for r in ranks) >= 2
    assert "need megatron's distributed optimizer" in ranks[0]["plain_error"]


@pytest.mark.multiprocess
def test_fused_main_param_copy_updates_the_model_as_megatrons_loop() -> None:
    from longboat.core.distributed import run_multiprocess

    fused = run_multiprocess(_fused_copy_worker, 2, True)
    loop = run_multiprocess(_fused_copy_worker, 2, False)
    assert int(fused[0]["swapped"]) >= 1
    for key in ("a.weight", "a.bias", "b.weight", "scale"):
        assert not torch.equal(loop[0][key], loop[0][f"init.{key}"]), key  # steps moved it
        for f, lp in zip(fused, loop, strict=True):
            assert torch.equal(f[key], lp[key]), key  # the same bits
        assert torch.equal(fused[0][key], fused[1][key]), key  # both ranks hold the update


def _release_worker(rank: int, world: int) -> dict[str, bool]:
    import gc
    import weakref

    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.optimizer import (
        build_optimizer,
        optimizer_step,
        release_ddp,
        wrap_ddp,
    )

    with _bf16_megatron() as config:

        def trained(keep_graph: bool) -> tuple[list[torch.nn.Module], weakref.ref]:
            model = _tiny(config)
            (ddp,) = wrap_ddp([model], distributed_optimizer=True)
            opt = build_optimizer([ddp], OptimConfig(name="adamw"), precision="bf16",
                                  distributed_optimizer=True)  # fmt: skip
            ddp.zero_grad_buffer()
            out = ddp(torch.randn(4, 8, dtype=torch.bfloat16))
            out.square().mean().backward()
            optimizer_step(opt)
            if keep_graph:  # what megatron's token dispatcher does with its routing probabilities
                model.last_output = (out, 1)
            return [ddp], weakref.ref(model)

        out: dict[str, bool] = {}
        for keep_graph in (False, True):
            ddps, model = trained(keep_graph)
            release_ddp(ddps)
            del ddps
            gc.collect()
            out[f"freed_{keep_graph}"] = model() is None
        ddps, model = trained(False)
        del ddps
        gc.collect()
        out["kept_without_release"] = model() is not None
        return out


@pytest.mark.multiprocess
def test_release_ddp_lets_a_finished_run_be_freed() -> None:
    from longboat.core.distributed import run_multiprocess

    (out,) = run_multiprocess(_release_worker, 1)
    # megatron's DDP keeps its model alive through its grad-accumulation hooks until released,
    # also where a module attribute still holds the last step's autograd graph
    assert out["kept_without_release"]
    assert out["freed_False"] and out["freed_True"]


def _decay_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.optimizer import build_optimizer, optimizer_step, wrap_ddp

    with _bf16_megatron() as config:
        model = _tiny(config)
        (ddp,) = wrap_ddp([model], distributed_optimizer=True)
        optim = OptimConfig(name="adamw", lr=0.1, weight_decay=0.5, grad_clip=0.0)
        opt = build_optimizer([ddp], optim, precision="bf16", distributed_optimizer=True)
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        ddp.zero_grad_buffer()  # zero gradients: only weight decay can move a parameter
        opt.zero_grad()
        (ddp(torch.zeros(4, 8, dtype=torch.bfloat16)) * 0.0).sum().backward()
        optimizer_step(opt)
        return {n: p.detach().float() / before[n] for n, p in model.named_parameters()}


@pytest.mark.multiprocess
def test_biases_and_norm_weights_get_no_weight_decay() -> None:
    """megatron's groups exempt 1-D parameters (wd_mult=0), as the HF Trainer does; matrices
    decay by ``1 - lr * weight_decay`` a step (here with zero gradients)."""
    from longboat.core.distributed import run_multiprocess

    (ratio,) = run_multiprocess(_decay_worker, 1)
    for name in ("a.weight", "b.weight"):  # 0.95 on the bf16 grid
        torch.testing.assert_close(
            ratio[name], torch.full_like(ratio[name], 0.95), atol=4e-3, rtol=0
        )
    for name in ("a.bias", "scale"):
        assert torch.equal(ratio[name], torch.ones_like(ratio[name])), name
