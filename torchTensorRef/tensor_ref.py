"""``TensorRef``: a real ``torch.Tensor`` whose bytes the tensorsManager moves.

A TensorRef is a wrapper subclass: it has the metadata of a tensor (shape, dtype,
requires_grad, autograd history) but no bytes of its own. Its bytes live in a storage
block (Note [Blocks and coherence], ``blocks.py``) that may be in host memory, in
accelerator memory or both. Every aten op on it reaches ``__torch_dispatch__`` *below*
autograd, so autograd, ``nn.Module``, ``nn.Parameter`` and optimizers work unmodified and
the tensors autograd saves for backward are TensorRefs too.

A few Tensor methods reach the bytes without an aten op (``numpy``, ``tolist``,
``data_ptr``, ``untyped_storage``, pickling, ``deepcopy``, ``repr``); they are overridden
here to read the host copy.
"""

from __future__ import annotations

import threading
import weakref

import torch

from . import raw
from .blocks import Block

_make_wrapper = torch.Tensor._make_wrapper_subclass
_saving = threading.local()


def _manager():
    from .manager import tensorsManager

    return tensorsManager


class TensorRef(torch.Tensor):
    """A tensor whose data the global ``tensorsManager`` keeps in RAM or VRAM.

    ``TensorRef(t)`` manages an existing plain tensor ``t`` (sharing its bytes). Tensors
    made by torch's creation functions after ``import torchTensorRef`` are TensorRefs
    already, and so is every result of an op on a TensorRef.

    Attributes:
        target: the plain tensor holding the data right now (read it, do not write it).
        proxyInfo: a :class:`~torchTensorRef.proxy_info.ProxyInfo`.
    """

    # Internals, all prefixed to stay clear of torch.Tensor's own attributes:
    #   _tr_block: the Block; _tr_view: cached plain view of its current copy;
    #   _tr_gen: the block generation the view was made for; _tr_wr: liveness weakref.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, data: torch.Tensor, requires_grad: bool | None = None):
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"TensorRef(data) needs a torch.Tensor (got: {type(data).__name__})")
        return _manager().manage_tensor(data, requires_grad=requires_grad)

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .ops.dispatch import dispatch

        return dispatch(func, args, kwargs or {})

    # -- the proxy API -------------------------------------------------------------------

    @property
    def target(self) -> torch.Tensor:
        """The plain tensor holding this TensorRef's data right now."""
        with _manager()._lock:
            return compute_view(self)

    @property
    def proxyInfo(self):
        """Where the data is and what the manager tracks (a ``ProxyInfo``)."""
        from .proxy_info import ProxyInfo

        return ProxyInfo(self)

    def toGPU(self) -> "TensorRef":
        """Move the data to the accelerator now (within the budget); return ``self``."""
        _manager().move_to_device(self)
        return self

    def toCPU(self) -> "TensorRef":
        """Move the data to host memory now (writing back changes); return ``self``."""
        _manager().move_to_host(self)
        return self

    # -- Tensor methods that reach the bytes without an aten op -------------------------

    def numpy(self, *, force: bool = False):
        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        # The array shares the host copy, so keep no accelerator copy that would hide its writes.
        _manager().move_to_host(self)
        return host_view(self).numpy()

    def tolist(self):
        return host_copy(self).tolist()

    def untyped_storage(self) -> torch.UntypedStorage:
        _manager().move_to_host(self)
        return self._tr_block.host

    def data_ptr(self) -> int:
        storage = self.untyped_storage()
        return storage.data_ptr() + self.storage_offset() * self.element_size()

    def __repr__(self, *, tensor_contents=None) -> str:
        text = repr(host_copy(self))
        extra = ""
        if self.device.type != "cpu":
            extra += f", device='{self.device}'"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        if extra:
            text = text[:-1] + extra + ")"
        if getattr(self, "_is_param", False):
            text = "Parameter containing:\n" + text
        return text

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __reduce_ex__(self, protocol):
        plain = host_copy(self, share=True)
        if self.requires_grad and self.is_leaf:
            plain.requires_grad_(True)
        if getattr(_saving, "active", False):
            # torch.save: write plain tensors, readable with weights_only=True and without us.
            return plain.__reduce_ex__(protocol)
        return (_rebuild, (plain, bool(getattr(self, "_is_param", False))))

    def __deepcopy__(self, memo):
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol at the moment."
            )
        if id(self) in memo:
            return memo[id(self)]
        new = _manager().clone_ref(self, memo)
        memo[id(self)] = new
        return new

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        # ``p.data = t`` copies t's metadata into p's C++ tensor but not our block: rebind it.
        if not isinstance(new, TensorRef):
            new = _manager().manage_tensor(new)
        torch._C.TensorBase.data.__set__(self, new)
        _manager().rebind(self, new)


def _rebuild(plain: torch.Tensor, is_param: bool):
    ref = _manager().manage_tensor(plain)
    if is_param:
        return torch.nn.Parameter(ref, requires_grad=plain.requires_grad)
    return ref


def make_ref(block: Block, view: torch.Tensor, declared: torch.device, requires_grad=False) -> TensorRef:
    """Wrap the plain ``view`` (a view of ``block``'s current copy) in a new TensorRef."""
    ref = _make_wrapper(
        TensorRef, view.size(), strides=view.stride(), storage_offset=view.storage_offset(),
        dtype=view.dtype, device=declared, requires_grad=requires_grad,
    )
    if view.is_conj():
        torch._C._set_conj(ref, True)  # conj() and neg views are lazy: the bit is the value
    if view.is_neg():
        torch._C._set_neg(ref, True)
    ref._tr_block = block
    ref._tr_view = view
    ref._tr_gen = block.gen
    block.refs += 1
    ref._tr_wr = weakref.ref(ref, block.on_ref_dead)
    return ref


def compute_view(ref: TensorRef) -> torch.Tensor:
    """Plain view of ``ref`` on its block's current copy (the accelerator copy if valid).

    The caller holds the manager's lock and, for an op, has made the block resident.
    """
    block = ref._tr_block
    if ref._tr_gen == block.gen:
        return ref._tr_view
    storage = block.dev if block.dev is not None else block.host
    view = with_math_bits(raw.typed_view(storage, ref.dtype, ref.size(), ref.stride(), ref.storage_offset()), ref)
    ref._tr_view, ref._tr_gen = view, block.gen
    return view


def with_math_bits(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``view`` with the conjugate and negative bits of ``like`` (a fresh view has neither)."""
    if like.is_conj():
        torch._C._set_conj(view, True)
    if like.is_neg():
        torch._C._set_neg(view, True)
    return view


def host_view(ref: TensorRef) -> torch.Tensor:
    """Plain view of ``ref`` on the host copy; the caller made that copy valid."""
    block = ref._tr_block
    return with_math_bits(raw.typed_view(block.host, ref.dtype, ref.size(), ref.stride(), ref.storage_offset()), ref)


def host_copy(ref: TensorRef, share: bool = False) -> torch.Tensor:
    """A plain host tensor with ``ref``'s values.

    With ``share`` it views the block's host copy (views of one block then share storage,
    which ``torch.save`` preserves); otherwise it is an independent copy.
    """
    mgr = _manager()
    with mgr._lock:
        mgr.sync_host(ref._tr_block)
        view = host_view(ref)
        return view if share else view.clone()


class saving:
    """Context in which pickling a TensorRef writes a plain tensor (used by ``torch.save``)."""

    def __enter__(self):
        self._before = getattr(_saving, "active", False)
        _saving.active = True

    def __exit__(self, *exc):
        _saving.active = self._before
