"""tools/bench/llm_throughput.py and llm_loss_alignment.py at tiny shapes on CPU, and the
timing, results and noise-band helpers they share."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_testkit import run_script

FULL_MODEL = SimpleNamespace(
    vocab_size=32000, hidden_size=2048, num_layers=16, num_attention_heads=16,
    num_query_groups=8, head_dim=128, ffn_hidden_size=5632, tie_embeddings=False,
)  # fmt: skip


def test_flop_accounting_reproduces_the_anchors() -> None:
    from baselines import llm_reference as ref
    from bench_env import PEAK_BF16_FLOPS

    # The MFU arithmetic of benchmarks/notes/llm.md: 886M parameters; 62.6k tokens/s = 36.2% MFU,
    # 99.0k = 57.2%.
    assert ref.param_count(FULL_MODEL) == pytest.approx(886e6, rel=1e-3)
    for tokens_per_s, mfu in ((62.6e3, 0.362), (99.0e3, 0.572), (34.5e3, 0.199)):
        got = tokens_per_s * ref.flops_per_token(FULL_MODEL, 2048) / PEAK_BF16_FLOPS
        assert got == pytest.approx(mfu, abs=0.001)


def test_every_run_is_the_cli_assembly_or_a_baseline(tmp_path: Path) -> None:
    """The longboat runs (the CLI's defaults, two variants) and two baselines train 2 timed
    steps; the default (graphed, one-pass) and the variants without them run the same math on
    CPU (eager steps, the same update rule), so their losses are equal."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "llm.json"
    runs = "hf_eager,mcore_local_spec,longboat_megatron_step,longboat_no_graph,longboat"
    stdout = run_script(
        "llm_throughput.py",
        [
            "--out",
            str(out),
            "--tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--runs",
            runs,
            "--results-dir",
            str(tmp_path),
        ],
    )
    result = json.loads(out.read_text())
    assert result["benchmark"] == "llm_throughput"
    by_name = {r["name"]: r for r in result["runs"]}
    assert list(by_name) == runs.split(",")
    for name, r in by_name.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["tokens_per_s"] > 0 and r["timed_steps"] == len(r["step_times_s"]) == 2
        assert r["peak_mem_gb"] > 0 and 0 < r["mfu"] < 1
        # Random init on random tokens: cross-entropy near ln(vocab) (uniform prediction).
        assert all(math.isfinite(x) and abs(x - math.log(256)) < 0.3 for x in r["losses"]), r
    lb = by_name["longboat"]
    assert len(lb["losses"]) == 4  # warm-up, 2 timed, the last (logged) step
    assert (
        lb["losses"]
        == by_name["longboat_no_graph"]["losses"]
        == by_name["longboat_megatron_step"]["losses"]
    )
    assert lb["levers"]["fused_linear_ce"] is True
    assert by_name["hf_eager"]["notes"]["logits_materialised"] is True
    assert by_name["hf_eager"]["notes"]["forward"].startswith("transformers.")
    assert lb["levers"]["one_pass_adamw"] is True and lb["levers"]["cuda_graph"] is False  # CPU
    assert by_name["longboat_megatron_step"]["levers"]["one_pass_adamw"] is False
    assert result["config"]["variants"]["longboat"] == []
    stem = tmp_path / f"llm_throughput_{result['date']}"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    md = stem.with_suffix(".md").read_text()
    assert md.count("| longboat |") == 1 and "hf_eager: forward from" in md
    assert "[tokens, vocab] logits materialised" in md
    assert stem.with_suffix(".png").stat().st_size > 0
    assert stdout.rstrip().splitlines()[-1].startswith("| longboat |")


def test_a_failing_run_is_recorded_not_raised(tmp_path: Path) -> None:
    import llm_throughput

    out = tmp_path / "llm.json"
    assert llm_throughput.main(["--out", str(out), "--tiny", "--steps", "1", "--runs", "nope"]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["name"] == "nope" and "unknown run" in run["error"]


def test_tiny_loss_alignment_matches_hf(tmp_path: Path, quickstart_dir: Path) -> None:
    """Same HF weights, the very batches of the built run: on CPU (fp32 on both sides) the
    curves agree to float32 rounding (5e-7 measured; a reference that also decayed norm
    weights was 5e-5 apart); the loss falls (warm-up 2 instead of the quickstart's 20)."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "align.json"
    run_script("llm_loss_alignment.py", ["--out", str(out), "--tiny", "--steps", "8",
               "--data-dir", str(quickstart_dir), "--results-dir", str(tmp_path),
               "--override", "optim.schedule.warmup_steps=2"])  # fmt: skip
    result = json.loads(out.read_text())
    curves = {r["name"]: r["losses"] for r in result["runs"]}
    assert list(curves) == ["reference", "reference_perturbed", "longboat"]
    assert all(len(c) == 8 for c in curves.values())
    assert result["max_abs_loss_diff"] < 1e-5
    assert curves["reference"][-1] < curves["reference"][0] - 0.1
    assert curves["longboat"][0] == pytest.approx(curves["reference"][0], abs=1e-4)
    assert set(result["verdict"]) >= {"max_diff", "band_max_diff", "no_bias", "passes"}
    assert (tmp_path / f"llm_loss_alignment_{result['date']}.png").stat().st_size > 0


@pytest.mark.slow
def test_tiny_moe_loss_alignment_matches_hf(tmp_path: Path, quickstart_dir: Path) -> None:
    """``--shape qwen3_moe_4l``: the same from one ``Qwen3MoeForCausalLM`` (grouped experts,
    transformers' load-balancing term in both objectives, LM losses compared): fp32 on the CPU,
    the curves agree to float32 rounding and the loss falls."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "align.json"
    run_script("llm_loss_alignment.py", ["--out", str(out), "--tiny", "--shape", "qwen3_moe_4l",
               "--steps", "8", "--data-dir", str(quickstart_dir), "--results-dir", str(tmp_path),
               "--override", "optim.schedule.warmup_steps=2"])  # fmt: skip
    result = json.loads(out.read_text())
    curves = {r["name"]: r["losses"] for r in result["runs"]}
    assert result["max_abs_loss_diff"] < 1e-5
    assert curves["reference"][-1] < curves["reference"][0] - 0.1
    assert curves["longboat"][0] == pytest.approx(curves["reference"][0], abs=1e-4)


@pytest.mark.slow
def test_tiny_deepseek_v3_loss_alignment_matches_hf(tmp_path: Path, quickstart_dir: Path) -> None:
    """``--shape moonlight_4l``: the same from one ``DeepseekV3ForCausalLM`` (MLA, shared and
    routed experts, the dense first layer); longboat's bias update and balance loss are off
    as transformers trains: fp32 on the CPU, the curves agree to float32 rounding (1e-6
    measured; 1.9e-3 after 5 steps with both on)."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "align.json"
    run_script("llm_loss_alignment.py", ["--out", str(out), "--tiny", "--shape", "moonlight_4l",
               "--steps", "8", "--data-dir", str(quickstart_dir), "--results-dir", str(tmp_path),
               "--override", "optim.schedule.warmup_steps=2"])  # fmt: skip
    result = json.loads(out.read_text())
    curves = {r["name"]: r["losses"] for r in result["runs"]}
    assert "model.moe_router_bias_update_rate=0" in result["config"]["overrides"]
    assert result["max_abs_loss_diff"] < 1e-5
    assert curves["reference"][-1] < curves["reference"][0] - 0.1
    assert curves["longboat"][0] == pytest.approx(curves["reference"][0], abs=1e-4)


def test_noise_band_verdict() -> None:
    import bench_align

    ref = [2.0, 1.8, 1.6, 1.5]
    band = [2.0, 1.81, 1.59, 1.51]  # |diff| 0, .01, .01, .01
    ok = bench_align.judge([2.0, 1.79, 1.61, 1.49], ref, band, relative=False)
    assert ok["passes"] and ok["max_diff"] == pytest.approx(0.01)
    assert ok["tail_steps"] == 2 and ok["tail_mean_signed_diff"] == pytest.approx(0.0)
    # within the band at every step, but always above the reference: a bias
    biased = bench_align.judge([2.0, 1.81, 1.61, 1.51], ref, band, relative=False)
    assert biased["within_max"] and biased["within_mean"] and not biased["no_bias"]
    far = bench_align.judge([2.0, 1.9, 1.6, 1.5], ref, band, relative=True)
    assert not far["within_max"] and far["max_diff"] == pytest.approx(0.1 / 1.8)


class _HostClock:
    """The CPU accelerator's timing surface, counting synchronize() calls."""

    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1

    def event(self, enable_timing: bool = False):
        from longboat.core.device.base import HostEvent

        return HostEvent(enable_timing)


def test_step_timer_times_trainer_steps_with_two_syncs() -> None:
    """As a Trainer callback: warm-up step 1 untimed, steps 2-4 timed by the gaps between
    events, the batch waits recorded, one sync at each end of the window."""
    from bench_timing import StepTimer

    acc = _HostClock()
    timer = StepTimer(acc, warmup=1, steps=3)
    batches = timer.timed_batches(iter(range(5)))
    sleeps = [0.01, 0.02, 0.05, 0.03, 0.01]
    for step, s in enumerate(sleeps, start=1):
        next(batches)
        time.sleep(s)
        timer.on_step_end(None, step, None)
    t = timer.timing
    assert len(t.step_times) == len(t.host) == len(t.data_wait) == 3
    for got, want in zip(t.step_times, sleeps[1:4]):
        assert want <= got < want + 0.015, (got, want)  # scheduler latency on a busy box
    assert sum(sleeps[1:4]) <= t.window_s < sum(sleeps[1:4]) + 0.03
    assert acc.syncs == 2
    s = t.summary(items_per_step=100)
    assert s["median_step_s"] == pytest.approx(sorted(t.step_times)[1])
    assert s["items_per_s"] == pytest.approx(100 / s["median_step_s"])


def test_moe_flop_accounting_counts_the_active_experts() -> None:
    from baselines import llm_reference as ref

    # Qwen3-30B-A3B cut to 4 layers, by hand: attention 2*2048*4096 + 2*2048*512 (q,o,k,v),
    # qk-norm 2*128, two norms 2*2048, router 2048*128; 128 (8 active) experts of 3*2048*768;
    # untied 151,936-row embedding and head, the final norm.
    m = SimpleNamespace(
        vocab_size=151936, hidden_size=2048, num_layers=4, num_attention_heads=32,
        num_query_groups=4, head_dim=128, ffn_hidden_size=6144, tie_embeddings=False,
        qk_norm=True, num_experts=128, moe_topk=8, moe_ffn_hidden_size=768,
    )  # fmt: skip
    layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 2 * 2048 + 2048 * 128
    emb = 2 * 151936 * 2048 + 2048
    total, active = ref.param_counts(m)
    assert total == emb + 4 * (layer + 128 * 3 * 2048 * 768)
    assert active == emb + 4 * (layer + 8 * 3 * 2048 * 768)
    assert ref.flops_per_token(m, 4096) == 6 * active + 6 * 4 * 4096 * 32 * 128


def test_hf_moe_baseline_adds_the_aux_loss_and_runs_grouped_gemms() -> None:
    """The tiny MoE shape's HF baseline step (as ``hf_eager`` runs it): its loss is the
    cross-entropy plus 0.001 x transformers' load-balancing loss, and its experts ran as
    ``aten::_grouped_mm`` (fp32 operands: the weights are fp32 under autocast), as the result's
    note says."""
    import llm_throughput as lt
    import torch
    from baselines import llm_reference as ref
    from bench_train import compose

    cfg = compose("llm", lt.EXPERIMENT, lt.overrides(lt.QWEN3_MOE_TINY), "unused")
    torch.manual_seed(0)
    model = ref.hf_causal_lm(cfg.model, torch.device("cpu"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    note = ref.hf_experts_kernel(model, compiled=False)
    assert note == "grouped_mm: torch.nn.functional.grouped_mm on float32 operands"
    assert "per-expert" in ref.hf_experts_kernel(model, compiled=True)
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=tokens, labels=tokens)
    ce = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), tokens[0, 1:])
    # HF pools both layers' router logits into one term; balanced routing gives topk (2).
    assert 1.5 < out.aux_loss.item() < 3.0
    assert out.loss.item() == pytest.approx(ce.item() + 0.001 * out.aux_loss.item(), abs=1e-5)
    assert abs(ce.item() - math.log(256)) < 0.3
    step = ref.HFStep(model, cfg.optim, torch.device("cpu"))
    with torch.profiler.profile() as prof:
        loss = step(tokens)
    ops = {e.key: e.count for e in prof.key_averages()}
    # 2 layers x (gate-up, down) forward; the backward's grouped GEMMs come on top.
    assert ops.get("aten::_grouped_mm", 0) >= 4, sorted(k for k in ops if "mm" in k)
    # The step trains on CE + 0.001 x aux and reports the LM loss, as longboat logs it.
    assert loss.item() == pytest.approx(ce.item(), abs=2e-2)  # bf16 autocast, same weights
    assert abs(loss.item() - out.loss.item()) > 0.5 * 0.001 * out.aux_loss.item()
    with pytest.raises(ValueError, match="dense Llama / Qwen3"):
        ref.HFStep(model, cfg.optim, torch.device("cpu"), liger=True)


@pytest.mark.slow
def test_moe_shape_runs_the_cli_assembly_against_qwen3_moe(tmp_path: Path) -> None:
    """``--shape qwen3_moe_4l``: transformers' ``Qwen3MoeForCausalLM`` (grouped_mm experts)
    and longboat with grouped and with per-expert experts train 2 timed steps; the two longboat
    runs compute the same math on CPU (equal losses), all near ln(vocab) at random init;
    ``hf_liger`` asked for is a skipped row saying why."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "moe.json"
    runs = "hf_eager,hf_liger,longboat_sequential_experts,longboat"
    run_script(
        "llm_throughput.py",
        ["--out", str(out), "--tiny", "--shape", "qwen3_moe_4l", "--steps", "2", "--warmup",
         "1", "--runs", runs, "--results-dir", str(tmp_path)],
    )  # fmt: skip
    result = json.loads(out.read_text())
    by_name = {r["name"]: r for r in result["runs"]}
    assert by_name.pop("hf_liger")["error"].startswith("skipped: the baseline applies Liger's")
    for name, r in by_name.items():
        assert "error" not in r, (name, r.get("error"))
        # ln(256) plus the load-balancing term (0.001 x about 1 a layer pooled, or per layer).
        assert all(math.isfinite(x) and abs(x - math.log(256)) < 0.3 for x in r["losses"]), r
    assert by_name["hf_eager"]["notes"]["experts"].startswith("grouped_mm: torch.nn.functional")
    assert by_name["hf_eager"]["notes"]["forward"].startswith("transformers.models.qwen3_moe")
    lb, seq = by_name["longboat"]["losses"], by_name["longboat_sequential_experts"]["losses"]
    assert lb == pytest.approx(seq, rel=1e-6, abs=0)
    assert result["config"]["active_params"] < result["config"]["params"]
    md = (tmp_path / f"llm_throughput_qwen3_moe_4l_{result['date']}.md").read_text()
    assert "vs hf_eager" in md and "MFU (active params)" in md


def test_torchtitan_rows_are_skipped_rows_without_torchtitan(tmp_path: Path) -> None:
    """Asked for where torchtitan is not installed (CI), each torchtitan row is a skipped row
    saying so and what to install; nothing else runs."""
    import importlib.util

    import llm_throughput

    if importlib.util.find_spec("torchtitan") is not None:
        pytest.skip("torchtitan is installed here: the rows would run")
    out = tmp_path / "llm.json"
    runs = "titan_compiled,titan_float8"
    assert llm_throughput.main(["--out", str(out), "--tiny", "--steps", "1", "--runs", runs]) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["runs"]] == runs.split(",")
    for r in result["runs"]:
        assert r["error"] == (
            "skipped: torchtitan is not installed (0.2.x; benchmarks/notes/llm.md lists its wheels)"
        )
    assert result["versions"]["torchtitan"] == "absent"
    assert "| titan_float8 | failed: skipped: torchtitan is not installed" in llm_throughput.table(
        result
    )


def test_torchtitan_flags_match_the_benchmark_config() -> None:
    """The torchtitan command line of ``titan_float8`` on a GPU: the benchmark's batch, clip and
    AdamW settings, compile of blocks and loss, no recompute, Float8 with the LM head in bf16;
    on a CPU (no compile) Float8 is emulated."""
    import llm_throughput as lt
    from baselines import titan_reference as titan
    from bench_train import compose

    cfg = compose("llm", lt.EXPERIMENT, lt.overrides(lt.FULL), "unused")
    o = cfg.optim
    flags = titan.job_flags(cfg.model, o, seq=2048, micro_batch=8, float8=True, compiled=True,
                            dump_folder="/d")  # fmt: skip
    assert flags == [
        "--job.dump_folder", "/d", "--model.name", "llama3", "--model.hf_assets_path", "/d",
        "--training.local_batch_size", "8", "--training.seq_len", "2048",
        "--training.max_norm", "1.0", "--training.mixed_precision_param", "bfloat16",
        "--optimizer.name", "AdamW", "--optimizer.lr", str(o.lr),
        "--optimizer.beta1", str(float(o.betas[0])), "--optimizer.beta2", str(float(o.betas[1])),
        "--optimizer.eps", str(o.eps), "--optimizer.weight_decay", str(o.weight_decay),
        "--lr_scheduler.warmup_steps", str(o.schedule.warmup_steps),
        "--activation_checkpoint.mode", "none",
        "--compile.enable", "--compile.components", "model", "loss",
        "--model.converters", "quantize.linear.float8",
        "--quantize.linear.float8.filter_fqns", "output",
    ]  # fmt: skip
    assert o.grad_clip == 1.0 and o.schedule.warmup_steps >= 1
    eager = titan.job_flags(cfg.model, o, seq=64, micro_batch=2, float8=True, compiled=False,
                            dump_folder="/d")  # fmt: skip
    assert "--compile.enable" not in eager and eager[-1] == "--quantize.linear.float8.emulate"
    bf16 = titan.job_flags(cfg.model, o, seq=64, micro_batch=2, float8=False, compiled=False,
                           dump_folder="/d")  # fmt: skip
    assert not any("float8" in f for f in bf16)
