"""What the checks of a checkpoint's content cost its reads (Note [Checkpoint changes] in
``torchTensorRef/memory/disk.py``).

A 100 MiB safetensors checkpoint (float32, random values) is read range by range through
the disk tier's ``FileRange``, as a lazily loaded model's weights are read when they come
back, twice over the same ranges: once with the checks, once with them replaced by nothing
(the file's identity as size, modification time and inode only), alternating, in one
process. Two checkpoints: 25 tensors of 4 MiB, and 6400 of 16 KiB. It prints the median
time of a first read of every range (the file's samples are checked) and of a later one
(each range's checksum is compared), with and without the checks.

    python benchmarks/checkpoint_checks.py [--repeats 15] [--json docs/benchmarks/checkpoint_checks.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from torchTensorRef.memory import disk  # noqa: E402
from torchTensorRef.integrations.checkpoint import read_header  # noqa: E402

#: (tensors, elements per tensor): 100 MiB of float32 either way
SHAPES = {"4 MiB tensors": (25, 2**20), "16 KiB tensors": (6400, 2**12)}


def _write(path: str, tensors: int, elements: int) -> None:
    from safetensors.torch import save_file

    with torchTensorRef.disabled():
        g = torch.Generator().manual_seed(0)
        save_file({f"t{i}": torch.randn(elements, generator=g) for i in range(tensors)}, path)


def _identity_only(fd: int, samples: bool = True) -> tuple:
    st = os.fstat(fd)
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _ranges(path: str, identity: tuple, checked: bool):
    header = read_header(path)
    identity = identity if checked else identity[:3]
    ranges = [disk.FileRange(header.path, e.offset, e.nbytes, identity=identity) for e in header.entries.values()]
    return ranges, [torch.empty(r.nbytes, dtype=torch.uint8) for r in ranges]


def measure(path: str, repeats: int) -> dict:
    """Seconds of a pass over every range: first and later reads, checked and not."""
    modes = {True: (disk._checksum, disk._identity_of), False: (lambda view: 0, _identity_only)}
    times = {}
    identity = disk.file_identity(path)  # (with its samples: taken before the checks are swapped)
    with torchTensorRef.disabled():
        for first in (True, False):
            sets = {checked: _ranges(path, identity, checked) for checked in modes}
            for rep in range(repeats if not first else max(repeats // 3, 3)):
                for checked, (checksum, identity_of) in modes.items():
                    disk._checksum, disk._identity_of = checksum, identity_of
                    if first:
                        sets[checked] = _ranges(path, identity, checked)  # (fresh ranges: each read is a first read)
                    ranges, buffers = sets[checked]
                    start = time.perf_counter()
                    for r, b in zip(ranges, buffers):
                        r.read_into(b)
                    times.setdefault((first, checked), []).append(time.perf_counter() - start)
                    if not first and rep == 0:
                        times[(first, checked)].pop()  # (the ranges' first read: not a later one)
    disk._checksum, disk._identity_of = modes[True]
    return {f"{'first' if first else 'later'}_{'checked' if checked else 'unchecked'}_ms":
            round(statistics.median(t) * 1e3, 1) for (first, checked), t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, (tensors, elements) in SHAPES.items():
            path = os.path.join(folder, f"{tensors}.safetensors")
            _write(path, tensors, elements)
            results[name] = measure(path, args.repeats)
            r = results[name]
            print(f"{name}: first reads {r['first_checked_ms']} ms checked, {r['first_unchecked_ms']} ms not; "
                  f"later reads {r['later_checked_ms']} ms checked, {r['later_unchecked_ms']} ms not")
    if args.json:
        from benchmarks import common

        common.write_result(args.json, "benchmarks/checkpoint_checks.py", sys.argv[1:] if argv is None else argv,
                            "cpu", {"checkpoint_mib": 100, "repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
