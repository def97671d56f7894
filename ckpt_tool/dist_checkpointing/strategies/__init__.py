"""Save/load strategies: the ``torch`` common backend, ``torch_dist`` (PyTorch DCP) and
``zarr`` sharded backends. Backends register themselves when first needed."""

from .common import register_default_common_strategies

register_default_common_strategies()
