"""Per-op facts read once from the op's schema, and the table of special-case handlers.

Everything not in the table goes through the one generic path in ``dispatch.py``;
handlers are keyed by the exact ``OpOverload`` and registering one twice is an error.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch._ops import OpOverload

Handler = Callable[..., object]


class OpSpec:
    """What the dispatcher needs to know about one ``OpOverload``, from its schema.

    Attributes:
        name: ``"aten.add_.Tensor"``.
        write_args: ``(position, name)`` of each argument the op writes in place
            (``self`` of ``add_``, ``out`` of ``add.out``, the list of ``_foreach_add_``).
        return_args: for each return, the position of the written argument it is (an
            in-place op returns its ``self``), or ``None`` for a new or view result.
        allocates: whether the op returns a newly allocated tensor.
        restrides: whether it may change a written argument's geometry or storage
            (``resize_``, ``set_``, ``t_``, ``unsqueeze_``, ``out=`` variants ...).
        one_result: whether it returns one new tensor or view (or one list of them).
        host_results: positions of the results that accelerator kernels return in host
            memory (``batch_sizes`` of ``_pack_padded_sequence``): they stay plain CPU
            tensors, because composite kernels (``lstm`` on packed data) read their bytes.
        host_args: ``(position, name)`` of the tensor arguments that accelerator kernels
            read in host memory and refuse on the device (``lengths`` of
            ``_pack_padded_sequence``, the per-position ``scalars`` of ``_foreach_addcmul``).
        list_writes: the ``write_args`` that are lists of tensors (the list of
            ``_foreach_add_``): Note [Versions of list writes].
        handler: special-case handler, or ``None`` for the generic path.
    """

    __slots__ = ("func", "name", "write_args", "return_args", "allocates", "restrides", "one_result", "one_tensor",
                 "call", "host_results", "host_args", "handler", "list_writes")

    def __init__(self, func: OpOverload) -> None:
        self.func = func
        #: the C++ callable behind ``func`` (calling it skips one Python frame per op)
        self.call = getattr(func, "_op", func)
        self.name = str(func)
        schema = func._schema
        self.write_args: List[Tuple[int, str]] = []
        sets = {}
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is not None and info.is_write:
                self.write_args.append((i, arg.name))
                for s in info.before_set:
                    sets[s] = i
        unannotated = _UNANNOTATED_WRITES.get(func.overloadpacket.__name__, ())
        for i, arg in enumerate(schema.arguments):
            if arg.name in unannotated and (i, arg.name) not in self.write_args:
                self.write_args.append((i, arg.name))
        self.return_args: List[Optional[int]] = []
        for ret in schema.returns:
            info = ret.alias_info
            index = None
            if info is not None and info.is_write:
                index = next((sets[s] for s in info.before_set if s in sets), None)
            self.return_args.append(index)
        #: whether some result may be a new tensor (not a view or an in-place argument)
        self.allocates: bool = (any(r.alias_info is None for r in schema.returns)
                                or func.overloadpacket.__name__ in _ALIAS_OR_COPY)
        #: whether the op may change the shape, strides or storage of an argument it writes
        # (out= arguments are the keyword-only written ones, whatever their name: ``L``,
        # ``values``, ``output`` ...)
        self.restrides: bool = bool(self.write_args) and (
            func.overloadpacket.__name__ in _RESTRIDING
            or any(schema.arguments[i].kwarg_only for i, _n in self.write_args)
        )
        #: whether it returns a single new tensor or view (not an argument it wrote)
        self.one_result: bool = len(self.return_args) == 1 and self.return_args[0] is None
        #: whether that result is one tensor (not a list): no other result shares its storage
        self.one_tensor: bool = self.one_result and isinstance(schema.returns[0].type, torch.TensorType)
        self.host_results: Tuple[int, ...] = _HOST_RESULTS.get(func.overloadpacket.__name__, ())
        host = _HOST_ARGUMENTS.get(func.overloadpacket.__name__, ())
        self.host_args: Tuple[Tuple[int, str], ...] = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments) if a.name in host)
        self.handler: Optional[Handler] = _HANDLERS.get(func)
        self.list_writes: Tuple[Tuple[int, str], ...] = tuple(
            (i, n) for i, n in self.write_args if isinstance(schema.arguments[i].type, torch.ListType))


def move_list_versions(spec: OpSpec, args: tuple, kwargs: dict, cls: type) -> None:
    """Move the version counter of each ``cls`` tensor in the lists op ``spec`` wrote.

    Note [Versions of list writes]: an in-place list op (``torch._foreach_add_``) moves
    the version counter of each plain tensor it writes, once, as any in-place op does; but
    not that of a tensor subclass's wrapper (a TensorRef, a ``SimTensor``), whose bytes
    are written below it. Autograd's check that a tensor saved for backward was not
    written since reads that counter, and so does a region, to find what its call wrote
    (Note [Regions] in ``regions/mechanism.py``). The wrappers' counters are moved here
    after the op, as plain torch moves a plain tensor's.
    """
    moved: list = []
    for i, name in spec.list_writes:
        arg = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(arg, (list, tuple)):
            moved.extend(t for t in arg if isinstance(t, cls))
    if moved:
        torch.autograd.graph.increment_version(moved)


#: ops whose schema says their result aliases the argument, which copy where they must:
#: ``to`` another dtype, ``reshape`` or ``contiguous`` of a tensor with gaps. They decompose
#: before the manager sees them, except on inference tensors (no autograd keys): there the
#: manager sized ``x.to(torch.float32)`` as nothing, and its result passed the budget
_ALIAS_OR_COPY = frozenset({"to", "reshape", "reshape_as", "contiguous", "flatten", "ravel"})

#: in-place ops that change their argument's metadata, not (only) its values
_RESTRIDING = frozenset({
    "resize_", "resize_as_", "set_", "as_strided_", "t_", "transpose_", "swapdims_",
    "swapaxes_", "squeeze_", "unsqueeze_", "_resize_output_",
})

#: ops that write arguments their schema does not mark ``(a!)``: native_batch_norm updates
#: the running statistics in place (a known schema gap kept for compatibility); FSDP2's
#: all_gather_copy_in copies each rank's shards into its all-gather buffer
_UNANNOTATED_WRITES = {
    "native_batch_norm": ("running_mean", "running_var"),
    "cudnn_batch_norm": ("running_mean", "running_var"),
    "miopen_batch_norm": ("running_mean", "running_var"),
    "all_gather_copy_in": ("all_gather_output",),
}

#: small results that CUDA kernels make in host memory and other kernels read there
_HOST_RESULTS = {
    "_pack_padded_sequence": (1,),  # batch_sizes
    "_pad_packed_sequence": (1,),  # lengths
}

#: tensor arguments that accelerator kernels take in host memory only: CUDA raises "Expected
#: scalars to be on CPU" for a device tensor of ``_foreach_addcmul``'s per-position scalars
_HOST_ARGUMENTS = {
    "_pack_padded_sequence": ("lengths",),
    "_foreach_addcmul": ("scalars",), "_foreach_addcmul_": ("scalars",),
    "_foreach_addcdiv": ("scalars",), "_foreach_addcdiv_": ("scalars",),
}

#: ops whose accelerator kernels accept CPU tensors of any size among their arguments
#: (copies, indexing with host indices, the RNNs' packed-sequence host arguments); other
#: kernels accept a 0-dim one only, as a scalar
TAKES_CPU_TENSORS = frozenset({
    "copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "index", "_unsafe_index", "index_put",
    "index_put_", "_index_put_impl_", "_unsafe_index_put", "_pack_padded_sequence", "_pad_packed_sequence",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "set_", "lift_fresh", "lift_fresh_copy", "to",
})

_HANDLERS: Dict[object, Handler] = {}
_SPECS: Dict[int, OpSpec] = {}


def implements(ops: Union[OpOverload, List[OpOverload], Tuple[OpOverload, ...]]) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of each op in ``ops``.

    The handler is called as ``handler(func, args, kwargs, spec)`` instead of the generic
    path. Registering an op twice raises ``ValueError``.
    """
    ops = list(ops) if isinstance(ops, (list, tuple)) else [ops]

    def register(fn: Handler) -> Handler:
        for op in ops:
            if op in _HANDLERS:
                raise ValueError(f"{op} already has a handler: {_HANDLERS[op].__name__}")
            _HANDLERS[op] = fn
            _SPECS.pop(id(op), None)
        return fn

    return register


def spec_of(func: OpOverload) -> OpSpec:
    """The cached :class:`OpSpec` of ``func``."""
    spec = _SPECS.get(id(func))
    if spec is None:
        spec = _SPECS[id(func)] = OpSpec(func)
    return spec


def specs() -> Dict[int, OpSpec]:
    """The cache itself, for the dispatcher's fast lookup: keyed by ``id(func)``.

    ``OpOverload.__hash__`` is Python code, too slow to run for every op; the ids are stable
    because each spec holds its op.
    """
    return _SPECS


aten = torch.ops.aten
