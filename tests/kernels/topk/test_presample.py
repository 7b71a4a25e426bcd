"""HyTopK's threshold pre-pass (``HyTopKConfig.presample``) and the rescue of rows it overshoots.

The pre-pass starts each row's threshold at the r-th largest of every KS-th key's score; a row where
fewer than K keys reach it, or whose keys above it fill a slot of its buffer twice (the second time
from a threshold raised to the K-th key it held), is rebuilt by ``hytopk_rescue_kernel``. A negative or zero margin
(``presample_z``) makes that common, so these tests reach the rescue on purpose. Everything is
compared bit for bit with the torch reference on integer inputs (interpreter on CPU).
"""

import dataclasses
import math

import pytest
import torch

from hyscale_hf.kernels.topk import HyTopKConfig, host, hytopk_stats, hytopk_triton, reset_hytopk_stats
from hyscale_hf.kernels.topk.naive import hytopk_reference
from tests.support.hytopk_cases import adversarial_inputs, assert_same, int_inputs

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BASE = host.pick_config(4, 16, torch.bfloat16, torch.device(DEV))


def config(**kw) -> HyTopKConfig:
    return dataclasses.replace(BASE, presample=2, **kw)


def run(q, k, w, topk, cfg, cap=None, **kw):
    reset_hytopk_stats()
    got = hytopk_triton(q, k, w, topk, config=cfg, cap=cap, **kw)
    assert_same(got, hytopk_reference(q, k, w, topk, **kw), f"{cfg.presample} z={cfg.presample_z} {kw}")
    return hytopk_stats()


def test_plan_rank_and_where_it_applies():
    # K / KS = 128 samples expected in the top K; r lies z standard deviations (sqrt(128)) above
    assert host.presample_plan(32768, 2048, 16384, 16, 5.0) == (16, math.ceil(128 + 5 * math.sqrt(128)))
    # the samples must fit one row's buffer: a longer T takes a larger stride
    assert host.presample_plan(1 << 20, 2048, 16384, 16, 5.0)[0] == 64
    assert host.presample_plan(32768, 2048, 16384, 0, 5.0) == (0, 0)  # off
    assert host.presample_plan(32768, 64, 16384, 16, 5.0) == (0, 0)  # K / KS = 4 < 8
    assert host.presample_plan(2048, 2048, 16384, 16, 5.0) == (0, 0)  # no row has more than r samples
    assert host.presample_plan(32768, 2048, 16384, 16, -20.0) == (0, 0)  # r < 1


@pytest.mark.parametrize("z", [5.0, pytest.param(0.0, marks=pytest.mark.slow)], ids=["margin", "rescues"])
def test_random_integer_inputs_bitwise(z):
    q, k, w = int_inputs(2, 96, 96, 4, 16, device=DEV, seed=1)
    st = run(q, k, w, 16, config(presample_z=z))
    # ties at the estimate's score all pass it, so a margin of 5 never misses on these inputs
    assert (st["rows_rescued"] > 0) if z == 0.0 else (st["rows_rescued"] == 0), st


@pytest.mark.slow
def test_adversarial_rows_rescued_bitwise():
    """Plateaus, monotone rows (the estimate of an increasing row sits at its latest keys), one huge
    bucket, shared strong keys; with no margin many rows take the rescue."""
    q, k, w = adversarial_inputs(64, 64, 4, 16, device=DEV, seed=2)
    assert run(q, k, w, 16, config(presample_z=0.0))["rows_rescued"] > 0


@pytest.mark.slow
def test_windows_packed_sequences_relu_off_and_nan_rescued_bitwise():
    q, k, w = int_inputs(1, 96, 96, 4, 16, device=DEV, seed=5)
    cfg = config(presample_z=0.0)
    cu = torch.tensor([0, 10, 10, 70, 96], dtype=torch.int32, device=DEV)  # with an empty sequence
    rescued = run(q, k, w, 16, cfg, cu_seqlens=cu)["rows_rescued"]
    rescued += run(q, k, w, 16, cfg, window_start=torch.randint(-2, 98, (1, 96), device=DEV))["rows_rescued"]
    k[0, 40] = float("nan")  # NaN ranks below every finite score; ReLU off: negative scores
    rescued += run(q, k, w, 16, cfg, relu=False)["rows_rescued"]
    assert rescued > 0


