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

import functools
import operator
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, cast

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import context, raw
from .blocks import Block
from .tensor_text import tensor_text

if TYPE_CHECKING:
    from .proxy_info import ProxyInfo

_Method = TypeVar("_Method", bound=Callable[..., Any])

_make_wrapper = torch.Tensor._make_wrapper_subclass
_saving = threading.local()
_manager = context.manager


def _apart_from_modes(method: _Method) -> _Method:
    """``method`` of a TensorRef, with the manager's own copies kept from the caller's dispatch
    modes: plain torch runs no op there, so a mode must see none (torch.export's fake tensors
    would take the copies over and fail)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _dispatch_modes():
            with _disable_current_modes():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return cast(_Method, run)


_dispatch_modes = torch._C._len_torch_dispatch_stack


class TensorRef(torch.Tensor):
    """A tensor whose data the global ``tensorsManager`` keeps in RAM or VRAM.

    ``TensorRef(t)`` manages an existing plain tensor ``t`` (sharing its bytes). Tensors
    made by torch's creation functions after ``import torchTensorRef`` are TensorRefs
    already, and so is every result of an op on a TensorRef.

    Attributes:
        target: the plain tensor holding the data right now (read it, do not write it).
        proxyInfo: a :class:`~torchTensorRef.core.proxy_info.ProxyInfo`.
    """

    # Internals, all prefixed to stay clear of torch.Tensor's own attributes:
    #   _tr_block: the Block; _tr_view: cached plain view of its current copy;
    #   _tr_gen: the block generation the view was made for; _tr_wr: liveness weakref;
    #   _tr_alias: None or ``grad_alias``'s alias of _tr_view, dropped with it.
    # Slots, not the instance dict: every op's result sets them, and users' attributes
    # (``__dict__``) then hold only what users set.
    __slots__ = ("_tr_block", "_tr_view", "_tr_gen", "_tr_wr", "_tr_alias")
    _tr_block: Block
    _tr_view: torch.Tensor | None  # (None only while _tr_gen is -1, never a generation)
    _tr_gen: int
    _tr_alias: torch.Tensor | None
    _tr_wr: weakref.ref[TensorRef] | None
    # (torch's stubs type the impl as a plain function, the attribute as a classmethod)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __new__(cls, data: torch.Tensor, requires_grad: bool | None = None, **attributes: Any):
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"TensorRef(data) needs a torch.Tensor (got: {type(data).__name__})")
        # ``type(p)(data, requires_grad=..., **p.__dict__)`` rebuilds a parameter (accelerate's
        # ``init_empty_weights``, loaders): a managed parameter is a TensorRef marked
        # ``_is_param``, so this call must do what ``Parameter(data, requires_grad)`` does.
        if attributes.pop("_is_param", False):
            keep = True if requires_grad is None else requires_grad
            if data.is_meta or data.layout is not torch.strided:
                out = torch.nn.Parameter(data, keep)  # (not managed, as such tensors are anywhere)
            else:
                out = torch.nn.Parameter(_manager().manage_tensor(data), keep)
        else:
            out = _manager().manage_tensor(data, requires_grad=requires_grad)
        if attributes:
            out.__dict__.update(attributes)  # (what the rebuilt parameter carried)
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __del__(self) -> None:
        # Note [A dying TensorRef's view]: CPython runs a dying object's finalizer, then its
        # weakrefs' callbacks (the manager's ``ref_died``, which may release the block), and
        # only then clears its slots. The cached view would keep the device copy allocated
        # past its release: the manager would count bytes gone that the device still holds,
        # and another thread could fill that room. Dropped here, it is gone first.
        self._tr_view = self._tr_alias = None
        self._tr_gen = -1

    # (torch declares it by assigning a plain function to the attribute, which mypy reads as
    # an instance method: no classmethod matches that signature)
    @classmethod
    def __torch_dispatch__(cls, func: torch._ops.OpOverload, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: Optional[dict] = None) -> Any:
        # Replaced by ``ops.dispatch.torch_dispatch`` when the ops layer is imported
        # (bound there at import): the core does not know how ops run.
        raise RuntimeError(f"{func} on a TensorRef before the ops layer was installed: import torchTensorRef")

    # -- the proxy API -------------------------------------------------------------------

    @property
    @_apart_from_modes
    def target(self) -> torch.Tensor:
        """The plain tensor holding this TensorRef's data right now (copies in flight waited on)."""
        mgr = _manager()
        with mgr.lock:
            block = self._tr_block
            if block.dev_pending is not None:
                block.arrived()  # a prefetch may still be writing it
            if block.dev is None:
                mgr.sync_host(block)  # a write-back may still be writing the host copy
            return compute_view(self)

    @property
    def proxyInfo(self) -> ProxyInfo:
        """Where the data is and what the manager tracks (a ``ProxyInfo``)."""
        from .proxy_info import ProxyInfo

        return ProxyInfo(self, self._tr_block)

    @_apart_from_modes
    def toGPU(self) -> "TensorRef":
        """Move the data to the accelerator now (within the budget); return ``self``."""
        _manager().move_to_device(self)
        return self

    @_apart_from_modes
    def toCPU(self) -> "TensorRef":
        """Move the data to host memory now (writing back changes); return ``self``."""
        _manager().move_to_host(self)
        return self

    # -- Tensor methods that reach the bytes without an aten op -------------------------

    @_apart_from_modes
    def numpy(self, *, force: bool = False):
        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        # The array shares the host copy: from now on the block must not hide its writes
        # behind an accelerator copy (Note [External bytes]).
        mgr = _manager()
        block = self._tr_block
        with mgr.lock:
            mgr.mark_external(block)  # writes back and drops the accelerator copy
            array = host_view(self).numpy()
        # Every numpy view of the array keeps its base (a tensor) alive: when the last one
        # dies, nothing outside writes the block any more.
        weakref.finalize(array.base, mgr.unmark_external, block)
        return array

    @_apart_from_modes
    def tolist(self):
        return host_copy(self).tolist()

    def new_tensor(self, data: Any, dtype: Optional[torch.dtype] = None, device: Any = None,
                   requires_grad: bool = False, pin_memory: bool = False) -> torch.Tensor:
        # Made by the (patched) ``torch.tensor``, where this tensor's would be: torch's own
        # builds it in C++, a plain device tensor outside the manager on CUDA
        block = self._tr_block
        if device is None and (block.host_only or block.explicit):
            device = _CPU if block.host_only else self.device
        return torch.tensor(plain_values(data), dtype=dtype or self.dtype, device=device,
                            requires_grad=requires_grad, pin_memory=pin_memory)

    @_apart_from_modes
    def untyped_storage(self) -> torch.UntypedStorage:
        _manager().move_to_host(self)
        return self._tr_block.host_storage()

    @_apart_from_modes
    def data_ptr(self) -> int:
        """Address of the first element where ops read it: device memory for an accelerator
        tensor, host memory for a CPU one (as for a plain tensor of that device).

        The block is brought in, counted as written (the address may be handed to a kernel
        that writes it) and kept resident until the manager needs the room; to keep the
        address longer, ``tensorsManager.pin`` the tensor.
        """
        mgr = _manager()
        if self._tr_block.host_only or mgr.backend.passthrough:
            storage = self.untyped_storage()
            return storage.data_ptr() + int(self.storage_offset()) * self.element_size()
        return mgr.expose(self).data_ptr()

    # (mypy reads the keyword-only parameter of Tensor.__repr__ without its name: no
    # override matches it, this one included)
    def __repr__(self, *, tensor_contents: Optional[str] = None) -> str:  # type: ignore[override]
        text = tensor_text(self, host_copy(self), tensor_contents)
        if getattr(self, "_is_param", False):
            text = "Parameter containing:\n" + text
        return text

    def __format__(self, format_spec: str) -> str:
        # as torch: 0-dim plain tensors format as their value, Parameters never do
        if self.dim() == 0 and not getattr(self, "_is_param", False):
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # (not decorated: ``_called_by_torch_save`` counts the frames above this one)
        plain = _apart_from_modes(host_copy)(self, share=True)
        plain.requires_grad_(self.requires_grad)  # torch pickles it for non-leaves too
        plain.__dict__.update(user_attributes(self))
        is_param = bool(getattr(self, "_is_param", False))
        if getattr(_saving, "active", False) or _called_by_torch_save():
            # torch.save: write plain tensors and Parameters, readable with
            # weights_only=True and without torchTensorRef.
            if is_param:
                param = torch.nn.Parameter(plain, requires_grad=self.requires_grad)
                param.__dict__.update(plain.__dict__)
                plain = param
            return plain.__reduce_ex__(protocol)
        return (_rebuild, (plain, is_param))

    def __deepcopy__(self, memo: dict) -> TensorRef:
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
    def data(self) -> torch.Tensor:
        return raw.TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # ``p.data = t`` copies t's metadata into p's C++ tensor but not our block: rebind it.
        if not isinstance(new, TensorRef):
            new = _manager().manage_tensor(new)
        raw.TENSOR_DATA.__set__(self, new)
        _manager().rebind(self, new)


