"""A training step with nothing to move, part by part, counted in instructions.

``train_parts.py`` times each part of an AdamW step (``zero_grad``, the forward and its loss,
``backward``, the optimizer's ``step``) managed with no budget against plain torch; on a
shared CPU its clock moves by more than most changes to the host's work are worth. This
counts the instructions each part executes instead, with callgrind (valgrind's tool, as
``region_instructions.py`` does): a child process builds ``train_parts``' Llama (``--layers``
of ``--width``, random weights, batch 1 x ``--seq`` tokens), takes ``--warmup`` steps of
plain torch and of the managed copy on the lenient ``"sim"``, then, part by part, ``--steps``
steps of each with only that part counted. Per part: plain torch's instructions a step, the
managed ones, what the manager adds and their ratio; the losses of the two are checked equal
bit for bit (the same kernels in the same order).

It needs valgrind and a C compiler with valgrind's headers (Debian: ``apt install valgrind
gcc``). Two runs differ by well under 1%. A run takes two to three minutes.

    python benchmarks/train_instructions.py [--layers 8] [--width 64] [--seq 16] [--steps 2]
                                            [--warmup 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from benchmarks.region_instructions import NoCounter, build_counter, dumps, totals  # noqa: E402
from benchmarks.train_parts import PARTS  # noqa: E402

SCRIPT = "benchmarks/train_instructions.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512


def _step(model, ids, opt, counted: str, counter) -> float:
    """One training step, only its part ``counted`` counted; its loss."""
    def part(name, fn):
        if name == counted:
            counter.cg_start()
        out = fn()
        if name == counted:
            counter.cg_stop()
        return out

    part("zero_grad", lambda: opt.zero_grad(set_to_none=True))
    loss = part("forward", lambda: model(ids, labels=ids).loss)
    part("backward", loss.backward)
    part("step", opt.step)
    return loss.item()


def child(layers: int, width: int, seq: int, steps: int, warmup: int, counter) -> dict:
    """The counted steps: for each of ``PARTS``, ``steps`` steps of plain torch then ``steps``
    managed ones (one dump each); whether the losses are equal and the manager's ops a step."""
    torch.set_num_threads(1)
    heads = max(width // 16, 1)
    model = common.llama(layers, width, 2 * width, VOCAB, heads, heads, seq + 8)
    ids = common.plain_inputs(0, VOCAB, 1, seq)
    try:
        managed = common.managed_copy(model, common.SIM_CPU, "flow")
        with torchTensorRef.disabled():
            plain = common.plain_copy(model)
            plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=True)
        managed_ids = torchTensorRef.manage(ids.clone())
        managed_opt = torch.optim.AdamW(managed.parameters(), lr=1e-3, foreach=True)
        quiet = NoCounter()
        losses: dict = {"plain": [], "managed": []}

        def both(counted: str, c) -> None:
            with torchTensorRef.disabled():
                for _ in range(steps if counted else 1):
                    losses["plain"].append(_step(plain, ids, plain_opt, counted, c))
            for _ in range(steps if counted else 1):
                losses["managed"].append(_step(managed, managed_ids, managed_opt, counted, c))

        for _ in range(warmup):
            both("", quiet)
        before = tm.stats()["ops"]
        for name in PARTS:
            both(name, counter)
        ops = (tm.stats()["ops"] - before) / (steps * len(PARTS))
        return {"equal": losses["plain"] == losses["managed"], "ops_per_step": ops}
    finally:
        tm.budget = None


def parts_of(counts, steps: int) -> dict:
    """Per part and in all, from the dumps' ``counts`` in the child's order: plain and managed
    instructions a step, what the managed step adds and its ratio."""
    if len(counts) != 2 * steps * len(PARTS):
        raise ValueError(f"{len(counts)} dumps, expected {2 * steps * len(PARTS)} (plain and managed, per part)")
    out = {}
    total_plain = total_managed = 0.0
    for i, name in enumerate(PARTS):
        block = counts[2 * steps * i: 2 * steps * (i + 1)]
        plain, managed = sum(block[:steps]) / steps, sum(block[steps:]) / steps
        total_plain, total_managed = total_plain + plain, total_managed + managed
        out[name] = {"plain": plain, "managed": managed, "added": managed - plain, "ratio": managed / plain}
    out["step total"] = {"plain": total_plain, "managed": total_managed, "added": total_managed - total_plain,
                         "ratio": total_managed / total_plain}
    return out


def counted(args, folder: str, library: str) -> dict:
    out_file = os.path.join(folder, "train.out")
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out_file}", sys.executable, os.path.abspath(__file__), "--child",
               "--library", library, "--layers", str(args.layers), "--width", str(args.width),
               "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if run.returncode:
        raise SystemExit(f"the counted steps failed under callgrind:\n{run.stderr[-2000:]}")
    result = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    return {**result, "parts": parts_of(totals(dumps(out_file)), args.steps)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="steps counted per part, each side")
    parser.add_argument("--warmup", type=int, default=4, help="steps of each before counting")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds the counted run may take")
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layers < 1 or args.width < 16 or args.seq < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--layers, --seq and --steps must be at least 1, --width at least 16, --warmup at least 0")
    if args.child:
        counter = ctypes.CDLL(args.library) if args.library else NoCounter()
        print(json.dumps(child(args.layers, args.width, args.seq, args.steps, args.warmup, counter)))
        return {}
    with tempfile.TemporaryDirectory() as folder:
        result = counted(args, folder, build_counter(folder))
    result.update(layers=args.layers, width=args.width, seq=args.seq, steps=args.steps, warmup=args.warmup)
    print(f"Llama, {args.layers} layers of {args.width}, batch 1 x {args.seq}, AdamW, no budget on lenient sim, "
          f"torch {torch.__version__}; instructions a step, counted by callgrind over {args.steps} steps per part")
    print(f"  {'part':<11} {'plain M':>9} {'managed M':>10} {'added M':>8} {'ratio':>6}")
    for name, r in result["parts"].items():
        print(f"  {name:<11} {r['plain'] / 1e6:9.2f} {r['managed'] / 1e6:10.2f} {r['added'] / 1e6:8.2f} "
              f"{r['ratio']:6.3f}")
    print(f"  manager ops per step: {result['ops_per_step']:.0f}; losses "
          f"{'equal to plain torch bit for bit' if result['equal'] else 'DIFFER from plain torch'}")
    if args.json:
        common.write_result(args.json, SCRIPT, argv, common.SIM_CPU, result)
    if not result["equal"]:
        raise SystemExit("managed losses differ from plain torch's")
    return result


if __name__ == "__main__":
    main()
