"""HyTopK: each query's exact top-k keys under the lightning indexer, without a score table.

- ``op.py``: the public function ``hytopk`` (shapes in its docstring) and the custom op
  ``torch.ops.hyscale.hytopk`` that selective checkpointing sees;
- ``host.py``: the Triton path's host code: ``HyTopKConfig``, ``hytopk_triton`` (the launch, with
  its tuning and profiling arguments) and the counters ``hytopk_stats``;
- ``triton_kernels.py``: the scan, refine and final-selection kernels (the algorithm is described
  there); ``scan_gluon.py``: the warp-specialised scan for sm_90;
- ``naive.py``: the torch reference, the test oracle and the CPU backend;
- ``selection_counts.py``: how often the op's body really ran (selection replay reads it).
"""

from .host import HyTopKConfig, hytopk_stats, hytopk_triton, pick_config, reset_hytopk_stats
from .op import hytopk, hytopk_op

__all__ = ["hytopk", "hytopk_op", "hytopk_stats", "reset_hytopk_stats", "HyTopKConfig", "hytopk_triton", "pick_config"]