def _rebuild(plain: torch.Tensor, is_param: bool) -> torch.Tensor:
    ref = _manager().manage_tensor(plain)  # with plain's attributes
    if is_param:
        ref = torch.nn.Parameter(ref, requires_grad=plain.requires_grad)
        ref.__dict__.update(plain.__dict__)
    return ref


def user_attributes(ref: TensorRef) -> dict:
    """Attributes set on ``ref`` by its users (torchTensorRef's own are slots; not ``_is_param``)."""
    return {k: v for k, v in ref.__dict__.items() if k != "_is_param"}


def _called_by_torch_save() -> bool:
    # torch.serialization pickles from its own frame (the C pickler adds none): this catches
    # torch.save bound before torchTensorRef patched it, and torch.serialization.save.
    try:
        return sys._getframe(2).f_globals.get("__name__") == "torch.serialization"
    except ValueError:  # no such frame
        return False


_CPU = torch.device("cpu")
_inference_mode = torch.is_inference_mode_enabled


def make_ref(block: Block, view: torch.Tensor, declared: torch.device, requires_grad: bool = False,
             geometry_only: bool = False) -> TensorRef:
    """Wrap the plain ``view`` (a view of ``block``'s current copy) in a new TensorRef.

    ``declared``: the device an accelerator TensorRef reports; a host-only block reports ``cpu``.
    ``geometry_only``: ``view`` gives the geometry only (a meta tensor, a checkpoint's
    tensor not read yet), never bytes to run on: the first use makes a view of a copy.
    """
    inference = view.is_inference()
    if inference is not _inference_mode():
        # A view made in inference mode of a normal tensor is a normal tensor, which autograd
        # gives its base's version counter (an inference tensor has none): the wrapper is
        # what the plain result is.
        with torch.inference_mode(inference):
            return make_ref(block, view, declared, requires_grad, geometry_only)
    ref = _make_wrapper(
        TensorRef, view.size(), strides=view.stride(), storage_offset=view.storage_offset(),
        dtype=view.dtype, device=_CPU if block.host_only else declared, requires_grad=requires_grad,
    )
    if view.is_conj():
        torch._C._set_conj(ref, True)  # conj() and neg views are lazy: the bit is the value
    if view.is_neg():
        torch._C._set_neg(ref, True)
    ref._tr_block = block
    ref._tr_view = view
    ref._tr_alias = None
    ref._tr_gen = -1 if geometry_only else block.gen
    block.refs += 1
    ref._tr_wr = wr = weakref.ref(ref, block.on_ref_dead)
    views = block.views
    views.append(wr)
    if len(views) > 2 * block.refs + 8:  # (views that died since: a weight's list would grow forever)
        block.views = [v for v in views if v() is not None]
    return ref


