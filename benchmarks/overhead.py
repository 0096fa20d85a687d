"""Per-op cost of the proxy on a machine with no GPU.

Forward pass of a GPT-2 with the width of GPT-2 small (768) and 6 layers, sequence 128,
one thread: plain torch against torchTensorRef in pass-through (``device="cpu"``) and on
``"sim"`` with no budget (everything resident after the first touch), interleaved in one
process. Each forward is timed in CPU time of this thread (``time.thread_time``: with one
thread every kernel runs on it, and time the machine gives to other processes does not
count) and the ratio to plain is the median of the per-repeat ratios, so that drift of the
machine's speed hits both sides of each ratio alike; the ratio of the fastest runs is
reported beside it (noise only ever adds time).

The same model with a minimal ``__torch_dispatch__`` wrapper (it unwraps, calls and
rewraps, nothing else) gives the floor of any Python tensor subclass on this model; a cheap
op (a 64x64 add) then gives the time the proxy adds per op beside that floor.

    python benchmarks/overhead.py [--layers 6] [--seq 128] [--repeats 21] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from torchTensorRef import tensorsManager as tm  # noqa: E402

MODES = (("cpu", "pass-through"), ("sim", "sim"))


class MinimalWrapper(torch.Tensor):
    """The least a Python ``__torch_dispatch__`` subclass can do: unwrap, call, rewrap."""

    __slots__ = ("elem",)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(t: torch.Tensor) -> "MinimalWrapper":
        w = torch.Tensor._make_wrapper_subclass(MinimalWrapper, t.size(), strides=t.stride(),
                                                storage_offset=t.storage_offset(), dtype=t.dtype,
                                                device=t.device, requires_grad=False)
        w.elem = t
        return w

    @staticmethod
    def unwrap(a):
        if isinstance(a, MinimalWrapper):
            return a.elem
        if a.__class__ is list or a.__class__ is tuple:  # torch.cat's list of tensors
            return a.__class__(MinimalWrapper.unwrap(e) for e in a)
        return a

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = MinimalWrapper.unwrap
        args = [a.elem if isinstance(a, MinimalWrapper) else unwrap(a) if a.__class__ in (list, tuple) else a
                for a in args]
        out = func(*args, **{k: unwrap(v) for k, v in kwargs.items()} if kwargs else {})
        if isinstance(out, torch.Tensor):
            return MinimalWrapper.wrap(out)
        return tree_map(lambda t: MinimalWrapper.wrap(t) if isinstance(t, torch.Tensor) else t, out)


def build(layers: int, width: int, seq: int, vocab: int):
    """A plain GPT-2 (GPT-2 small's head size, 64) in eval mode, and plain token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    common.quiet_transformers()
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1), vocab_size=vocab,
                        n_positions=max(seq, 8))
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).eval()
    return model, common.plain_inputs(0, vocab, 1, seq)


