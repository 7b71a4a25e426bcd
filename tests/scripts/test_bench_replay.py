"""scripts/bench_replay.py runs end to end at a tiny size on the CPU (the GPU run uses the same code)."""

import json

import pytest

import hyscale_hf
from tests.support.scripts import load_script


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_replay_tiny(tmp_path, monkeypatch):
    if "glm_moe_dsa" not in hyscale_hf.supported_model_types():
        pytest.skip("glm_moe_dsa is not patchable with the installed Transformers")
    bench = load_script("bench_replay")
    monkeypatch.setattr("sys.argv", ["bench_replay.py", "--tiny", "--seqlens", "24", "--reps", "1", "--rounds", "1",
                                     "--warmup", "0", "--out", str(tmp_path)])
    bench.main()
    result = json.loads((tmp_path / "bench_replay.json").read_text())
    (row,) = result["rows"]
    assert row["T"] == 24 and row["hytopk_ms"] > 0
    assert row["replay_off"]["stats_per_step"]["indexer_recompute"] == result["layers"]
    assert row["replay_on"]["stats_per_step"]["indexer_recompute"] == 0
    assert row["replay_on"]["stats_per_step"]["replayed_selections"] == result["layers"]
    assert "replay off" in bench.table(result)
