"""torch.distributed with TensorRefs: what needs adjusting beyond the collectives themselves.

Each process has its own ``tensorsManager``, on its own device (``"cuda"`` resolves to the
process's ``LOCAL_RANK`` or current device; ``"sim"`` is a simulated device per process)
and under its own budget. The collectives run through the manager (Note [Collectives] in
``ops/collectives.py``). These functions of torch's are wrapped here (the wrappers are
installed and removed with the rest by ``patch()`` / ``unpatch()``):

- ``torch.distributed._broadcast_coalesced``, which DDP uses to copy rank 0's parameters
  and buffers to the other ranks, flattens them into buckets of 250 MiB: one op on such a
  bucket would have to fit the budget. Under a budget the buckets are made small enough.
- ``nn.DataParallel``, which copies a module onto several GPUs of one process: the manager
  pages one device, so that is refused with what to use instead.
- ``DistributedDataParallel``, whose ``find_unused_parameters=True`` needs pinned memory of
  the device, which ``"sim"`` cannot give: refused when DDP is built, not in backward.
- FSDP2's ``fully_shard``, ``alloc_storage`` and ``free_storage`` (Note [FSDP2 on TensorRefs]),
  wrapped when ``torch.distributed.fsdp`` is imported.

Note [FSDP2 on TensorRefs]: FSDP2 gathers each group's parameters into buffers of its own
before the group's forward and backward, and frees them after by resizing their storage to
nothing; the next gather gives the bytes back and writes all of them before any is read.
On TensorRefs the manager owns those bytes: the shards, the gathered parameters, the
gradients and the optimizer's state are blocks like any other, paged under the budget.
FSDP2's free becomes ``tensorsManager.discard``: the accelerator copy is dropped without
being written back (its bytes are dead), and its give-back does nothing (the block keeps its
size; the gather writes it). FSDP2's ``all_gather_copy_in`` writes the all-gather buffer
without saying so in its schema: ``core/op_specs.py`` marks it. The rest FSDP2 asks of the
device is its streams, which ``"sim"`` provides as no-ops (Note [Streams of sim for PyTorch
code] in ``streams.py``).
Refused at ``fully_shard``, before it changes the module: CUDA (FSDP2's side streams and the
manager's frees are not ordered yet) and ``CPUOffloadPolicy`` (the manager already offloads).
"""

from __future__ import annotations

import inspect

import torch

#: ``(owner, name)`` of the functions wrapped here, for ``patching.patch()``
FUNCTIONS = (
    ("torch.distributed", "_broadcast_coalesced"),
    ("torch.nn.parallel.data_parallel:DataParallel", "__init__"),
    ("torch.nn.parallel.distributed:DistributedDataParallel", "__init__"),
    ("torch.distributed.fsdp", "fully_shard"),
    ("torch.distributed.fsdp._fully_shard", "fully_shard"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "alloc_storage"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "free_storage"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "alloc_storage"),
)
#: modules torch imports on demand: ``FUNCTIONS`` of theirs are wrapped when they are imported
LATE_MODULES = ("torch.distributed.fsdp",)

DDP_UNUSED_ERROR = (
    "DistributedDataParallel(find_unused_parameters=True) cannot run on TensorRefs of \"sim\": DDP "
    "stages its map of the parameters used in each step in pinned memory of the device, which a "
    "device registered from Python cannot allocate. The module is left as it was. Leave "
    "find_unused_parameters out (every parameter must then get a gradient in every step), or check "
    "it on device \"cpu\" (pass-through)"
)
FSDP_CUDA_ERROR = (
    "FSDP2 (fully_shard) cannot run on TensorRefs on device {device!r}: FSDP2 runs its all-gathers "
    "and reduce-scatters on CUDA streams of its own, and the manager frees and reuses device memory "
    "in the order of the current stream only. The module is left as it was. Use "
    "DistributedDataParallel on {device!r}, or FSDP2 on device \"sim\" or \"cpu\" (docs/distributed.md)"
)
FSDP_OFFLOAD_ERROR = (
    "FSDP2 (fully_shard) with offload_policy=CPUOffloadPolicy() on TensorRefs: the manager already "
    "keeps in host memory what does not fit its budget, and two mechanisms would move the same "
    "bytes. The module is left as it was. Leave offload_policy out and set tensorsManager.budget"
)

DATA_PARALLEL_ERROR = (
    "nn.DataParallel over {n} GPUs cannot run on TensorRefs: the manager of a process pages "
    "one device ({device}), and DataParallel copies the module onto every GPU of the process. "
    "Use DistributedDataParallel with one process per GPU (torchrun --nproc-per-node {n} "
    "-m torchTensorRef run train.py), or DataParallel(module, device_ids=[{index}])"
)


