"""Indexer KL loss: trains the lightning indexer towards the main attention's distribution.

- ``op.py``: the public ``indexer_kl_loss`` (shapes in its docstring), its autograd wrapper and the
  host launches, with ``IndexerKLConfig`` (launch tiles);
- ``triton_kernels.py``: the sparse-stage Triton kernels (the one-pass loss is derived there);
- ``naive.py``: the torch reference, the test oracle, the CPU backend and the dense warm-up loss.
"""

from .op import IndexerKLConfig, indexer_kl_loss

__all__ = ["indexer_kl_loss", "IndexerKLConfig"]
