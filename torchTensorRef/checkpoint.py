"""Loading without reading: TensorRefs whose bytes stay in a safetensors checkpoint until used.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape
and byte range) and the tensors' bytes, contiguous and little-endian. So a tensor of the
file can be a block whose only copy is that byte range (Note [Three levels] in
``disk.py``): nothing is read when the model is loaded, the first op that uses a weight
reads it, and under a host budget its host copy is dropped for free and read again later.

``load_checkpoint(model, path)`` installs such TensorRefs in a model (one built on
``meta`` costs no memory at all); ``from_pretrained`` of transformers does the same for
local safetensors checkpoints (``transformers_loading``).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from typing import Dict, List, NamedTuple, Tuple

import torch

from . import raw
from .disk import FileRange, file_identity

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class Entry(NamedTuple):
    """One tensor of a safetensors file."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


class Header(NamedTuple):
    path: str
    identity: tuple
    entries: Dict[str, Entry]


_headers: Dict[tuple, Header] = {}
_headers_lock = threading.Lock()


def read_header(path) -> Header:
    """The tensors of the safetensors file ``path`` (cached while the file is unchanged)."""
    path = os.path.abspath(os.fspath(path))
    identity = file_identity(path)
    key = (path, identity)
    with _headers_lock:
        header = _headers.get(key)
    if header is not None:
        return header
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path} is not a safetensors file: it has no header")
        (length,) = struct.unpack("<Q", raw_len)
        if length > identity[0] - 8:
            raise ValueError(f"{path} is not a safetensors file: its header length {length} is past its end")
        meta = json.loads(f.read(length))
    start = 8 + length
    entries = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which torchTensorRef "
                             f"cannot load lazily (accepted: {', '.join(sorted(_DTYPES))})")
        begin, end = info["data_offsets"]
        entries[name] = Entry(dtype, tuple(info["shape"]), start + begin, end - begin)
    header = Header(path, identity, entries)
    with _headers_lock:
        _headers[key] = header
    return header


def file_backed(header: Header, name: str, parameter: bool = False, requires_grad: bool = False):
    """A TensorRef of tensor ``name`` of ``header``'s file, nothing read.

    ``parameter``: made an ``nn.Parameter`` as ``Parameter(ref)`` would, without its
    ``detach`` (an op, which would read the bytes).
    """
    from .manager import tensorsManager as mgr
    from .tensor_ref import make_ref

    entry = header.entries[name]
    with mgr._lock:
        mgr._drain()
        block = mgr._new_block(entry.nbytes)
        mgr._set_disk(block, FileRange(header.path, entry.offset, entry.nbytes, identity=header.identity))
        # (a geometry without bytes: the block has no copy in memory yet)
        like = raw.empty(entry.shape, dtype=entry.dtype, device="meta")
        ref = make_ref(block, like, mgr._declared, requires_grad=requires_grad)
        ref._tr_gen = -1  # the meta view is never a copy to run on
        if parameter:
            ref._is_param = True
        mgr._strategy.on_adopt(block)
        return ref


