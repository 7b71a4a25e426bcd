"""Memory-lean autograd for the dense parts of a decoder layer (torch only): ``op.py`` holds
``rms_norm`` and ``swiglu_mlp``, ``naive.py`` the plain compositions they equal bit for bit."""

from .op import rms_norm, swiglu_mlp

__all__ = ["rms_norm", "swiglu_mlp"]
