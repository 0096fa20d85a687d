"""The disk tier: file ranges that hold a block's bytes below host memory.

Note [Three levels]: a block's bytes may live in accelerator memory (``dev``), host memory
(``host``) and on disk (``disk``), and at least one of them holds the current bytes. A
disk copy is a :class:`FileRange`, of one of two kinds:

- a range of a *checkpoint* (a safetensors file): the block's bytes came from there and
  have not been written since. Dropping the host copy of such a *clean* block costs
  nothing, and bringing it back is a read of that range. The file is only ever opened for
  reading;
- a *slot* of the spill file in ``tensorsManager.offload_dir``, written when a block that
  has no clean copy anywhere (a trained weight, optimizer state, an activation) must leave
  host memory.

Any write to the block (an op, ``write_view``) makes the disk copy stale: it is dropped
(a slot goes back to the spill file's free list). Reads and writes run on one background
thread (:class:`DiskIO`), so the op stream does not wait for the disk unless it needs the
bytes now; the manager changes blocks only on its own thread, when it learns that an
operation ended (``DiskPending``).
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import stat
import tempfile
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ..core.sizes import format_size
from .streams import Pending


class DiskError(OSError):
    """The disk tier could not read or write: the message names the file and the setting."""


class CheckpointChangedError(DiskError):
    """A checkpoint file that TensorRefs read their bytes from changed or shrank while in use."""


# Note [Checkpoint changes]: a block whose only copy is a range of a checkpoint reads that
# range whenever it comes back, possibly many times, so the file must not change while the
# blocks live. Each read of a range checks, against what was found before:
#
# - always: the file's size, modification time and inode, taken when it was opened for
#   loading (a file replaced, rewritten with another length, or touched);
# - at the range's first read: a CRC-32 of three samples of ``SAMPLE_BYTES`` at the file's
#   start, middle and end, taken when it was opened for loading. A file rewritten in place
#   with its size and modification time kept is found where the rewrite changed a sample: a
#   safetensors file's data at its middle and end, a ``torch.save`` archive's central
#   directory at its end (it holds each record's CRC-32);
# - at every later read: the range's checksum, taken at its first read: the sum of its
#   8-byte words, wrapping, over the whole range up to ``RANGE_SAMPLES`` pages of
#   ``SAMPLE_BYTES``, else over that many pages spread evenly across it, its first and last
#   among them. A tensor written again with other values changes every one of them;
# - once a check found a change, every later read of that file raises, until the file is
#   loaded again (``file_identity`` is taken anew).
#
# Not found: bytes changed only outside the pages a range's checksum covers, changes that
# leave the sum as it was (words swapped), and a change to a range not read before that left
# the file's three samples as they were. A checksum of every byte would take about as long
# as the read itself; the pages checked take a small part of it.
SAMPLE_BYTES = 4096
#: pages of ``SAMPLE_BYTES`` of a range whose checksum is compared at each read: a range of
#: at most this many pages is checked whole (Note [Checkpoint changes])
RANGE_SAMPLES = 16
_changed_files: set = set()  # (path, identity) of checkpoints found changed: no read of them is trusted


class FileRange:
    """``nbytes`` bytes at ``offset`` of the file ``path``.

    ``spill`` is the :class:`SpillFile` that owns the range (its slot goes back when the
    block no longer needs it), ``None`` for a checkpoint, whose identity
    (:func:`file_identity`) is taken when it is opened and checked at every read, with the
    checksum of the range's bytes from its first read (Note [Checkpoint changes]).
    """

    __slots__ = ("path", "offset", "nbytes", "spill", "_identity", "_sum")

    def __init__(self, path: str, offset: int, nbytes: int, spill: Optional["SpillFile"] = None,
                 identity: Optional[tuple] = None):
        self.path, self.offset, self.nbytes, self.spill = path, offset, nbytes, spill
        self._identity = identity
        self._sum: Optional[int] = None  # the checksum of the bytes the first read found

    def read_into(self, buffer: torch.Tensor) -> None:
        """Fill the flat uint8 CPU tensor ``buffer`` (``nbytes`` long) with the range's bytes."""
        if self.spill is not None:
            self.spill.read(self.offset, buffer)
            return
        with _open_checked(self.path, self._identity, samples=self._sum is None) as fd:
            view = _read_exactly(fd, self.offset, buffer, self.path)
            # The bytes are a host copy now, within the host budget: the page cache would only
            # hold a second copy of them outside it.
            os.posix_fadvise(fd, self.offset, self.nbytes, os.POSIX_FADV_DONTNEED)
        total = _checksum(view)
        if self._sum is None:
            self._sum = total
        elif total != self._sum:
            _changed_files.add((self.path, self._identity))
            raise CheckpointChangedError(
                errno.ESTALE, f"checkpoint {self.path} changed while TensorRefs still read their bytes from it: "
                              f"bytes {self.offset} to {self.offset + self.nbytes} differ from their first read, "
                              f"though its size and modification time are the same (written in place): write new "
                              f"checkpoints to another file, or load this one again")

    def release(self) -> None:
        """The block no longer needs these bytes (a spill slot is freed; a checkpoint is left alone)."""
        if self.spill is not None:
            self.spill.free(self.offset, self.nbytes)
            self.spill = None

    def __repr__(self) -> str:
        kind = "spill" if self.spill is not None else "checkpoint"
        return f"FileRange({kind} {self.path!r}, offset={self.offset}, nbytes={self.nbytes})"


