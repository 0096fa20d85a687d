"""Expected failures of the OpInfo sweep (``test_opinfo.py``): ``(op name, variant) -> reason``.

Entries are strict expected failures: when an op starts to match, the sweep fails until its
entry is removed.
"""

#: data read by C++ without an aten op: no tensor subclass sees it
_RAW_DATA = (
    "torch.tensor_split with a 1-D index tensor is a C++ composite that reads the indices "
    "through data_ptr, below any op a TensorRef intercepts; a TensorRef has no storage of "
    "its own, so torch raises 'data is not allocated yet' (0-D indices, lists and ints work)"
)
#: results made by factory calls that have no tensor argument
_FACTORY_RESULT = (
    "for an empty matrix the C++ composite returns at::zeros/at::full (factory calls with no "
    "tensor argument, which no tensor subclass intercepts), so the result is a plain tensor "
    "(its values match)"
)

#: engine limits with inputs on two devices
_TWO_DEVICES = (
    "a sparse CSR input (a CPU tensor) beside accelerator tensors: the autograd engine's stream "
    "bookkeeping asserts in backward (opt_ready_stream && opt_parent_stream), on CUDA as on sim"
)

#: expected failures in the pass-through mode only ("cpu": TensorRefs report the CPU, so
#: C++ composites reach the CPU kernels with them); on an accelerator the device's own
#: kernels see them and these match
PASS_THROUGH_XFAILS = {
    ("tensor_split", ""): _RAW_DATA,
    ("linalg.matrix_rank", ""): _FACTORY_RESULT,
    ("linalg.matrix_rank", "hermitian"): _FACTORY_RESULT,
}

#: expected failures on an accelerator only (every mode but pass-through)
ACCELERATOR_XFAILS = {
    ("sparse.sampled_addmm", ""): _TWO_DEVICES,
}

XFAILS = {
    ("to_sparse", ""): (
        "only strided tensors are managed: the sparse result is a plain tensor, and so is the "
        "gradient that flows back through it (values match)"
    ),
}
