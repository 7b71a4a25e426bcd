"""Context parallelism on CPU processes (gloo) against one process: ``cp_worker.py`` on 2 and 4 ranks.

For each case (tiny GLM-5 and Llama with an indexer; plain, padded and packed batches; the sparse stage
and the dense warm-up) one checkpointed training step must give the one-process LM loss, indexer loss
and gradients (fp32, up to summation order), and every rank's selections must be the one-process
selections of its queries. ~30-60 s per world size on 2 cores.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

import hyscale_hf
from tests.distributed import cp_worker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
slow = pytest.mark.slow  # the spawned ranks: ~20 s per world size on 2 cores


def _spawn(world: int, tmp_path) -> list[dict]:
    store = tmp_path / "store"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(cp_worker.main, args=(world, str(store), str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request, tmp_path_factory):
    if "glm_moe_dsa" not in hyscale_hf.supported_model_types():
        pytest.skip("this Transformers has no glm_moe_dsa")
    return request.param, _spawn(request.param, tmp_path_factory.mktemp(f"cp{request.param}"))


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(b, a, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")


@slow
def test_losses_and_gradients_equal_one_process(ranks):
    world, results = ranks
    for case in cp_worker.CASES[world]:
        res = results[0][case]
        _close(*res["loss"], what=f"{case} LM loss")
        ref_index, cp_index = res["indexer_loss"]
        if not torch.isnan(ref_index):
            _close(ref_index, cp_index, what=f"{case} indexer loss")
        ref_grads, grads = res["grads"]
        assert grads.keys() == ref_grads.keys(), case
        for name, g in ref_grads.items():
            _close(g, grads[name], what=f"{case} grad {name}")


def _per_layer(records: list, parts: int) -> list:
    """The selections recorded part by part (tiles in order) joined into one ``[B, T, K]`` per layer, -1 padded."""
    layers = []
    for i in range(0, len(records), parts):
        group = records[i : i + parts]
        width = max(r.shape[-1] for r in group)
        layers.append(torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[-1]), value=-1) for r in group], 1))
    return layers


@slow
def test_every_rank_selects_what_one_process_selects(ranks):
    world, results = ranks
    for case in cp_worker.CASES[world]:
        if case[2]:  # the dense warm-up selects nothing
            continue
        tile = case[3] if len(case) > 3 else None
        tiles = 1 if tile is None else -(-cp_worker.LENGTH // tile)  # the reference selects tile by tile
        for rank, result in enumerate(results):
            res = result[case]
            ref_sel, cp_sel = res["selections"]
            ref_layers = _per_layer(ref_sel, tiles)
            chunks = res["chunks"]
            # The forward's selections (the recompute replays them): one per full indexer layer, two chunks each.
            assert len(cp_sel) == 2 * len(ref_layers) and ref_layers, (case, rank)
            for layer, ref in enumerate(ref_layers):
                for c, (start, end) in enumerate(chunks):
                    ours = cp_sel[2 * layer + c]
                    K = ours.shape[-1]
                    assert torch.equal(ours, ref[:, start:end, :K]), (case, rank, layer, c)
                    assert (ref[:, start:end, K:] == -1).all(), (case, rank, layer, c)


@slow
def test_fsdp2_on_a_2d_mesh_equals_one_process(ranks):
    world, results = ranks
    if world != 4:
        pytest.skip("the 2 x 2 mesh needs 4 ranks")
    res = results[0]["fsdp2_2d"]
    _close(*res["loss"], what="LM loss")
    ref_grads, grads = res["grads"]
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        _close(g, grads[name], what=f"grad {name}")


@slow
def test_memory_per_rank_is_a_share_plus_the_gathered_keys(ranks):
    """What a rank saves for backward: the one-process bytes over N (per-token activations, and the
    selections and attention blocks of its queries), plus the gathered keys, which are whole-sequence."""
    world, results = ranks
    for rank, result in enumerate(results):
        m = result["saved_bytes"]
        print(f"{world} ranks, rank {rank}: saved {m['rank']} B, one process {m['single']} B "
              f"(/N = {m['single'] // world}), gathered keys {m['gathered']} B")
        assert m["rank"] <= 1.02 * m["single"] / world + m["gathered"], (rank, m)
        assert m["rank"] >= 0.98 * m["single"] / world, (rank, m)


@slow
def test_input_ids_by_position_and_inputs_embeds_are_sharded_too(ranks):
    _, results = ranks
    for result in results:
        by_position, by_keyword, by_embeds = result["positional"]
        assert torch.equal(by_position, by_keyword)
        torch.testing.assert_close(by_embeds, by_keyword, rtol=1e-6, atol=1e-6)


@slow
def test_bad_inputs_are_refused_with_the_reason(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert f"multiple of {2 * world}" in errors["length"] and "got 30 tokens" in errors["length"], rank
        assert "different batches" in errors["different_batches"], rank
        assert "output_attentions" in errors["output_attentions"], rank


def test_enable_needs_a_patched_model_and_an_initialised_group():
    from tests.distributed.fsdp2_tiny_train import tiny_llama

    with pytest.raises(ValueError, match="patched"):
        hyscale_hf.enable_context_parallel(tiny_llama())
    model = hyscale_hf.patch_model(tiny_llama(), backend="torch")
    with pytest.raises(ValueError, match="torch.distributed"):
        hyscale_hf.enable_context_parallel(model)


def test_layout_is_head_and_tail():
    from hyscale_hf.context_parallel import ContextParallel, _global_order, _rank_order

    cp = ContextParallel(None, 1, 3)  # rank 1 of 3: chunks 1 and 4 of 6
    assert cp.chunks(12) == ((2, 4), (8, 10))
    assert cp.local_positions(12).tolist() == [2, 3, 8, 9]
    assert cp.shard(torch.arange(12)[None]).tolist() == [[2, 3, 8, 9]]
    order = _rank_order(cp, 2, "cpu")
    assert order.tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert torch.equal(order[_global_order(cp, 2, "cpu")], torch.arange(12))
    with pytest.raises(ValueError, match="multiple of 6"):
        cp.chunks(10)
