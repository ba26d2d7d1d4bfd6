"""core.megatron.optimizer helpers on megatron-shaped optimizer wrappers (CPU)."""

from __future__ import annotations

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


def _fused_copy_worker(rank: int, world: int, fused: bool) -> dict[str, torch.Tensor]:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.optimizer import build_optimizer, optimizer_step, wrap_ddp

    class Tiny(MegatronModule):
        def __init__(self, config: TransformerConfig) -> None:
            super().__init__(config)
            torch.manual_seed(0)
            self.a = torch.nn.Linear(8, 13, dtype=torch.bfloat16)  # odd sizes: shards cut params
            self.b = torch.nn.Linear(13, 5, bias=False, dtype=torch.bfloat16)
            self.scale = torch.nn.Parameter(torch.ones(5))  # an fp32 parameter in a bf16 model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x))).float() * self.scale

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   bf16=True, params_dtype=torch.bfloat16)  # fmt: skip
        (ddp,) = wrap_ddp([Tiny(config)], distributed_optimizer=True)
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
    finally:
        parallel_state.destroy()


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
