"""The training step's speed levers change no numbers beyond stated tolerances.

- RoPE through ``LayerKernels.rope`` (``KernelSelfAttention``) == megatron's own rotation;
- the loss through fused linear cross-entropy (``output_processor``) == megatron's logits
  path, loss and every gradient, with a partial loss mask;
- the optimizer step without the grad-norm sync == ``optimizer.step()``;
- ``build_train_step`` (what the benchmark times) == the loop's pieces.

On CPU the kernels dispatch to their torch references; ``test_triton_levers_in_the_model``
runs the Triton RoPE and fused CE kernels through Triton's interpreter in a subprocess.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch
from llm_testkit import run_interpreted

from longboat.core.distributed import run_multiprocess

FP32_TOL = 2e-5  # fp32: the paths differ only in summation order (measured <= 3e-6)


def _tiny_cfg():
    from longboat.core.family import find_family

    return find_family("llm", "llama3").flavor("tiny")


def _batch(cfg, b: int = 2, s: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(
        0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed)
    )
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _init(seed: int = 1):
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=seed)
    return parallel_state


# ----------------------------------------------------------------------------- RoPE


def _rope_worker(rank: int, world: int, precision: str, qkv: bool) -> dict[str, float]:
    from megatron.core.transformer.attention import SelfAttention

    from longboat.core.megatron.specs import KernelSelfAttention
    from longboat.kernels.layers import longboat_layer_kernels
    from longboat.llm import build

    ps = _init()
    try:
        cfg = _tiny_cfg()
        original = build.longboat_layer_kernels
        build.longboat_layer_kernels = lambda: longboat_layer_kernels(qkv_rope=qkv)
        try:
            (kernel,) = build.build_model(cfg, precision=precision)
        finally:
            build.longboat_layer_kernels = original
        build.longboat_layer_kernels = lambda: longboat_layer_kernels(rope=False)
        try:
            (plain,) = build.build_model(cfg, precision=precision)
        finally:
            build.longboat_layer_kernels = original
        attn = [layer.self_attention for layer in kernel.decoder.layers]
        assert all(type(a) is KernelSelfAttention for a in attn)
        assert all((a._qkv_rope is not None) is qkv for a in attn)  # llama: no qk-norm
        assert all(type(layer.self_attention) is SelfAttention for layer in plain.decoder.layers)
        plain.load_state_dict(kernel.state_dict())
        tokens, _ = _batch(cfg)
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        out: dict[str, float] = {}
        grads, logits = [], []
        for model in (kernel, plain):
            y = model(tokens, pos, None)
            y.float().square().mean().backward()
            grads.append({n: p.grad.float() for n, p in model.named_parameters()})
            logits.append(y.detach().float())
        out["logits"] = float((logits[0] - logits[1]).abs().max())
        out["logits_scale"] = float(logits[1].abs().max())
        out["grad"] = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])
        out["qkv_grad_scale"] = float(
            grads[1]["decoder.layers.0.self_attention.linear_qkv.weight"].abs().max()
        )
        # Once per freqs table: every layer's second call reuses its cos / sin.
        out["cached"] = float(all(a._cos_sin is not None for a in attn))
        return out
    finally:
        ps.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("qkv", [True, False], ids=["split_qkv_rope", "rope"])
def test_kernel_rope_matches_megatrons_rotation_fp32(qkv: bool) -> None:
    """The RoPE kernel (and the fused QKV split + RoPE kernel) == megatron's split + rotation."""
    (out,) = run_multiprocess(_rope_worker, 1, "fp32", qkv)
    assert out["logits"] <= FP32_TOL * max(1.0, out["logits_scale"]), out
    assert out["grad"] <= FP32_TOL * max(1.0, out["qkv_grad_scale"]), out
    assert out["qkv_grad_scale"] > 1e-4, "the loss does not reach the attention weights"
    assert out["cached"] == 1.0


def test_rope_rotation_in_bf16_is_at_least_as_accurate_as_megatrons() -> None:
    """megatron rotates bf16 q/k with bf16 cos/sin; the kernel contract rotates in fp32.

    Against an fp64 rotation of the same bf16 inputs, the kernel path's error is one bf16
    rounding of the output (<= 2^-8 relative) and no larger than megatron's.
    """
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from longboat.core.megatron.specs import KernelSelfAttention
    from longboat.kernels.layers import longboat_layer_kernels

    g = torch.Generator().manual_seed(0)
    s, b, h, hk, d = 24, 2, 4, 2, 32
    q = torch.randn(s, b, h, d, generator=g).bfloat16()
    k = torch.randn(s, b, hk, d, generator=g).bfloat16()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    theta = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    freqs = torch.cat([theta, theta], -1)[:, None, None, :].float()
    attn = KernelSelfAttention.__new__(KernelSelfAttention)  # only the table helper is used
    attn._cos_sin = None
    cos, sin = attn._rope_tables(freqs, s)
    rope = longboat_layer_kernels().rope
    qk, kk = (t.transpose(0, 1) for t in rope(q.transpose(0, 1), k.transpose(0, 1), cos, sin))
    for x, got in ((q, qk), (k, kk)):
        ref = _apply_rotary_pos_emb_bshd(x.double(), freqs.double())
        mega = _apply_rotary_pos_emb_bshd(x, freqs)
        err = float((got.double() - ref).abs().max())
        err_mega = float((mega.double() - ref).abs().max())
        assert err <= 2**-8 * float(ref.abs().max()), (err, err_mega)
        assert err <= err_mega, (err, err_mega)


