"""Host work per region call, counted in instructions: a figure a busy machine does not move.

On a shared CPU a clock varies by 15% and more between two runs of one command, more than
most changes to a region's boundary are worth. The instructions a process executes do not
depend on the machine's load: this counts them with callgrind (valgrind's tool), for
``region_calls.py``'s model (a stack of ``--layers`` residual MLP blocks of ``--width``, each
block a region, called on one vector with gradients off, on the lenient ``"sim"``, one
thread). Per row, a child process runs under callgrind: ``--warmup`` forwards of the managed
model not counted (Flow settles and follows its plan), then ``--forwards`` of plain torch's
model and ``--forwards`` of the managed one, each counted apart. The row's figure is what a
region call executes beyond plain torch's block: (managed - plain) / (forwards x layers).
Also: plain torch's block forward, the MiB brought to the device per forward, and whether
the managed outputs equal plain torch's (bit for bit: the same kernels).

Rows: no budget, and Flow at each of ``--fractions`` of the weights. Counting runs Python
about 50 times slower than natively: the default takes a minute or two a row. Two runs of one
row differ by about 0.5% (addresses and hashing differ from process to process).

It needs valgrind and a C compiler with valgrind's headers (Debian: ``apt install valgrind
gcc``): a small library, built once into a temporary folder, starts and stops the count
from inside the child, so that only the forwards are counted.

    python benchmarks/region_instructions.py [--layers 32] [--width 64] [--forwards 8] [--warmup 60]
                                             [--fractions 0.5,0.25] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common, region_calls  # noqa: E402
from benchmarks.common import tm  # noqa: E402

SCRIPT = "benchmarks/region_instructions.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the counting library: each ``cg_stop`` writes one dump of what ran since ``cg_start``
_COUNTER_SOURCE = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


class NoCounter:
    """Where nothing counts (a child run natively: the tests)."""

    def cg_start(self) -> None:
        pass

    def cg_stop(self) -> None:
        pass


def child(layers: int, width: int, forwards: int, warmup: int, fraction: Optional[float], counter) -> dict:
    """One row, counted by ``counter`` (``cg_start``/``cg_stop``): plain torch's forwards, then
    the managed model's; returns the bytes moved and whether the outputs equal plain's."""
    torch.set_num_threads(1)
    model = region_calls.stack(layers, width)
    with torchTensorRef.disabled():
        x = torch.randn(1, width, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = model(x)
    managed, mx = region_calls.managed_stack(model, x, fraction, {})

    def forward(m, a):
        with torch.no_grad():
            return m(a)

    try:
        for _ in range(warmup):
            forward(managed, mx)
        with torchTensorRef.disabled():
            for _ in range(2):  # (its first calls allocate what the later ones reuse)
                forward(model, x)
            counter.cg_start()
            for _ in range(forwards):
                forward(model, x)
            counter.cg_stop()
        tm.reset_stats()
        counter.cg_start()
        outs = [forward(managed, mx) for _ in range(forwards)]
        counter.cg_stop()
        stats = tm.stats()
        return {"bytes_to_device": stats["bytes_to_device"], "ops": stats["ops"],
                "equal": all(torch.equal(common.as_plain(o), expected) for o in outs)}
    finally:
        tm.budget = None


def totals(paths: List[str]) -> List[int]:
    """The instruction counts of callgrind's dumps ``paths`` (their ``totals:`` lines), in order."""
    out = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("totals:"):
                    out.append(int(line.split()[1]))
                    break
            else:
                raise ValueError(f"{path}: no 'totals:' line (not a callgrind dump?)")
    return out


def dumps(out_file: str) -> List[str]:
    """Callgrind's numbered dumps of ``out_file`` (``out_file.1``, ``.2``, ...), in order."""
    found = glob.glob(glob.escape(out_file) + ".*")
    return sorted((p for p in found if p.rsplit(".", 1)[1].isdigit()), key=lambda p: int(p.rsplit(".", 1)[1]))


