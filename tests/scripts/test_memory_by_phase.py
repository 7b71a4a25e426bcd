"""scripts/memory_by_phase.py records one step's points at a tiny size on the CPU (the GPU run adds the
memory figures with the same code)."""

import json

import pytest

from tests.support.scripts import load_script


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("stack,arm", [("glm5", "tiled_offload"), ("smollm2", "hyscale")])
def test_points_cover_every_layer_in_forward_and_recompute(tmp_path, stack, arm):
    result = load_script("memory_by_phase").main(["--tiny", "--stack", stack, "--arm", arm, "--layers", "2",
                                                  "--out", str(tmp_path)])
    assert {r["step"] for r in result["rows"]} == {1, 2} and result["oom"] is None
    points = [r["point"] for r in result["rows"] if r["step"] == 2]
    assert points[0].startswith("start") and points[-2:] == ["backward done", "optimizer step"]
    backward = points[points.index("loss computed"):]
    for layer in (0, 1):
        assert f"L{layer}.layer >" in points[:points.index("loss computed")]
        for part in ("attn", "mlp", "norm1", "norm2"):
            # in the forward, and again in the layer's checkpoint recompute during backward
            assert points.count(f"L{layer}.{part} >") == 2 and f"L{layer}.{part} >" in backward, (layer, part)
    assert backward.index("L1.attn >") < backward.index("L0.attn >")  # backward takes the layers in reverse
    assert all(r["allocated_gib"] is None for r in result["rows"])  # no memory figures on the CPU
    assert json.loads((tmp_path / "memory_by_phase.json").read_text())["rows"] == result["rows"]


def test_a_step_that_runs_out_of_memory_keeps_its_points(tmp_path, monkeypatch):
    script = load_script("memory_by_phase")

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(script, "chunked_cross_entropy", out_of_memory)
    result = script.main(["--tiny", "--layers", "2", "--out", str(tmp_path)])
    assert result["oom"].startswith("CUDA out of memory") and {r["step"] for r in result["rows"]} == {1}
    assert result["rows"][-1]["point"] == "L1.layer <"  # the forward ran; the loss did not
    assert json.loads((tmp_path / "memory_by_phase.json").read_text())["oom"] == result["oom"]


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        load_script("memory_by_phase").main(["--tiny", "--seqlen", "0"])


def test_detail_adds_the_attention_projections(tmp_path):
    result = load_script("memory_by_phase").main(["--tiny", "--layers", "1", "--detail", "--out", str(tmp_path)])
    points = [r["point"] for r in result["rows"] if r["step"] == 2]
    forward = points[:points.index("loss computed")]
    assert "L0.attn.indexer.wq_b <" in forward and "L0.attn.o_proj <" in forward
    # the indexer runs before the query heads: their gap is the selection
    assert forward.index("L0.attn.indexer.weights_proj <") < forward.index("L0.attn.q_b_proj >")
