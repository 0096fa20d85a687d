"""Where the host time of a region call goes: the steps of the boundary, timed one by one.

The model and rows of ``region_calls.py`` (a stack of ``--layers`` MLP blocks of ``--width``,
each a region, called on one vector with gradients off, on the lenient ``"sim"``): a forward
is region calls and nothing else. Each step of the boundary below is wrapped in a timer for
the run (its inclusive wall time, ``time.perf_counter_ns``), and the table gives µs per region
call: what the call adds beyond plain torch's forward of the block (timed on its own in the
same process), then each step. Steps nest (``Region._as_step`` holds ``Step.begin``, the call
and its outputs); the step "the call" is the block's forward itself, on the plain views.

Figures are wall time on one thread. Each timer adds well under a microsecond per step. A
small ``--width`` (16) gives the host work with warm caches; at 256 and above the kernels and
copies before each step evict the caches its code then misses on, which a GPU's kernels and
copies do not (their memory traffic is the device's).

``--model llama`` times greedy ``generate()`` calls of a Llama of ``--layers`` decoder layers
of hidden ``--width`` instead (``--tokens`` after 8, batch 1; ``--forwards`` calls): with no
budget a call is one region; under a budget that pages, its loop runs on plain tensors and each
layer, the embedding, the last norm and the head are region calls given the key/value cache
(Note [Loops on plain tensors]), the call step being a decoder layer's forward; µs are per
manager op, plain torch's time being its ``generate()`` call's divided by them (the step
"module call to region" then holds the model's own forward, no region, and its layers').

``--device cuda`` runs the same on a GPU against plain CUDA torch: what the host spends per
region call there, the stream and allocator calls of its copies included (the device is
synchronized after each timed loop; the kernels are queued, not waited for, so at a small
width the times are the host's). ``--profile N`` then runs the forwards once more under
``cProfile`` (without the timers) and prints the N functions taking the most time of their
own, in µs per region call. ``--bytecodes N`` counts the Python bytecodes a region call runs
(``common.bytecode_counts``: a figure no machine's load moves, unlike a clock), beyond plain
torch's for its block, by area and in the N functions running the most of their own.

    python benchmarks/region_anatomy.py [--layers 8] [--width 16] [--forwards 400] [--budget 0.5]
                                        [--device cuda] [--profile 25] [--bytecodes 25]
                                        [--model llama [--tokens 16]]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
import torchTensorRef.regions as regions  # noqa: E402
from benchmarks import common, region_calls  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from torchTensorRef.memory import residency, room  # noqa: E402
from torchTensorRef.regions import mechanism, op, scan, step  # noqa: E402


#: (label, owner, attribute): the steps timed, outermost first; an owner's attribute is
#: replaced by a timed wrapper for the run and given back after
STEPS = (
    ("module call to region", regions, "_call"),
    ("  region", mechanism.Region, "_call"),
    ("    scan the call", mechanism, "scan_call"),
    ("    plan (blocks, room)", mechanism.Region, "_plan"),
    ("    step", mechanism.Region, "_as_step"),
    ("      begin (prepare: room, fetches)", step.Step, "begin"),
    ("        fetch", residency.Residency, "fetch"),
    ("        evict", residency.Residency, "evict"),
    ("        make room", room.Room, "make"),
    ("      run (views in, call, views out)", mechanism.Region, "_run"),
    ("        the call", region_calls.Block, "forward"),
    ("      outputs", mechanism.Region, "_finish_outputs"),
    ("        views given back", mechanism.Region, "_given_back"),
    ("        outputs wrapped", op.Wrapper, "tree"),
    ("      end (finish)", step.Step, "end"),
    # (across the others: the search of the objects a call is given, a key/value cache,
    # for the TensorRefs they hold, before the call and for what it stored after)
    ("    objects searched", scan, "object_tensors"),
)


def timed_steps(acc: collections.Counter, steps=STEPS):
    """Wrap each of ``steps`` to add its wall time to ``acc[label]``; returns a function
    that gives the originals back."""
    originals = []
    for label, owner, name in steps:
        fn = owner.__dict__[name]
        originals.append((owner, name, fn))

        def timed(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                acc[_label] += time.perf_counter_ns() - start
        setattr(owner, name, timed)

    def restore():
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return restore


class Work:
    """What is timed: a managed call and plain torch's, and the module whose forward is a
    region's call (``STEPS``' "the call"). ``regions``: region calls per call, known for the
    stack (every block), counted by the manager for decoding."""

    def __init__(self, run, plain_run, expected, block: type, regions: Optional[int] = None):
        self.run, self.plain_run, self.expected, self.block, self.regions = run, plain_run, expected, block, regions

    def steps(self):
        return tuple((label, self.block, "forward") if label == "        the call" else (label, owner, name)
                     for label, owner, name in STEPS)


def stack_work(layers: int, width: int, fraction, device: str) -> Work:
    """``region_calls``' stack of MLP blocks, each a region, called on one vector."""
    model = region_calls.stack(layers, width)
    on = common.plain_device(device)
    with torchTensorRef.disabled():
        x = torch.randn(1, width)
    with torchTensorRef.disabled(device=on if on != "cpu" else None):
        plain_model, plain_x = common.plain_copy(model).to(on), x.to(on)
        with torch.no_grad():
            expected = plain_model(plain_x).cpu()
    managed, mx = region_calls.managed_stack(model, x, fraction, {}, device)

    def run():
        with torch.no_grad():
            return managed(mx)

    def plain_run():
        with torch.no_grad():
            return plain_model(plain_x)

    return Work(run, plain_run, expected, region_calls.Block, layers)


