"""Op interception: what happens to each aten op that reaches a TensorRef.

May import core, strategies, analysis and memory. Importing this package installs
:func:`.dispatch.torch_dispatch` as ``TensorRef.__torch_dispatch__`` and registers the
special-case handlers in ``core.op_specs``.
"""

from . import dispatch  # noqa: F401  (installs the dispatch function into the core)
from . import foreach  # noqa: F401,E402  (registers the handlers of list ops)
from . import host_arguments  # noqa: F401,E402  (registers _pack_padded_sequence)
from . import metadata_only  # noqa: F401,E402  (registers empty_like, new_zeros ...)
from . import collectives  # noqa: F401,E402  (registers torch.distributed's c10d ops)
from . import split_handlers  # noqa: F401,E402  (registers embedding, elementwise ops and views larger than the budget)
from . import split_on_host  # noqa: F401,E402  (registers pad, slice and select backward larger than the budget)
from . import split_products  # noqa: F401,E402  (registers matrix products larger than the budget)
from . import split_convolutions  # noqa: F401,E402  (registers convolutions and their backward larger than the budget)
from . import split_norms  # noqa: F401,E402  (registers GroupNorm's and LayerNorm's forward larger than the budget)
from . import split_losses  # noqa: F401,E402  (registers nll_loss larger than the budget)
from . import split_reductions  # noqa: F401,E402  (registers sum along dimensions, cumsum and flip larger than the budget)
from . import device_kernels  # noqa: F401,E402  (registers the ops "sim" runs as composites: histc of integers)
