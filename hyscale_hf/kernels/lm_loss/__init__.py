"""Causal-LM cross-entropy a token chunk at a time (torch only): ``op.py`` holds
``chunked_cross_entropy``, ``naive.py`` the whole-logits loss it equals."""

from .op import chunked_cross_entropy

__all__ = ["chunked_cross_entropy"]
