"""Sparse attention: each query attends only to its selected keys (GQA/MHA, and MLA in absorbed form).

- ``op.py``: the public ``sparse_attention`` (shapes in its docstring) and its autograd wrapper;
- ``mla.py``: ``mla_sparse_attention``, which rebuilds MLA's absorbed query in backward instead of
  keeping it; ``mla_query.py``: that absorbed query;
- ``host.py``: the Triton path's host code: ``SparseAttentionConfig`` (tile shapes and kernel
  variants), key lists (``reuse_query_tiles``: one build for callers attending over one tensor
  several times), forward and backward launches;
- ``triton_kernels.py``: the Triton kernels (the design is described there);
  ``mla_forward_gluon.py``: the warp-specialised MLA forward for sm_90; ``tile_unions.py``: the
  query tiles' key unions; ``tile_head_probs.py``: the indexer KL's target over query tiles;
- ``head_probs.py``: ``HeadProbs``, where the MLA op leaves its head-summed probabilities (the
  indexer KL's target) from its backward;
- ``naive.py``: the torch reference, the test oracle and the CPU backend.
"""

from .head_probs import HeadProbs
from .host import SparseAttentionConfig, reuse_query_tiles
from .mla import mla_sparse_attention
from .op import sparse_attention

__all__ = ["sparse_attention", "mla_sparse_attention", "SparseAttentionConfig", "HeadProbs", "reuse_query_tiles"]
