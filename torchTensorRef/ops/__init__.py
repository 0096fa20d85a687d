"""Op interception: what happens to each aten op that reaches a TensorRef."""

from . import foreach  # noqa: F401,E402  (registers the handlers of list ops)
from . import host_arguments  # noqa: F401,E402  (registers _pack_padded_sequence)
from . import metadata_only  # noqa: F401,E402  (registers empty_like, new_zeros ...)
from . import collectives  # noqa: F401,E402  (registers torch.distributed's c10d ops)