def _has_refs(values) -> bool:
    from ..core.tensor_ref import TensorRef

    return any(isinstance(v, TensorRef) for v in values)


def broadcast_coalesced_wrapper(wrapped, instance, args, kwargs):
    """Broadcast TensorRefs in buckets that fit the budget (flatten and copy back need ~2x)."""
    from ..memory.manager import tensorsManager

    share = tensorsManager.accounting.share()  # (not the budget: what is outside it is no room)
    names = ("process_group", "tensors", "buffer_size", "src")
    bound = dict(zip(names, args), **kwargs)
    if share is not None and "buffer_size" in bound and _has_refs(bound.get("tensors", ())):
        bound["buffer_size"] = max(min(int(bound["buffer_size"]), share // 4), 1)
        args = tuple(bound.pop(n) for n in names[:len(args)])
        kwargs = bound
    return wrapped(*args, **kwargs)


def data_parallel_wrapper(wrapped, instance, args, kwargs):
    """``DataParallel.__init__``: refuse to replicate a managed module onto several GPUs."""
    from ..memory.manager import tensorsManager

    module = args[0] if args else kwargs.get("module")
    device_ids = args[1] if len(args) > 1 else kwargs.get("device_ids")
    if isinstance(module, torch.nn.Module) and torch.cuda.is_available():
        count = len(device_ids) if device_ids is not None else torch.cuda.device_count()
        managed = _has_refs(module.parameters()) or _has_refs(module.buffers())
        if managed and count > 1:
            device = tensorsManager.torch_device
            raise RuntimeError(DATA_PARALLEL_ERROR.format(n=count, device=device, index=device.index or 0))
    return wrapped(*args, **kwargs)


def ddp_wrapper(wrapped, instance, args, kwargs):
    """``DistributedDataParallel.__init__``: refuse what cannot run on ``"sim"``, before DDP starts."""
    from ..memory.manager import tensorsManager

    if tensorsManager.backend.name == "sim":
        bound = inspect.signature(wrapped).bind(*args, **kwargs).arguments  # (wrapped: bound to the instance)
        module = bound.get("module")
        if bound.get("find_unused_parameters") and isinstance(module, torch.nn.Module) and _managed([module]):
            raise ValueError(DDP_UNUSED_ERROR)
    return wrapped(*args, **kwargs)


def _managed(modules) -> bool:
    from torch.distributed.tensor import DTensor

    tensors = [t for m in modules for t in list(m.parameters()) + list(m.buffers())]
    return _has_refs(t.to_local() if isinstance(t, DTensor) else t for t in tensors)


def fully_shard_wrapper(wrapped, instance, args, kwargs):
    """``fully_shard``: refuse a managed module where FSDP2 cannot run, before it changes anything."""
    from ..memory.manager import tensorsManager

    module = args[0] if args else kwargs.get("module")
    modules = [module] if isinstance(module, torch.nn.Module) else list(module or ())
    if _managed(modules):
        from torch.distributed.fsdp import CPUOffloadPolicy

        if isinstance(kwargs.get("offload_policy"), CPUOffloadPolicy):
            raise ValueError(FSDP_OFFLOAD_ERROR)
        if tensorsManager.backend.name == "cuda":
            raise RuntimeError(FSDP_CUDA_ERROR.format(device=tensorsManager.device))
    return wrapped(*args, **kwargs)


def alloc_storage_wrapper(wrapped, instance, args, kwargs):
    """FSDP2 gives a gathered parameter its bytes back before the all-gather writes them
    (Note [FSDP2 on TensorRefs]): a TensorRef's block has them all along."""
    from ..core.tensor_ref import TensorRef

    tensor = args[0] if args else kwargs.get("tensor")
    if isinstance(tensor, TensorRef):
        return None
    return wrapped(*args, **kwargs)


def free_storage_wrapper(wrapped, instance, args, kwargs):
    """FSDP2 frees a gathered parameter (Note [FSDP2 on TensorRefs]): the manager drops its
    accelerator copy without writing it back."""
    from ..core.tensor_ref import TensorRef
    from ..memory.manager import tensorsManager

    tensor = args[0] if args else kwargs.get("tensor")
    if isinstance(tensor, TensorRef):
        return tensorsManager.discard(tensor)
    return wrapped(*args, **kwargs)


def wrapper_for(owner: str, name: str):
    """The wrapt wrapper function of an entry of ``FUNCTIONS``."""
    if name == "__init__":
        return ddp_wrapper if owner.endswith(":DistributedDataParallel") else data_parallel_wrapper
    return {"_broadcast_coalesced": broadcast_coalesced_wrapper, "fully_shard": fully_shard_wrapper,
            "alloc_storage": alloc_storage_wrapper, "free_storage": free_storage_wrapper}[name]
