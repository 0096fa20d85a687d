"""PNG plots of the benchmarks' results (matplotlib, no display needed)."""

from __future__ import annotations

import os
from typing import Dict, List

MIB = 2**20
COLORS = {"genoa": "#d62728", "flow": "#1f77b4", "reference": "#2ca02c", "accelerate": "#7f7f7f",
          "resident": "#9467bd"}
PLOT_HINT = 'the plots need matplotlib: pip install "torchTensorRef[bench]"'


def _save(plt, fig, path: str, rect=None) -> str:
    """Lay out (within ``rect``, when given), write and close ``fig``; returns ``path``."""
    fig.tight_layout(**({"rect": rect} if rect else {}))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def transfer(result: dict, path: str) -> str:
    """Bytes moved per strategy and budget beside the reference and accelerate, one panel per workload."""
    plt = _pyplot()
    rows = result["rows"]
    panels = sorted({(r["model"], r["workload"]) for r in rows}, key=lambda k: (k[0], k[1] != "train"))
    cols = min(len(panels), 2)
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.3 * nrows + 0.6), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (model, workload) in zip(axes.flat, panels):
        entries = [s for s in result["summary"] if (s["model"], s["workload"]) == (model, workload)]
        entries.sort(key=lambda s: s["budget_fraction"])
        xs = range(len(entries))
        width = 0.27
        for i, (key, label) in enumerate((("genoa", "Genoa"), ("flow", "Flow"), ("reference", "offline reference"))):
            values = [(s.get(key) or 0) / MIB for s in entries]
            ax.bar([x + (i - 1) * width for x in xs], values, width, label=label, color=COLORS[key])
        acc = next((s.get("accelerate") for s in entries if s.get("accelerate") is not None), None)
        forward_only = bool(entries and entries[0].get("accelerate_forward_only"))
        if acc is not None:
            ax.axhline(acc / MIB, color=COLORS["accelerate"], linestyle="--", label="accelerate cpu_offload")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{s['budget_fraction']:.0%}" for s in entries])
        ax.set_xlabel("budget (of parameter bytes)", fontsize=8)
        ax.set_ylabel("MiB moved per " + ("step" if workload == "train" else "call"), fontsize=8)
        title = f"{model}: {'AdamW training step' if workload == 'train' else 'generate()'}"
        if forward_only and acc is not None:
            title += "\n(accelerate: its forward copies only; it does not train)"
        ax.set_title(title, fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Bytes moved between host and accelerator on 'sim' (torch {result.get('torch', '?')})",
                 fontsize=10)
    return _save(plt, fig, path, rect=(0, 0.06, 1, 1))


