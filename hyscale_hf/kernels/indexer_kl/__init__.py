"""Indexer KL loss: trains the lightning indexer towards the main attention's distribution.

- ``op.py``: the public ``indexer_kl_loss`` (shapes in its docstring), its autograd wrapper and the
  host launches, with ``IndexerKLConfig`` (launch tiles); ``indexer_kl_loss_given_target``, the
  same loss from a target computed elsewhere, and ``attention_prob_sum``, that target as a pass of
  its own;
- ``triton_kernels.py``: the sparse-stage Triton kernels (the one-pass loss is derived there);
- ``naive.py``: the torch reference, the test oracle, the CPU backend and the dense warm-up loss.
"""

from .op import IndexerKLConfig, attention_prob_sum, indexer_kl_loss, indexer_kl_loss_given_target

__all__ = ["indexer_kl_loss", "indexer_kl_loss_given_target", "attention_prob_sum", "IndexerKLConfig"]