def llama_work(layers: int, width: int, fraction, device: str, tokens: int) -> Work:
    """Greedy ``generate()`` of ``tokens`` after 8 of a Llama of ``layers`` decoder layers of
    hidden ``width``, batch 1: under a budget that pages, its loop on plain tensors and one
    region per layer and per module outside them (Note [Loops on plain tensors])."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    common.quiet_transformers()
    model = common.llama(layers=layers, hidden=width, intermediate=2 * width, vocab=1000, heads=4, kv_heads=4,
                         positions=8 + tokens + 8).eval()
    ids = common.plain_inputs(0, 1000, 1, 8)
    on = common.plain_device(device)
    with torchTensorRef.disabled(device=on if on != "cpu" else None):
        plain_model, plain_ids = common.plain_copy(model).to(on), ids.to(on)
        expected = common.generate(plain_model, plain_ids, tokens).cpu()
    managed = common.managed_copy(model, device, "flow")
    mids = torchTensorRef.manage(ids.clone())
    tm.budget = None if fraction is None else tm.outside_bytes() + int(fraction * common.param_bytes(model))
    return Work(lambda: common.generate(managed, mids, tokens), lambda: common.generate(plain_model, plain_ids, tokens),
                expected, LlamaDecoderLayer)


def anatomy(layers: int, width: int, forwards: int, fraction, device: str = common.SIM_CPU,
            profile: int = 0, model: str = "stack", tokens: int = 16, bytecodes: int = 0) -> dict:
    """µs per region call of each step, and of the whole call beyond plain's; with
    ``profile``, the functions taking the most time of their own in a profiled run; with
    ``bytecodes``, the Python bytecodes a region call runs, beyond plain torch's per block
    and in the functions running the most of their own."""
    work = (stack_work(layers, width, fraction, device) if model == "stack"
            else llama_work(layers, width, fraction, device, tokens))
    on = common.plain_device(device)
    sync = torch.cuda.synchronize if on.startswith("cuda") else (lambda: None)
    common.warm_up(work.run, region_calls.WARMUP, 4 * region_calls.WARMUP)
    with torchTensorRef.disabled(device=on if on != "cpu" else None), torch.no_grad():
        sync()
        start = time.perf_counter_ns()
        for _ in range(forwards):
            work.plain_run()
        sync()
        plain_ns = time.perf_counter_ns() - start
    acc: collections.Counter = collections.Counter()
    tm.reset_stats()
    steps = work.steps()
    restore = timed_steps(acc, steps)
    try:
        sync()
        start = time.perf_counter_ns()
        outs = [work.run() for _ in range(forwards)]
        sync()
        managed_ns = time.perf_counter_ns() - start
    finally:
        restore()
    stats = tm.stats()
    # (decoding: the manager's ops are its region calls and the loop's own, one a call)
    calls = forwards * work.regions if work.regions is not None else stats["ops"]
    result = {
        "device": device, "model": model, "width": width, "layers": layers, "forwards": forwards,
        "budget_fraction": fraction,
        "plain_us_per_block": plain_ns / calls / 1e3,
        "added_us_per_call": (managed_ns - plain_ns) / calls / 1e3,
        "steps_us_per_call": {label: acc[label] / calls / 1e3 for label, _o, _n in steps},
        "ops_per_forward": stats["ops"] / forwards,
        "evictions_per_forward": stats["evictions"] / forwards,
        "equal": all(torch.equal(common.as_plain(o), work.expected) for o in outs),
    }
    if profile:
        result["profile"] = common.host_profile(work.run, forwards, calls, profile, sync)["functions"]
    if bytecodes:
        # (a tenth of the forwards: tracing each bytecode runs Python about 30 times slower)
        repeats = max(1, forwards // 10)
        per = calls * repeats / forwards
        counted = common.bytecode_counts(work.run, repeats, per, bytecodes)
        with torchTensorRef.disabled(device=on if on != "cpu" else None), torch.no_grad():
            plain = common.bytecode_counts(work.plain_run, repeats, per, 0)["total"]
        result["bytecodes"] = {"added_per_call": counted["total"] - plain, "plain_per_block": plain,
                               "functions": counted["functions"], "areas": counted["areas"]}
    return result


def table(result: dict) -> str:
    unit = "block forward" if result.get("model", "stack") == "stack" else "call per manager op"
    lines = [f"  plain torch's {unit}: {result['plain_us_per_block']:.1f} us; a region call adds "
             f"{result['added_us_per_call']:.1f} us (with the timers); manager ops per forward: "
             f"{result['ops_per_forward']:.0f}; outputs equal plain: {result['equal']}",
             f"  {'step (inclusive)':<40} {'us/call':>8}"]
    for label, us in result["steps_us_per_call"].items():
        lines.append(f"  {label:<40} {us:8.1f}")
    if result.get("bytecodes"):
        counted = result["bytecodes"]
        lines.append(f"  Python bytecodes: a region call adds {counted['added_per_call']:.0f} to plain torch's "
                     f"{counted['plain_per_block']:.0f}; by area:")
        lines += [f"  {n:8.0f}  {area}" for area, n in counted["areas"].items()]
        lines.append("  by function, its own:")
        lines += [f"  {n:8.0f}  {where}" for where, n in counted["functions"]]
    if result.get("profile"):
        lines.append("  profiled (cProfile, its own cost included), per region call:")
        lines.append(f"  {'calls':>6} {'own us':>7} {'incl. us':>8}  function")
        for where, ncalls, own, inclusive in result["profile"]:
            lines.append(f"  {ncalls:6.2f} {own:7.1f} {inclusive:8.1f}  {where}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--forwards", type=int, default=400, help="timed forwards")
    parser.add_argument("--budget", type=float, default=None,
                        help="Flow's budget as a fraction of the weights (default: none)")
    parser.add_argument("--device", default=common.SIM_CPU,
                        help='"sim-cpu" (the lenient "sim", the default) or "cuda"')
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile the forwards and print the N functions with the most time of their own")
    parser.add_argument("--bytecodes", type=int, default=0, metavar="N",
                        help="also count the Python bytecodes a region call runs and print the N functions "
                             "running the most of their own")
    parser.add_argument("--model", choices=("stack", "llama"), default="stack",
                        help="stack: region_calls' MLP blocks; llama: greedy generate() of a Llama of "
                             "--layers decoder layers of hidden --width")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens a generate() call (--model llama)")
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torchTensorRef.patch()
    previous = regions.enabled, regions.under_budget
    regions.enabled = regions.under_budget = True
    try:
        result = anatomy(args.layers, args.width, args.forwards, args.budget, args.device, args.profile,
                         args.model, args.tokens, args.bytecodes)
    finally:
        regions.enabled, regions.under_budget = previous
        tm.budget = None
        tm.strategy, tm.device, tm.sim_strict = "flow", "cpu", True
    budget = "no budget" if args.budget is None else f"Flow at {args.budget:.0%} of the weights"
    where = "lenient sim" if args.device == common.SIM_CPU else args.device
    what = (f"{args.layers} blocks of width {args.width}, one region each, batch 1, no gradients"
            if args.model == "stack" else
            f"a Llama of {args.layers} layers of hidden {args.width}, generate() of {args.tokens} tokens after 8")
    print(f"{what}; {where}, {budget}; torch {torch.__version__}, 1 thread, {args.forwards} "
          f"{'forwards' if args.model == 'stack' else 'calls'} (wall time)")
    print(table(result))
    if args.json:
        common.write_result(args.json, "benchmarks/region_anatomy.py", argv, where, result)
    if not result["equal"]:
        raise SystemExit("outputs differ from plain torch")
    return result


if __name__ == "__main__":
    main()