# ----------------------------------------------------------------------------- fused CE


def _flce_worker(rank: int, world: int) -> dict[str, float]:
    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step
    from longboat.llm.train.megatron_schedule import forward_backward

    ps = _init()
    try:
        cfg = _tiny_cfg()
        ts = build_train_step(cfg, OptimConfig(grad_clip=0.0), precision="fp32", device="cpu")
        (net,) = ts.model
        tokens, labels = _batch(cfg, b=2, s=16)
        mask = torch.ones(2, 16)
        mask[0, :5] = 0.0  # SFT-style prompt tokens carry no loss
        mask[1, 11:] = 0.0
        calls = []
        handle = ts.chunks[0].output_layer.register_forward_hook(lambda *a: calls.append(1))
        results = {}
        for fused in (True, False):
            calls.clear()
            loss = forward_backward(ts.model, [ts.batch(tokens, labels, mask)], fused_ce=fused)
            grads = {n: p.main_grad.clone() for n, p in net.module.named_parameters()}
            results[fused] = (float(loss), grads, len(calls))
        handle.remove()
        (lf, gf, cf), (ll, gl, cl) = results[True], results[False]
        # The logits path by hand: megatron's per-token CE, masked mean.
        with torch.no_grad():
            pos = torch.arange(16).unsqueeze(0).expand(2, -1)
            per_token = ts.chunks[0](tokens, pos, None, labels=labels)
            manual = float((per_token * mask).sum() / mask.sum())
        return {
            "loss_fused": lf,
            "loss_logits": ll,
            "loss_manual": manual,
            "grad": max(float((gf[n] - gl[n]).abs().max()) for n in gf),
            "grad_scale": max(float(gl[n].abs().max()) for n in gl),
            "head_grad": float(gl["output_layer.weight"].abs().max()),
            "output_layer_calls_fused": cf,
            "output_layer_calls_logits": cl,
        }
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_fused_ce_matches_the_logits_path() -> None:
    (out,) = run_multiprocess(_flce_worker, 1)
    assert abs(out["loss_fused"] - out["loss_logits"]) <= FP32_TOL, out
    assert abs(out["loss_logits"] - out["loss_manual"]) <= FP32_TOL, out
    assert out["grad"] <= FP32_TOL * out["grad_scale"], out
    assert out["head_grad"] > 1e-4, "the output weight got no gradient"
    # The fused path never runs the output layer (no [tokens, vocab] logits); the other does.
    assert out["output_layer_calls_fused"] == 0 and out["output_layer_calls_logits"] == 1, out


def test_fused_ce_is_off_where_the_vocab_or_tokens_are_split() -> None:
    from types import SimpleNamespace

    from longboat.llm.train.loss import fused_loss_applies

    def model(**cfg):
        base = dict(tensor_model_parallel_size=1, context_parallel_size=1, sequence_parallel=False)
        inner = SimpleNamespace(config=SimpleNamespace(**(base | cfg)), post_process=True)
        inner.output_layer = object()
        return SimpleNamespace(module=inner)  # a DDP-like wrapper

    assert fused_loss_applies(model())
    assert not fused_loss_applies(model(tensor_model_parallel_size=2))
    assert not fused_loss_applies(model(context_parallel_size=2))
    assert not fused_loss_applies(model(sequence_parallel=True))
    assert not fused_loss_applies(model(mtp_num_layers=1))
    last = model()
    last.module.post_process = False
    assert not fused_loss_applies(last)


# ----------------------------------------------------------------------------- optimizer


def _step_worker(rank: int, world: int, clip: float) -> dict[str, object]:
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron import optimizer as core_opt
    from longboat.llm.train.lm_step import build_train_step

    ps = _init()
    try:
        cfg = _tiny_cfg()
        optim = OptimConfig(lr=1e-2, eps=1e-3, grad_clip=clip)
        tokens, labels = _batch(cfg)
        weights = []
        norm_calls = []
        for sync_free in (True, False):
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1)
            ts = build_train_step(cfg, optim, precision="fp32", device="cpu")
            before = {n: p.detach().clone() for n, p in ts.chunks[0].named_parameters()}
            opt = ts.optimizer
            real = opt.get_grad_norm

            def counting(real=real, sync_free=sync_free):
                norm_calls.append(sync_free)
                return real()

            opt.get_grad_norm = counting
            if sync_free:
                losses = [ts.step(tokens, labels) for _ in range(2)]
            else:  # the loop's pieces with megatron's plain step()
                from longboat.llm.train.megatron_schedule import forward_backward

                losses = []
                for _ in range(2):
                    opt.zero_grad()
                    losses.append(forward_backward(ts.model, [ts.batch(tokens, labels)]))
                    opt.step()
            weights.append({n: p.detach().clone() for n, p in ts.chunks[0].named_parameters()})
            moved = max(float((weights[-1][n] - before[n]).abs().max()) for n in before)
        diff = max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0])
        return {
            "diff": diff,
            "moved": moved,
            "loss_is_tensor": isinstance(losses[0], torch.Tensor),
            "norm_calls_sync_free": norm_calls.count(True),
            "fused_groups_on_cpu": core_opt.use_fused_torch_adamw(ts.optimizer),
        }
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_sync_free_step_equals_megatrons_step_without_clipping() -> None:
    (out,) = run_multiprocess(_step_worker, 1, 0.0)
    assert out["diff"] <= 1e-6 and out["moved"] > 1e-3, out
    assert out["loss_is_tensor"]
    assert out["norm_calls_sync_free"] == 0, "the grad norm (a host sync) was computed"
    assert out["fused_groups_on_cpu"] == 0  # fused AdamW is switched on for CUDA params only


