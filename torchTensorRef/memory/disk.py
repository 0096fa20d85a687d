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
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from ..core.sizes import format_size
from .streams import Pending


class DiskError(OSError):
    """The disk tier could not read or write: the message names the file and the setting."""


class CheckpointChangedError(DiskError):
    """A checkpoint file that TensorRefs read their bytes from changed or shrank while in use."""


class FileRange:
    """``nbytes`` bytes at ``offset`` of the file ``path``.

    ``spill`` is the :class:`SpillFile` that owns the range (its slot goes back when the
    block no longer needs it), ``None`` for a checkpoint, whose identity (size,
    modification time, inode) is taken when it is opened and checked at every read.
    """

    __slots__ = ("path", "offset", "nbytes", "spill", "_identity")

    def __init__(self, path: str, offset: int, nbytes: int, spill: Optional["SpillFile"] = None,
                 identity: Optional[tuple] = None):
        self.path, self.offset, self.nbytes, self.spill = path, offset, nbytes, spill
        self._identity = identity

    def read_into(self, buffer: torch.Tensor) -> None:
        """Fill the flat uint8 CPU tensor ``buffer`` (``nbytes`` long) with the range's bytes."""
        if self.spill is not None:
            self.spill.read(self.offset, buffer)
            return
        with _open_checked(self.path, self._identity) as fd:
            _read_exactly(fd, self.offset, buffer, self.path)
            # The bytes are a host copy now, within the host budget: the page cache would only
            # hold a second copy of them outside it.
            os.posix_fadvise(fd, self.offset, self.nbytes, os.POSIX_FADV_DONTNEED)

    def release(self) -> None:
        """The block no longer needs these bytes (a spill slot is freed; a checkpoint is left alone)."""
        if self.spill is not None:
            self.spill.free(self.offset, self.nbytes)
            self.spill = None

    def __repr__(self) -> str:
        kind = "spill" if self.spill is not None else "checkpoint"
        return f"FileRange({kind} {self.path!r}, offset={self.offset}, nbytes={self.nbytes})"


def file_identity(path: str) -> tuple:
    """What must not change while TensorRefs read from ``path``."""
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class _open_checked:
    """Open a checkpoint read-only, after checking it is the file its ranges were made from."""

    def __init__(self, path: str, identity: Optional[tuple]):
        self.path, self.identity = path, identity

    def __enter__(self) -> int:
        try:
            now = file_identity(self.path)
        except FileNotFoundError:
            raise CheckpointChangedError(
                errno.ENOENT, f"checkpoint {self.path} was removed while TensorRefs still read their bytes "
                              f"from it: keep checkpoint files in place while the model loaded from them is in use")
        if self.identity is not None and now != self.identity:
            raise CheckpointChangedError(
                errno.ESTALE, f"checkpoint {self.path} changed while TensorRefs still read their bytes from it "
                              f"(size {self.identity[0]} -> {now[0]} bytes or a newer modification time): "
                              f"write new checkpoints to another file, or load this one again")
        self.fd = os.open(self.path, os.O_RDONLY)
        return self.fd

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _read_exactly(fd: int, offset: int, buffer: torch.Tensor, path: str) -> None:
    view = memoryview(buffer.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointChangedError(
                errno.EIO, f"{path} ends before byte {offset + len(view)}: it was truncated while in use")
        done += n


class SpillFile:
    """One file in ``directory`` holding the bytes of blocks that left host memory.

    Slots are reused by size (blocks of a model come in a few sizes); the file is made on
    the first write and removed by :meth:`close` (at exit for the default folder).
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
        return self._fd

    def write(self, offset: int, buffer: torch.Tensor) -> None:
        view = memoryview(buffer.numpy())
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

    def submit(self, fn, *args) -> DiskPending:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchTensorRef-disk")
        return DiskPending(self._pool.submit(fn, *args))


def default_offload_dir() -> str:
    """A temporary folder for spill files, removed when the process exits."""
    path = tempfile.mkdtemp(prefix="torchTensorRef-offload-")
    atexit.register(shutil.rmtree, path, True)
    return path


def check_offload_dir(path) -> str:
    """``path`` as a folder that exists (made if needed) and is writable; else ``ValueError``."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"offload_dir must be a folder path (str or os.PathLike) or None (got: {type(path).__name__})")
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
