"""scripts/bench_trained_selections.py runs end to end on the CPU on a tiny saved patched model (the GPU
run on the main job's saved SmolLM2 uses the same code), and rejects bad arguments by name."""

import json

import pytest
import torch

from tests.support.saved_model import save_tiny_converted
from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    save_tiny_converted(folder)
    return folder


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_trained_selections_tiny(saved, tmp_path):
    bench = load_script("bench_trained_selections")
    data = bench.main(["--model", str(saved), "--seqlens", "48", "64", "--layers", "1", "--reps", "1",
                       "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_trained_selections.json").read_text())
    assert [r["T"] for r in written["lengths"]] == [48, 64] == [r["T"] for r in data["lengths"]]
    row = written["lengths"][1]
    assert row["K"] == 8 and row["attention_shape"] == [4, 2, 8] and row["kernel_tile_q"] == 64
    assert len(row["layers"]) == 2 and {"G=2", "G=64"} <= set(row["layers"][0])
    assert set(row["selections"]) == {"trained layer 1", "stack (random init), layer 0", "realistic_selection"}
    for name, timed in row["selections"].items():
        assert timed["fwd_ms"] > 0 and timed["fwd_bwd_head_probs_ms"] > 0
        assert ("hytopk_ms" in timed) == (name != "realistic_selection") == ("indexer_kl" in timed)
        if "indexer_kl" in timed:
            assert timed["indexer_kl"]["per_query_ms"] > 0 and timed["indexer_kl"]["tiled_ms"] > 0
        mean = timed["sharing"]["G=64"]["mean_union"]
        assert timed["tiled_forward"] == (mean <= 4 * 8)
    assert row["dense_fwd_bwd_ms"] > 0
    png = tmp_path / "bench_trained_selections.png"
    assert png.stat().st_size > 0
    png.unlink()
    assert bench.main(["--plot", str(tmp_path / "bench_trained_selections.json")]) == written and png.stat().st_size > 0


def test_statistics_only_and_a_topk_override(saved, tmp_path):
    bench = load_script("bench_trained_selections")
    data = bench.main(["--model", str(saved), "--seqlens", "32", "--topk", "4", "--layers", "0", "--no-timing", "--out", str(tmp_path)])
    (row,) = data["lengths"]
    assert row["K"] == 4 and "dense_fwd_bwd_ms" not in row
    assert (tmp_path / "bench_trained_selections.png").stat().st_size > 0  # statistics only: one panel
    for selection in row["selections"].values():
        assert set(selection) == {"sharing", "tiled_forward"} and selection["sharing"]["pairs"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--seqlens", "0"], "--seqlens must be positive"),
    (["--layers", "-1"], "--layers must be non-negative"),
    (["--topk", "0"], "--topk must be positive"),
    (["--reps", "0"], "--reps must be positive"),
])
def test_bad_arguments_are_named(saved, argv, message, capsys):
    bench = load_script("bench_trained_selections")
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", str(saved), *argv])
    assert message in capsys.readouterr().err


def test_a_layer_past_the_model_is_refused_before_any_forward(saved, tmp_path):
    bench = load_script("bench_trained_selections")
    with pytest.raises(SystemExit, match="the model has 2 layers"):
        bench.main(["--model", str(saved), "--layers", "2", "--out", str(tmp_path)])


def test_a_folder_without_the_saved_config_is_refused(tmp_path, capsys):
    bench = load_script("bench_trained_selections")
    with pytest.raises(SystemExit):
        bench.parse_args([])
    assert "--model is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", str(tmp_path)])
    assert "no hyscale_config.json" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_refine_slacks_time_the_captured_inputs(saved):
    """The GPU-only timing of HyTopK's refine slacks, run here on the CPU (the Triton interpreter)."""
    bench = load_script("bench_trained_selections")
    model, tokenizer = bench.load_saved(str(saved), "cpu", torch.float32)
    cap = bench.capture(model.eval(), bench.text_ids(tokenizer, 24), (0,))
    times = bench.time_refine_slacks(cap.inputs[0], torch.device("cpu"), 1)
    assert set(times) == {f"slack={s}" for s in bench.REFINE_SLACKS}
    assert all(ms > 0 for ms in times.values())