def build_counter(folder: str) -> str:
    """The counting library built into ``folder``; raises ``SystemExit`` saying what is missing."""
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"counting instructions with valgrind's callgrind needs {' and '.join(missing)} "
                         f"on the PATH (Debian: apt install valgrind gcc)")
    source, library = os.path.join(folder, "counter.c"), os.path.join(folder, "counter.so")
    with open(source, "w") as f:
        f.write(_COUNTER_SOURCE)
    built = subprocess.run(["gcc", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"could not build the instruction counter (valgrind's headers missing? Debian: "
                         f"apt install valgrind): {built.stderr.strip()}")
    return library


def counted_row(args, fraction: Optional[float], folder: str, library: str) -> dict:
    """One row in a child process under callgrind: instructions per region call beyond plain."""
    out_file = os.path.join(folder, f"row-{fraction}.out")
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out_file}", sys.executable, os.path.abspath(__file__), "--child",
               "none" if fraction is None else str(fraction), "--library", library, "--layers", str(args.layers),
               "--width", str(args.width), "--forwards", str(args.forwards), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if run.returncode:
        raise SystemExit(f"the row at {fraction} failed under callgrind:\n{run.stderr[-2000:]}")
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1])
    plain, managed = totals(dumps(out_file))[-2:]
    calls = args.forwards * args.layers
    return {"budget_fraction": fraction, "instructions_per_call": (managed - plain) / calls,
            "plain_block_instructions": plain / calls, "regions_per_forward": result["ops"] / args.forwards,
            "mib_to_device_per_forward": result["bytes_to_device"] / args.forwards / 2**20,
            "equal": result["equal"]}


def table(rows: Dict[str, dict]) -> str:
    lines = [f"  {'row':<12} {'K instr/call':>12} {'plain block K':>13} {'regions':>8} {'MiB/forward':>11}  equal"]
    for label, r in rows.items():
        per_call, plain = r["instructions_per_call"] / 1e3, r["plain_block_instructions"] / 1e3
        lines.append(f"  {label:<12} {per_call:12.1f} {plain:13.1f} {r['regions_per_forward']:8.0f} "
                     f"{r['mib_to_device_per_forward']:11.2f}  {r['equal']}")
    return "\n".join(lines)


def _fractions(text: str) -> List[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fractions takes numbers separated by commas, not {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--fractions must be above 0 (got {text!r})")
    return values


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--forwards", type=int, default=8, help="forwards counted, each side")
    parser.add_argument("--warmup", type=int, default=60, help="managed forwards before counting")
    parser.add_argument("--fractions", type=_fractions, default=[0.5, 0.25],
                        help="budgets as fractions of the weights, besides no budget")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a row may take")
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layers < 1 or args.width < 1 or args.forwards < 1 or args.warmup < 0:
        parser.error("--layers, --width and --forwards must be at least 1, --warmup at least 0")
    if args.child is not None:
        fraction = None if args.child == "none" else float(args.child)
        counter = ctypes.CDLL(args.library) if args.library else NoCounter()
        print(json.dumps(child(args.layers, args.width, args.forwards, args.warmup, fraction, counter)))
        return {}
    with tempfile.TemporaryDirectory() as folder:
        library = build_counter(folder)
        rows = {}
        for label, fraction in [("no budget", None)] + [(f"Flow {f:g}", f) for f in args.fractions]:
            rows[label] = counted_row(args, fraction, folder, library)
    result = {"layers": args.layers, "width": args.width, "forwards": args.forwards, "warmup": args.warmup,
              "rows": rows}
    print(f"{args.layers} blocks of width {args.width}, one region each, batch 1, no gradients; lenient sim, "
          f"torch {torch.__version__}; instructions counted by callgrind over {args.forwards} forwards after "
          f"{args.warmup}")
    print(table(rows))
    print("  K instr/call: instructions a region call executes beyond plain torch's block forward")
    if args.json:
        common.write_result(args.json, SCRIPT, argv, common.SIM_CPU, result)
    if not all(r["equal"] for r in rows.values()):
        raise SystemExit("managed outputs differ from plain torch's")
    return result


if __name__ == "__main__":
    main()
