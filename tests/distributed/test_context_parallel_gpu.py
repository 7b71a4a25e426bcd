"""Context parallelism on CUDA: the group's collectives through NCCL (a group of one rank, which still
splits the sequence into its two chunks and runs the per-chunk path and the gather), against the plain
one-process step (torch backend: the tiny dims are for the references). The multi-GPU runs are issue 30's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hyscale_hf
from tests.distributed import cp_worker

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = tmp_path_factory.mktemp("nccl") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("case", [("glm5", "plain", False), ("glm5", "padded", False), ("llama", "packed", False)])
def test_cuda_context_parallel_step_equals_one_process(nccl_group, case):
    if case[0] == "glm5" and "glm_moe_dsa" not in hyscale_hf.supported_model_types():
        pytest.skip("this Transformers has no glm_moe_dsa")
    res = cp_worker.run_case(*case, device="cuda")
    torch.testing.assert_close(res["loss"][1], res["loss"][0], rtol=2e-4, atol=2e-5)
    ref_grads, grads = res["grads"]
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=2e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    ref_sel, cp_sel = res["selections"]
    for layer, ref in enumerate(ref_sel):
        for c, (start, end) in enumerate(res["chunks"]):
            ours = cp_sel[2 * layer + c]
            assert torch.equal(ours, ref[:, start:end, : ours.shape[-1]]), (case, layer, c)
