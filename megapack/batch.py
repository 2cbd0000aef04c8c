"""TEMPORARY re-export while the package moves (removed before landing)."""

from megapack.core.batch import PackedBatch, _check_cu  # noqa: F401
from megapack.core.fields import CU_DTYPE, MASK_DTYPE, TOKEN_DTYPE  # noqa: F401
from megapack.seq_params import make_packed_seq_params  # noqa: F401