def minimal_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of ``model`` whose parameters and buffers are ``MinimalWrapper``s."""
    with torchTensorRef.disabled():
        copy = common.plain_copy(model)
        for module in copy.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(MinimalWrapper.wrap(p.detach()), requires_grad=False))
            for name, b in list(module.named_buffers(recurse=False)):
                setattr(module, name, MinimalWrapper.wrap(b))
    return copy


def small_op_us(device: str, calls: int = 20000, budget=None) -> dict:
    """Median µs of one 64x64 add: plain, the minimal wrapper and TensorRefs on ``device``.

    The three alternate call by call, so that the machine's drift hits them alike. With a
    ``budget`` that holds everything Flow stays on the fast path: it watches every op (the
    generic path) only once it has had to evict.
    """
    tm.device = device
    tm.budget = budget
    x = torch.rand(64, 64)
    with torchTensorRef.disabled():
        y = torch.rand(64, 64)
        w = MinimalWrapper.wrap(y.clone())
    x + x  # first touch: on "sim" this brings x in
    plain_us, minimal_us, managed_us = alternating_add_us(y, w, x, calls)
    tm.budget = None
    return {"plain_us": plain_us, "minimal_wrapper_us": minimal_us, "managed_us": managed_us,
            "added_us": managed_us - plain_us, "floor_added_us": minimal_us - plain_us,
            "own_us": managed_us - minimal_us}


def alternating_add_us(plain, minimal, managed, calls: int):
    """Median µs of ``t + t`` for the three tensors, called in turn so that drift hits them alike."""
    clock = time.perf_counter_ns
    times = ([], [], [])
    for _ in range(calls):
        start = clock()
        plain + plain
        mid = clock()
        minimal + minimal
        end = clock()
        managed + managed
        times[2].append(clock() - end)
        times[0].append(mid - start)
        times[1].append(end - mid)
    return tuple(statistics.median(v) / 1e3 for v in times)


def interleaved(plain, fn, label: str, repeats: int, times: dict, ratios: dict, clock=time.thread_time) -> None:
    """Time ``plain`` and ``fn`` in turn ``repeats`` times (``clock``: thread CPU time); add the
    times to ``times["plain"]`` and ``times[label]`` and the per-pair ratios to ``ratios[label]``."""
    times[label], ratios[label] = [], []
    for _ in range(repeats):
        pair = {}
        for name, f in (("plain", plain), (label, fn)):
            start = clock()
            f()
            pair[name] = clock() - start
            times[name].append(pair[name])
        ratios[label].append(pair[label] / pair["plain"])


def main(argv=None) -> dict:
    """The benchmark with module regions off: it measures the per-op path."""
    with common.regions_off():
        return _main(argv)


def _main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--small-op-calls", type=int, default=20000)
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    plain_model, ids = build(args.layers, args.width, args.seq, args.vocab)
    tm.strategy = "flow"
    tm.budget = None
    tm.device = "cpu"
    model = torchTensorRef.manage(common.plain_copy(plain_model))
    minimal_model = minimal_copy(plain_model)

    def plain():
        # disabled(): the masks and positions the model creates per call stay plain too
        with torch.no_grad(), torchTensorRef.disabled():
            return plain_model(ids).logits

    def managed():
        with torch.no_grad():
            return model(ids).logits

    def minimal():
        with torch.no_grad(), torchTensorRef.disabled():
            return minimal_model(ids).logits.elem

    reference = plain()

    def reference_on(device: str) -> torch.Tensor:
        # An accelerator's kernels (on "sim" too: attention's) differ from the CPU's in the
        # last bits: its managed outputs are compared with plain torch on that device.
        if device == "cpu":
            return reference
        with torch.no_grad(), torchTensorRef.disabled(device=device):
            plain_on = common.plain_device(device)
            return common.plain_copy(plain_model).to(plain_on)(ids.to(plain_on)).logits.cpu()
    equal_minimal = torch.equal(minimal(), reference)
    times, ratios, equal, ops, moved = {"plain": []}, {}, {}, {}, {}
    # One phase per device, each interleaved with plain torch: switching the device sends
    # every block back to the host, which is not what is measured here.
    for device, label in MODES:
        tm.device = device
        out = managed()  # warm-up: on "sim" this brings every block in
        equal[label] = torch.equal(common.as_plain(out), reference_on(device))
        tm.reset_stats()
        managed()
        ops[label] = tm.stats()["ops"]
        # only the tensors the model creates per call (masks, positions) are copied in now
        moved[label] = tm.stats()["bytes_to_device"]
        interleaved(plain, managed, label, args.repeats, times, ratios)
    # the same for the minimal subclass: what any Python tensor subclass costs on this model
    interleaved(plain, minimal, "minimal subclass", args.repeats, times, ratios)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ops_per_forward = ops["sim"]
    ratio = {label: statistics.median(r) for label, r in ratios.items()}
    small = {label: small_op_us(device, args.small_op_calls) for device, label in MODES}
    # not the fast path: Flow under a budget sees every op (what a GPU run under a budget pays)
    small["sim, Flow with a 1 GiB budget"] = small_op_us("sim", args.small_op_calls, budget="1GiB")
    result = {
        "torch": torch.__version__, "threads": 1, "layers": args.layers, "width": args.width,
        "seq": args.seq, "repeats": args.repeats, "ops_per_forward": ops_per_forward,
        "clock": "thread CPU time", "median_seconds": med,
        "ratio_pass_through": ratio["pass-through"], "ratio_sim": ratio["sim"],
        # noise only ever adds time: the fastest runs are the other estimate of the cost
        "ratio_minimal_subclass": ratio["minimal subclass"],
        "ratio_of_fastest": {label: min(times[label]) / min(times["plain"]) for label in ratio},
        "added_us_per_op_pass_through": (ratio["pass-through"] - 1) * med["plain"] / ops_per_forward * 1e6,
        "added_us_per_op_sim": (ratio["sim"] - 1) * med["plain"] / ops_per_forward * 1e6,
        "outputs_equal": {**equal, "minimal subclass": equal_minimal}, "bytes_to_device_per_forward": moved,
        "small_op": small,
    }
    print(f"GPT-2 forward, {args.layers} layers x {args.width}, seq {args.seq}, 1 thread, "
          f"{ops_per_forward} ops, torch {torch.__version__}, {args.repeats} repeats (thread CPU time)")
    for name in ("plain",) + tuple(label for _d, label in MODES) + ("minimal subclass",):
        print(f"  {name:>12}: median {med[name] * 1e3:8.2f} ms")
    fastest = result["ratio_of_fastest"]
    print(f"  pass-through / plain = {result['ratio_pass_through']:.3f} (target <= 1.05), "
          f"{result['added_us_per_op_pass_through']:.1f} us added per op; fastest runs: {fastest['pass-through']:.3f}")
    print(f"  sim resident / plain = {result['ratio_sim']:.3f} (target <= 1.10), "
          f"{result['added_us_per_op_sim']:.1f} us added per op; fastest runs: {fastest['sim']:.3f}")
    print(f"  a minimal Python subclass / plain = {result['ratio_minimal_subclass']:.3f}; "
          f"fastest runs: {fastest['minimal subclass']:.3f}")
    for label, s in small.items():
        print(f"  64x64 add, {label}: {s['added_us']:.1f} us added per op (target < 8); a minimal "
              f"Python subclass adds {s['floor_added_us']:.1f} us, torchTensorRef {s['own_us']:.1f} us more")
    print(f"  outputs equal to plain: {result['outputs_equal']}; bytes copied in per forward: {moved}")
    if args.json:
        common.write_result(args.json, "benchmarks/overhead.py", argv, "cpu (pass-through) and sim", result)
    return result


if __name__ == "__main__":
    main()
