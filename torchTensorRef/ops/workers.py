"""DataLoader workers: what an op on a TensorRef does in a forked worker process.

Note [Forked workers]: a dataset built after ``import torchTensorRef`` holds TensorRefs
(``TensorDataset(torch.randn(...))``), and ``DataLoader(num_workers=N)`` forks processes
that index it. A worker is not the manager's process: on CUDA it cannot touch the device
(PyTorch refuses CUDA in a forked child), its copies of the manager's tables are private
and die with it, and what it returns travels to the main process through shared memory,
which only plain CPU tensors have. So in a worker an op on TensorRefs runs on their
current bytes where the process can read them (the host copy; on ``"sim"`` the device
copy, which is host memory; a disk copy, read into a private buffer) and returns plain CPU
tensors, as the same dataset of CPU tensors gives in plain torch; a dataset that returns
its TensorRefs as they are is collated from their bytes the same way
(``collate_tensor_refs``). Bytes only in CUDA memory cannot be read there: the error says
to build the dataset with ``device="cpu"`` or inside ``torchTensorRef.disabled()``.
Creation functions in a worker already make plain tensors (``core.context.is_disabled``).

After a fork the child also gets a new manager lock: a thread of the parent (the disk
thread, autograd's) may have held it, and that thread does not exist in the child.
"""

from __future__ import annotations

import os
import threading

import torch
from torch.utils import _pytree as pytree
from torch.utils.data._utils import collate as _collate

from ..core import raw
from ..core.tensor_ref import TensorRef, view_on, block_of
from ..memory.manager import tensorsManager as _mgr


def in_worker() -> bool:
    """Whether this process is a DataLoader worker forked from the manager's process."""
    return _mgr.forked and torch.utils.data.get_worker_info() is not None


def run_in_worker(func, args, kwargs):
    """Run aten ``func`` on the plain bytes of its TensorRef arguments (Note [Forked workers])."""
    args, kwargs = pytree.tree_map_only(TensorRef, readable_bytes, (args, kwargs))
    return func(*args, **kwargs)


def readable_bytes(ref: TensorRef) -> torch.Tensor:
    """A plain CPU tensor viewing ``ref``'s current bytes, in a forked worker."""
    block = block_of(ref)
    if block.dev is not None:
        if not _mgr.backend.simulated:
            if not block.host_valid or block.host_pending is not None:
                raise RuntimeError(
                    "a DataLoader worker process cannot read a tensor whose bytes are only in "
                    "accelerator memory (a forked process cannot use CUDA): make the dataset's "
                    "tensors with device=\"cpu\", or inside torchTensorRef.disabled()")
            storage = block.host
        else:
            if block.dev_pending is not None:
                block.dev_pending.wait_compute()  # (a copy "sim" deferred: it runs here, on host memory)
            storage = block.dev
    elif block.host is not None and block.host_valid:
        if block.host_pending is not None:
            block.host_pending.wait_compute()
        storage = block.host
    else:
        buffer = raw.empty(block.nbytes, dtype=raw.UINT8)
        block.disk.read_into(buffer)  # (not through the manager: its disk thread is the parent's)
        storage = buffer.untyped_storage()
    return view_on(ref, storage)


def collate_tensor_refs(batch, *, collate_fn_map=None):
    """``default_collate`` for TensorRefs: in a worker, of their plain bytes (the default asks
    for shared memory on the tensors' device, the accelerator); elsewhere, as for any tensor."""
    if in_worker():
        batch = [readable_bytes(t) if isinstance(t, TensorRef) else t for t in batch]
    return _collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def _after_fork_in_child() -> None:
    _mgr.forked = True
    _mgr.lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
# (the map is how torch.utils.data lets a tensor type have its own collate)
_collate.default_collate_fn_map[TensorRef] = collate_tensor_refs
