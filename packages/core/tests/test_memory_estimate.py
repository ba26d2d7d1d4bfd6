"""The memory plan's estimator (``longboat.core.engine.memory``): state bytes against the
buffers the optimizers really allocate (exact), saved activations against saved-tensor-hook
measurements (within 10%)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longboat.core.engine.memory.activations import measure_saved, profile_activations
from longboat.core.engine.memory.states import OptimizerLayout, state_bytes
from longboat.core.engine.torch.master_weights import ALIGN, CHUNK, MasterWeightAdamW


class Block(nn.Module):
    """A pre-norm transformer block: attention (SDPA) and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyModel(nn.Module):
    """Embedding (frozen), blocks, a head and an MSE loss."""

    def __init__(self, d: int = 32, layers: int = 3, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(d, 4) for _ in range(layers))
        self.head = nn.Linear(d, 7)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.embed(batch["ids"]).to(self.head.weight.dtype)
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        for block in self.blocks:
            x = block(x, mask)
        return F.mse_loss(self.head(x).float(), batch["target"])


def _batch(n: int, seq: int = 12, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 50, (n, seq), generator=g)
    return {"ids": ids.to(device), "target": torch.randn(n, seq, 7, generator=g).to(device)}


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(_batch(2)).backward()
    opt.step()


def test_state_bytes_of_fp32_adamw_are_the_allocated_buffers() -> None:
    torch.manual_seed(0)
    model = TinyModel()
    predicted = state_bytes(model.parameters(), OptimizerLayout())
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=False
    )
    _step(model, opt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert predicted.weights == sum(p.nbytes for p in trainable)
    assert predicted.grads == sum(p.grad.nbytes for p in trainable)
    assert predicted.moments == sum(
        opt.state[p][k].nbytes for p in trainable for k in ("exp_avg", "exp_avg_sq")
    )
    assert predicted.frozen == sum(p.nbytes for p in frozen) == 50 * 32 * 4
    assert predicted.masters == predicted.scratch == 0
    assert predicted.trainable_params == sum(p.numel() for p in trainable)


@pytest.mark.parametrize("moment_bytes", [4, 2])
@pytest.mark.parametrize("storage", ["fp32", "split", "bf16_sr"])
def test_state_bytes_of_master_weights_are_the_flat_buffers(
    storage: str, moment_bytes: int
) -> None:
    """``MasterWeightAdamW``'s flat buffers, alignment padding and slice scratch included,
    for every master storage and moment dtype; the plan's re-costing of a storage change
    (``with_storage``) from the default layout gives the same bytes."""
    torch.manual_seed(0)
    model = TinyModel()
    layout = OptimizerLayout(
        master_weights=True, master_storage=storage, align=ALIGN, scratch_elements=CHUNK,
        moment_bytes=moment_bytes,
    )  # fmt: skip
    predicted = state_bytes(model.parameters(), layout)
    default = dataclasses.replace(layout, master_storage="split", moment_bytes=4)
    recosted = state_bytes(model.parameters(), default).with_storage(default, layout)
    assert recosted == predicted
    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = torch.bfloat16 if moment_bytes == 2 else torch.float32
    opt = MasterWeightAdamW(
        [{"params": trainable}], lr=1e-3, master_storage=storage, moment_dtype=moments
    )
    _step(model, opt)
    assert predicted.weights == opt.flat_param.nbytes
    assert predicted.grads == opt.flat_grad.nbytes
    masters = {"split": opt.master_lo, "fp32": opt._master, "bf16_sr": None}[storage]
    assert predicted.masters == (0 if masters is None else masters.nbytes)
    assert predicted.moments == opt.exp_avg.nbytes + opt.exp_avg_sq.nbytes
    scratch = opt._scratch.nbytes + opt._master_scratch.nbytes + opt._moment_scratch.nbytes
    assert predicted.scratch == scratch
    padded = opt.flat_param.numel()
    assert padded > predicted.trainable_params  # the alignment is counted
    per_param = 2 + 2 + {"fp32": 4, "split": 2, "bf16_sr": 0}[storage] + 2 * moment_bytes
    assert predicted.total - predicted.scratch - predicted.frozen == per_param * padded


def test_sharding_divides_what_each_strategy_shards() -> None:
    model = TinyModel()
    whole = state_bytes(model.parameters(), OptimizerLayout(master_weights=True))
    zero1 = state_bytes(model.parameters(), OptimizerLayout(master_weights=True, state_shards=4))
    fsdp = state_bytes(
        model.parameters(), OptimizerLayout(master_weights=True, state_shards=4, param_shards=4)
    )
    assert (zero1.weights, zero1.grads) == (whole.weights, whole.grads)
    assert zero1.masters == -(-whole.masters // 4) and zero1.moments == -(-whole.moments // 4)
    assert fsdp.weights == -(-whole.weights // 4) and fsdp.grads == -(-whole.grads // 4)
    bf16 = state_bytes(model.parameters(), OptimizerLayout(master_weights=True, moment_bytes=2))
    assert bf16.moments * 2 == whole.moments


def _saved_reference(model: nn.Module, batch: dict, autocast: bool) -> int:
    """Bytes of the unique storages autograd saves, apart from parameters and inputs,
    counted with a bare saved-tensor hook."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in batch.values()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        model(batch)
    return sum(seen.values())


@pytest.mark.parametrize("autocast", [False, True])
def test_profile_extrapolates_to_the_measured_batch(autocast: bool) -> None:
    """A profile from micro-batches of 1 and 2 predicts the saved bytes at 6 within 10%."""
    torch.manual_seed(0)
    model = TinyModel()
    dtype = torch.bfloat16 if autocast else None
    profile = profile_activations(
        model, model, _batch, blocks=list(model.blocks), autocast_dtype=dtype
    )
    measured = _saved_reference(model, _batch(6), autocast)
    predicted = profile.saved(6)
    assert measured > 0
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)
    assert profile.num_blocks == 3 and profile.block_names == ["blocks.0", "blocks.1", "blocks.2"]
    # Every block saves the same; a recomputed block keeps only its inputs.
    per_block = {profile.block_bytes(6, i) for i in range(3)}
    assert len(per_block) == 1
    full = profile.saved(6, recompute=range(3))
    assert full < predicted - 2 * per_block.pop()


def test_meta_probe_matches_the_cpu_measurement() -> None:
    """The same model and batch on ``meta`` (autocast and fused attention emulated) saves
    within 10% of what CPU autocast saves (the CPU's fused attention kernel keeps the
    log-sum-exp, as the GPU's does)."""
    torch.manual_seed(0)
    model = TinyModel(d=64)
    measured = measure_saved(
        model, model, _batch(4), blocks=list(model.blocks), autocast_dtype=torch.bfloat16
    )
    with torch.device("meta"):
        meta_model = TinyModel(d=64)
    meta_model.embed.weight.requires_grad_(False)
    meta_batch = {k: v.to("meta") for k, v in _batch(4).items()}
    on_meta = measure_saved(
        meta_model,
        meta_model,
        meta_batch,
        blocks=list(meta_model.blocks),
        autocast_dtype=torch.bfloat16,
    )
    cpu, meta = measured.total(), on_meta.total()
    assert abs(meta - cpu) <= 0.1 * cpu, (meta, cpu)
    assert on_meta.batch_bytes == measured.batch_bytes
