"""What intercepting every module call costs: the ways a pager can see module calls.

Module regions (``torchTensorRef/regions``) must see each ``nn.Module`` call. Two ways
exist: global hooks (``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook``, which see only positional arguments and cannot wrap the
call in ``try``/``finally``), or a wrapper of ``nn.Module.__call__`` (what the package
installs). This times one call of a parameterless module whose forward returns its input,
on one thread, in microseconds per call (median of ``--repeats`` runs of ``--calls``
calls, process CPU time):

- ``torch's __call__``: the unwrapped ``Module.__call__`` (its fast path, no hooks);
- ``wrapper, plain torch``: the package's wrapper under ``disabled()`` (what plain torch
  pays in a process that imported torchTensorRef);
- ``wrapper, inside a region``: a module called by a region's forward (returns at once);
- ``wrapper, regions off``: ``torchTensorRef.regions.enabled = False``;
- ``global hook pair (no-op)``: torch's ``__call__`` with a no-op global forward pre-hook
  and forward hook registered (the slow path of ``_call_impl`` for every module).

    python benchmarks/module_call.py [--calls 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from torchTensorRef import regions  # noqa: E402
from torchTensorRef.regions import mechanism  # noqa: E402


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


def per_call(fn, calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    m = Identity()
    with torchTensorRef.disabled():
        x = torch.zeros(1)
    original = regions._original_call
    rows = {}
    rows["torch's __call__"] = per_call(lambda: original(m, x), args.calls, args.repeats)

    def plain():
        with torchTensorRef.disabled():
            for _ in range(100):
                m(x)
    rows["wrapper, plain torch"] = per_call(plain, args.calls // 100, args.repeats) / 100

    def inside():
        mechanism.state.depth += 1
        try:
            for _ in range(100):
                m(x)
        finally:
            mechanism.state.depth -= 1
    rows["wrapper, inside a region"] = per_call(inside, args.calls // 100, args.repeats) / 100
    previous = regions.enabled
    regions.enabled = False
    rows["wrapper, regions off"] = per_call(lambda: m(x), args.calls, args.repeats)
    regions.enabled = previous
    from torch.nn.modules import module as torch_module

    pre = torch_module.register_module_forward_pre_hook(lambda mod, inp: None)
    post = torch_module.register_module_forward_hook(lambda mod, inp, out: None)
    try:
        rows["global hook pair (no-op)"] = per_call(lambda: original(m, x), args.calls, args.repeats)
    finally:
        pre.remove()
        post.remove()
    print(f"1 thread, torch {torch.__version__}: microseconds per module call (median of {args.repeats})")
    for label, us in rows.items():
        print(f"  {label:<28} {us:6.2f}")
    return rows


if __name__ == "__main__":
    main()
