"""The GPUs a timeline can be predicted on: one row per GPU in ``data/gpus.json``, with its source.

A row gives the device memory, the peak dense 16-bit (tensor cores, fp32 accumulation) and
fp32 rates, the memory bandwidth and the host link with its copy rates, pinned and
pageable, each way. Pass a name from :func:`names`, a :class:`GPU`, or a dict of your own
numbers (every field, or ``"base": NAME`` and the fields that differ).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Union

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpus.json")
_GB = 1e9


@dataclasses.dataclass(frozen=True)
class GPU:
    """A modelled GPU; rates in the units of ``data/gpus.json`` (TFLOP/s, GB/s)."""

    name: str
    memory_gib: float
    tflops_16: float
    tflops_32: float
    memory_gb_s: float
    h2d_pinned_gb_s: float
    d2h_pinned_gb_s: float
    h2d_pageable_gb_s: float
    d2h_pageable_gb_s: float
    link: str = ""
    title: str = ""
    source: str = "user-supplied"

    def __post_init__(self):
        for field in _RATES:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GPU {self.name!r}: {field} must be a positive number (got: {value!r})")

    def peak_flops(self, half: bool) -> float:
        """FLOP/s of dense math: 16-bit on tensor cores, or fp32."""
        return (self.tflops_16 if half else self.tflops_32) * 1e12

    @property
    def memory_bandwidth(self) -> float:
        return self.memory_gb_s * _GB

    def copy_rate(self, to_device: bool, pinned: bool) -> float:
        """Bytes/s of a copy over the host link."""
        if to_device:
            return (self.h2d_pinned_gb_s if pinned else self.h2d_pageable_gb_s) * _GB
        return (self.d2h_pinned_gb_s if pinned else self.d2h_pageable_gb_s) * _GB


_RATES = ("memory_gib", "tflops_16", "tflops_32", "memory_gb_s", "h2d_pinned_gb_s", "d2h_pinned_gb_s",
          "h2d_pageable_gb_s", "d2h_pageable_gb_s")
_FIELDS = tuple(f.name for f in dataclasses.fields(GPU))


def table() -> Dict[str, GPU]:
    """Every GPU of the data file, by name."""
    with open(_DATA) as f:
        rows = json.load(f)["gpus"]
    return {name: GPU(name=name, **row) for name, row in rows.items()}


def names() -> List[str]:
    return list(table())


#: what ``torch.cuda.get_device_name()`` says of each row's GPU: words that must all appear
#: ("!w": must not: a "Ti" is another GPU)
_DEVICE_NAMES = {
    "h100-pcie": ("h100", "pcie"), "h100-sxm": ("h100", "hbm3"), "h200": ("h200", "!nvl"),
    "a100-pcie": ("a100", "80gb", "pcie"),
    "a100-sxm": ("a100", "sxm4", "80gb"), "l4": ("nvidia l4",), "rtx-4090": ("rtx 4090", "!d"),
    "rtx-3090": ("rtx 3090", "!ti"), "rtx-3060-12gb": ("rtx 3060", "!ti"), "t4": ("t4",),
}


def for_device(device_name: str) -> Optional[str]:
    """The row of the GPU ``torch.cuda.get_device_name()`` names, or None if none matches."""
    words = f" {' '.join(device_name.lower().replace('-', ' ').split())} "
    for name, needed in _DEVICE_NAMES.items():
        if all((f" {w[1:]} " not in words) if w.startswith("!") else (f" {w} " in words)
               for w in needed):  # whole words: "L4" is not "L40S"
            return name
    return None


def resolve(gpu: Union[str, GPU, dict]) -> GPU:
    """The :class:`GPU` for a name of the table, a ``GPU``, or a dict of numbers."""
    if isinstance(gpu, GPU):
        return gpu
    rows = table()
    if isinstance(gpu, str):
        if gpu not in rows:
            raise ValueError(f"unknown GPU {gpu!r}: accepted are {', '.join(rows)}, or a dict of numbers "
                             f"(on the command line: a .json file of them)")
        return rows[gpu]
    if isinstance(gpu, dict):
        fields = dict(gpu)
        base = fields.pop("base", None)
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown GPU field(s) {', '.join(unknown)}: accepted are base, {', '.join(_FIELDS)}")
        if base is not None:
            fields = {**dataclasses.asdict(resolve(base)), "source": "user-supplied", **fields}
        fields.setdefault("name", "custom")
        missing = [f for f in _RATES if f not in fields]
        if missing:
            raise ValueError(f"GPU {fields['name']!r} needs {', '.join(missing)} (or \"base\": one of "
                             f"{', '.join(rows)})")
        return GPU(**fields)
    raise TypeError(f"gpu must be a name, a GPU or a dict of numbers (got: {type(gpu).__name__})")
