"""What the suite writes (benchmarks/scripts/suite.py): every figure as JSON, its page and its plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_ORDER = ("default", "workers=cpus", "rule-of-thumb", "over-provisioned", "tuned")

LOG_SCALE_RATIO = 50.0
"""A workload's bars use a log scale when its fastest configuration is this many times its slowest."""


def _fmt_ratio(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _config_names(result: dict[str, Any]) -> list[str]:
    names = [n for n in CONFIG_ORDER if n in result["configs"]]
    return names + [n for n in result["configs"] if n not in names]


def write_json(data: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def workload_table(result: dict[str, Any]) -> list[str]:
    head = result["headline"]
    lines = [
        f"### {result['name']}",
        "",
        f"{result['description']}; batch size {result['batch_size']}. Space: {result['space']['size']}"
        f" points (workers 0..{result['space']['max_workers']}, prefetch"
        f" {result['space']['prefetch_factors']}, torch threads {result['space']['torch_threads']},"
        f" pre-transforms {result['space']['pretransforms']}); window {result['window_s']:.2f} s.",
        "",
        "| config | settings | median samples/s | spread (min-max) | epoch score | ratio to default |",
        "|---|---|---:|---|---:|---:|",
    ]
    for name in _config_names(result):
        c = result["configs"][name]
        mark = " (oracle)" if name == head["oracle"] else ""
        failed = f", {len(c['failures'])} failed" if c["failures"] else ""
        lines.append(
            f"| {name}{mark} | `{c['label']}` | {c['median_samples_per_s']:.0f} |"
            f" {c['spread']:.0%} ({c['min_samples_per_s']:.0f}-{c['max_samples_per_s']:.0f}{failed}) |"
            f" {c['median_score']:.0f} | {_fmt_ratio(c['ratio_to_default'])} |"
        )
    t = result["tuning"]
    found = t.get("winner_found_s")
    lines += [
        "",
        f"Tuning: {t['tuning_s']:.1f} s, {t['measured']} distinct candidates measured, chose"
        f" `{t['label']}` (it reported {t['reported_samples_per_s']:.0f} samples/s,"
        f" {_fmt_ratio(t['reported_speedup'])}x its own baseline"
        + (f"; first measured {found:.1f} s into the search" if found is not None else "")
        + f"). Grid: {result['grid']['size']} points in {result['grid']['total_s']:.1f} s.",
        "",
    ]
    return lines


def _default_score_ratio(result: dict[str, Any]) -> float | None:
    h = result["headline"]
    if "tuned_over_default_score" in h:
        return h["tuned_over_default_score"]
    base = result["configs"]["default"]["median_score"]  # results written before the key existed
    return result["configs"]["tuned"]["median_score"] / base if base > 0 else None


def headline_table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| workload | tuned/oracle | tuned/oracle (epoch score) | tuned/default |"
        " tuned/default (epoch score) | tuned/best heuristic | tuning time/grid time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        h = r["headline"]
        lines.append(
            f"| {r['name']} | {_fmt_ratio(h['tuned_over_oracle'])} |"
            f" {_fmt_ratio(h['tuned_over_oracle_score'])} | {_fmt_ratio(h['tuned_over_default'])} |"
            f" {_fmt_ratio(_default_score_ratio(r))} |"
            f" {_fmt_ratio(h['tuned_over_best_heuristic'])} ({h['best_heuristic']}) |"
            f" {_fmt_ratio(h['tuning_over_grid_time'])} |"
        )
    return lines


def target_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| workload | target | value | met |", "|---|---|---:|---|"]
    for r in results:
        for label, t in r["targets"].items():
            lines.append(f"| {r['name']} | {label} | {_fmt_ratio(t['value'])} |"
                         f" {'yes' if t['met'] else '**no**'} |")
    return lines


def _tuning_breakdown(tu: dict[str, Any]) -> str:
    """Where the tuning time went: finding the winner, confirming convergence, the final rounds."""
    found = tu.get("winner_found_s")
    if "search_s" not in tu:
        return "This run did not record where the tuning time went"
    if found is None:
        return f"Its winner was first measured in the final rounds, which took {tu['final_s']:.0f} s"
    n = tu["tried_after_winner"]
    return (f"Its winner was first measured {found:.0f} s in; the search tried {n} more"
            f" candidate{'s' * (n != 1)} ({tu['search_s'] - found:.0f} s) before it stopped (converged, the"
            " space explored, or its share of the budget spent), and the finalists'"
            f" side-by-side re-measurement took {tu['final_s']:.0f} s")


def misses(results: list[dict[str, Any]]) -> list[str]:
    """One sentence per missed target, with what the figures say about the cause."""
    out: list[str] = []
    for r in results:
        h, cfg = r["headline"], r["configs"]
        tuned = cfg["tuned"]
        for label, t in r["targets"].items():
            if t["met"]:
                continue
            value = t["value"]
            if value is None:
                out.append(f"- {r['name']}, {label}: no value (a configuration never completed).")
                continue
            gap = f"{value:.2f} against {t['bound']:g}"
            if t["key"] == "tuning_over_grid_time":
                tu = r["tuning"]
                why = (f"the tuner took {tu['tuning_s']:.0f} s while the grid of {r['grid']['size']}"
                       f" points took {r['grid']['total_s']:.0f} s. {_tuning_breakdown(tu)}; over a"
                       " space this small, the warm starts, the convergence check and honest"
                       " re-measurement cost more than a 15 % share")
            elif t["key"] in ("tuned_over_oracle", "tuned_over_best_heuristic", "tuned_over_default"):
                other = {"tuned_over_oracle": h["oracle"], "tuned_over_best_heuristic": h["best_heuristic"],
                         "tuned_over_default": "default"}[t["key"]]
                o = cfg[other]
                overlap = tuned["max_samples_per_s"] >= o["min_samples_per_s"]
                noise = ("the two ranges overlap across rounds (spreads"
                         f" {tuned['spread']:.0%} and {o['spread']:.0%}), so noise is a large part of it"
                         if overlap else "the ranges do not overlap, so it is not noise alone")
                if t["key"] == "tuned_over_oracle":
                    tried = ("the tuner measured that configuration and ranked it lower"
                             if r["tuning"]["tried_oracle"]
                             else "the tuner never measured that configuration")
                    noise = f"{noise}; {tried}"
                if tuned["median_score"] >= o["median_score"] > 0:
                    noise += (f"; by the epoch-aware score the tuner maximises, tuned is ahead"
                              f" ({tuned['median_score']:.0f} vs {o['median_score']:.0f})")
                why = f"tuned `{tuned['label']}` vs {other} `{o['label']}`: {noise}"
            else:
                why = "see the table above"
            out.append(f"- {r['name']}, {label}: {gap}; {why}.")
    return out


def write_markdown(data: dict[str, Any], path: Path) -> Path:
    meta = data["meta"]
    results = list(data["workloads"].values())
    machine = meta["machine"]
    lines = [
        "# Benchmark results",
        "",
        f"Run on {meta['date']} with `{meta['command']}`"
        + (" (**quick mode**: a smoke run; the figures mean nothing)." if meta["quick"] else "."),
        "",
        f"Machine: {machine['usable_cpus']} usable CPUs ({machine['logical_cpus']} logical,"
        f" {machine['physical_cores']} physical) of a {machine['cpu_model']},"
        f" {machine['ram_total_bytes'] / 2**30:.1f} GiB RAM, accelerator {machine['accelerator']}"
        f" ({machine['accelerator_name'] or 'none'}), torch {machine['torch_version']}, torchvision"
        f" {machine['torchvision_version']}, Python {machine['python_version']}, {machine['os']}."
        f" Load average at the start: {meta['load_average']}.",
        "",
        f"Budget {meta['budget_s']:g} s per tuning; {meta['rounds']} interleaved rounds; the grid's"
        f" top {meta['top_k']} by epoch score (plus its fastest per sample) re-measured as oracle"
        f" candidates; device {meta['device']}; total run time {meta['total_s'] / 60:.1f} min."
        " Every figure is `autotune.measure.measure` under the tuner's own limits; samples/s are"
        " medians over the rounds, the spread is (max - min) / median. The epoch score is the"
        f" tuner's objective: throughput over {meta['epochs']} epochs with start-up and cache builds"
        " included. See NOTE [ Benchmark protocol ] in `benchmarks/scripts/suite.py`.",
        "",
        "The other benchmarks, each measured side by side in its own run, and the page each writes under"
        " `benchmarks/results/`: `docs/benchmarks.md`.",
        "",
        "## Headline",
        "",
        *headline_table(results),
        "",
        "## Targets",
        "",
        *target_lines(results),
        "",
        "## What missed, and why",
        "",
        *(misses(results) or ["Every target was met in this run."]),
        "",
        "## Per workload",
        "",
    ]
    for r in results:
        lines += workload_table(r)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_plot(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = list(data["workloads"].values())
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        names = _config_names(r)
        meds = [r["configs"][n]["median_samples_per_s"] for n in names]
        lo = [m - r["configs"][n]["min_samples_per_s"] for n, m in zip(names, meds, strict=True)]
        hi = [r["configs"][n]["max_samples_per_s"] - m for n, m in zip(names, meds, strict=True)]
        colours = ["tab:green" if n == "tuned" else "tab:purple" if n.startswith("grid")
                   else "tab:grey" for n in names]
        ax.barh(names, meds, xerr=[lo, hi], color=colours, capsize=3)
        ax.invert_yaxis()
        positive = [m for m in meds if m > 0]
        log_scale = bool(positive) and max(positive) > LOG_SCALE_RATIO * min(positive)
        if log_scale:
            ax.set_xscale("log")
        ax.set_title(r["name"], fontsize=10)
        ax.set_xlabel("samples/s (median, bars: min-max over rounds" + (", log scale)" if log_scale else ")"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
