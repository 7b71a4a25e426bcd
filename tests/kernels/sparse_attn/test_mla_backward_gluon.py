"""The Hopper MLA backward's dS + dK/dV kernel (Gluon) compiles for sm_90 and fits one SM, checked on
any machine.

Its results are checked against the fp32 reference and the Triton kernel by the GPU tests
(``tests/kernels/sparse_attn/test_gpu.py``: ``test_mla_absorbed_matches_fp32_reference`` runs it for
64 and 128 heads, ``test_mla_gluon_backward_matches_triton_backward``); see
``tests/support/sm90_build.py`` for why and how the kernel is built here.
"""

import re

import pytest
import torch

from hyscale_hf.kernels.sparse_attn import host
from tests.support.sm90_build import SM90_SHARED_BYTES, assert_warp_specialised, build_sm90

needs_gluon = pytest.mark.skipif(host.mla_backward_gluon is None, reason="needs Triton with Gluon's Hopper ops")

PTRS = dict(q_ptr="*bf16", k_ptr="*bf16", idx_ptr="*i32", num_ptr="*i32", o_ptr="*bf16", do_ptr="*bf16",
            lse_ptr="*fp32", dlse_ptr="*fp32", ds_desc="tensordesc:bf16:64x64", acc_ptr="*fp32")
INTS = ("s_qb s_qs s_qh s_kb s_kt s_ib s_is s_nb s_ob s_os s_oh s_dob s_dos s_doh s_lb s_ls s_lh s_dlb s_dls "
        "s_dlh ds_rows s_ab s_at s_ah scratch_slots").split()
PASS = dict(off_ptr="*i32", s_fb="i32", s_fs="i32", pass_idx="i32", perm_ptr="*i32", delta_ptr="*fp32",
            s_eb="i32", s_es="i32", s_eh="i32")
TAIL = "t_offset num_head_blocks".split()
ALIGNED = "s_qb s_qs s_qh s_kb s_kt s_ob s_os s_oh s_dob s_dos s_doh s_ab s_at s_ah".split()


# (HAS_DLSE, PSUM, PASSES): without / with the lse gradient, the head-summed P stored or added, and
# one key pass of the regrouped slots (key_passes.py)
@pytest.fixture(
    scope="module",
    params=[(False, 0, False), (True, 1, False), (False, 2, False), (True, 1, True)],
    ids=["plain", "dlse_psum", "psum_atomic", "key_pass_psum"],
)
def sm90_build(request):
    has_dlse, psum, passes = request.param
    signature = {**PTRS, **dict.fromkeys(INTS, "i32"), "psum_ptr": "*fp32", "s_pb": "i32", "s_ps": "i32", **PASS,
                 **dict.fromkeys(TAIL, "i32"), "sm_scale": "fp32", "qk_scale": "fp32"}
    return build_sm90(
        dict(
            module="hyscale_hf.kernels.sparse_attn.mla_backward_gluon",
            kernel="mla_backward_dkv_kernel",
            signature=signature,
            constexprs={"HAS_DLSE": has_dlse, "PSUM": psum, "PASSES": passes},
            aligned=[n for n in PTRS if n != "ds_desc"] + ALIGNED + ["psum_ptr", "off_ptr", "perm_ptr", "delta_ptr"],
        )
    )


@needs_gluon
def test_fits_one_sm(sm90_build):
    assert sm90_build["shared"] <= SM90_SHARED_BYTES
    assert "LOCAL:0" in sm90_build["usage"]


@needs_gluon
def test_warpgroups_are_specialised(sm90_build):
    # cp.async gathers, wgmma products (m64n64 for S / dP, m64n256 for the contributions), dS tiles
    # stored by TMA from shared memory, and the value columns added 4 adjacent fp32 at a time (the rope
    # tile in pairs), or in the deterministic backward stored to scratch 4 at a time
    assert_warp_specialised(
        sm90_build,
        r"cp\.async",
        r"cp\.async\.bulk\.tensor\.2d\.global\.shared",
        r"wgmma\.mma_async\.sync\.aligned\.m64n64k16",
        r"wgmma\.mma_async\.sync\.aligned\.m64n256k16",
        r"red\.global\.[a-z.]*add\.v4\.f32",
        r"st\.global\.v4\.b32",
    )


@needs_gluon
def test_head_sums_are_one_small_product(sm90_build, request):
    # with PSUM the head sums of P come from an m64n8 product; without, no such product is built
    psum = "psum" in request.node.callspec.id
    assert bool(re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n8k16", sm90_build["ptx"])) == psum


def test_rows_aligned_ignores_the_stride_of_size_one_dims():
    # The model's output gradient: a view of [H, S, D] storage, batch stride 1 at B = 1.
    H, S, D = 64, 16, 512
    do = torch.empty(H * S * D, dtype=torch.bfloat16).as_strided((1, S, H, D), (1, D, S * D, 1))
    assert host._rows_aligned(do)
    assert not host._rows_aligned(torch.empty(2 * S * H * D + 1)[1:].view(2, S, H, D))  # start not 16-byte aligned
    assert not host._rows_aligned(torch.empty(S, H, D + 4)[..., :D].unsqueeze(0))  # rows 516 apart: not a multiple of 8
    assert not host._rows_aligned(torch.empty(1, S, D, H).transpose(2, 3))  # inner stride not 1
    assert host._rows_aligned(torch.empty(2, S, H, D))


def test_unit_dims_zeroed_keeps_the_elements_and_zeroes_only_size_one_strides():
    H, S, D = 4, 8, 16
    base = torch.randn(H, S, D)
    do = base.as_strided((1, S, H, D), (1, D, S * D, 1))
    z = host._unit_dims_zeroed(do)
    assert z.stride() == (0, D, S * D, 1) and z.data_ptr() == do.data_ptr()
    assert torch.equal(z, do)
    full = torch.randn(2, S, H, D)
    assert host._unit_dims_zeroed(full) is full