@pytest.mark.multiprocess
def test_clipping_still_takes_megatrons_step() -> None:
    (out,) = run_multiprocess(_step_worker, 1, 1e-3)  # far below the tiny model's norm
    assert out["diff"] <= 1e-6 and out["moved"] > 1e-4, out  # clipped: smaller steps
    assert out["norm_calls_sync_free"] >= 2, "clipping needs the norm every step"


@pytest.mark.gpu
def test_fused_adamw_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from longboat.core.megatron.optimizer import use_fused_torch_adamw

    class Fake:
        def __init__(self, opt):
            self.optimizer = opt

    p = torch.nn.Parameter(torch.randn(4, device="cuda"))
    inner = torch.optim.AdamW([p], lr=1e-3)
    assert use_fused_torch_adamw(Fake(inner)) == 1
    assert inner.param_groups[0]["fused"] and not inner.param_groups[0]["foreach"]
    p.grad = torch.ones_like(p)
    inner.step()


# ----------------------------------------------------------------------------- init device


def test_build_model_initialises_on_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    from longboat.llm import build

    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def capture(arch, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(build, "current_layout", lambda: _Layout())
    monkeypatch.setattr(build, "to_transformer_config", capture)
    for device, cpu_init in (("cuda", False), ("cpu", True)):
        with pytest.raises(Stop):
            build.build_model(_tiny_cfg(), device_type=device)
        assert seen["use_cpu_initialization"] is cpu_init, device
    with pytest.raises(Stop):
        build.build_model(_tiny_cfg(), device_type="cuda", use_cpu_initialization=True)
    assert seen["use_cpu_initialization"] is True


class _Layout:
    tensor_parallel = pipeline_parallel = context_parallel = expert_parallel = 1
    virtual_pipeline_parallel = None


# ----------------------------------------------------------------------------- Triton


TRITON_BODY = textwrap.dedent(
    """
    from longboat.llm.train.loss import fused_lm_loss
    import longboat.kernels.qkv_rope as qkv_mod
    import longboat.kernels.rope as rope_mod

    launched = {"rope": 0, "qkv": 0}
    real_rope = rope_mod.apply_rope_triton
    def counted_rope(*a, **k):
        launched["rope"] += 1
        return real_rope(*a, **k)
    rope_mod.apply_rope_triton = counted_rope
    real_qkv = qkv_mod._QKVRopeFn.apply
    def counted_qkv(*a):
        launched["qkv"] += 1
        return real_qkv(*a)
    qkv_mod._QKVRopeFn.apply = counted_qkv
    models = {}
    for name, kw in (("qkv", {}), ("rope", {"qkv_rope": False}), ("plain", {"rope": False})):
        (models[name],) = build.build_model(cfg, kernel_options=kw)
    for m in ("rope", "plain"):
        models[m].load_state_dict(models["qkv"].state_dict())
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    tokens, labels = seq[:, :-1], seq[:, 1:]
    pos = torch.arange(8).unsqueeze(0).expand(2, -1)
    ref = models["plain"](tokens, pos, None, labels=labels).float().mean()
    ref.backward()
    gp = dict(models["plain"].named_parameters())
    scale = max(float(p.grad.abs().max()) for p in gp.values())
    for name in ("qkv", "rope"):
        fused = models[name](tokens, pos, None, labels=labels, output_processor=fused_lm_loss)
        fused.backward()
        mp = models[name].named_parameters()
        grad = max(float((p.grad - gp[n].grad).abs().max()) for n, p in mp)
        print("RESULT", name, float(fused), float(ref), grad, scale)
    print("LAUNCHED", launched["qkv"], launched["rope"])
    """
)


# ~6 s on 2 cores: a fresh process importing megatron, every kernel in Triton's interpreter
def test_triton_levers_in_the_model(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = run_interpreted(TRITON_BODY, tmp_path / "triton_levers.py")
    results = {x[0]: [float(v) for v in x[1:]] for x in out["RESULT"]}
    (launch,) = out["LAUNCHED"]
    layers = _tiny_cfg().num_layers
    # Every layer's forward ran the fused QKV kernel in one model and the RoPE kernel in the other.
    assert [int(v) for v in launch] == [layers, layers], launch
    for name in ("qkv", "rope"):
        fused, ref, grad, scale = results[name]
        # Triton (interpreter, fp32) vs megatron's fp32 logits path, split and rotation.
        assert abs(fused - ref) <= FP32_TOL, (name, fused, ref)
        assert grad <= FP32_TOL * max(1.0, scale), (name, grad, scale)


# ----------------------------------------------------------------------------- single-pass grads


def _single_pass_worker(rank: int, world: int) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step
    from longboat.llm.train.megatron_schedule import forward_backward

    ps = _init()
    try:
        cfg = _tiny_cfg()
        tokens, labels = _batch(cfg)
        grads, weights, info = [], [], []
        for single in (True, False):
            model_parallel_cuda_manual_seed(1)
            ts = build_train_step(
                cfg,
                OptimConfig(lr=1e-2, eps=1e-3, grad_clip=0.0),
                precision="bf16",
                device="cpu",
                wgrad_fusion=single,
            )
            (net,) = ts.model
            fc1 = ts.chunks[0].decoder.layers[0].mlp.linear_fc1.weight
            forward_backward(ts.model, [ts.batch(tokens, labels)])
            grads.append({n: p.main_grad.float().clone() for n, p in net.module.named_parameters()})
            info.append(
                {
                    "buffer_dtype": str(net.buffers[0].grad_data.dtype),
                    "fused": bool(ts.chunks[0].config.gradient_accumulation_fusion),
                    "written_by_gemm": bool(getattr(fc1, "grad_added_to_main_grad", False)),
                }
            )
            ts.optimizer.zero_grad()
            ts.step(tokens, labels)
            ts.step(tokens, labels)
            weights.append({n: p.detach().float() for n, p in ts.chunks[0].named_parameters()})
        # Relative to each tensor's scale: bf16 keeps 8 significant bits.
        grad_rel = max(
            float(
                (grads[0][n] - grads[1][n]).abs().max() / grads[1][n].abs().max().clamp(min=1e-12)
            )
            for n in grads[0]
        )
        weight_diff = max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0])
        return {"info": info, "grad_rel": grad_rel, "weight_diff": weight_diff}
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_single_pass_grads_equal_the_fp32_buffer_path_in_bf16() -> None:
    """One microbatch, DP 1, bf16: wgrad GEMMs writing the bf16 buffer give the gradients the
    hook path puts in the fp32 buffer (both are the bf16-rounded wgrad; CPU: bit-identical)."""
    (out,) = run_multiprocess(_single_pass_worker, 1)
    single, plain = out["info"]
    assert single == {"buffer_dtype": "torch.bfloat16", "fused": True, "written_by_gemm": True}
    assert plain == {"buffer_dtype": "torch.float32", "fused": False, "written_by_gemm": False}
    assert out["grad_rel"] <= 2**-8, out  # at most one bf16 rounding apart
    assert out["weight_diff"] <= 2**-7, out  # two AdamW steps later: within ~1 bf16 ulp of 1


