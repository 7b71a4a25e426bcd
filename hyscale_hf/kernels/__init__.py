"""hyscale_hf ops: Triton kernels with a pure-torch reference beside each (torch + triton only).

One package per op: ``topk`` (``hytopk``), ``sparse_attn`` (``sparse_attention``,
``mla_sparse_attention``), ``indexer_kl`` (``indexer_kl_loss``), ``lean_autograd`` (``rms_norm``,
``swiglu_mlp``), ``lm_loss`` (``chunked_cross_entropy``) and ``rope`` (``rotary_embedding``). Each holds the public function(s), the
kernels with their host code, and a ``naive.py`` torch reference (the test oracle and the CPU
backend). Tile shapes and kernel variants are chosen through each op's config:
``topk.HyTopKConfig`` (with ``topk.hytopk_triton``), ``sparse_attn.SparseAttentionConfig`` and
``indexer_kl.IndexerKLConfig``. Shared by the ops: ``checks`` (argument checks), ``windows``
(query windows and chunking), ``bitmap`` and ``gluon_hopper`` (kernel helpers).

Every public op takes ``backend``: ``"auto"`` runs the Triton kernel on CUDA tensors where one
exists and the torch reference otherwise; ``"torch"`` forces the reference; ``"triton"`` forces the
kernel (on CPU tensors it needs ``TRITON_INTERPRET=1`` set before import: Triton's interpreter).
"""

from .indexer_kl import indexer_kl_loss
from .lean_autograd import rms_norm, swiglu_mlp
from .lm_loss import chunked_cross_entropy
from .rope import rotary_embedding
from .sparse_attn import mla_sparse_attention, sparse_attention
from .topk import hytopk, hytopk_stats, reset_hytopk_stats

__all__ = [
    "hytopk", "hytopk_stats", "reset_hytopk_stats", "sparse_attention", "mla_sparse_attention", "indexer_kl_loss",
    "rms_norm", "swiglu_mlp", "chunked_cross_entropy", "rotary_embedding",
]
