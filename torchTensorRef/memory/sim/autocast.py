"""The simulated device's autocast policy: the CPU's own lists, on ``AutocastPrivateUse1``.

``torch.autocast("sim")`` casts what ``torch.autocast("cpu")`` would, so results stay
bit-identical to the CPU reference. Registered once, by ``register()`` (``device.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch._ops import OpOverload

from .tensor import NAME

_libraries: List[torch.library.Library] = []  # torch.library registrations live as long as these objects

# -- autocast: the CPU policy (aten/src/ATen/autocast_mode.cpp), by (op, overload) -------------

#: ops whose floating-point inputs autocast casts to the lower precision (bfloat16 / float16)
LOWER_PRECISION = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
    "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated",
    "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
)
#: ops whose floating-point inputs autocast casts to float32
FLOAT32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "prod.dim_int", "quantile",
    "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center", "cdist", "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex", "cholesky",
    "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d",
    "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss",
    "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "ctc_loss.IntList", "ctc_loss.Tensor", "kl_div",
    "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2",
    "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
    "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float", "linalg_solve", "linalg_cholesky", "linalg_svdvals",
    "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product", "linalg_tensorinv",
    "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd",
    "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d",
    "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig",
    "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
)
#: ops whose floating-point inputs autocast casts to the widest of their types
PROMOTE = ("stack", "cat", "index_copy")


def register_autocast() -> None:
    fallthrough = torch.library.Library("_", "IMPL")  # noqa: TOR901
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    policies: Dict[str, tuple] = {"lower": LOWER_PRECISION, "float32": FLOAT32, "promote": PROMOTE}
    for policy, names in policies.items():
        for qualified in names:
            name, _, overload = qualified.partition(".")
            packet = getattr(torch.ops.aten, name, None)
            op = getattr(packet, overload or "default", None) if packet is not None else None
            if op is None:
                continue  # not in this torch version
            lib.impl(qualified, _autocast_kernel(op, policy), "AutocastPrivateUse1")
    _libraries.extend([fallthrough, lib])


# (the stubs' DispatchKey lacks the autocast keys of the PrivateUse1 backend)
_AUTOCAST_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]


def _eligible(value: object) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type == NAME and value.is_floating_point()
            and value.dtype is not torch.float64)


def _autocast_kernel(op: OpOverload, policy: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype: Optional[torch.dtype]
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY):
            if policy == "lower":
                dtype = torch.get_autocast_dtype(NAME)
            elif policy == "float32":
                dtype = torch.float32
            else:
                found = [v.dtype for v in _tensors(args, kwargs) if _eligible(v)]
                dtype = max(found, key=lambda d: torch.finfo(d).bits, default=None)
            if dtype is not None:
                args = tuple(_cast(a, dtype) for a in args)
                kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    kernel.__name__ = f"sim_autocast_{op.__name__.replace('.', '_')}"
    return kernel


def _tensors(args: tuple, kwargs: dict) -> Iterator[Any]:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value