def _fp32_buffer_fusion_worker(rank: int, world: int) -> dict[str, float]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.engine.ddp import wrap_and_build
    from longboat.core.megatron.wgrad_fusion import install_wgrad_fusion
    from longboat.llm.build import build_model
    from longboat.llm.train.megatron_schedule import forward_backward

    ps = _init()
    try:
        cfg = _tiny_cfg()
        micro = []
        for seed in (0, 1):  # two microbatches: the buffer accumulates
            tokens, labels = _batch(cfg, seed=seed)
            pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            micro.append(
                {"tokens": tokens, "labels": labels, "loss_mask": None, "position_ids": pos,
                 "attention_mask": None}
            )  # fmt: skip
        grads = []
        for fusion in (True, False):
            model_parallel_cuda_manual_seed(1)
            install_wgrad_fusion()
            chunks = build_model(cfg, precision="bf16", gradient_accumulation_fusion=fusion)
            model, _ = wrap_and_build(chunks, OptimConfig(), precision="bf16")
            assert model[0].buffers[0].grad_data.dtype == torch.float32
            forward_backward(model, micro)
            grads.append({n: p.main_grad.clone() for n, p in model[0].module.named_parameters()})
        return {
            "rel": max(
                float((grads[0][n] - grads[1][n]).abs().max() / grads[1][n].abs().max())
                for n in grads[0]
            )
        }
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_wgrad_fusion_into_an_fp32_buffer_matches_the_hook() -> None:
    """Two microbatches, fp32 buffer: the fused GEMM accumulates the unrounded product (CPU:
    fp32 product + add); the hook adds the bf16-rounded one. They differ by bf16 rounding."""
    (out,) = run_multiprocess(_fp32_buffer_fusion_worker, 1)
    assert 0.0 < out["rel"] <= 2**-7, out  # not identical (different rounding), within 2 ulp


