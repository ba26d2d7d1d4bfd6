"""Where a training step's time goes: a torch.profiler window summarised for a person.

A ``ProfileWindow`` (a baseline's loop: ``profile_steps``; a longboat run: ``ProfileCallback``)
writes the usual op table (self device time, or CPU time without a GPU) and a per-step summary:
wall time, device busy time (the union of kernel intervals: overlapping streams count once), the
idle share (wall minus busy: launch overhead and syncs), and device time by kernel category
(GEMM, attention, Triton, optimizer, copies and casts, other elementwise / reductions,
communication). The categories come from kernel names: a reading aid, not an exact accounting.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("communication", re.compile(r"nccl|allreduce|all_gather|reduce_scatter", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|cublas|sm90_xmma|wgmma|_mm_|matmul|splitk", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach", re.I)),
    ("copy/cast", re.compile(r"copy|cast|convert|memcpy|to_copy|catarray|cat_", re.I)),
    ("memset", re.compile(r"memset|fill", re.I)),
    ("reduction", re.compile(r"reduce|sum|norm|softmax|max|mean", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
)


def categorize(kernel_name: str) -> str:
    """A kernel's category by name; other ``triton*`` / ``*_kernel`` names are "triton"."""
    for cat, pat in CATEGORIES:
        if pat.search(kernel_name):
            return cat
    if kernel_name.startswith("triton") or kernel_name.endswith("_kernel"):
        return "triton"
    return "other"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(kernels: list[tuple[str, float, float]], steps: int, wall_s: float) -> dict[str, Any]:
    """``kernels``: (name, start_us, duration_us) of every device kernel in the window."""
    by_cat: dict[str, float] = {}
    for name, _, dur in kernels:
        cat = categorize(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + dur
    busy_us = _union_length([(s, s + d) for _, s, d in kernels])
    per_step_ms = {k: v / 1e3 / steps for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    wall_ms = wall_s * 1e3 / steps
    busy_ms = busy_us / 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "device_busy_ms_per_step": busy_ms,
        "device_idle_fraction": max(0.0, 1.0 - busy_ms / wall_ms) if wall_ms > 0 else 0.0,
        "kernels_per_step": len(kernels) / steps,
        "device_ms_per_step_by_category": per_step_ms,
    }


def idle_gaps(
    kernels: list[tuple[str, float, float]],
    host: list[tuple[str, float, float]],
    min_us: float = 200.0,
) -> dict[str, float]:
    """Device-idle gaps of at least ``min_us`` between kernels, attributed to the host: for
    each host event (name, start_us, duration_us) the microseconds of gaps it overlaps (nested
    events each count theirs: a reading aid for where the host was while the device waited)."""
    spans, end = [], None
    for _, a, d in sorted(kernels, key=lambda k: k[1]):
        if end is not None and a - end >= min_us:
            spans.append((end, a))
        end = a + d if end is None else max(end, a + d)
    out: dict[str, float] = {}
    for name, a, d in host:
        b = a + d
        for g0, g1 in spans:
            overlap = min(b, g1) - max(a, g0)
            if overlap > 0:
                out[name] = out.get(name, 0.0) + overlap
    out["(all gaps)"] = sum(g1 - g0 for g0, g1 in spans)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summary_text(s: dict[str, Any]) -> str:
    lines = [
        f"per step over {s['steps']} profiled steps: wall {s['wall_ms_per_step']:.1f} ms, "
        f"device busy {s['device_busy_ms_per_step']:.1f} ms "
        f"(idle {s['device_idle_fraction']:.0%}), {s['kernels_per_step']:.0f} kernels",
        "| category | device ms/step | share of busy |",
        "|---|---|---|",
    ]
    busy = max(s["device_busy_ms_per_step"], 1e-9)
    for cat, ms in s["device_ms_per_step_by_category"].items():
        lines.append(f"| {cat} | {ms:.2f} | {ms / busy:.0%} |")
    parts = s.get("parts_ms_per_step")
    if parts is not None:
        lines += ["", "model parts (record_function ranges; forward + the backward of its ops):",
                  "| part | device fwd ms/step | device bwd ms/step | share of device busy | "
                  "host fwd + bwd ms/step |", "|---|---|---|---|---|"]  # fmt: skip
        for name, t in parts.items():
            both = t["device_forward"] + t["device_backward"]
            lines.append(f"| {name} | {t['device_forward']:.2f} | {t['device_backward']:.2f} | "
                         f"{both / busy:.0%} | {t['host_forward'] + t['host_backward']:.2f} |")  # fmt: skip
        if not parts:
            lines.append("| none attributed (a replayed CUDA graph runs no op) | | | | |")
    syncs = s.get("host_syncs_per_step_by_caller")
    if syncs is not None:
        lines += ["", "host syncs (torch.cuda sync debug mode) by the innermost longboat / bench "
                  "frame:", "| caller | syncs/step |", "|---|---|"]  # fmt: skip
        lines += [f"| {where} | {n:.2f} |" for where, n in syncs.items()] or ["| none | 0 |"]
    gaps = s.get("idle_gap_ms_per_step_by_host_event")
    if gaps:
        lines += ["", "device-idle gaps (>= 0.2 ms) by the host event overlapping them:",
                  "| host event | gap ms/step |", "|---|---|"]  # fmt: skip
        lines += [f"| {name[:70]} | {ms:.2f} |" for name, ms in list(gaps.items())[:15]]
    return "\n".join(lines)


def part_times(events: list[Any], parts: tuple[str, ...], device: bool) -> dict[str, Any]:
    """Forward and backward time (us) of the ops under each ``record_function`` range named in
    ``parts``: the forward is the range's own total (its ops and kernels); the backward, every
    autograd backward function whose forward op ran inside the range (matched by autograd's
    sequence number and thread, as torch.profiler links them). ``device``: kernel time (eager
    steps: replayed graphs attribute no kernel to an op), else host time."""

    def total(ev: Any) -> float:
        return float(ev.device_time_total if device else ev.cpu_time_total)

    out: dict[str, Any] = {}
    owner: dict[tuple[int, int], str] = {}
    for ev in events:
        if ev.name in parts and not _inside_named(ev.cpu_parent, parts):
            entry = out.setdefault(ev.name, {"forward_us": 0.0, "backward_us": 0.0, "calls": 0})
            entry["forward_us"] += total(ev)
            entry["calls"] += 1
            stack = list(ev.cpu_children)
            while stack:
                child = stack.pop()
                if child.sequence_nr >= 0:
                    owner[(child.sequence_nr, child.thread)] = ev.name
                stack.extend(child.cpu_children)
    for ev in events:
        if getattr(ev, "scope", 0) == 1 and ev.sequence_nr >= 0:  # a backward function
            name = owner.get((ev.sequence_nr, ev.fwd_thread))
            if name is not None:
                out[name]["backward_us"] += total(ev)
    return out


def _inside_named(ev: Any, parts: tuple[str, ...]) -> bool:
    while ev is not None:
        if ev.name in parts:
            return True
        ev = ev.cpu_parent
    return False


class SyncAudit:
    """Counts host synchronisations (``torch.cuda.set_sync_debug_mode("warn")``) between
    ``start()`` and ``stop()`` by the innermost longboat or benchmark frame that caused them
    (CUDA only; elsewhere ``stop()`` returns {})."""

    def __init__(self, acc: Any) -> None:
        self.acc = acc
        self.counts: dict[str, int] = {}
        self._saved: Any = None

    def start(self) -> None:
        import warnings

        import torch

        if self.acc.device_type != "cuda":
            return
        self._saved = (warnings.showwarning, torch.cuda.get_sync_debug_mode(), warnings.filters[:])
        warnings.simplefilter("always", UserWarning)

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchronizing" not in str(message):
                return self._saved[0](message, category, *args, **kwargs)
            import traceback

            frames = [f for f in traceback.extract_stack()[:-2]
                      if "longboat" in f.filename or "/bench/" in f.filename]  # fmt: skip
            where = (f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}"
                     if frames else "elsewhere")  # fmt: skip
            self.counts[where] = self.counts.get(where, 0) + 1

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> dict[str, int]:
        import warnings

        import torch

        if self._saved is None:
            return {}
        torch.cuda.set_sync_debug_mode(self._saved[1])
        warnings.showwarning = self._saved[0]
        warnings.filters[:] = self._saved[2]
        self._saved = None
        return dict(sorted(self.counts.items(), key=lambda kv: -kv[1]))