#: the block a TensorRef views (for the layers above the core: its slot is the core's)
block_of = operator.attrgetter("_tr_block")


def _forget_views(views: list) -> list:
    """``Block.forget_views``: the TensorRefs still alive among ``views`` drop their cached
    view (the next use makes one afresh); returns their weakrefs."""
    live = []
    for wr in views:
        ref = wr()
        if ref is not None:
            ref._tr_view = ref._tr_alias = None
            ref._tr_gen = -1  # (never a generation: the next use makes a view afresh)
            live.append(wr)
    return live


Block.forget_views = staticmethod(_forget_views)


def set_view(ref: TensorRef, view: torch.Tensor) -> None:
    """``view`` is ``ref``'s view of its block's current copy (its geometry changed in place)."""
    ref._tr_view, ref._tr_gen, ref._tr_alias = view, ref._tr_block.gen, None


def rebind_view(ref: TensorRef, new: TensorRef) -> None:
    """``ref`` views ``new``'s block from now on (``ref.data = new``; the caller counts the
    blocks' views). ``ref``'s liveness weakref on the old block goes, with its callback: left
    in the old block's list of views it would count ``ref``'s death against the old block a
    second time, releasing it under its other views."""
    old = ref._tr_block
    old_wr, ref._tr_wr = ref._tr_wr, None
    old.views = [v for v in old.views if v is not old_wr]
    block = new._tr_block
    ref._tr_block = block
    # ``new``'s view as it is, made afresh at the next use where stale: a block whose only
    # copy is a checkpoint's range (``from_pretrained``, then ``model.to(device)``) has no
    # copy to view yet.
    ref._tr_view, ref._tr_gen, ref._tr_alias = new._tr_view, new._tr_gen, None
    ref._tr_wr = wr = weakref.ref(ref, block.on_ref_dead)
    block.views.append(wr)