def checkpoint_files(path) -> List[str]:
    """The safetensors files of ``path``: a file, or a folder with one file or a sharded index."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}: give a .safetensors file or a folder holding one")
    names = sorted(os.listdir(path))
    for name in names:
        if name.endswith(".safetensors.index.json"):
            with open(os.path.join(path, name)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(path, s) for s in shards]
    files = [os.path.join(path, n) for n in names if n.endswith(".safetensors")]
    if not files:
        raise FileNotFoundError(f"no .safetensors file or index in {path}")
    return files


class LoadResult(NamedTuple):
    """What :func:`load_checkpoint` found, as ``Module.load_state_dict`` reports it."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def load_checkpoint(model: torch.nn.Module, path, strict: bool = True) -> LoadResult:
    """Give ``model``'s parameters and buffers the tensors of the safetensors checkpoint
    ``path`` (a file, or a folder with its shards and index) without reading them.

    Each tensor becomes a TensorRef whose bytes stay in the file until an op needs them;
    tied parameters stay tied. The model may be built on ``meta``. Shapes and dtypes must
    match the model's (cast after loading, or build the model in the checkpoint's dtype).

    Raises:
        ValueError: a shape or dtype differs, or (``strict``) keys are missing or
            unexpected; the model is left unchanged.
    """
    found: Dict[str, Header] = {}
    for file in checkpoint_files(path):
        header = read_header(file)
        for name in header.entries:
            found[name] = header
    slots = _slots(model)
    missing = [names[0] for names in slots.values() if not any(n in found for n in names)]
    known = {n for names in slots.values() for n in names}
    unexpected = sorted(n for n in found if n not in known)
    problems = []
    for key, names in slots.items():
        name = next((n for n in names if n in found), None)
        if name is None:
            continue
        entry = found[name].entries[name]
        current = key[0]
        if tuple(current.shape) != entry.shape or current.dtype != entry.dtype:
            problems.append(f"{name}: the checkpoint has {entry.dtype} {list(entry.shape)}, the model "
                            f"{current.dtype} {list(current.shape)}")
    if problems:
        raise ValueError("load_checkpoint: " + "; ".join(problems))
    if strict and (missing or unexpected):
        raise ValueError(f"load_checkpoint: missing keys {missing}, unexpected keys {unexpected} "
                         f"(strict=False loads what matches)")
    for (current, _id), names in slots.items():
        name = next((n for n in names if n in found), None)
        if name is None:
            continue
        new = file_backed(found[name], name, isinstance(current, torch.nn.Parameter), current.requires_grad)
        for full in names:
            module_name, _, attr = full.rpartition(".")
            module = model.get_submodule(module_name)
            if attr in module._parameters:
                module._parameters[attr] = new
            else:
                module._buffers[attr] = new
    return LoadResult(missing, unexpected)


def _slots(model: torch.nn.Module) -> Dict[tuple, List[str]]:
    """(tensor, id) -> every name it has in ``model`` (tied parameters have several)."""
    slots: Dict[tuple, List[str]] = {}
    by_id: Dict[int, tuple] = {}
    persistent = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for attr, t in module._parameters.items():
            if t is not None:
                persistent.append((dot + attr, t))
        for attr, t in module._buffers.items():
            if t is not None and attr not in module._non_persistent_buffers_set:
                persistent.append((dot + attr, t))
    for name, t in persistent:
        key = by_id.setdefault(id(t), (t, id(t)))
        names = slots.setdefault(key, [])
        if name not in names:
            names.append(name)
    return slots


# -- safetensors.safe_open, as transformers' from_pretrained uses it --------------------------

class LazyFile:
    """A ``safe_open`` handle whose whole-tensor reads (``get_tensor(k)``, ``get_slice(k)[...]``)
    give file-backed TensorRefs; anything else (partial slices, metadata) is the real handle's."""

    def __init__(self, handle, path):
        self._handle = handle
        self._header = read_header(path)

    def get_tensor(self, name):
        return file_backed(self._header, name)

    def get_slice(self, name):
        return LazySlice(self, name)

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._handle, name)


class LazySlice:
    """``get_slice(name)``: ``[...]`` or ``[:]`` gives the whole tensor, file-backed."""

    def __init__(self, file: LazyFile, name: str):
        self._file, self._name = file, name

    def __getitem__(self, index):
        if index is Ellipsis or index == slice(None):
            return file_backed(self._file._header, self._name)
        from .patching import _adopt

        return _adopt(self._file._handle.get_slice(self._name)[index])

    def get_shape(self):
        return list(self._file._header.entries[self._name].shape)

    def __getattr__(self, name):
        return getattr(self._file._handle.get_slice(self._name), name)


def safe_open_wrapper(wrapped, instance, args, kwargs):
    """The patched ``safe_open``: lazy for PyTorch tensors of a managed accelerator's host."""
    from .manager import tensorsManager as mgr
    from .patching import _is_disabled

    handle = wrapped(*args, **kwargs)
    framework = kwargs.get("framework", args[1] if len(args) > 1 else None)
    device = kwargs.get("device", args[2] if len(args) > 2 else "cpu")
    path = kwargs.get("filename", args[0] if args else None)
    if (framework not in ("pt", "torch") or str(device) != "cpu" or path is None or _is_disabled()
            or mgr._backend.passthrough):
        return handle
    return LazyFile(handle, path)