def test_single_pass_grads_only_where_numerics_are_unchanged() -> None:
    from longboat.core.megatron.wgrad_fusion import grad_plan, single_pass_grads

    assert grad_plan(precision="bf16", microbatches=1, data_parallel=1) == (True, False)
    assert grad_plan(precision="bf16", microbatches=4, data_parallel=1) == (True, True)
    assert grad_plan(precision="fp32", microbatches=1, data_parallel=1) == (False, True)

    base = dict(precision="bf16", microbatches=1, data_parallel=1)
    assert single_pass_grads(**base)
    assert not single_pass_grads(**(base | {"precision": "fp32"}))
    assert not single_pass_grads(**(base | {"microbatches": 2}))  # bf16 accumulation
    assert not single_pass_grads(**(base | {"data_parallel": 2}))  # bf16 all-reduce
    assert not single_pass_grads(**base, context_parallel=2)
    assert not single_pass_grads(**base, pipeline_parallel=2)  # tied-embedding all-reduce


# ----------------------------------------------------------------------------- fp32 residual


def _fp32_residual_worker(rank: int, world: int) -> dict[str, float]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step

    ps = _init()
    try:
        cfg = _tiny_cfg()
        tokens, labels = _batch(cfg)
        losses = {}
        for fp32_residual in (False, True):
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(lr=1e-3), precision="bf16", device="cpu",
                use_cpu_initialization=True, fp32_residual_connection=fp32_residual,
            )  # fmt: skip
            losses[fp32_residual] = [float(ts.step(tokens, labels)) for _ in range(2)]
        return {"off": losses[False], "on": losses[True]}
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_fp32_residual_stream_runs_with_the_longboat_spec() -> None:
    """megatron's fp32_residual_connection: the kernel norms hand the linears bf16 (they
    raised a dtype mismatch before); the loss stays that of the bf16 stream within bf16
    rounding of the residual adds (2 tiny layers: 2e-2)."""
    (out,) = run_multiprocess(_fp32_residual_worker, 1)
    for a, b in zip(out["off"], out["on"]):
        assert math.isfinite(b) and abs(a - b) <= 2e-2, out


# ----------------------------------------------------------------------------- exact main weights


def _exact_main_worker(rank: int, world: int) -> dict[str, float]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step

    def value(name: str, n: int) -> torch.Tensor:
        """fp32 values off the bf16 grid, a function of the parameter's name only."""
        k = sum(map(ord, name)) % 97
        return 0.02 * torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + k).float()

    def init(chunks):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            for chunk in chunks:
                for name, p in chunk.named_parameters():
                    p.copy_(value(name, p.numel()).view(p.shape))

    ps = _init()
    try:
        out = {}
        for exact in (False, True):
            model_parallel_cuda_manual_seed(1)
            ts = build_train_step(
                _tiny_cfg(), OptimConfig(lr=1e-3), precision="bf16", device="cpu",
                use_cpu_initialization=True, init_weights=init, exact_main_weights=exact,
            )  # fmt: skip
            names = {id(p): n for n, p in ts.chunks[0].named_parameters()}
            opts = getattr(ts.optimizer, "chained_optimizers", None) or [ts.optimizer]
            worst_exact, worst_rounded, off_grid = 0.0, 0.0, 0.0
            for opt in opts:
                for mgroup, sgroup in zip(
                    opt.model_float16_groups, opt.shard_fp32_from_float16_groups
                ):
                    for model_param, main in zip(mgroup, sgroup):
                        want = value(names[id(model_param)], model_param.numel())
                        rounded = want.to(torch.bfloat16).float()
                        got = main.detach().view(-1).float()
                        worst_exact = max(worst_exact, float((got - want).abs().max()))
                        worst_rounded = max(worst_rounded, float((got - rounded).abs().max()))
                        off_grid = max(off_grid, float((want - rounded).abs().max()))
            out[exact] = {
                "vs_exact": worst_exact,
                "vs_rounded": worst_rounded,
                "off_grid": off_grid,
            }
        return {f"{k}_{kk}": v for k, d in (("exact", out[True]), ("default", out[False]))
                for kk, v in d.items()}  # fmt: skip
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_exact_main_weights_start_from_the_fp32_checkpoint() -> None:
    """With ``exact_main_weights`` the fp32 main weights equal the fp32 values written by
    ``init_weights`` (not their bf16 rounding); by default they are the bf16 model copy."""
    (out,) = run_multiprocess(_exact_main_worker, 1)
    assert out["exact_off_grid"] > 1e-5  # the values are not bf16-representable: the test can fail
    assert out["exact_vs_exact"] == 0.0, out
    assert out["default_vs_rounded"] == 0.0 and out["default_vs_exact"] > 1e-5, out