class ProfileWindow:
    """torch.profiler over a window of steps: ``start()``, the steps, ``stop(steps)`` writes
    the op table and the per-step summary to ``out`` and returns the summary."""

    def __init__(
        self, acc: Any, out: Path, title: str = "", row_limit: int = 70, parts: tuple[str, ...] = ()
    ) -> None:
        self.acc, self.out, self.title, self.row_limit = acc, out, title, row_limit
        self.parts = parts
        """``record_function`` range names whose forward + backward time is reported."""

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.acc.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.acc.synchronize()
        self.syncs = SyncAudit(self.acc)
        self.syncs.start()
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self, steps: int) -> dict[str, Any] | None:
        syncs = self.syncs.stop()  # before the window's own synchronize
        self.acc.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        kernels, host = [], []
        events = [ev for ev in self.prof.events() if ev.time_range.elapsed_us() > 0]
        # Annotations ("ProfilerStep#3", "Optimizer.step#AdamW.step", record_function ranges)
        # also show up as device ranges and would count their kernels twice. (Kernel names
        # themselves may hold "#": "{lambda(float)#1}".)
        notes = {ev.name for ev in events if getattr(ev, "is_user_annotation", False)}
        for ev in events:
            dev = getattr(ev, "device_type", None)
            start, dur = float(ev.time_range.start), float(ev.time_range.elapsed_us())
            if (ev.name in notes or ev.name.startswith(("ProfilerStep#", "Optimizer.", "longboat:"))
                    or getattr(ev, "is_user_annotation", False)):  # fmt: skip
                if dev is None or "CUDA" not in str(dev):
                    host.append((ev.name, start, dur))
            elif dev is not None and "CUDA" in str(dev):
                kernels.append((ev.name, start, dur))
            else:
                host.append((ev.name, start, dur))
        summary = summarize(kernels, steps, wall) if kernels else None
        if summary and self.parts:
            dev = part_times(events, self.parts, device=True)
            host = part_times(events, self.parts, device=False)
            summary["parts_ms_per_step"] = {
                name: {
                    "device_forward": dev[name]["forward_us"] / 1e3 / steps,
                    "device_backward": dev[name]["backward_us"] / 1e3 / steps,
                    "host_forward": host[name]["forward_us"] / 1e3 / steps,
                    "host_backward": host[name]["backward_us"] / 1e3 / steps,
                }
                for name in dev
            }
        if summary:
            summary["host_syncs_per_step_by_caller"] = {k: v / steps for k, v in syncs.items()}
            gaps = idle_gaps(kernels, host)
            summary["idle_gap_ms_per_step_by_host_event"] = {
                k: v / 1e3 / steps for k, v in gaps.items()
            }
        key = "self_cuda_time_total" if self.acc.device_type == "cuda" else "self_cpu_time_total"
        averages = self.prof.key_averages()
        table = averages.table(sort_by=key, row_limit=self.row_limit, max_name_column_width=70)
        if self.acc.device_type == "cuda":  # which ops launched the kernels (eager steps)
            table += "\n\nsorted by cuda_time_total (an op's kernels and its children's)\n"
            table += averages.table(
                sort_by="cuda_time_total", row_limit=40, max_name_column_width=70
            )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        body = (summary_text(summary) + "\n\n") if summary else ""
        self.out.write_text(
            f"{self.title}\n{steps} profiled steps (profiler overhead included in wall)\n"
            f"{body}sorted by {key}\n{table}"
        )
        print(f"  profile: {self.out}", flush=True)
        if summary:
            print(summary_text(summary), flush=True)
        return summary


def profile_steps(
    acc: Any, run_step: Callable[[int], Any], steps: int, out: Path | None, *, title: str = ""
) -> dict[str, Any] | None:
    """Run ``run_step(i)`` for ``steps`` steps in a ``ProfileWindow`` (None when skipped)."""
    if steps <= 0 or out is None:
        return None
    window = ProfileWindow(acc, out, title)
    window.start()
    for i in range(steps):
        run_step(i)
    return window.stop(steps)


class ProfileCallback:
    """A ``Trainer`` callback profiling steps ``first + 1 .. first + steps`` into ``summary``."""

    exact = False

    def __init__(
        self, acc: Any, first: int, steps: int, out: Path, title: str = "",
        parts: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.first, self.steps = first, steps
        self.window = ProfileWindow(acc, out, title, parts=parts)
        self.summary: dict[str, Any] | None = None

    def on_step_end(self, trainer: Any, step: int, out: Any) -> None:
        if step == self.first:
            self.window.start()
        elif step == self.first + self.steps:
            self.summary = self.window.stop(self.steps)