def compute_view(ref: TensorRef) -> torch.Tensor:
    """Plain view of ``ref`` on its block's current copy (the accelerator copy if valid).

    The caller holds the manager's lock and, for an op, has made the block resident.
    """
    block = ref._tr_block
    view = ref._tr_view
    if ref._tr_gen == block.gen and view is not None:
        return view
    storage = block.dev if block.dev is not None else block.host
    assert storage is not None  # (Note [Blocks and coherence]: a copy is valid)
    view = view_on(ref, storage)
    ref._tr_view, ref._tr_gen, ref._tr_alias = view, block.gen, None
    return view


def grad_alias(ref: TensorRef) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_view(ref)`` and an alias of it that needs gradients: the one made last time,
    kept with that view while it stays ``ref``'s, where it is as it was made (needing
    gradients, with no gradient, the attributes ``ref`` has); else a new one. (One step, not
    two: a region call asks it for each of its module's parameters.)"""
    # (``compute_view``'s own check, inline: this runs for every parameter of every region
    # call, where a frame more per parameter shows)
    view = ref._tr_view
    if ref._tr_gen != ref._tr_block.gen or view is None:
        view = compute_view(ref)  # (and the alias kept with the old view goes)
    alias = ref._tr_alias
    if (alias is None or not alias.requires_grad or alias.grad is not None
            or alias.__dict__.keys() != ref.__dict__.keys()):
        alias = ref._tr_alias = view.detach().requires_grad_(True)
    return view, alias


def view_on(ref: TensorRef, storage: torch.UntypedStorage) -> torch.Tensor:
    """Plain view of ``ref``'s geometry on ``storage``, an inference tensor where ``ref`` is one.

    (Made in inference mode for a TensorRef made before it, a view would be an inference
    tensor: a view op on it would give an inference result, where plain torch gives a normal one.)
    """
    inference = ref.is_inference()
    if inference is not _inference_mode():
        with torch.inference_mode(inference):
            return view_on(ref, storage)
    return with_math_bits(raw.typed_view(storage, ref.dtype, ref.size(), ref.stride(), ref.storage_offset()), ref)


def with_math_bits(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``view`` with the conjugate and negative bits of ``like`` (a fresh view has neither)."""
    if like.is_conj():
        torch._C._set_conj(view, True)
    if like.is_neg():
        torch._C._set_neg(view, True)
    return view


def host_view(ref: TensorRef) -> torch.Tensor:
    """Plain view of ``ref`` on the host copy; the caller made that copy valid."""
    return view_on(ref, ref._tr_block.host_storage())


def host_copy(ref: TensorRef, share: bool = False) -> torch.Tensor:
    """A plain host tensor with ``ref``'s values.

    With ``share`` it views the block's host copy (views of one block then share storage,
    which ``torch.save`` preserves); otherwise it is an independent copy.
    """
    mgr = _manager()
    with mgr.lock:
        mgr.sync_host(ref._tr_block)
        view = host_view(ref)
        return view if share else view.clone()


def plain_values(data):
    """``data`` (values in lists and tuples, at any depth) with its TensorRefs given as plain host
    copies, ``data`` itself where it holds none: torch makes a tensor of such a list by reading
    each tensor's bytes, which a TensorRef does not hold (its target does)."""
    if not isinstance(data, (list, tuple)) or not any(issubclass(k, _HOLDERS) for k in set(map(type, data))):
        return data  # (the types read in C: a list of a million numbers costs milliseconds)
    values = [host_copy(v) if isinstance(v, TensorRef) else plain_values(v) for v in data]
    if all(w is v for w, v in zip(values, data)):
        return data
    return values if isinstance(data, list) else tuple(values)


_HOLDERS = (TensorRef, list, tuple)


class saving:
    """Context in which pickling a TensorRef writes a plain tensor (used by ``torch.save``)."""

    def __enter__(self) -> None:
        self._before = getattr(_saving, "active", False)
        _saving.active = True

    def __exit__(self, *exc: object) -> None:
        _saving.active = self._before