def test_exact_main_weights_only_for_fp32_checkpoints_in_mixed_precision(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from longboat.llm.train.lm_step import wants_exact_main_weights

    fp32_dir = hf_dirs["llama3"]  # saved from an fp32 model
    assert wants_exact_main_weights(fp32_dir, "bf16", lora=False)
    assert not wants_exact_main_weights(fp32_dir, "fp32", lora=False)
    assert not wants_exact_main_weights(fp32_dir, "bf16", lora=True)  # frozen base: no mains
    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    assert not wants_exact_main_weights(bf16_dir, "bf16", lora=False)  # already on the grid


# ----------------------------------------------------------------------------- CUDA graph


def _graph_ready_worker(rank: int, world: int) -> dict[str, object]:
    import megatron.core.distributed as mcd

    from longboat.core import device as core_device
    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step

    real_acc = core_device.get_accelerator()
    inside = {"depth": 0, "ddp_on_side_stream": [], "streams": 0}

    class RecordingAccelerator:
        """The real accelerator, recording when work is queued on a side stream."""

        def __getattr__(self, name: str):
            return getattr(real_acc, name)

        def stream(self):
            inside["streams"] += 1
            return real_acc.stream()

        def use_stream(self, stream):
            import contextlib

            @contextlib.contextmanager
            def ctx():
                inside["depth"] += 1
                with real_acc.use_stream(stream):
                    yield
                inside["depth"] -= 1

            return ctx()

    class RecordingDDP(mcd.DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            inside["ddp_on_side_stream"].append(inside["depth"] > 0)
            super().__init__(*args, **kwargs)

    core_device.get_accelerator = lambda *a, **k: RecordingAccelerator()
    mcd.DistributedDataParallel = RecordingDDP
    cfg = _tiny_cfg()
    tokens, labels = _batch(cfg, b=2, s=16)
    losses = {}
    for graph in (False, True):
        ps = _init(seed=3)
        try:
            ts = build_train_step(
                cfg, OptimConfig(grad_clip=0.0), precision="fp32", device="cpu", cuda_graph=graph
            )
            step = ts.graphed(RecordingAccelerator(), warmup=2) if graph else ts.step
            losses[graph] = [float(step(tokens, labels)) for _ in range(4)]
            if graph:
                reason = step.graph.reason
            else:
                try:
                    ts.graphed(real_acc)
                    refused = ""
                except ValueError as exc:
                    refused = str(exc)
        finally:
            ps.destroy()
    return {
        "losses": losses,
        "ddp_on_side_stream": inside["ddp_on_side_stream"],
        "reason": reason,
        "refused": refused,
    }


@pytest.mark.multiprocess
def test_graph_ready_step_builds_ddp_on_a_side_stream_and_trains_the_same() -> None:
    (out,) = run_multiprocess(_graph_ready_worker, 1)
    # cuda_graph=False: DDP on the current stream; cuda_graph=True: under a side stream,
    # where megatron's grad-accumulation nodes must be created for the backward to capture.
    assert out["ddp_on_side_stream"] == [False, True], out
    # On CPU GraphedStep runs eagerly (and says why); the step is the same step.
    assert "no CUDA graphs" in out["reason"], out
    plain, graphed = out["losses"][False], out["losses"][True]
    assert plain == graphed, out  # fp32 on CPU, same seed and batch: bitwise
    assert plain[-1] < plain[0], out  # it trains
    assert "cuda_graph=True" in out["refused"], out


def _grad_buffer_worker(rank: int, world: int) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step

    ps = _init()
    try:
        cfg = _tiny_cfg()
        tokens, labels = _batch(cfg)
        out: dict[str, object] = {}
        for name, kw in (("fused", {}), ("unfused", {"wgrad_fusion": False})):
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(lr=1e-3, grad_clip=0.0), precision="bf16", device="cpu",
                use_cpu_initialization=True, **kw,
            )  # fmt: skip
            (ddp,) = ts.model
            out[name] = {
                "grad_dtype": str(ddp.buffers[0].grad_dtype),
                "losses": [float(ts.step(tokens, labels)) for _ in range(3)],
            }
        return out
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_single_pass_bf16_grads_train_like_the_fp32_buffer() -> None:
    (out,) = run_multiprocess(_grad_buffer_worker, 1)
    # bf16 at DP=1 with one microbatch: wgrad fusion writes a bf16 buffer, without it fp32.
    assert out["fused"]["grad_dtype"] == "torch.bfloat16", out
    assert out["unfused"]["grad_dtype"] == "torch.float32", out
    # Single-pass bf16 grads hold the same values as the fp32 buffer: same curve (bf16 model,
    # so the tolerance is bf16's; measured equal on CPU).
    for a, b in zip(out["fused"]["losses"], out["unfused"]["losses"]):
        assert abs(a - b) <= 1e-2, out
    assert out["fused"]["losses"][-1] < out["fused"]["losses"][0], out


# ----------------------------------------------------------------------------- one-pass AdamW


def _one_pass_worker(rank: int, world: int, clip: float = 0.0) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.optimizer import (
        MegatronOptimizerState,
        inner_optimizers,
        optimizer_step,
    )
    from longboat.llm.train.lm_step import build_train_step
    from longboat.llm.train.megatron_schedule import forward_backward

    ps = _init()
    try:
        cfg = _tiny_cfg()
        tokens, labels = _batch(cfg, seed=rank)  # each data-parallel rank its own batch
        losses = {}
        for one_pass in (False, True):
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=clip), precision="bf16",
                device="cpu", use_cpu_initialization=True, one_pass_adamw=one_pass,
            )  # fmt: skip
            losses[one_pass] = [float(ts.step(tokens, labels)) for _ in range(3)]
        # One update from identical grads and state, both ways: ts (one-pass) has moments.
        mains = [p for o in inner_optimizers(ts.optimizer) for g in o.param_groups
                 for p in g["params"]]  # fmt: skip
        weights = list(ts.chunks[0].parameters())
        inner = inner_optimizers(ts.optimizer)
        ts.optimizer.zero_grad()
        forward_backward(ts.model, [ts.batch(tokens, labels)], fused_ce=True)

        # megatron clips an fp32 grad buffer (DP=2) in place: the grads are state too.
        grads = [b.grad_data for chunk in ts.model for b in chunk.buffers]

        def snapshot():
            return (
                [m.detach().clone() for m in mains],
                [w.detach().clone() for w in weights],
                [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in o.state[m].items()}
                 for o in inner for g in o.param_groups for m in g["params"]],
                [g.clone() for g in grads],
            )  # fmt: skip

        def restore(snap):
            ms, ws, states, gs = snap
            with torch.no_grad():
                for g, v in zip(grads, gs):
                    g.copy_(v)
                for m, v in zip(mains, ms):
                    m.copy_(v)
                for w, v in zip(weights, ws):
                    w.copy_(v)
                it = iter(states)
                for o in inner:
                    for g in o.param_groups:
                        for m in g["params"]:
                            for k, v in next(it).items():
                                o.state[m][k].copy_(v)

        before = snapshot()
        _, ref_norm = optimizer_step(ts.optimizer)  # megatron: cast, (clip,) AdamW, copy
        ref = snapshot()
        restore(before)
        skipped = torch.ones((), dtype=torch.float32)
        assert ts.one_pass.step(found_inf=skipped)  # a skipped update changes nothing
        unchanged = snapshot()
        assert ts.one_pass.step()
        got = snapshot()
        skip_ok = all(
            torch.equal(a, b) for a, b in zip(before[0] + before[1], unchanged[0] + unchanged[1])
        ) and all(
            torch.equal(a[k], b[k]) for a, b in zip(before[2], unchanged[2]) for k in a
        )  # fmt: skip
        device_norm = (
            None if ts.one_pass.last_grad_norm is None else float(ts.one_pass.last_grad_norm)
        )
        main_rel = max(
            float((a - b).abs().max()) / max(float(a.abs().max()), 1e-12)
            for a, b in zip(ref[0], got[0])
        )
        moved = max(float((a - b).abs().max()) for a, b in zip(before[0], ref[0]))
        flips = sum(int((a != b).sum()) for a, b in zip(ref[1], got[1]))
        total = sum(w.numel() for w in weights)
        state_rel = max(
            float((a[k] - b[k]).abs().max()) / max(float(a[k].abs().max()), 1e-30)
            for a, b in zip(ref[2], got[2]) for k in ("exp_avg", "exp_avg_sq")
        )  # fmt: skip
        steps = {float(s["step"]) for s in got[2]}
        norm_one_pass = float(ts.one_pass.grad_norm())
        no_main_grads = all(m.grad is None for m in mains)
        state = MegatronOptimizerState(ts.optimizer).state_dict()["optimizers"][0]["state"]
        return {
            "losses": (losses[False], losses[True]),
            "main_rel": main_rel,
            "moved": moved,
            "weight_flips": flips / total,
            "state_rel": state_rel,
            "steps": sorted(steps),
            "grad_norm": norm_one_pass,
            "no_main_grads": no_main_grads,
            "state_keys": sorted(next(iter(state.values()))),
            "checksum": sum(float(w.double().sum()) for w in got[1]),
            "skip_ok": skip_ok,
            "norms": (None if ref_norm is None else float(ref_norm), device_norm),
        }
    finally:
        ps.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "clip"), [(1, 0.0), (2, 0.0), (1, 0.05), (2, 0.05)], ids=str)
