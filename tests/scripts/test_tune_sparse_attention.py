"""scripts/tune_sparse_attention.py stops a sweep cleanly when a config faults on the device.

A device fault (illegal address) poisons the CUDA context: every later config would fail with the
same error and be reported as a config error. The sweep must keep what it measured and stop.
"""

import pytest
import torch

from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig, host
from tests.support.scripts import load_script


def test_sweep_stops_at_a_device_fault_and_keeps_earlier_rows(monkeypatch):
    tune = load_script("tune_sparse_attention")
    q = torch.zeros(1, 4, 2, 8)
    monkeypatch.setattr(tune, "shapes", lambda name, T, gqa: (q, q, q, (q,)))
    monkeypatch.setattr(torch, "randn", lambda *a, **k: torch.zeros(*a))
    calls = []

    def timed(fn, budget_ms):
        calls.append(fn)
        if len(calls) == 2:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return 1.5

    monkeypatch.setattr(tune, "timed", timed)
    configs = [(16, 4, 3), (16, 4, 1), (16, 8, 2)]
    with pytest.raises(tune.ContextLost) as lost:
        tune.sweep("mla", "fwd", configs, 4, None, 100.0)
    rows = lost.value.rows
    assert [r.get("ms") for r in rows] == [1.5, None]
    assert "illegal memory access" in rows[1]["error"]
    assert len(calls) == 2  # the third config never ran
    assert host.DEFAULT_CONFIG == SparseAttentionConfig()  # the kernels' defaults are untouched