def test_full_slots_second_chance_and_rescue_bitwise():
    """A buffer of 64 keys a row (4 per slot) against about r * KS = 46 keys above the estimate: after
    the pre-pass one scan launch takes each row's whole window with no refine between segments; rows
    that fill a slot get a second launch from the K-th key they hold (counted as refined), and rows
    that fill a slot again are rebuilt by the rescue. Exact either way."""
    q, k, w = int_inputs(2, 96, 96, 4, 16, device=DEV, seed=7)
    st = run(q, k, w, 16, config(presample_z=5.0), cap=64)
    assert st["rows_refined"] > 0 and st["rows_rescued"] > 0, st


@pytest.mark.parametrize("kw,name", [({"presample": 1}, "presample"), ({"presample": -2}, "presample"),
                                     ({"presample_z": 11.0}, "presample_z")])
def test_bad_settings_are_rejected(kw, name):
    with pytest.raises(ValueError, match=name):
        HyTopKConfig(BQ=2, BN=16, **kw)


def test_flagged_rows_listed_in_order():
    """``hytopk_flagged_rows_kernel`` lists each sequence's flagged rows (``redo`` > 0; the refine
    count can exceed 1) in ascending order with their count, over steps of BR rows and a last partial
    step; rows past the count are left alone."""
    from hyscale_hf.kernels.topk import triton_kernels

    B, R = 3, 150
    gen = torch.Generator().manual_seed(1)
    redo = torch.randint(-1, 3, (B, R), generator=gen, dtype=torch.int32) * (torch.rand(B, R, generator=gen) < 0.3)
    redo[2] = 0  # a sequence with no flagged row
    rows = torch.full((B, R), -7, dtype=torch.int32, device=DEV)
    n = torch.full((B,), -1, dtype=torch.int32, device=DEV)
    triton_kernels.hytopk_flagged_rows_kernel[(B,)](redo.to(DEV), rows, n, R, BR=64)
    for b in range(B):
        want = torch.nonzero(redo[b] > 0).flatten().tolist()
        assert n[b].item() == len(want)
        assert rows[b, : len(want)].tolist() == want
        assert (rows[b, len(want) :] == -7).all()
    assert n[0].item() > 0 and n[2].item() == 0


def test_short_rows_listed_exactly():
    """``hytopk_short_rows_kernel`` lists every row holding fewer keys than min(K, visible keys) and
    no other, counts them in the chunk's count and the running statistic, over two batches and rows
    of a chunk that starts past query 0 (``I0``)."""
    from hyscale_hf.kernels.topk import triton_kernels

    B, R, NS, S, T, I0, K = 2, 150, 8, 400, 400, 200, 64
    gen = torch.Generator().manual_seed(0)
    cnt = torch.randint(0, 12, (B, R, NS), generator=gen, dtype=torch.int32)
    start = torch.randint(0, 300, (B, S), generator=gen, dtype=torch.int32)
    held = cnt.sum(-1)
    qi = I0 + torch.arange(R)
    need = torch.minimum(torch.tensor(K), (T - S + qi - start[:, I0 : I0 + R] + 1).clamp_min(0))
    expected = torch.nonzero((held < need).flatten()).flatten()
    assert 0 < len(expected) < B * R  # both kinds of row occur
    rows = torch.full((B * R,), -1, dtype=torch.int32, device=DEV)
    n = torch.zeros(2, dtype=torch.int32, device=DEV)  # this chunk's count, then the next chunk's
    stat = torch.full((1,), 5, dtype=torch.int64, device=DEV)
    triton_kernels.hytopk_short_rows_kernel[(triton.cdiv(B * R, 64),)](
        cnt.to(DEV), start.to(DEV), rows, n, stat, S, T, I0, R, K, B * R, *start.stride(), NS=NS, BR=64
    )
    assert n.tolist() == [len(expected), 0]
    assert stat.item() == 5 + len(expected)
    assert sorted(rows[: len(expected)].tolist()) == expected.tolist()
    assert (rows[len(expected) :] == -1).all()