def test_one_pass_adamw_is_megatrons_update(world: int, clip: float) -> None:
    outs = run_multiprocess(_one_pass_worker, world, clip)
    for out in outs:
        ref, got = out["losses"]
        # Three steps each way on a bf16 model: same curve within bf16 noise.
        assert all(abs(a - b) <= 2e-2 for a, b in zip(ref, got)), out
        assert ref[-1] < ref[0], out  # it trains
        # One update from the same grads and state: the same fp32 arithmetic up to op order.
        assert out["moved"] > 1e-4, out
        assert out["main_rel"] <= 1e-6, out
        assert out["state_rel"] <= 1e-6, out
        assert out["weight_flips"] <= 1e-3, out  # bf16 copies equal but for rounding ties
        assert out["steps"] == [4.0], out  # torch AdamW's per-param step counts advance
        assert out["state_keys"] == ["exp_avg", "exp_avg_sq", "step"], out
        assert out["grad_norm"] > 0.0 and out["no_main_grads"], out
        assert out["skip_ok"], out  # found_inf: every buffer and step count unchanged
        ref_norm, device_norm = out["norms"]
        if clip:  # clipped on the device with megatron's norm (far above 0.05: it engages)
            assert ref_norm > 10 * clip and abs(device_norm - ref_norm) <= 1e-5 * ref_norm, out
        else:
            assert device_norm is None, out
    # Each rank updated its own shard; the all-gather (and the flip count above, against
    # megatron's gathered weights) leaves every rank with the same full weights.
    assert len({out["checksum"] for out in outs}) == 1, outs


