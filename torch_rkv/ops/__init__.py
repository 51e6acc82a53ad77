"""Python side of the rkv ops: one module per op family (wrapper + fake kernel + checks)."""

from . import attention, cache, hadamard, pack, paged, quant, rope  # noqa: F401  (registers the fake kernels)
from . import autograd  # noqa: F401  (gradients: must follow the op modules)
