"""Loss alignment judged against the baseline's own noise band (benchmarks/README.md).

The band is the baseline run against itself with one harmless perturbation (the alignment
scripts reverse the sample order inside every batch: the same samples, another reduction
order). longboat passes when its max and mean per-step loss difference to the baseline are
<= ``FACTOR`` x the band's, and its mean signed difference over the last ``TAIL`` steps shows
no bias: at most ``BIAS`` x its mean absolute difference there (a curve that stays on one side
fails), unless the band itself leans as far (``FACTOR`` x the band's signed mean).
"""

from __future__ import annotations

import statistics
from typing import Any

from bench_env import fmt, md_table

FACTOR = 1.5
TAIL = 100
BIAS = 0.5


def differences(a: list[float], b: list[float], relative: bool) -> list[float]:
    """Signed per-step ``a - b`` (``relative``: over ``|b|``)."""
    return [(x - y) / (abs(y) if relative else 1.0) for x, y in zip(a, b)]


def judge(
    candidate: list[float], reference: list[float], perturbed: list[float], *, relative: bool
) -> dict[str, Any]:
    """The verdict of ``candidate`` against ``reference`` within the band of ``perturbed``."""
    return judge_differences(
        differences(candidate, reference, relative),
        differences(perturbed, reference, relative),
        relative=relative,
    )