def overhead(result: dict, path: str) -> str:
    """Median forward time relative to plain torch: pass-through and ``"sim"`` with everything resident."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    names = ["plain", "pass-through", "sim"]
    values = [1.0, result["ratio_pass_through"], result["ratio_sim"]]
    colors = [COLORS["resident"], COLORS["flow"], COLORS["reference"]]
    if "ratio_minimal_subclass" in result:  # the floor of any Python tensor subclass
        names.insert(1, "minimal\nsubclass")
        values.insert(1, result["ratio_minimal_subclass"])
        colors.insert(1, COLORS["genoa"])
    ax.bar(names, values, color=colors)
    for x, v in enumerate(values):
        ax.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.05, color="gray", linestyle=":", label="target pass-through 1.05")
    ax.axhline(1.10, color="gray", linestyle="--", label="target sim 1.10")
    ax.set_ylim(0, max(values + [1.1]) * 1.2)
    ax.set_ylabel("median time / plain torch")
    ax.set_title(f"GPT-2 forward ({result['layers']}x{result['width']}, seq {result['seq']}, "
                 f"{result['ops_per_forward']} ops)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return _save(plt, fig, path)


def flow_vs_reference(result: dict, path: str) -> str:
    """Flow and Genoa against the offline reference, per budget (training step)."""
    plt = _pyplot()
    rows = result["rows"]
    fractions = sorted({r["budget_fraction"] for r in rows})
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    width = 0.27
    series: Dict[str, List[float]] = {"genoa": [], "flow": [], "reference": []}
    for f in fractions:
        flow = next(r for r in rows if r["strategy"] == "flow" and r["budget_fraction"] == f)
        genoa = next(r for r in rows if r["strategy"] == "genoa" and r["budget_fraction"] == f)
        series["genoa"].append((genoa["bytes_to_device"] + genoa["bytes_to_host"]) / MIB)
        series["flow"].append((flow["bytes_to_device"] + flow["bytes_to_host"]) / MIB)
        series["reference"].append((flow["reference_to_device"] + flow["reference_to_host"]) / MIB)
    for i, key in enumerate(("genoa", "flow", "reference")):
        ax.bar([x + (i - 1) * width for x in range(len(fractions))], series[key], width, label=key,
               color=COLORS[key])
    ax.set_xticks(range(len(fractions)))
    ax.set_xticklabels([f"{f:.0%}" for f in fractions])
    ax.set_xlabel("budget (of parameter bytes)")
    ax.set_ylabel("MiB moved per training step")
    ax.set_title(f"GPT-2 ({result.get('layers', '?')} layers) AdamW step on 'sim'", fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def gpu_throughput(result: dict, path: str) -> str:
    """Tokens/s and training step time per configuration, with the bound."""
    plt = _pyplot()
    rows = result["rows"]
    labels = [r["config"] if r["config"] in ("resident", "accelerate")
              else f"{r['config']}\nno budget" if r["budget_fraction"] is None
              else f"{r['config']}\n{r['budget_fraction']:.0%}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = [COLORS.get(r["config"], "#333333") for r in rows]
    ax1.bar(range(len(rows)), [r.get("generate", {}).get("tokens_per_s", 0) for r in rows], color=colors)
    ax1.set_ylabel("generate() tokens/s")
    ax2.bar(range(len(rows)), [r.get("train", {}).get("seconds", 0) for r in rows], color=colors)
    bounds = [r.get("train", {}).get("bound_seconds") for r in rows]
    ax2.scatter([i for i, b in enumerate(bounds) if b], [b for b in bounds if b], marker="_", s=300,
                color="black", label="bound max(compute, bytes / bandwidth)")
    ax2.set_ylabel("training step (s)")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7)
    from benchmarks.common import parameters_text

    fig.suptitle(f"{result['model']}, {parameters_text(result['parameters'])} parameters, on "
                 f"{result.get('gpu', result['device'])}",
                 fontsize=10)
    return _save(plt, fig, path)


def small_ops(result: dict, path: str) -> str:
    """Time relative to plain torch per row, one panel per work; the minimal subclass (floor) marked."""
    plt = _pyplot()
    works = result["works"]
    fig, axes = plt.subplots(1, len(works), figsize=(4.6 * len(works), 3.9), squeeze=False)
    top = max([r["ratio"] for w in works for r in w["rows"] if r["fits"]] + [1.1])
    for ax, work in zip(axes.flat, works):
        rows = work["rows"]
        ys = range(len(rows))
        for y, r in zip(ys, rows):
            if not r["fits"]:
                ax.text(1, y, " does not fit", va="center", fontsize=7, color="gray")
                continue
            floor = r["device"] is None and r["row"] != "plain"
            color = (COLORS["reference"] if floor else COLORS["resident"] if r["device"] is None
                     else COLORS.get(r["strategy"]) if r["budget_fraction"] is not None else COLORS["accelerate"])
            ax.barh(y, r["ratio"], color=color, hatch="//" if floor else None, edgecolor="white")
            ax.text(r["ratio"], y, f" {r['ratio']:.2f}", va="center", fontsize=7)
            if floor:  # the least any Python tensor subclass costs on this work
                ax.axvline(r["ratio"], color=COLORS["reference"], linestyle=":", linewidth=1)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([r["row"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(0.8, top * 1.6)
        ax.set_xlabel("median time / plain torch (log)", fontsize=8)
        ax.set_title(f"{work['work']} ({work['rows'][0]['ops']} ops/run plain)", fontsize=9)
    from matplotlib.patches import Patch
    from matplotlib.ticker import ScalarFormatter

    for ax in axes.flat:
        ax.xaxis.set_major_formatter(ScalarFormatter())
    legend = [Patch(color=COLORS["resident"], label="plain"),
              Patch(facecolor=COLORS["reference"], hatch="//", edgecolor="white", label="minimal subclass (floor)"),
              Patch(color=COLORS["accelerate"], label="no budget"), Patch(color=COLORS["flow"], label="Flow"),
              Patch(color=COLORS["genoa"], label="Genoa")]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.suptitle(f"Small ops, 1 thread: {result['size']} models, torch {result.get('torch', '?')}", fontsize=10)
    return _save(plt, fig, path, rect=(0, 0.06, 1, 1))


PLOTS = {"transfer": transfer, "overhead": overhead, "flow_vs_reference": flow_vs_reference,
         "gpu_throughput": gpu_throughput, "small_ops": small_ops}


def plot(name: str, result: dict, folder: str) -> str:
    """Write ``<folder>/<name>.png`` from a benchmark's result; returns its path."""
    os.makedirs(folder, exist_ok=True)
    return PLOTS[name](result, os.path.join(folder, f"{name}.png"))


def predicted(result: dict, path: str) -> str:
    """Predicted ms per step of each row on each GPU, one panel per work (log scale); a
    black tick on each bar marks the same row with no host time but the launches (its
    schedule alone), a grey one its bound."""
    plt = _pyplot()
    works = result["works"]
    fig, axes = plt.subplots(1, len(works), figsize=(5.6 * len(works), 3.8), squeeze=False)
    for ax, work in zip(axes.flat, works):
        rows = work["rows"]
        labels = list(dict.fromkeys(r["row"] for r in rows))
        gpu_names = list(dict.fromkeys(r["gpu"] for r in rows))
        width = 0.8 / max(len(gpu_names), 1)
        for i, gpu in enumerate(gpu_names):
            values, schedule, bound = [], [], []
            for label in labels:
                r = next(r for r in rows if r["row"] == label and r["gpu"] == gpu)
                values.append(r["step_seconds"] * 1e3 if r["fits"] else 0)
                schedule.append(r.get("schedule_step_seconds", 0) * 1e3 if r["fits"] else float("nan"))
                bound.append(r["bound_seconds"] * 1e3 if r["fits"] else float("nan"))
            xs = [x + (i - (len(gpu_names) - 1) / 2) * width for x in range(len(labels))]
            ax.bar(xs, values, width, label=gpu)
            ax.scatter(xs, bound, marker="_", color="0.6", s=120, zorder=3,
                       label="bound" if i == len(gpu_names) - 1 else None)
            ax.scatter(xs, schedule, marker="_", color="black", s=120, zorder=4,
                       label="no host time" if i == len(gpu_names) - 1 else None)
        ax.set_yscale("log")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("predicted ms per step", fontsize=8)
        kind = "batch-1 decode (per token)" if work["work"] == "decode" else "AdamW training step"
        ax.set_title(f"{kind}: {work['layers']} layers, {work['parameters']} params\n"
                     f"predicted as {work['predicted_dtype']}, not measured", fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=len(labels), loc="lower center")  # (below the bars)
    return _save(plt, fig, path, rect=(0, 0.06, 1, 1))


PLOTS["predicted"] = predicted
