"""Loading without reading: TensorRefs whose bytes stay in a safetensors checkpoint until used.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape
and byte range) and the tensors' bytes, contiguous and little-endian. So a tensor of the
file can be a block whose only copy is that byte range (Note [Three levels] in
``disk.py``): nothing is read when the model is loaded, the first op that uses a weight
reads it, and under a host budget its host copy is dropped for free and read again later.

``load_checkpoint(model, path)`` installs such TensorRefs in a model (one built on
``meta`` costs no memory at all); ``from_pretrained`` of transformers does the same for
local safetensors checkpoints (``transformers_loading``), and ``torch.load(path, mmap=True)``
for the storages of a file ``torch.save`` wrote (:func:`tie_mmapped`).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import threading
import zipfile
from typing import Dict, List, NamedTuple, Tuple

import torch

from ..core import context, raw
from ..memory.disk import FileRange, file_identity
from .on_device import HandleWrapper, OnDevice

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
    from ..memory.manager import tensorsManager as mgr

    entry = header.entries[name]
    with mgr.lock:
        mgr.drain()
        block = _file_block(FileRange(header.path, entry.offset, entry.nbytes, identity=header.identity))
        like = raw.empty(entry.shape, dtype=entry.dtype, device="meta")
        return _file_ref(block, like, parameter, requires_grad)


def _file_block(range_: FileRange):
    """A new block whose only copy is ``range_`` (the caller holds the manager's lock)."""
    from ..memory.manager import tensorsManager as mgr

    block = mgr.new_block(range_.nbytes)
    mgr.host_tier.set_disk(block, range_)
    mgr.strategy.on_adopt(block)
    return block


def _file_ref(block, like: torch.Tensor, parameter: bool, requires_grad: bool):
    """A TensorRef of ``block`` with the geometry of ``like`` (the caller holds the lock)."""
    from ..core.tensor_ref import make_ref
    from ..memory.manager import tensorsManager as mgr

    ref = make_ref(block, like, mgr.declared, requires_grad=requires_grad, geometry_only=True)
    if parameter:
        ref._is_param = True
    return ref


# -- torch.load(..., mmap=True) -------------------------------------------------------------------

def tie_mmapped(result, path):
    """``torch.load(path, mmap=True)``'s ``result`` with its tensors TensorRefs whose only copy
    is their range of the file, as :func:`file_backed` makes them; ``None`` when that cannot
    be done (the caller adopts ``result`` as usual, reading its bytes into host memory).

    PyTorch maps the whole file and gives each stored storage the slice at its record's
    offset; a storage is tied to a record when the one mapping's base puts every storage at
    a record of its size, and the first bytes of each match the file (what was loaded
    is what the file holds: a byte-swapped or converted storage is not tied).
    """
    from ..memory.manager import tensorsManager as mgr

    tensors = []
    if not _plain_tensors(result, tensors) or not tensors:
        return None
    path = os.path.abspath(os.fspath(path))
    ranges = _storage_ranges(path, tensors)
    if ranges is None:
        return None
    identity = file_identity(path)
    with mgr.lock:
        mgr.drain()
        blocks, refs = {}, {}
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in blocks:
                offset, nbytes = ranges[key]
                blocks[key] = _file_block(FileRange(path, offset, nbytes, identity=identity))
            like = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            ref = _file_ref(blocks[key], like, False, False)
            if t.storage_offset():  # (the wrapper's geometry is the view's: empty_strided has none)
                raw.set_geometry(ref, like.as_strided(t.size(), t.stride(), t.storage_offset()))
            refs[id(t)] = ref
    return _rebuilt(result, refs)


def _plain_tensors(obj, out: list) -> bool:
    """Collect the tensors of ``obj`` (dicts, lists, tuples of them); ``False`` if it holds
    anything else that holds tensors (a module, a subclass, a tensor off the CPU)."""
    if isinstance(obj, torch.Tensor):
        if (type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout is not torch.strided
                or not obj.is_cpu or obj.is_conj() or obj.is_neg()):
            return False
        out.append(obj)
        return True
    if isinstance(obj, dict):
        return all(_plain_tensors(v, out) for v in obj.values())
    if type(obj) in (list, tuple):
        return all(_plain_tensors(v, out) for v in obj)
    return not isinstance(obj, torch.nn.Module)


def _storage_ranges(path: str, tensors: list):
    """{storage data_ptr: (file offset, nbytes)} for the tensors' storages, or ``None``."""
    try:
        reader = torch._C.PyTorchFileReader(path)
        records = [n for n in reader.get_all_records() if n.startswith("data/")]
        found = list(zip((reader.get_record_offset(n) for n in records), _record_sizes(path, reader, records)))
        order = reader.get_record("byteorder") if reader.has_record("byteorder") else b"little"
    except (RuntimeError, OSError, KeyError, zipfile.BadZipFile):
        return None  # (not a zip archive: the legacy format is read, not mapped)
    if bytes(order).decode() != sys.byteorder:
        return None
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    by_offset = dict(found)
    first_ptr = min(storages)
    for offset, _size in found:  # the base the first storage's record would give
        base = first_ptr - offset
        ranges = {ptr: (ptr - base, n) for ptr, n in storages.items()}
        if all(by_offset.get(o) == n for o, n in ranges.values()) and _same_bytes(path, ranges):
            return ranges
    return None


def _record_sizes(path: str, reader, records: list) -> list:
    """The sizes in bytes of ``records`` of the archive ``path``.

    ``PyTorchFileReader.get_record_size`` is recent (torch 2.11 has none); without it the
    sizes are the zip central directory's, where a record ``r`` is ``<archive folder>/r``.
    """
    size = getattr(reader, "get_record_size", None)
    if size is not None:
        return [size(n) for n in records]
    with zipfile.ZipFile(path) as archive:
        sizes = {info.filename.partition("/")[2]: info.file_size for info in archive.infolist()}
    return [sizes[n] for n in records]


def _same_bytes(path: str, ranges: dict) -> bool:
    """Whether each storage's first bytes are its range's in the file."""
    with open(path, "rb") as f:
        for ptr, (offset, nbytes) in ranges.items():
            n = min(nbytes, 4096)
            f.seek(offset)
            on_disk = f.read(n)
            loaded = bytes((ctypes.c_char * n).from_address(ptr)) if n else b""
            if on_disk != loaded:
                return False
    return True


def _rebuilt(obj, refs: dict):
    """``obj`` with each tensor replaced by its TensorRef (a Parameter stays one)."""
    if isinstance(obj, torch.Tensor):
        ref = refs[id(obj)]
        if isinstance(obj, torch.nn.Parameter):
            ref._is_param = True  # (as ``file_backed`` makes parameters: no detach, which would read)
        if obj.requires_grad:
            ref.requires_grad_(True)
        if obj.__dict__:
            ref.__dict__.update(obj.__dict__)  # attributes users set (transformers marks parameters)
        return ref
    if isinstance(obj, dict):
        new = type(obj)()
        new.update((k, _rebuilt(v, refs)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            new._metadata = obj._metadata  # state dicts carry version metadata
        return new
    if type(obj) in (list, tuple):
        return type(obj)(_rebuilt(v, refs) for v in obj)
    return obj


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

class LazyFile(HandleWrapper):
    """A ``safe_open`` handle whose whole-tensor reads (``get_tensor(k)``, ``get_slice(k)[...]``)
    give file-backed TensorRefs; anything else (partial slices, metadata) is the real handle's."""

    def __init__(self, handle, path):
        super().__init__(handle)
        self._header = read_header(path)

    def get_tensor(self, name):
        return file_backed(self._header, name)

    def get_slice(self, name):
        return LazySlice(self, name)


class LazySlice:
    """``get_slice(name)``: ``[...]`` or ``[:]`` gives the whole tensor, file-backed."""

    def __init__(self, file: LazyFile, name: str):
        self._file, self._name = file, name

    def __getitem__(self, index):
        if index is Ellipsis or index == slice(None):
            return file_backed(self._file._header, self._name)
        from .manage import adopt

        return adopt(self._file.handle.get_slice(self._name)[index])

    def get_shape(self):
        return list(self._file._header.entries[self._name].shape)

    def __getattr__(self, name):
        return getattr(self._file.handle.get_slice(self._name), name)


class PlainFile(HandleWrapper):
    """A ``safe_open`` handle opened inside ``disabled()``: its reads give plain tensors in
    whichever thread makes them (transformers reads from a thread pool, where the opening
    thread's ``disabled()`` does not reach, and the tensors safetensors makes there were adopted)."""

    def get_tensor(self, name):
        from .plain import disabled

        with disabled():
            return self.handle.get_tensor(name)

    def get_slice(self, name):
        return PlainSlice(self.handle.get_slice(name))


class PlainSlice:
    """``get_slice(name)`` of a :class:`PlainFile`: indexing it gives a plain tensor."""

    def __init__(self, handle_slice):
        self._slice = handle_slice

    def __getitem__(self, index):
        from .plain import disabled

        with disabled():
            return self._slice[index]

    def __getattr__(self, name):
        return getattr(self._slice, name)


def safe_open_wrapper(wrapped, instance, args, kwargs):
    """The patched ``safe_open``: lazy for PyTorch tensors of a managed accelerator's host,
    plain in every thread when opened inside ``disabled()``."""
    from ..memory.manager import tensorsManager as mgr

    framework = kwargs.get("framework", args[1] if len(args) > 1 else None)
    device = kwargs.get("device", args[2] if len(args) > 2 else "cpu")
    if framework in ("pt", "torch") and isinstance(device, (str, torch.device)) and str(device).split(":")[0] == "sim":
        # (safetensors knows only real devices: read on the host, then moved as ``.to`` moves them)
        kwargs = {**kwargs, "device": "cpu"} if len(args) < 3 else kwargs
        args = args if len(args) < 3 else (*args[:2], "cpu", *args[3:])
        return OnDevice(safe_open_wrapper(wrapped, instance, args, kwargs), str(device), context.is_disabled())
    handle = wrapped(*args, **kwargs)
    path = kwargs.get("filename", args[0] if args else None)
    if framework not in ("pt", "torch"):
        return handle
    if context.is_disabled():
        return PlainFile(handle)
    if str(device) != "cpu" or path is None or mgr.backend.passthrough:
        return handle
    return LazyFile(handle, path)


def device_map_wrapper(wrapped, instance, args, kwargs):
    """The patched ``check_and_set_device_map`` of transformers (``from_pretrained``).

    Given no ``device_map``, transformers probes where ``torch.tensor([])`` lands. Under an
    accelerator manager that is the managed device, not ``torch.get_default_device()``, so
    transformers takes it for a ``torch.device`` context, loads the model there with a
    one-device map, and refuses to without accelerate (a one-device map uses nothing of it).
    Here that map is given without asking for accelerate, so the model loads to the managed
    device whether accelerate is installed or not; a device the caller set (a map, a context,
    ``set_default_device``) keeps transformers' own rules.
    """
    from ..memory.manager import tensorsManager as mgr

    device_map = kwargs.get("device_map", args[0] if args else None)
    zero3 = getattr(wrapped, "__globals__", {}).get("is_deepspeed_zero3_enabled", lambda: False)
    if (device_map is not None or context.is_disabled() or mgr.backend.passthrough or zero3()
            or torch.get_default_device().type != "cpu"):
        return wrapped(*args, **kwargs)
    probe = torch.tensor([]).device  # (transformers' probe: the managed device when the manager put it there)
    if not mgr.is_accelerator(probe):
        return wrapped(*args, **kwargs)
    return {"": probe}
