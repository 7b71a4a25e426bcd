"""The Hopper MLA forward (Gluon) compiles for sm_90 and fits one SM, checked on any machine.

Its results are checked against the Triton forward by the GPU tests
(``tests/kernels/sparse_attn/test_gpu.py::test_mla_gluon_forward_matches_triton_forward``); see
``tests/support/sm90_build.py`` for why and how the kernel is built here.
"""

import pytest

from hyscale_hf.kernels.sparse_attn import host
from tests.support.sm90_build import assert_fits_one_sm_without_spills, assert_warp_specialised, build_sm90

pytestmark = pytest.mark.skipif(host.mla_forward_gluon is None, reason="needs Triton with Gluon's Hopper ops")

PTRS = dict(q_ptr="*bf16", k_ptr="*bf16", idx_ptr="*i32", num_ptr="*i32", o_ptr="*bf16", lse_ptr="*fp32")
INTS = "s_qb s_qs s_qh s_kb s_kt s_ib s_is s_nb s_ob s_os s_oh s_lb s_ls s_lh num_head_blocks".split()


@pytest.fixture(scope="module")
def sm90_build():
    return build_sm90(
        dict(
            module="hyscale_hf.kernels.sparse_attn.mla_forward_gluon",
            kernel="mla_forward_kernel",
            signature={**PTRS, **dict.fromkeys(INTS, "i32"), "qk_scale": "fp32"},
            constexprs={},
            aligned=list(PTRS) + ["s_qb", "s_qs", "s_qh", "s_kb", "s_kt", "s_ob", "s_os", "s_oh"],
        )
    )


def test_fits_one_sm_without_spills(sm90_build):
    assert_fits_one_sm_without_spills(sm90_build)


def test_warpgroups_are_specialised(sm90_build):
    # the softmax warpgroup gathers the selected keys with cp.async; products run on wgmma
    assert_warp_specialised(sm90_build, r"cp\.async", r"wgmma\.mma_async")
