"""One table of every stack's loss alignment: the newest GPU result of each row.

    python3 tools/bench/alignment_table.py [--results-dir benchmarks/results] [--date YYYY-MM-DD]

Reads the ``*_loss_alignment*.json`` results the alignment scripts write (llm, vlm,
diffusion, vla; each judged by ``bench_align`` against its reference's own noise band) and
writes ``alignment_<date>.md`` with one row per model (LLM 886M, LLM Qwen3-1.7B, LLM
Moonlight 4-layer (from a ``--variants`` result too: its ``longboat`` row), VLM
Qwen2.5-VL-3B, diffusion Wan 1.3B, GR00T-N1.6, pi0.5): the band, max / mean / signed tail
differences, the verdict, the GPU, date and commit of the run, the result file. A model
with no GPU result is listed as not measured. One PNG per measured row,
``alignment_<date>_<row>.png``: both curves with the band (the perturbed reference's distance
to the reference, times the pass factor) shaded around the reference, and the difference.
CPU (``--tiny``) results are not rows: their shapes are not the models'.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import bench_align
from bench_env import fmt, md_table

ROWS = {
    "llm_886m": "LLM, Llama 886M",
    "llm_qwen3_1_7b": "LLM, Qwen3-1.7B",
    "llm_moonlight_4l": "LLM, Moonlight-16B-A3B cut to 4 layers",
    "vlm_qwen2_5_vl_3b": "VLM, Qwen2.5-VL-3B",
    "diffusion_wan_t2v_1_3b": "diffusion, Wan2.1 T2V 1.3B",
    "vla_groot_n1_6": "GR00T-N1.6",
    "vla_pi05": "pi0.5",
}
"""The rows of the table, in order: key -> label."""


def row_key(result: dict[str, Any], stem: str) -> str:
    """Which model a result measures: ``<stack>_<model or shape>``."""
    stack = result["benchmark"].removesuffix("_loss_alignment")
    config = result.get("config", {})
    if stack == "llm":  # llm_loss_alignment_[<shape>_]<date>[_<tag>]
        shape = re.split(r"_?\d{4}-\d{2}-\d{2}", stem.removeprefix("llm_loss_alignment_"))[0]
        return "llm_" + (shape or "886m")
    model = config.get("model") or config.get("family") or "unknown"
    if isinstance(model, dict):
        model = model.get("name", "unknown")
    return f"{stack}_{model}"


def newest(results_dir: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Per row key, the newest judged GPU result (date, then file name)."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(results_dir.glob("*_loss_alignment*.json")):
        result = json.loads(path.read_text())
        if "verdict" not in result or result.get("gpu", "cpu") == "cpu" or "runs" not in result:
            continue
        key = row_key(result, path.stem)
        have = found.get(key)
        if have is None or (result["date"], path.name) > (have[1]["date"], have[0].name):
            found[key] = (path, result)
    return found


def table(found: dict[str, tuple[Path, dict[str, Any]]]) -> str:
    header = ["model", "band max", "max diff", "band mean", "mean diff",
              "signed tail mean (band's)", "verdict", "run", "result"]  # fmt: skip
    rows = []
    for key in dict.fromkeys([*ROWS, *sorted(found)]):
        label = ROWS.get(key, key)
        if key not in found:
            rows.append([label, "-", "-", "-", "-", "-", "not measured on a GPU", "-", "-"])
            continue
        path, r = found[key]
        v = r["verdict"]
        spec = ".3%" if v["relative"] else ".2e"
        passes = "inside the band" if v["passes"] else "OUTSIDE the band"
        rows.append([
            label,
            fmt(v["band_max_diff"], spec), fmt(v["max_diff"], spec),
            fmt(v["band_mean_diff"], spec), fmt(v["mean_diff"], spec),
            f"{fmt(v['tail_mean_signed_diff'], spec)} ({fmt(v['band_tail_mean_signed_diff'], spec)})",
            passes, f"{r['date']}, {r['gpu']}, {str(r['commit']).split()[0]}",
            f"[{path.name}]({path.stem}.md)",
        ])  # fmt: skip
    return md_table(header, rows)


def band_plot(result: dict[str, Any], title: str) -> Any:
    """Both curves, the reference's band shaded (factor x |perturbed - reference| per step),
    and longboat's difference to the reference against that band."""

    def draw(plt: Any) -> Any:
        curves = {r["name"]: r["losses"] for r in result["runs"]}
        ref, pert, lb = curves["reference"], curves["reference_perturbed"], curves["longboat"]
        relative = result["verdict"]["relative"]
        band = [bench_align.FACTOR * abs(d) for d in bench_align.differences(pert, ref, relative)]
        scale = [abs(y) if relative else 1.0 for y in ref]
        steps = range(len(ref))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        lo = [y - b * s for y, b, s in zip(ref, band, scale)]
        hi = [y + b * s for y, b, s in zip(ref, band, scale)]
        a1.fill_between(steps, lo, hi, alpha=0.3, label="reference band")
        a1.plot(ref, label="reference", lw=1)
        a1.plot(lb, label="longboat", ls="--", lw=1)
        a1.set(xlabel="step", ylabel="loss")
        a1.legend()
        a2.fill_between(steps, [-b for b in band], band, alpha=0.3, label="band")
        a2.plot(bench_align.differences(lb, ref, relative), lw=1, label="longboat - reference")
        a2.set(xlabel="step", ylabel="relative difference" if relative else "difference")
        a2.legend()
        fig.suptitle(title)
        fig.tight_layout()
        return fig

    return draw


def write(results_dir: Path, date: str) -> Path:
    """Write the table (and one PNG per measured row) into ``results_dir``; returns the md."""
    from bench_env import pyplot

    found = newest(results_dir)
    plt = pyplot()
    out = results_dir / f"alignment_{date}.md"
    lines = [
        f"# Loss alignment, all stacks ({date})",
        "",
        "Each row is the newest GPU run of its model: longboat (the CLI's defaults) against the "
        "reference loop with the run's optimizer, judged against the reference's own band (the "
        "reference with one harmless perturbation). Inside: max and mean difference at most "
        f"{bench_align.FACTOR}x the band's, and no lean over the last {bench_align.TAIL} steps. "
        "Percentages are relative to the reference's loss.",
        "",
        table(found),
        "",
    ]
    for key in (k for k in dict.fromkeys([*ROWS, *sorted(found)]) if k in found):
        if plt is None:
            break
        r, png = found[key][1], f"alignment_{date}_{key}.png"
        fig = band_plot(r, f"{ROWS.get(key, key)}: {r['date']}, {r['gpu']}")(plt)
        fig.savefig(results_dir / png, dpi=110)
        plt.close(fig)
        lines.append(f"![{ROWS.get(key, key)}]({png})")
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--date", default=dt.date.today().isoformat())
    args = p.parse_args(argv)
    if not args.results_dir.is_dir():
        p.error(f"--results-dir {args.results_dir}: no such folder")
    out = write(args.results_dir, args.date)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
