"""Triton kernels vs their torch references, forward and backward.

Not collected by the default run (no ``test_`` prefix): ``test_kernels_triton.py`` runs this
file in a subprocess, on CPU with ``TRITON_INTERPRET=1`` (set before triton is imported)
or on CUDA with ``LONGBOAT_KERNEL_TEST_DEVICE=cuda``. Shapes are small and awkward
(non-power-of-two hidden, one-row inputs, vocab and token chunks that do not divide).

Tolerances, as ``||triton - ref|| / ||ref||`` on the same inputs: fp32 1e-5 (outputs) and
1e-4 (gradients); bf16 1e-2 (both sides compute in fp32 and round once; the gap is a few
rounding flips), 2e-2 for the fused linear CE gradients (bf16 dlogits and bf16 accumulation
of the weight gradient over chunks).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from longboat import kernels as K  # noqa: E402  (after the interpreter check)
from longboat.kernels import fused_linear_ce  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def leaf(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype).requires_grad_()


def run_both(fn, inputs: list[torch.Tensor], seed: int = 0):  # type: ignore[no-untyped-def]
    """Run ``fn(impl, *inputs)`` for torch and triton; return (outputs, grads) for each."""
    results = []
    for impl in ("torch", "triton"):
        for t in inputs:
            t.grad = None
        outs = fn(impl, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        loss = sum(
            (o.float() * torch.randn(o.shape, device=DEVICE, generator=gen)).sum() for o in outs
        )
        loss.backward()
        results.append(([o.detach() for o in outs], [t.grad.clone() for t in inputs]))
    return results


def check(results, dtype, what: str) -> None:  # type: ignore[no-untyped-def]
    (ref_out, ref_grad), (tri_out, tri_grad) = results
    tol_out, tol_grad = TOL[dtype]
    for i, (a, b) in enumerate(zip(tri_out, ref_out, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} out{i}: {a.shape} {b.shape}"
        assert torch.isfinite(a).all(), f"{what} out{i} not finite"
        assert rel_err(a, b) <= tol_out, f"{what} out{i}: rel err {rel_err(a, b):.2e}"
    for i, (a, b) in enumerate(zip(tri_grad, ref_grad, strict=True)):
        assert a.shape == b.shape, f"{what} grad{i}: {a.shape} {b.shape}"
        assert rel_err(a, b) <= tol_grad, f"{what} grad{i}: rel err {rel_err(a, b):.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 200), (37, 96), (6, 1000)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, rows, hidden, residual) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(rows * hidden)
    x = leaf(rows, hidden, dtype=dtype)
    w = leaf(hidden, dtype=dtype)
    inputs = [x, w] + ([leaf(rows, hidden, dtype=dtype)] if residual else [])
    res = run_both(lambda impl, *t: K.rms_norm(t[0], t[1], 1e-6, *t[2:], impl=impl), inputs)
    check(res, dtype, f"rms_norm[{rows}x{hidden}, residual={residual}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["none", "weight", "weight_bias"])
def test_layer_norm(dtype, affine) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    x = leaf(3, 13, 200, dtype=dtype, scale=3.0)
    params = []
    if affine != "none":
        params.append(leaf(200, dtype=dtype))
    if affine == "weight_bias":
        params.append(leaf(200, dtype=dtype))
    res = run_both(lambda impl, *t: K.layer_norm(*t, eps=1e-5, impl=impl), [x, *params])
    check(res, dtype, f"layer_norm[{affine}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 11, 200), (2, 1, 96)])
def test_ada_layer_norm(dtype, shape) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(2)
    b, _, d = shape
    x = leaf(*shape, dtype=dtype)
    scale, shift = leaf(b, d, dtype=dtype, scale=0.5), leaf(b, d, dtype=dtype)
    res = run_both(lambda impl, *t: K.ada_layer_norm(*t, impl=impl), [x, scale, shift])
    check(res, dtype, f"ada_layer_norm{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("packed", [False, True])
def test_glu(dtype, activation, packed) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    if packed:
        inputs = [leaf(2, 5, 2 * 2500, dtype=dtype, scale=2.0)]  # 2500 > one 2048 column block
    else:
        inputs = [leaf(7, 200, dtype=dtype, scale=2.0), leaf(7, 200, dtype=dtype)]
    res = run_both(lambda impl, *t: K.glu(*t, activation=activation, impl=impl), inputs)
    check(res, dtype, f"glu[{activation}, packed={packed}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "bshd_partial", "packed"])
def test_rope(dtype, layout) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(4)
    head_dim = 48
    rotary = 16 if layout == "bshd_partial" else head_dim
    cos, sin = K.rope_cos_sin(64, rotary, device=DEVICE)
    if layout == "packed":  # two documents of 4 and 5 tokens; positions restart per document
        q, k = leaf(9, 6, head_dim, dtype=dtype), leaf(9, 2, head_dim, dtype=dtype)
        pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4], device=DEVICE)
    else:
        q, k = leaf(2, 5, 6, head_dim, dtype=dtype), leaf(2, 5, 2, head_dim, dtype=dtype)
        pos = torch.randint(0, 64, (2, 5), device=DEVICE)
    res = run_both(lambda impl, a, b: K.apply_rope(a, b, cos, sin, pos, impl=impl), [q, k])
    check(res, dtype, f"rope[{layout}]")


def test_rope_inplace_matches() -> None:
    torch.manual_seed(5)
    cos, sin = K.rope_cos_sin(16, 32, device=DEVICE)
    q, k = torch.randn(2, 7, 3, 32, device=DEVICE), torch.randn(2, 7, 1, 32, device=DEVICE)
    ref_q, ref_k = K.apply_rope_torch(q, k, cos, sin)
    with torch.no_grad():
        K.apply_rope_(q, k, cos, sin)
    assert rel_err(q, ref_q) <= 1e-5 and rel_err(k, ref_k) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,q_per_group,head_dim,rotary", [(2, 3, 16, 16), (3, 1, 24, 8)])
def test_split_qkv_rope(dtype, groups, q_per_group, head_dim, rotary) -> None:  # type: ignore[no-untyped-def]
    """Fused split + RoPE vs views + torch rotation, forward and backward, on megatron's
    [s, b, groups * (q_per_group + 2) * head_dim] layout; also full vs partial rotary."""
    from longboat.kernels.qkv_rope import positions_for_layout, split_qkv_rope

    torch.manual_seed(7)
    s, b = 5, 3
    cos, sin = K.rope_cos_sin(16, rotary, device=DEVICE)
    pos = positions_for_layout(s, b, seq_first=True, device=DEVICE)
    mixed = leaf(s, b, groups * (q_per_group + 2) * head_dim, dtype=dtype)
    res = run_both(
        lambda impl, m: split_qkv_rope(m, groups, q_per_group, cos, sin, pos, impl=impl), [mixed]
    )
    check(res, dtype, f"split_qkv_rope[g={groups}, q={q_per_group}, r={rotary}]")
    q, k, v = res[1][0]
    assert q.shape == (s, b, groups * q_per_group, head_dim) and k.shape == (s, b, groups, head_dim)
    # v passes through untouched and equals its slot of the row bit for bit
    row = mixed.detach().view(s, b, groups, q_per_group + 2, head_dim)
    assert torch.equal(v, row[:, :, :, q_per_group + 1])


def test_split_qkv_rope_matches_split_then_rope() -> None:
    """Same as megatron's path: torch.split of the grouped row, then RoPE on q and k."""
    from longboat.kernels.qkv_rope import positions_for_layout, split_qkv_rope

    torch.manual_seed(8)
    s, b, g, qpg, d = 6, 2, 2, 2, 32
    cos, sin = K.rope_cos_sin(32, d, device=DEVICE)
    mixed = torch.randn(s, b, g * (qpg + 2) * d, device=DEVICE)
    pos = positions_for_layout(s, b, seq_first=True, device=DEVICE)
    q, k, v = split_qkv_rope(mixed, g, qpg, cos, sin, pos, impl="triton")
    qs, ks, vs = torch.split(mixed.view(s, b, g, (qpg + 2) * d), [qpg * d, d, d], dim=3)
    qs = qs.reshape(s, b, g * qpg, d)
    rq, rk = K.apply_rope_torch(qs.transpose(0, 1), ks.transpose(0, 1), cos, sin)
    assert rel_err(q, rq.transpose(0, 1)) <= 1e-5 and rel_err(k, rk.transpose(0, 1)) <= 1e-5
    assert torch.equal(v, vs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("z_loss,reduction", [(0.0, "mean"), (1e-3, "mean"), (0.0, "sum")])
def test_fused_linear_cross_entropy(dtype, z_loss, reduction, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(6)
    monkeypatch.setattr(fused_linear_ce, "MAX_BLOCK_V", 128)  # 300 = 128 + 128 + 44 columns
    n, hidden, vocab = 37, 48, 300
    h = leaf(n, hidden, dtype=dtype)
    w = leaf(vocab, hidden, dtype=dtype, scale=0.3)
    target = torch.randint(0, vocab, (n,), device=DEVICE)
    target[::5] = -100
    target[-1] = vocab - 1  # the last vocab column, in the partial block

    def fn(impl, a, b):  # type: ignore[no-untyped-def]
        return K.fused_linear_cross_entropy(
            a, b, target, z_loss=z_loss, reduction=reduction, chunk_size=16, impl=impl
        )

    (ref_out, ref_grad), (tri_out, tri_grad) = run_both(fn, [h, w])
    assert tri_out[0].dtype == torch.float32 and tri_out[0].shape == ()
    tol_grad = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(tri_out[0], ref_out[0]) <= (1e-5 if dtype == torch.float32 else 1e-2)
    for name, a, b in zip(("dhidden", "dweight"), tri_grad, ref_grad, strict=True):
        assert rel_err(a, b) <= tol_grad, f"{name}: {rel_err(a, b):.2e}"


def test_fused_linear_cross_entropy_all_ignored() -> None:
    h = torch.randn(5, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 8, device=DEVICE, requires_grad=True)
    target = torch.full((5,), -100, device=DEVICE)
    loss = K.fused_linear_cross_entropy(h, w, target, impl="triton")
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max().item() == 0.0


def test_torch_compile_traces_custom_ops() -> None:
    """torch.compile(fullgraph) traces the custom ops via their fake impls, fwd and bwd."""
    torch.manual_seed(7)
    x = torch.randn(4, 96, device=DEVICE, requires_grad=True)
    w = torch.randn(96, device=DEVICE, requires_grad=True)

    def fn(x, w):  # type: ignore[no-untyped-def]
        y, h = K.rms_norm(x, w, 1e-6, residual=x * 2, impl="triton")
        return K.swiglu(y, h, impl="triton")

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    out = torch.compile(fn, backend=backend, fullgraph=True)(x, w)
    out.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    ref = fn(x, w)
    ref.sum().backward()
    assert rel_err(out, ref) <= 1e-5 and rel_err(gx, x.grad) <= 1e-4


def test_fake_impls_match_the_kernels_on_non_contiguous_inputs() -> None:
    """Each op's fake (what torch.compile traces with) gives the real kernel's shapes,
    dtypes and strides, also for a transposed input: a fake that kept the input's strides
    while the kernel returns a contiguous tensor broke torch.compile of a ViT."""
    from torch.library import opcheck

    torch.manual_seed(3)
    x = torch.randn(96, 6, device=DEVICE).t()  # [6, 96], last stride 6
    assert not x.is_contiguous()
    w, b = torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    x3 = torch.randn(2, 96, 5, device=DEVICE).transpose(1, 2)  # [2, 5, 96], not contiguous
    scale, shift = torch.randn(2, 96, device=DEVICE), torch.randn(2, 96, device=DEVICE)
    gate = torch.randn(96, 6, device=DEVICE).t()
    cases = [
        (torch.ops.longboat.layer_norm_fwd, (x, w, b, 1e-5)),
        (torch.ops.longboat.rms_norm_fwd, (x, w, None, 1e-6)),
        (torch.ops.longboat.rms_norm_fwd, (x, w, x * 0.5, 1e-6)),
        (torch.ops.longboat.ada_layer_norm_fwd, (x3, scale, shift, 1e-6)),
        (torch.ops.longboat.glu_fwd, (gate, gate * 2, 0)),
        (
            torch.ops.longboat.qkv_rope_fwd,
            (
                torch.randn(4, 2, 64, device=DEVICE),
                *K.rope_cos_sin(8, 8, device=DEVICE),
                torch.arange(4, device=DEVICE).repeat_interleave(2),
                2,
                2,
            ),
        ),
    ]
    for op, args in cases:
        opcheck(op, args, test_utils=("test_faketensor",))


# ---------------------------------------------------------------- AdamW on master weights

ADAMW = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
ADAMW_N = 3 * 1024 + 77  # three full Triton blocks and a partial one


def _adamw_state(n: int, param_dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    master = torch.randn(n, device=DEVICE, generator=g)
    return {
        "master": master,
        "exp_avg": torch.zeros(n, device=DEVICE),
        "exp_avg_sq": torch.zeros(n, device=DEVICE),
        "param_out": master.to(param_dtype),
    }


def _adamw_call(state, grad, impl, **scalars) -> None:  # type: ignore[no-untyped-def]
    K.adamw_master_step_(
        state["master"],
        grad,
        state["exp_avg"],
        state["exp_avg_sq"],
        state["param_out"],
        **ADAMW,
        **scalars,
        impl=impl,
    )


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, device=DEVICE)


@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("clip", [None, 4.0])
def test_adamw_master_step_matches_torch_adamw(grad_dtype, clip) -> None:  # type: ignore[no-untyped-def]
    """Triton vs torch reference vs torch.optim.AdamW (fp32 weights, the same grads divided
    by the clip factor) over 3 steps with a per-step lr. fp32 buffers within 1e-6 relative;
    the low-precision weights are the master rounded (to nearest even) exactly; the update
    itself (master - initial) within 1e-5 relative, so the test is not just "params ~ init".
    Measured in the interpreter: master 1e-8, moments 7e-8, update 3e-7 vs torch AdamW;
    triton vs reference moments bit for bit, master 6e-9 (torch on CPU divides by a 0-d
    tensor as a multiply by its reciprocal)."""
    n = ADAMW_N
    tri, ref = _adamw_state(n, grad_dtype, 0), _adamw_state(n, grad_dtype, 0)
    init = tri["master"].clone()
    weight = init.clone().requires_grad_(True)
    opt = torch.optim.AdamW(
        [weight],
        lr=1.0,
        betas=(ADAMW["beta1"], ADAMW["beta2"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
        foreach=False,
    )
    lr, step = _scalar(0.0), _scalar(0.0)
    grad_scale = None if clip is None else _scalar(clip)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    for i in range(3):
        grad = torch.randn(n, device=DEVICE, generator=g).to(grad_dtype)
        lr.fill_(1e-2 * (i + 1))
        step.add_(1.0)
        for state, impl in ((tri, "triton"), (ref, "torch")):
            _adamw_call(state, grad, impl, lr=lr, step=step, grad_scale=grad_scale)
        weight.grad = grad.float() / (clip or 1.0)
        opt.param_groups[0]["lr"] = 1e-2 * (i + 1)
        opt.step()
        torch_state = {
            "master": weight.detach(),
            "exp_avg": opt.state[weight]["exp_avg"],
            "exp_avg_sq": opt.state[weight]["exp_avg_sq"],
        }
        for key, want in torch_state.items():
            for name, got in (("triton", tri[key]), ("reference", ref[key])):
                err = rel_err(got, want)
                assert err <= 1e-6, f"step {i + 1}: {name} {key} vs torch AdamW: {err:.2e}"
            assert rel_err(tri[key], ref[key]) <= 1e-6, f"step {i + 1}: {key} triton vs ref"
        for name, state in (("triton", tri), ("reference", ref)):
            rounded = state["master"].to(grad_dtype)
            assert torch.equal(state["param_out"], rounded), f"{name} param_out != rounded master"
            delta_err = rel_err(state["master"] - init, weight.detach() - init)
            assert delta_err <= 1e-5, f"step {i + 1}: {name} update vs torch AdamW: {delta_err:.2e}"


def test_adamw_master_step_found_inf_changes_nothing(
    skipped_step_check: Callable[..., None],
) -> None:
    """found_inf != 0: masters, moments and the bf16 weights stay bit for bit (even with
    NaN/inf grads); found_inf == 0 afterwards updates again."""
    n = ADAMW_N
    g = torch.Generator(device=DEVICE).manual_seed(2)
    for impl in ("triton", "torch"):
        state = _adamw_state(n, torch.bfloat16, 3)
        good = torch.randn(n, device=DEVICE, generator=g).bfloat16()
        skipped_step_check(_adamw_call, state, good, impl, updated="master")


def test_adamw_master_step_rounds_like_torch() -> None:
    """With lr 0 the master stays, and param_out is its bf16 rounding: ties to even, the
    overflow to inf, subnormals and inf bit for bit as torch's fp32 -> bf16 copy, NaN stays
    NaN (the interpreter's own cast truncates, so the kernel rounds on the bits)."""
    values = [1.00390625, 1.01171875, -1.00390625, 1.0039063, 3.3961776e38, 3.3895314e38]
    values += [1e-40, -0.0, float("inf"), float("-inf"), float("nan"), 0.1, -2.7182817]
    master = torch.tensor(values, device=DEVICE)
    state = {
        "master": master.clone(),
        "exp_avg": torch.zeros_like(master),
        "exp_avg_sq": torch.zeros_like(master),
        "param_out": torch.zeros_like(master, dtype=torch.bfloat16),
    }
    grad = torch.zeros_like(master, dtype=torch.bfloat16)
    _adamw_call(state, grad, "triton", lr=_scalar(0.0), step=_scalar(1.0))
    got, want = state["param_out"], master.bfloat16()
    nan = torch.isnan(want)  # NaN payloads differ by platform (torch on CPU: 0xFFFF)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_adamw_master_step_reads_no_host_values() -> None:
    """No host read of a device scalar (capturable): item / bool / float / tolist raise."""
    from torch.overrides import TorchFunctionMode

    banned = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__}
    banned |= {torch.Tensor.__int__, torch.Tensor.tolist, torch.Tensor.__index__}

    class NoHostReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in banned:
                raise AssertionError(f"host read: {func.__name__}")
            return func(*args, **(kwargs or {}))

    state = _adamw_state(ADAMW_N, torch.bfloat16, 4)
    grad = torch.randn(ADAMW_N, device=DEVICE).bfloat16()
    scalars = {"lr": _scalar(1e-3), "step": _scalar(1.0), "grad_scale": _scalar(1.5)}
    with NoHostReads():
        _adamw_call(state, grad, "torch", found_inf=_scalar(0.0), **scalars)
    if DEVICE == "cuda":  # the interpreter itself copies tensors to the host
        with NoHostReads():
            _adamw_call(state, grad, "triton", found_inf=_scalar(0.0), **scalars)


def test_adamw_master_step_custom_op_schema() -> None:
    """The registered op declares its mutations and its fake runs (torch.compile traces it)."""
    from torch.library import opcheck

    state = _adamw_state(100, torch.bfloat16, 5)
    args = (
        state["master"],
        torch.randn(100, device=DEVICE).bfloat16(),
        state["exp_avg"],
        state["exp_avg_sq"],
        state["param_out"],
        _scalar(1e-3),
        _scalar(1.0),
        _scalar(2.0),
        _scalar(0.0),
        0.9,
        0.999,
        1e-8,
        0.1,
    )
    opcheck(
        torch.ops.longboat.adamw_master_step, args, test_utils=("test_schema", "test_faketensor")
    )


def test_adamw_master_step_rejects_bad_buffers() -> None:
    state = _adamw_state(10, torch.bfloat16, 6)
    grad = torch.zeros(10, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg must be float32 or bfloat16"):
        state["exp_avg"] = state["exp_avg"].half()
        _adamw_call(state, grad, "torch", lr=_scalar(1.0), step=_scalar(1.0))
    state = _adamw_state(10, torch.bfloat16, 6)
    with pytest.raises(ValueError, match="grad must be a contiguous 1-D tensor"):
        _adamw_call(state, grad[:9], "torch", lr=_scalar(1.0), step=_scalar(1.0))
    with pytest.raises(ValueError, match="lr must be a one-element tensor"):
        _adamw_call(state, grad, "torch", lr=1e-3, step=_scalar(1.0))


if DEVICE == "cuda":  # defined only where it can run: a skip would fail the CPU run's check

    def test_adamw_master_step_replays_in_a_cuda_graph(
        graph_replay_check: Callable[..., None],
    ) -> None:
        """Captured once, replayed with new lr / step / found_inf: bit for bit the eager
        kernel with the same values (no Python number frozen into the graph)."""
        n = ADAMW_N
        graphed, eager = _adamw_state(n, torch.bfloat16, 7), _adamw_state(n, torch.bfloat16, 7)
        grad = torch.randn(n, device=DEVICE).bfloat16()
        graph_replay_check(_adamw_call, graphed, eager, grad)
