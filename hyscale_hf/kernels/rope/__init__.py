"""Rotary position embedding (RoPE) as one fused pass: ``op.py`` holds ``rotary_embedding`` (backend
"torch": the torch ops of Transformers' RoPE functions, bit-identical to them; "triton", the default
"auto" on CUDA for 16-bit inputs: one Triton kernel each way, ``triton_kernels.py``)."""

from .op import rotary_embedding

__all__ = ["rotary_embedding"]
