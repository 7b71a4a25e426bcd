"""Memory-lean autograd for the dense parts of a decoder layer: ``op.py`` holds ``rms_norm`` and
``swiglu_mlp`` (backend "torch": torch ops, bit-identical to the plain compositions of ``naive.py``;
"triton", the default "auto" on CUDA: their elementwise parts as fused Triton kernels,
``triton_kernels.py`` launched by ``host.py``)."""

from .op import rms_norm, swiglu_mlp

__all__ = ["rms_norm", "swiglu_mlp"]
