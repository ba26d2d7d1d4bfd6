"""bench_profile's reading aids: kernel categories, busy time and idle-gap attribution."""

from __future__ import annotations

import pytest
from bench_profile import categorize, idle_gaps, summarize, summary_text


def test_idle_gaps_are_attributed_to_the_host_events_overlapping_them():
    kernels = [("nvjet_gemm", 0, 100), ("_ln_fwd_kernel", 500, 100), ("x", 650, 100),
               ("sdpa_flash", 2000, 10)]  # fmt: skip
    host = [("longboat: next batch", 550, 1400), ("cudaGraphLaunch", 150, 50),
            ("aten::copy_", 100, 450), ("aten::add", 20, 30)]  # fmt: skip
    # gaps: 100-500 and 750-2000 (the 600-650 gap is under 200 us)
    gaps = idle_gaps(kernels, host)
    assert gaps == {"(all gaps)": 1650, "longboat: next batch": 1200, "aten::copy_": 400,
                    "cudaGraphLaunch": 50}  # fmt: skip
    s = summarize(kernels, steps=2, wall_s=0.004)
    assert s["device_busy_ms_per_step"] == pytest.approx(0.155)
    assert s["device_idle_fraction"] == pytest.approx(1 - 0.155 / 2)
    s["idle_gap_ms_per_step_by_host_event"] = {k: v / 1e3 / 2 for k, v in gaps.items()}
    s["host_syncs_per_step_by_caller"] = {"step.py:375 run_step": 1.0}
    text = summary_text(s)
    assert "| longboat: next batch | 0.60 |" in text and "| step.py:375 run_step | 1.00 |" in text
    assert [categorize(k[0]) for k in kernels] == ["gemm", "triton", "other", "attention"]


def test_part_times_split_a_groot_step_between_backbone_and_action_head():
    """GR00T's named ranges: the forward under each range and the backward of its ops are
    attributed to it (autograd sequence numbers), and together the two parts account for
    the step's backward."""
    import torch
    from bench_profile import part_times
    from torch.profiler import ProfilerActivity, profile

    from longboat.embodied.models import apply_freezing, build_model, get_config
    from longboat.embodied.models.synthetic import synthetic_batch

    torch.manual_seed(0)
    cfg = get_config("groot_n1_6", "tiny", {})
    model = build_model("groot_n1_6", cfg)
    apply_freezing(model, cfg)
    batch = synthetic_batch(cfg, 2)
    parts = ("groot_n1_6.backbone", "groot_n1_6.action_head")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(batch)["loss"].backward()
    events = list(prof.events())
    got = part_times(events, parts, device=False)
    assert set(got) == set(parts) and all(got[p]["calls"] == 1 for p in parts)
    assert all(got[p]["forward_us"] > 0 for p in parts)
    head = got["groot_n1_6.action_head"]
    assert head["backward_us"] > 0
    backward = sum(e.cpu_time_total for e in events if getattr(e, "scope", 0) == 1)
    attributed = sum(got[p]["backward_us"] for p in parts)
    # AccumulateGrad (no sequence number) is the only backward work left unattributed.
    assert 0.8 * backward <= attributed <= backward + 1e-6