def judge_differences(
    d: list[float], signed_band: list[float], *, relative: bool
) -> dict[str, Any]:
    """The verdict of signed per-step differences ``d`` against a band's signed per-step
    differences: also a pair judged against another pair's band (TP=2 vs TP=1 within the band
    of the HF baseline against itself, over the same steps)."""
    band = [abs(x) for x in signed_band]
    tail = min(TAIL, max(1, len(d) // 2))
    out = {
        "max_diff": max(map(abs, d)),
        "mean_diff": statistics.fmean(map(abs, d)),
        "band_max_diff": max(band),
        "band_mean_diff": statistics.fmean(band),
        "tail_steps": tail,
        "tail_mean_signed_diff": statistics.fmean(d[-tail:]),
        "tail_mean_diff": statistics.fmean(map(abs, d[-tail:])),
        "band_tail_mean_signed_diff": statistics.fmean(signed_band[-tail:]),
        "factor": FACTOR,
        "relative": relative,
    }
    out["within_max"] = out["max_diff"] <= FACTOR * out["band_max_diff"]
    out["within_mean"] = out["mean_diff"] <= FACTOR * out["band_mean_diff"]
    lean = max(BIAS * out["tail_mean_diff"], FACTOR * abs(out["band_tail_mean_signed_diff"]))
    out["no_bias"] = abs(out["tail_mean_signed_diff"]) <= lean
    out["passes"] = out["within_max"] and out["within_mean"] and out["no_bias"]
    return out


def table(result: dict[str, Any], name: str = "longboat") -> str:
    v, curves = result["verdict"], {r["name"]: r["losses"] for r in result["runs"]}
    spec = ".3%" if v["relative"] else ".2e"
    header = ["steps", "first loss (ref / longboat)", "last loss (ref / longboat)",
              "max diff (band)", "mean diff (band)", f"signed mean, last {v['tail_steps']}",
              "verdict"]  # fmt: skip
    ref, lb = curves["reference"], curves[name]
    row = [str(len(lb)), f"{ref[0]:.4f} / {lb[0]:.4f}", f"{ref[-1]:.4f} / {lb[-1]:.4f}",
           f"{fmt(v['max_diff'], spec)} ({fmt(v['band_max_diff'], spec)})",
           f"{fmt(v['mean_diff'], spec)} ({fmt(v['band_mean_diff'], spec)})",
           fmt(v["tail_mean_signed_diff"], spec),
           "inside the band" if v["passes"] else "OUTSIDE the band"]  # fmt: skip
    return md_table(header, [row])


def band_row(reference: list[float], perturbed: list[float], relative: bool) -> dict[str, Any]:
    """The band's own numbers: the perturbed reference against the reference (max, mean and
    signed tail mean of their per-step difference)."""
    d = differences(perturbed, reference, relative)
    tail = min(TAIL, max(1, len(d) // 2))
    return {"max_diff": max(map(abs, d)), "mean_diff": statistics.fmean(map(abs, d)),
            "tail_steps": tail, "tail_mean_signed_diff": statistics.fmean(d[-tail:]),
            "relative": relative}  # fmt: skip


def rows_table(result: dict[str, Any], names: list[str]) -> str:
    """One table of the band and of every run in ``names`` against the reference: each run's
    verdict is ``result["rows"][name]["verdict"]``, its keys ``result["rows"][name]["keys"]``;
    the limits (``FACTOR`` x the band's) in brackets."""
    curves = {r["name"]: r["losses"] for r in result["runs"]}
    ref, band = curves["reference"], result["band"]
    spec = ".3%" if band["relative"] else ".2e"
    header = ["run", "keys", "first / last loss", "max diff (limit)", "mean diff (limit)",
              f"signed mean, last {band['tail_steps']}", "verdict"]  # fmt: skip
    pert = curves["reference_perturbed"]
    rows = [["reference", "(the baseline)", f"{ref[0]:.4f} / {ref[-1]:.4f}", "", "", "", ""],
            ["reference, perturbed", "(the band)", f"{pert[0]:.4f} / {pert[-1]:.4f}",
             fmt(band["max_diff"], spec), fmt(band["mean_diff"], spec),
             fmt(band["tail_mean_signed_diff"], spec), "the band"]]  # fmt: skip
    for name in names:
        v, lb = result["rows"][name]["verdict"], curves[name]
        rows.append([name, " ".join(result["rows"][name]["keys"]) or "(the CLI's defaults)",
                     f"{lb[0]:.4f} / {lb[-1]:.4f}",
                     f"{fmt(v['max_diff'], spec)} ({fmt(FACTOR * v['band_max_diff'], spec)})",
                     f"{fmt(v['mean_diff'], spec)} ({fmt(FACTOR * v['band_mean_diff'], spec)})",
                     fmt(v["tail_mean_signed_diff"], spec),
                     "inside the band" if v["passes"] else "OUTSIDE the band"])  # fmt: skip
    return md_table(header, rows)


def rows_plot(result: dict[str, Any], names: list[str], title: str) -> Any:
    """Every curve, and every run's difference to the reference against the band (``FACTOR``
    x the perturbed reference's distance to the reference at each step, shaded)."""

    def draw(plt: Any) -> Any:
        curves = {r["name"]: r["losses"] for r in result["runs"]}
        ref, relative = curves["reference"], result["band"]["relative"]
        pert = differences(curves["reference_perturbed"], ref, relative)
        limit = [FACTOR * abs(d) for d in pert]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for name in ["reference", "reference_perturbed", *names]:
            a1.plot(curves[name], label=name, lw=1, ls="-" if name == "reference" else "--")
        a2.fill_between(range(len(ref)), [-x for x in limit], limit, alpha=0.25,
                        label=f"band x {FACTOR}")  # fmt: skip
        a2.plot(pert, lw=0.8, color="grey", label="reference_perturbed - reference")
        for name in names:
            a2.plot(differences(curves[name], ref, relative), lw=1, label=f"{name} - reference")
        a1.set(xlabel="step", ylabel="loss")
        a2.set(xlabel="step", ylabel="relative difference" if relative else "difference")
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        return fig

    return draw


def plot(result: dict[str, Any], title: str, ylabel: str = "loss") -> Any:
    def draw(plt: Any) -> Any:
        curves = {r["name"]: r["losses"] for r in result["runs"]}
        ref = curves["reference"]
        relative = result["verdict"]["relative"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for name, losses in curves.items():
            a1.plot(losses, label=name, ls="--" if name != "reference" else "-")
            if name != "reference":
                a2.plot(differences(losses, ref, relative), label=f"{name} - reference")
        a1.set(xlabel="step", ylabel=ylabel)
        a2.set(xlabel="step", ylabel="relative difference" if relative else "difference")
        a1.legend()
        a2.legend()
        fig.suptitle(title)
        fig.tight_layout()
        return fig

    return draw


def curve_check(a: list[float], b: list[float], tol: float) -> dict[str, Any]:
    """Per-step relative difference of loss curve ``b`` to ``a``: equal when no step differs by
    more than ``tol`` (and the curves have the same length)."""
    rel = [abs(y - x) / abs(x) for x, y in zip(a, b, strict=False)]
    return {
        "steps": len(rel),
        "max_rel_loss_diff": max(rel),
        "mean_rel_loss_diff": sum(rel) / len(rel),
        "mean_signed_rel_diff": sum((y - x) / abs(x) for x, y in zip(a, b, strict=False))
        / len(rel),
        "tolerance": tol,
        "equal": len(a) == len(b) and max(rel) <= tol,
    }


def curve_check_line(c: dict[str, Any]) -> str:
    """One line saying what :func:`curve_check` found."""
    return (
        f"loss curves over {c['steps']} steps: max |rel diff| {c['max_rel_loss_diff']:.2e}, "
        f"mean {c['mean_rel_loss_diff']:.2e}, mean signed {c['mean_signed_rel_diff']:.2e}: "
        f"{'equal' if c['equal'] else 'NOT equal'} within {c['tolerance']:g}"
    )
