"""scripts/profile_step.py profiles one training step at a tiny size on the CPU (the GPU run uses the same code)."""

import json

import pytest

from tests.support.scripts import load_script


def _script():
    return load_script("profile_step")


def test_categories_sort_kernel_names():
    category = _script().category
    assert category("sparse_attn_bwd_dkv_kernel") == "sparse attention backward"
    assert category("_sparse_attn_fwd_kernel") == "sparse attention forward"
    assert category("indexer_kl_fwd_kernel") == "indexer KL"
    assert category("hytopk_scan_kernel") == "HyTopK"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmuls"
    assert category("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise, copies"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "dense attention"
    assert category("something_else") == "other"


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("stack,arm", [("smollm2", "hyscale"), ("smollm2", "dense")])
def test_profile_step_tiny(tmp_path, stack, arm, capsys):
    chunk = 16 if arm == "dense" else 0  # the LM loss in chunks (bench_e2e's --loss-chunk) on one arm
    share = ["--index-share", "2", "--host-top", "4"] if arm == "hyscale" else []
    result = _script().main(["--tiny", "--stack", stack, "--arm", arm, "--layers", "2", "--seqlens", "32",
                             "--top", "5", "--loss-chunk", str(chunk), *share, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "profile_step.json").read_text())
    assert saved == json.loads(json.dumps(result)) and saved["loss_chunk"] == chunk
    assert saved["index_share"] == (2 if arm == "hyscale" else None)
    (row,) = saved["rows"]
    assert row["T"] == 32 and row["kernel_ms_total"] > 0 and len(row["top_kernels"]) == 5
    host = row["host"]  # the unprofiled steps: no GPU, so no synchronising calls to count
    assert 0 < host["host_ms"] <= host["wall_ms"] and host["syncs"] is None and host["sync_sites"] == []
    if arm == "hyscale":  # --host-top: one step under cProfile, its functions by own time
        funcs = host["host_functions"]
        assert len(funcs) == 4 and all(f["own_ms"] >= 0 and f["calls"] > 0 for f in funcs)
        assert [f["own_ms"] for f in funcs] == sorted((f["own_ms"] for f in funcs), reverse=True)
    shares = [c["share"] for c in row["categories"]]
    assert abs(sum(shares) - 1) < 1e-6
    assert "matmuls" in {c["category"] for c in row["categories"]}
    if arm == "hyscale":
        assert "HyTopK" in {c["category"] for c in row["categories"]}
    assert "T=32: profiled step" in capsys.readouterr().out


def test_call_sites_name_the_innermost_package_frame_and_its_module():
    call_site = _script().call_site
    stack = ["<built-in method pow>", "/x/site-packages/hyscale_hf/kernels/lean_autograd/op.py(25): _inverse_rms",
             "/x/site-packages/hyscale_hf/model_patches/_lean_layers.py(27): _lean_norm_forward",
             "nn.Module: GlmMoeDsaRMSNorm_3", "/x/transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py(587): forward"]
    assert call_site(stack) == "hyscale_hf/kernels/lean_autograd/op.py(25): _inverse_rms in GlmMoeDsaRMSNorm"
    assert call_site(["/x/torch/optim/adam.py(347): _single_tensor_adam"]) == "torch/optim/adam.py(347): _single_tensor_adam"
    assert call_site([]) == "(no Python frame)"
    assert call_site(["/y/other.py(1): f"]) == "(other) /y/other.py(1): f"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_glue_sites_list_elementwise_ops_by_call_site(tmp_path, capsys):
    result = _script().main(["--tiny", "--stack", "smollm2", "--layers", "2", "--seqlens", "32", "--sites", "6",
                             "--out", str(tmp_path)])
    (row,) = result["rows"]
    sites = row["glue_sites"]
    assert 0 < len(sites) <= 6
    assert all(g["op"].startswith("aten::") and g["ms"] > 0 and g["calls"] > 0 for g in sites)
    assert [g["ms"] for g in sites] == sorted((g["ms"] for g in sites), reverse=True)
    assert any(g["site"].startswith(("hyscale_hf/", "transformers/", "torch/optim/")) for g in sites)
    assert "by call site" in capsys.readouterr().out


def test_profile_step_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        _script().main(["--tiny", "--stack", "smollm2", "--arm", "native", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        _script().main(["--tiny", "--seqlens", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        _script().main(["--tiny", "--sites", "-1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        _script().main(["--tiny", "--loss-chunk", "-1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        _script().main(["--tiny", "--host-reps", "-1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        _script().main(["--tiny", "--host-top", "-1", "--out", str(tmp_path)])
    for share in (["--index-share", "0", "--stack", "smollm2"], ["--index-share", "2"],  # glm5 has its own layout
                  ["--index-share", "2", "--stack", "smollm2", "--arm", "dense"]):
        with pytest.raises(SystemExit):
            _script().main(["--tiny", *share, "--out", str(tmp_path)])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_profile_step_on_a_saved_converted_model(tmp_path):
    """--model: the saved model (its dims and layers) on real text; conflicting options are refused."""
    from tests.support.saved_model import save_tiny_converted

    folder = tmp_path / "saved"
    save_tiny_converted(folder)
    result = _script().main(["--model", str(folder), "--seqlens", "32", "--top", "3", "--out", str(tmp_path)])
    assert result["stack"] == "smollm2" and result["model"] == str(folder) and result["layers"] == 2
    assert "HyTopK" in {c["category"] for c in result["rows"][0]["categories"]}
    for argv in (["--stack", "glm5"], ["--tiny"], ["--layers", "3"]):
        with pytest.raises(SystemExit):
            _script().main(["--model", str(folder), *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        _script().main(["--model", str(tmp_path), "--out", str(tmp_path)])  # no hyscale_config.json there