def _cuda_levers_worker(rank: int, world: int) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.train.lm_step import build_train_step

    torch.cuda.set_device(0)
    acc = get_accelerator("cuda")
    parallel_state.initialize(ParallelConfig(), acc, seed=1)
    try:
        cfg = _tiny_cfg()
        tokens, labels = (t.cuda() for t in _batch(cfg, b=2, s=64))
        out: dict[str, object] = {}
        variants = {
            "eager": {},
            "graphed": {"cuda_graph": True},
            "one_pass": {"one_pass_adamw": True},
            "graphed_one_pass": {"cuda_graph": True, "one_pass_adamw": True},
        }
        for name, kw in variants.items():
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(lr=1e-3, grad_clip=0.0), precision="bf16", device="cuda", **kw
            )
            step = ts.graphed(acc, warmup=2) if kw.get("cuda_graph") else ts.step
            out[name] = [float(step(tokens, labels)) for _ in range(6)]
            if kw.get("cuda_graph"):
                out[f"{name}_graph"] = (step.graph.reason, step.graph.replays)
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_and_one_pass_steps_on_cuda() -> None:
    """The whole step as one CUDA graph (megatron DDP built under a side stream, capturable
    AdamW) and the one-pass Triton update train like the eager step (bf16, 6 steps)."""
    # spawn: the test process may have initialised CUDA already, which a fork cannot inherit
    (out,) = run_multiprocess(
        _cuda_levers_worker, 1, backend="nccl", timeout=300, start_method="spawn"
    )
    for name in ("graphed", "graphed_one_pass"):
        reason, replays = out[f"{name}_graph"]
        assert reason is None and replays >= 4, out  # captured after 2 eager steps
    ref = out["eager"]
    assert ref[-1] < ref[0], out
    for name in ("graphed", "one_pass", "graphed_one_pass"):
        assert all(abs(a - b) <= 2e-2 for a, b in zip(ref, out[name])), (name, out)


def _hazards_worker(rank: int, world: int, variant: dict) -> list[tuple[str, str]]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.core.loop.capture_check import capture_hazards
    from longboat.core.megatron.engine.lagged_gate import use_fused_adamw as _use_fused
    from longboat.core.megatron.optimizer import inner_optimizers
    from longboat.llm.train.lm_step import build_train_step

    ps = _init()
    try:
        cfg = _tiny_cfg()
        tokens, labels = _batch(cfg)
        model_parallel_cuda_manual_seed(1)
        clip = variant.get("clip", 0.0)
        ts = build_train_step(
            cfg, OptimConfig(lr=1e-3, grad_clip=clip), precision="bf16", device="cpu",
            cuda_graph=True, one_pass_adamw=variant.get("one_pass", False),
        )  # fmt: skip
        for inner in inner_optimizers(ts.optimizer):
            _use_fused(inner)  # the fused AdamW CUDA runs (on CPU it would be foreach)
        for _ in range(2):  # lazy state (moments, step counts) exists before a capture
            ts.step(tokens, labels)
        with capture_hazards() as found:
            ts.step(tokens, labels)
        return [(h.op, h.where.split("/")[-1]) for h in found]
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_the_graphed_llm_step_has_no_capture_hazards() -> None:
    """What ``TrainStep.graphed`` captures - forward, backward, grad finalisation and the
    update - reads no device value on the host, builds no tensor from Python data, makes no
    data-dependent shape and reseeds no RNG (core's capture_check, which sees every aten op on
    CPU): with megatron's (fused) AdamW step and with the one-pass update, clipped or not.
    megatron's clipped step is the control: it reads the grad norm on the host."""
    for variant in ({}, {"one_pass": True}, {"one_pass": True, "clip": 1.0}):
        (found,) = run_multiprocess(_hazards_worker, 1, variant)
        assert found == [], (variant, found)
    (control,) = run_multiprocess(_hazards_worker, 1, {"clip": 1.0})
    assert any("_local_scalar_dense" in op and "clip_grads" in where for op, where in control)


def _weight_decay_worker(rank: int, world: int) -> list[tuple[int, float]]:
    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step

    ps = _init()
    try:
        ts = build_train_step(_tiny_cfg(), OptimConfig(weight_decay=0.1), precision="bf16",
                              device="cpu")  # fmt: skip
        out = []  # (largest model-parameter rank in the group, its weight decay)
        for part in getattr(ts.optimizer, "chained_optimizers", None) or [ts.optimizer]:
            for i, group in enumerate(part.optimizer.param_groups):
                params = [*part.model_float16_groups[i], *part.model_fp32_groups[i]]
                if params:
                    out.append((max(p.dim() for p in params), float(group["weight_decay"])))
        return out
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_the_train_step_decays_matrices_only() -> None:
    """Norm weights (and any bias) get no weight decay, as in megatron's own schedule and the
    HF Trainer; the matrices get ``optim.weight_decay``."""
    (groups,) = run_multiprocess(_weight_decay_worker, 1)
    assert {ndim for ndim, _ in groups} == {1, 2}, groups
    for ndim, decay in groups:
        assert decay == (0.1 if ndim == 2 else 0.0), groups
