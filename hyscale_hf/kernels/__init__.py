"""hyscale_hf ops: Triton kernels with a pure-torch reference beside each (torch + triton only).

Every public op takes ``backend``: ``"auto"`` runs the Triton kernel on CUDA tensors where one
exists and the torch reference otherwise; ``"torch"`` forces the reference; ``"triton"`` forces the
kernel (on CPU tensors it needs ``TRITON_INTERPRET=1`` set before import: Triton's interpreter).
"""

from .hytopk import hytopk, hytopk_stats, reset_hytopk_stats
from .indexer_loss import indexer_kl_loss
from .lean_autograd import rms_norm, swiglu_mlp
from .lm_loss import chunked_cross_entropy
from .mla_attention import mla_sparse_attention
from .sparse_attention import sparse_attention

__all__ = [
    "hytopk", "hytopk_stats", "reset_hytopk_stats", "sparse_attention", "mla_sparse_attention", "indexer_kl_loss",
    "rms_norm", "swiglu_mlp", "chunked_cross_entropy",
]
