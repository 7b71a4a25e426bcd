"""scripts/bench_e2e.py runs end to end at a tiny size on the CPU (the GPU run uses the same code)."""

import json

import pytest

import hyscale_hf
from tests.support.saved_model import save_tiny_converted
from tests.support.scripts import load_script


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_e2e_tiny(tmp_path):
    if "glm_moe_dsa" not in hyscale_hf.supported_model_types():
        pytest.skip("glm_moe_dsa is not patchable with the installed Transformers")
    bench = load_script("bench_e2e")
    bench.main(["--tiny", "--arms", "hyscale", "dense", "lean_off", "--seqlens", "16", "32", "--reps", "1", "--warmup", "0",
                "--search-arms", "hyscale", "--search-max", "64", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_e2e.json").read_text())
    hyscale, dense, lean_off = result["arms"]
    assert [r["T"] for r in hyscale["rows"]] == [16, 32] and all(r["step_ms"] > 0 for r in hyscale["rows"])
    assert [r["T"] for r in hyscale["search"]] == [64] and hyscale["longest_trained_T"] == 64
    assert dense["search"] == [] and dense["longest_trained_T"] == 32
    assert lean_off["arm"] == "lean_off" and [r["T"] for r in lean_off["rows"]] == [16, 32]
    assert set(result["ratios_vs_hyscale"]["dense"]) == {"16", "32"}
    assert (tmp_path / "bench_e2e.png").stat().st_size > 0


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_e2e_tiny_smollm2_stack(tmp_path):
    """The converted-dense-model stack: a Llama with and without patch_model, in the same run."""
    bench = load_script("bench_e2e")
    bench.main(["--tiny", "--stack", "smollm2", "--arms", "hyscale", "dense", "--seqlens", "32", "--reps", "1",
                "--warmup", "0", "--search-arms", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert result["stack"] == "smollm2" and result["layers"] == 30
    assert [a["arm"] for a in result["arms"]] == ["hyscale", "dense"]
    assert set(result["ratios_vs_hyscale"]["dense"]) == {"32"}
    with pytest.raises(SystemExit):  # the dense stack has no unpatched DSA arm
        bench.main(["--tiny", "--stack", "smollm2", "--arms", "native", "--out", str(tmp_path)])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_e2e_smollm2_stack_with_shared_selections(tmp_path):
    """--index-share: the patched arm's indexers on every N-th layer; refused where the layers are fixed."""
    bench = load_script("bench_e2e")
    result = bench.main(["--tiny", "--stack", "smollm2", "--index-share", "3", "--arms", "hyscale", "--seqlens", "32",
                         "--reps", "1", "--warmup", "0", "--search-arms", "--out", str(tmp_path)])
    assert result["index_share"] == 3 and result["arms"][0]["rows"][0]["step_ms"] > 0
    for argv in (["--stack", "glm5"], ["--stack", "smollm2", "--index-share", "0"]):
        with pytest.raises(SystemExit):
            bench.main(["--tiny", "--index-share", "2", *argv, "--out", str(tmp_path)])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_e2e_on_a_saved_converted_model(tmp_path):
    """--model: the saved model (its dims and layers) on real text, patched and dense, in the same run."""
    folder = tmp_path / "saved"
    save_tiny_converted(folder)
    bench = load_script("bench_e2e")
    result = bench.main(["--model", str(folder), "--arms", "hyscale", "dense", "--seqlens", "32", "--reps", "1",
                         "--warmup", "0", "--search-arms", "--out", str(tmp_path)])
    assert result["stack"] == "smollm2" and result["model"] == str(folder) and result["text"] == "stdlib sources"
    assert result["layers"] == 2 and result["dims"]["hidden_size"] == 32
    assert [a["arm"] for a in result["arms"]] == ["hyscale", "dense"]
    assert all(a["rows"][0]["step_ms"] > 0 for a in result["arms"])
    for argv in (["--stack", "glm5"], ["--tiny"], ["--layers", "3"]):
        with pytest.raises(SystemExit):
            bench.main(["--model", str(folder), *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--model", str(tmp_path), "--out", str(tmp_path)])  # no hyscale_config.json there
