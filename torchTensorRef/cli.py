"""The command line: ``python -m torchTensorRef run script.py``, ``demo`` and ``predict`` (``predict_run.py``).

``run`` executes an unmodified script the way ``python -m cProfile`` does: the script sees
the ``sys.argv``, ``sys.path[0]`` and ``__name__`` it would see under plain ``python``, its
exceptions are shown with its own traceback and the process exits with its exit code. The
difference is that torch is patched and the manager configured before the script's first
line, so every tensor it creates is a TensorRef.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import List, Optional

from . import strategies
from .core.sizes import format_size
from .memory.devices import ACCEPTED_DEVICES
from .memory.manager import tensorsManager
from .running import default_device, run_script  # noqa: F401  (default_device: cli's API too)


def add_manager_options(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--strategy`` and ``--budget``, shared by ``run`` and ``demo``."""
    names = ", ".join(strategies.NAMES)
    parser.add_argument("--device", metavar="D", default=None,
                        help=f"{ACCEPTED_DEVICES}; default: TORCHTENSORREF_DEVICE, else cuda when "
                             f"available, else sim")
    parser.add_argument("--strategy", metavar="S", default=None,
                        help=f"one of: {names}; default: TORCHTENSORREF_STRATEGY, else "
                             f"{tensorsManager.strategy.name}")
    parser.add_argument("--budget", metavar="B", default=None,
                        help='accelerator bytes to use: an int, or a size such as "512MiB", "6GB" '
                             'or "1.5GiB"; default: TORCHTENSORREF_BUDGET, else the free memory '
                             '(unlimited on sim)')
    parser.add_argument("--host-budget", metavar="B", default=None,
                        help='host bytes for host copies; past it they go to disk (--offload-dir): '
                             'a size such as "24GiB"; default: TORCHTENSORREF_HOST_BUDGET, else no limit')
    parser.add_argument("--offload-dir", metavar="DIR", default=None,
                        help="folder for tensors past the host budget; default: TORCHTENSORREF_OFFLOAD_DIR, "
                             "else a temporary folder removed at exit")


def configure(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply ``--device/--strategy/--budget/--host-budget/--offload-dir``; a bad value is a
    usage error (exit code 2)."""
    settings = [("device", args.device if args.device is not None else default_device()),
                ("strategy", args.strategy), ("budget", args.budget),
                ("host_budget", getattr(args, "host_budget", None)),
                ("offload_dir", getattr(args, "offload_dir", None))]
    for name, value in settings:
        if value is None:
            continue
        try:
            setattr(tensorsManager, name, value)
        except ValueError as e:
            parser.error(f"--{name.replace('_', '-')}: {e}")


def summary(elapsed: float) -> str:
    """A few lines on what the manager did: bytes moved, peak vs budget, evictions, time."""
    s = tensorsManager.stats()
    # Under torchrun every rank prints one: say whose it is.
    rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else None
    who = f" (rank {rank})" if rank else ""
    return (
        f"torchTensorRef{who}: device {s['device']}, strategy {s['strategy']}, "
        f"budget {format_size(s['budget'])}\n"
        f"  moved {format_size(s['bytes_to_device'])} to the accelerator and "
        f"{format_size(s['bytes_to_host'])} back; peak {format_size(s['peak_device_bytes'])} "
        f"resident of {format_size(s['budget'])}; {s['evictions']} evictions; "
        f"{s['ops']} ops; {elapsed:.1f} s"
        + (f"\n  disk: read {format_size(s['bytes_from_disk'])}, wrote {format_size(s['bytes_to_disk'])}; "
           f"peak {format_size(s['peak_host_bytes'])} of host copies of {format_size(s['host_budget'])}"
           if s["host_budget"] is not None else "")
    )


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} is not a file")
    configure(parser, args)
    tensorsManager.reset_stats()
    start = time.perf_counter()
    code = 0
    try:
        code = run_script(args.script, args.args)
    finally:
        if not args.quiet:
            sys.stdout.flush()
            print(summary(time.perf_counter() - start), file=sys.stderr)
            sys.stderr.flush()
    if code < 0:  # killed by a signal under plain python: die the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(parser, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchTensorRef",
        description="Run PyTorch code with every tensor paged between host and accelerator memory.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{run,demo,predict}", required=True)

    run = commands.add_parser(
        "run", help="run an unmodified script under torchTensorRef",
        description="Run an unmodified Python script with torch patched and the manager configured; "
                    "print a summary to stderr at exit.",
        usage="python -m torchTensorRef run [--device D] [--strategy S] [--budget B] [--host-budget B] "
              "[--offload-dir DIR] [--quiet] script.py [args ...]",
    )
    add_manager_options(run)
    run.add_argument("--quiet", action="store_true", help="print no summary at exit")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    run.set_defaults(handler=_run, parser=run)

    from . import demo

    demo_parser = commands.add_parser(
        "demo", help="run a GPT-2 model plain and under each strategy, compare",
        description=demo.__doc__.splitlines()[0],
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=_demo, parser=demo_parser)

    from . import predict_run

    predict = commands.add_parser(
        "predict", help="predict a script's step time on a GPU from a run on sim",
        description=predict_run.__doc__.splitlines()[0],
        usage="python -m torchTensorRef predict [--gpu NAME] [--strategy S] [--budget B] [--steps A:B] "
              "[--step-on {forward,optimizer}] [--half] [--host-scale X] [--json PATH] [--chrome PATH] "
              "script.py [args ...]",
    )
    predict_run.add_arguments(predict)
    predict.set_defaults(handler=predict_run.main, parser=predict)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m torchTensorRef``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args.parser, args)
