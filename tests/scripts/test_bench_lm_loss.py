"""scripts/bench_lm_loss.py runs its three arms at a tiny size on the CPU (the GPU run uses the same code)."""

import json

import pytest

from tests.support.scripts import load_script


def test_bench_lm_loss_tiny(tmp_path, capsys):
    result = load_script("bench_lm_loss").main(["--tiny", "--seqlens", "40", "64", "--reps", "1",
                                                "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_lm_loss.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert [(r["arm"], r["T"]) for r in saved["rows"]] == [(a, T) for T in (40, 64) for a in ("fused", "checkpointed", "whole")]
    assert all(r["ms"] > 0 for r in saved["rows"])
    assert set(saved["ratios_vs_fused"]) == {"checkpointed", "whole"}
    assert (tmp_path / "bench_lm_loss.png").stat().st_size > 0
    assert "checkpointed / fused" in capsys.readouterr().out


def test_bench_lm_loss_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        load_script("bench_lm_loss").main(["--tiny", "--chunk", "0", "--out", str(tmp_path)])
