"""Run every benchmark and write its results (JSON) and plots (PNG) under docs/benchmarks/.

    python benchmarks/run_all.py [--quick] [--only NAME ...] [--out docs/benchmarks] [--note TEXT]

Runs ``overhead``, ``small_ops``, ``flow_vs_reference``, ``transfer`` and ``predicted``, and
``gpu_throughput`` when a CUDA GPU is present (without one it is skipped and an earlier GPU
result is left as it is). Each result is written to ``<out>/<name>.json`` with the device,
torch version, date and the exact command, and plotted to ``<out>/<name>.png``; the headline
plot (bytes moved: strategies against the offline reference and accelerate) is copied to ``assets/``.
``--quick`` runs tiny sizes: it checks the harness in a few minutes, and its figures mean little.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

BENCHMARKS = ("overhead", "small_ops", "flow_vs_reference", "transfer", "predicted", "gpu_throughput")
#: each benchmark's arguments: full sizes, and --quick
ARGS = {
    "full": {"overhead": [], "small_ops": [], "flow_vs_reference": ["--fractions", "0.5", "0.25"], "transfer": [],
             "predicted": [], "gpu_throughput": []},
    "quick": {"overhead": ["--layers", "2", "--width", "128", "--seq", "32", "--vocab", "512", "--repeats", "3",
                           "--small-op-calls", "500"],
              "small_ops": ["--size", "tiny"],
              "flow_vs_reference": ["--layers", "2", "--steps", "2", "--fractions", "0.5"],
              "transfer": ["--quick"], "predicted": ["--tiny", "--layers", "2", "--train-layers", "2"],
              "gpu_throughput": ["--tiny"]},
}
#: plots copied to the assets folder, for the README
HEADLINES = {"transfer": "benchmark-transfer.png", "gpu_throughput": "benchmark-gpu.png"}
NOISE_NOTE = ("timing figures were taken on a machine shared with other jobs and are noisy; "
              "byte counts are exact and do not depend on the machine")


def run_one(name: str, extra, args, command: str) -> dict:
    """Run benchmark ``name``; returns its result wrapped with metadata (or why it was skipped)."""
    argv = list(ARGS["quick" if args.quick else "full"][name]) + list(extra)
    device = "sim"
    if name in ("overhead", "small_ops"):
        device = "cpu (pass-through) and sim"
    if name == "predicted":
        device = "sim (predicted for GPUs)"
    if name == "gpu_throughput":
        if not torch.cuda.is_available():
            message = f"gpu_throughput skipped: no CUDA GPU (torch {torch.__version__}); nothing written"
            print(message)
            return {"skipped": message}
        device = "cuda"
    module = importlib.import_module(f"benchmarks.{name}")
    print(f"== {name}: python benchmarks/{name}.py {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    result = module.main(argv)
    seconds = time.perf_counter() - start
    out = {"benchmark": name, **common.metadata(command, device),
           "standalone_command": f"python benchmarks/{name}.py {' '.join(argv)}".strip(),
           "wall_seconds": round(seconds, 1), "result": result}
    notes = [n for n in (args.note, NOISE_NOTE if args.noisy else None) if n]
    if notes:
        out["note"] = "; ".join(notes)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness, figures mean little")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    parser.add_argument("--out", default=os.path.join("docs", "benchmarks"), help="folder for JSON and PNG")
    parser.add_argument("--assets", default="assets", help="folder that receives the headline plot")
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")
    parser.add_argument("--note", default=None, help="a remark stored in every JSON")
    parser.add_argument("--noisy", action="store_true",
                        help="store a note that the machine was shared and timings are noisy")
    args = parser.parse_args(argv)
    command = common.command_line("benchmarks/run_all.py", argv)
    from benchmarks import plots  # matplotlib itself is imported when plotting

    draw = not args.no_plots
    if draw:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"no plots: {plots.PLOT_HINT}")
            draw = False
    written = {}
    for name in args.only or BENCHMARKS:
        out = run_one(name, [], args, command)
        if "skipped" in out:
            written[name] = out
            continue
        path = os.path.join(args.out, f"{name}.json")
        common.write_json(path, out)
        files = [path]
        if draw:
            png = plots.plot(name, out["result"], args.out)
            files.append(png)
            if name in HEADLINES:
                os.makedirs(args.assets, exist_ok=True)
                files.append(shutil.copyfile(png, os.path.join(args.assets, HEADLINES[name])))
        out["files"] = files
        written[name] = out
        print(f"wrote {', '.join(files)}", flush=True)
    return written


if __name__ == "__main__":
    main()
    sys.exit(0)