def _checksum(view: memoryview) -> int:
    """The checksum of a checkpoint range's bytes (Note [Checkpoint changes]): the sum of its
    8-byte words, wrapping at 2**64, and of its last bytes; over the whole range up to
    ``RANGE_SAMPLES`` pages of ``SAMPLE_BYTES``, else over that many pages spread evenly
    across it and its last page."""
    import numpy as np  # (as ``Tensor.numpy`` does, where the disk tier reads: not at import)

    data = np.frombuffer(view, dtype=np.uint8)
    pages = len(data) // SAMPLE_BYTES
    if pages <= RANGE_SAMPLES:
        whole = len(data) // 8 * 8
        words = data[:whole].view(np.uint64).sum(dtype=np.uint64)
        return int(words) + int.from_bytes(data[whole:].tobytes(), "little")
    step = -(-pages // (RANGE_SAMPLES - 1))  # (the last page is added apart: at most RANGE_SAMPLES in all)
    rows = data[:pages * SAMPLE_BYTES].view(np.uint64).reshape(pages, SAMPLE_BYTES // 8)[::step]
    return int(rows.sum(dtype=np.uint64)) + int(data[-SAMPLE_BYTES:].view(np.uint64).sum(dtype=np.uint64))


def file_identity(path: str) -> tuple:
    """What must not change while TensorRefs read from ``path``: its size, modification
    time, inode and the CRC-32 of samples of its bytes (Note [Checkpoint changes])."""
    fd = os.open(path, os.O_RDONLY)
    try:
        identity = _identity_of(fd)
    finally:
        os.close(fd)
    _changed_files.discard((path, identity))  # (loaded again: the file as it is now is the one read)
    return identity


def _identity_of(fd: int, samples: bool = True) -> tuple:
    """:func:`file_identity` of the open file ``fd``; without ``samples``, its first three fields."""
    st = os.fstat(fd)
    if not samples:
        return (st.st_size, st.st_mtime_ns, st.st_ino)
    crc = 0
    for offset in sorted({0, st.st_size // 2, max(st.st_size - SAMPLE_BYTES, 0)}):
        crc = zlib.crc32(os.pread(fd, SAMPLE_BYTES, offset), crc)
    return (st.st_size, st.st_mtime_ns, st.st_ino, crc)


def _what_changed(before: tuple, now: tuple) -> str:
    if before[0] != now[0]:
        return f"size {before[0]} -> {now[0]} bytes"
    if before[2] != now[2]:
        return "replaced by another file"
    if before[1] != now[1]:
        return "a newer modification time"
    return "its bytes differ, though its size and modification time are the same: written in place"


class _open_checked:
    """Open a checkpoint read-only, after checking it is the file its ranges were made from
    (its samples too where ``samples``: for a range's first read, which has no checksum of
    its own to compare with yet)."""

    def __init__(self, path: str, identity: Optional[tuple], samples: bool = True):
        self.path, self.identity, self.samples = path, identity, samples

    def __enter__(self) -> int:
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointChangedError(
                errno.ENOENT, f"checkpoint {self.path} was removed while TensorRefs still read their bytes "
                              f"from it: keep checkpoint files in place while the model loaded from them is in use")
        if self.identity is None:
            return self.fd
        now = _identity_of(self.fd, self.samples)
        same = now == self.identity[:len(now)]
        if not same or (self.path, self.identity) in _changed_files:
            os.close(self.fd)
            _changed_files.add((self.path, self.identity))
            what = "a range read before differs" if same else _what_changed(self.identity, now)
            raise CheckpointChangedError(
                errno.ESTALE, f"checkpoint {self.path} changed while TensorRefs still read their bytes from it "
                              f"({what}): write new checkpoints to another file, or load this one again")
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _read_exactly(fd: int, offset: int, buffer: torch.Tensor, path: str) -> memoryview:
    """Fill ``buffer`` with the bytes at ``offset`` of ``fd``; returns them, as a view of ``buffer``."""
    view = buffer.numpy().data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointChangedError(
                errno.EIO, f"{path} ends before byte {offset + len(view)}: it was truncated while in use")
        done += n
    return view


# Note [Spill files at exit]: a spill file is the manager's own, whichever folder holds it:
# the bytes in it mean nothing without the process that wrote them. Each one is removed by
# ``SpillFile.close`` or, failing that, at a normal exit of the process that made it (not by
# a child that inherited the list through fork), if the path still names the file it made.
# The folder and any other file in it are never touched; the default temporary folder is
# removed as a whole.
_spill_files: Dict[str, Tuple[int, int, int]] = {}  # path -> (pid that made it, st_dev, st_ino)
_spill_lock = threading.Lock()


def _remove_spill_files() -> None:
    """Remove the spill files this process made and did not remove (Note [Spill files at exit])."""
    with _spill_lock:
        made = list(_spill_files.items())
        _spill_files.clear()
    for path, (pid, device, inode) in made:
        try:
            st = os.stat(path)
            if pid == os.getpid() and (st.st_dev, st.st_ino) == (device, inode):
                os.unlink(path)
        except FileNotFoundError:
            pass


atexit.register(_remove_spill_files)


class SpillFile:
    """One file in ``directory`` holding the bytes of blocks that left host memory.

    Slots are reused by size (blocks of a model come in a few sizes); the file is made on
    the first write and removed by :meth:`close`, or at exit (Note [Spill files at exit]).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, f"torchTensorRef-spill-{os.getpid()}-{id(self):x}.bin")
        self._fd: Optional[int] = None
        self._end = 0
        self._free: Dict[int, List[int]] = {}
        self._lock = threading.Lock()  # slots are taken on the manager's thread, freed from it too
        self.used = 0
        self._retired = False

    def allocate(self, nbytes: int) -> int:
        """The offset of a free slot of ``nbytes``."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                offset = free.pop()
            else:
                offset, self._end = self._end, self._end + nbytes
            self.used += nbytes
            return offset

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._free.setdefault(nbytes, []).append(offset)
            self.used -= nbytes
            last = self._retired and not self.used
        if last:
            self.close()

    def retire(self) -> None:
        """No new slots: the file goes when its last slot is freed (now, if none is used)."""
        self._retired = True
        if not self.used:
            self.close()

    def _file(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as e:
                raise DiskError(e.errno, f"cannot create the spill file {self.path}: {e.strerror}; "
                                         f"set tensorsManager.offload_dir to a writable folder") from e
            st = os.fstat(self._fd)
            if stat.S_ISREG(st.st_mode):  # (a regular file it made: never a device given as the path)
                with _spill_lock:
                    _spill_files[self.path] = (os.getpid(), st.st_dev, st.st_ino)
        return self._fd

    def write(self, offset: int, buffer: torch.Tensor) -> None:
        view = buffer.numpy().data
        fd = self._file()
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            hint = ("the disk is full" if e.errno == errno.ENOSPC else e.strerror)
            raise DiskError(e.errno, f"writing {format_size(len(view))} to {self.path} failed: {hint}; "
                                     f"free space there or set tensorsManager.offload_dir to another "
                                     f"folder (the bytes are still in host memory)") from e

    def read(self, offset: int, buffer: torch.Tensor) -> None:
        _read_exactly(self._file(), offset, buffer, self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            with _spill_lock:
                _spill_files.pop(self.path, None)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class DiskPending(Pending):
    """A read or write on the disk thread (Note [Pending copies]): waiting blocks the host."""

    __slots__ = ("future",)

    def __init__(self, future: Future):
        self.future = future

    def wait_host(self) -> None:
        self.future.result()  # (re-raises the thread's DiskError here)

    wait_compute = wait_host  # a device cannot wait on a thread: the host does

    def done(self) -> bool:
        return self.future.done()


class DiskIO:
    """The background thread for disk reads and writes, one at a time in submission order."""

    def __init__(self):
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable[..., object], *args: object) -> DiskPending:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchTensorRef-disk")
        return DiskPending(self._pool.submit(fn, *args))


def default_offload_dir() -> str:
    """A temporary folder for spill files, removed when the process exits."""
    path = tempfile.mkdtemp(prefix="torchTensorRef-offload-")
    atexit.register(shutil.rmtree, path, True)
    return path


def check_offload_dir(path: Union[str, os.PathLike]) -> str:
    """``path`` as a folder that exists (made if needed) and is writable; else ``ValueError``."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"offload_dir must be a folder path (str or os.PathLike) or None (got: {type(path).__name__})")
    if os.fspath(path) == "":
        raise ValueError('offload_dir must be a folder path or None (got: \'\'): give the folder, "." for the '
                         "current one, or None for a temporary folder")
    path = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"offload_dir {path!r} cannot be created: {e.strerror}; give a writable folder or None "
                         f"(a temporary folder)") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"offload_dir {path!r} is not a writable folder; give a writable folder or None "
                         f"(a temporary folder)")
    return path
