"""HyTopK's Hopper scan (Gluon) compiles for sm_90 and fits one SM, checked on any machine.

Its results are checked against the reference and the Triton scan by the GPU tests
(``tests/kernels/topk/test_gpu.py::test_gluon_scan_exact_like_the_triton_scan``); see
``tests/support/sm90_build.py`` for why and how the kernel is built here.
"""

import pytest

from hyscale_hf.kernels.topk import HyTopKConfig, host
from tests.support.sm90_build import assert_fits_one_sm_without_spills, assert_warp_specialised, build_sm90

pytestmark = pytest.mark.skipif(host.scan_gluon is None, reason="needs Triton with Gluon's Hopper ops")

PTRS = dict(q_ptr="*bf16", k_desc="", w_ptr="*fp32", start_ptr="*i32", buf_ptr="*i64", cnt_ptr="*i32",
            th_ptr="*i32", nan_ptr="*i32", dbg_ptr="*fp32")  # fmt: skip
INTS = "S T I0 R SEG0 LOCAL_TILES s_qb s_qs s_qh s_wb s_ws s_wh s_sb s_ss".split()


# the default widths (256 product columns for 32 and 64 heads) and a small indexer's opt-in width
# (HyTopKConfig.gluon_columns = 64: 16 queries of 4 heads a warpgroup)
@pytest.fixture(scope="module", params=[(32, 128, None), (64, 128, None), (4, 64, 64)],
                ids=["H32-D128", "H64-D128", "H4-D64-64cols"])  # fmt: skip
def sm90_build(request):
    H, D, columns = request.param
    cfg = HyTopKConfig(BQ=4, BN=64, gluon_columns=columns)
    build = build_sm90(
        dict(
            module="hyscale_hf.kernels.topk.scan_gluon",
            kernel="hytopk_scan_ws_kernel",
            signature={**PTRS, "k_desc": f"tensordesc:bf16:64x{D}", **dict.fromkeys(INTS, "i32")},
            # the buffer of a top-2048 call: 256 entries per slot, segments of 74 tiles
            constexprs=dict(H=H, BQ=host.gluon_columns(cfg) // H, SC=256, SEG=74, STAGES=cfg.gluon_stages,
                            RELU=True, CHECK_NAN=False, SCORE_ONLY=False),  # fmt: skip
            aligned=[n for n in PTRS if n != "k_desc"] + ["s_qb", "s_qs", "s_qh", "s_wb", "s_ws", "s_sb", "S", "T"],
        )
    )
    return build, host.gluon_columns(cfg)


def test_fits_one_sm_without_spills(sm90_build):
    assert_fits_one_sm_without_spills(sm90_build[0])


def test_warpgroups_are_specialised(sm90_build):
    # the load warp copies key tiles with TMA; each selection warpgroup runs an m64nN product, N its columns
    build, columns = sm90_build
    assert_warp_specialised(build, r"cp\.async\.bulk\.tensor", rf"wgmma\.mma_async\.sync\.aligned\.m64n{columns}k16")
