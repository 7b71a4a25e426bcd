"""One rank of the context-parallel tests (tests/distributed/test_context_parallel.py), on CPU with gloo.

Every rank builds the same tiny patched model twice: a reference that runs the whole batch in this one
process, and a copy with ``enable_context_parallel`` over all ranks. Both take one checkpointed training
step's forward and backward on the same batch. The rank writes what the test compares to
``OUT/rank<r>.pt``: per case, the reference's and the group's LM loss (mean over ranks of each rank's
loss), indexer loss (likewise), gradients (the group's averaged over ranks, as DDP does), and the
selections (the reference's rows of this rank's queries, and the rank's own).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

import hyscale_hf
from hyscale_hf.model_patches import _dsa_step
from hyscale_hf.state import patch_state
from tests.support.saved import saved_bytes

LENGTH = 32  # a multiple of 2 x 4 ranks


def _model(family: str):
    if family == "glm5":
        from tests.model_patches.tiny_models import build

        model, _ = build("glm_moe_dsa", seed=0, index_topk=6)
        return model, dict(backend="torch", indexer_loss_coef=1.0)
    from tests.distributed.fsdp2_tiny_train import PATCH, tiny_llama

    if family == "llama_share":  # IndexShare: layer 1 attends over layer 0's selection
        return tiny_llama(), dict(PATCH, index_share=2)
    return tiny_llama(), dict(PATCH)


def _batch(kind: str):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2 if kind != "packed" else 1, LENGTH), generator=g)
    kwargs = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":  # right padding in row 0, left padding in row 1
        mask = torch.ones_like(ids)
        mask[0, -5:] = 0
        mask[1, :3] = 0
        kwargs["attention_mask"] = mask
        kwargs["labels"] = ids.masked_fill(mask == 0, -100)
    if kind == "packed":  # three sequences, positions restarting
        kwargs["position_ids"] = torch.cat([torch.arange(11), torch.arange(9), torch.arange(12)])[None]
    return kwargs


def _record_selections(store: list):
    original = _dsa_step._select

    def recording(index, vis, compaction, topk, cfg, with_lse):
        indices, index_lse = original(index, vis, compaction, topk, cfg, with_lse)
        store.append(indices.clone())
        return indices, index_lse

    _dsa_step._select = recording
    return lambda: setattr(_dsa_step, "_select", original)


def _step(model, kwargs: dict, selections: list):
    model.zero_grad(set_to_none=True)
    restore = _record_selections(selections)
    try:
        loss = model(**kwargs).loss
        loss.backward()
    finally:
        restore()
    indexer = patch_state(model).pop_indexer_loss()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), torch.tensor(indexer if indexer is not None else float("nan"), device=loss.device), grads


def _mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def run_case(family: str, kind: str, warmup: bool, tile: int | None = None, device: str = "cpu") -> dict:
    base, options = _model(family)
    ref = hyscale_hf.patch_model(base.to(device), dense_warmup=warmup, tile_tokens=tile, **options)
    cp = copy.deepcopy(ref)  # the same added indexers (patch_model initialises them at random)
    for m in (ref, cp):
        m.train()
        m.config.use_cache = False
        m.gradient_checkpointing_enable()
    hyscale_hf.enable_context_parallel(cp)
    kwargs = {k: v.to(device) for k, v in _batch(kind).items()}
    ref_sel, cp_sel = [], []
    ref_loss, ref_index, ref_grads = _step(ref, kwargs, ref_sel)
    cp_loss, cp_index, cp_grads = _step(cp, {k: v.clone() for k, v in kwargs.items()}, cp_sel)
    grads = {n: _mean_over_ranks(g) for n, g in cp_grads.items()}
    return {
        "loss": (ref_loss, _mean_over_ranks(cp_loss)), "indexer_loss": (ref_index, _mean_over_ranks(cp_index)),
        "grads": (ref_grads, grads), "selections": (ref_sel, cp_sel),
        "chunks": patch_state(cp).context_parallel.chunks(LENGTH),
    }


def fsdp2_2d() -> dict:
    """FSDP2 over all 4 ranks x context parallelism over pairs of them (mesh dp 2 x cp 2): each data-parallel
    group trains on its own sequence of a 2-sequence batch, split over its 2 ranks; FSDP2 averages the
    gradients over the 4. Against one process on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    base, options = _model("llama")
    ref = hyscale_hf.patch_model(base, **options)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.train()
        m.config.use_cache = False
        m.gradient_checkpointing_enable()
    kwargs = _batch("plain")  # 2 sequences
    ref_loss, _, ref_grads = _step(ref, kwargs, [])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    world = init_device_mesh("cpu", (4,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=world)
    fully_shard(model, mesh=world)
    hyscale_hf.enable_context_parallel(model, mesh["cp"])
    row = mesh["dp"].get_local_rank()
    mine = {k: v[row : row + 1].clone() for k, v in kwargs.items()}
    model.zero_grad(set_to_none=True)
    loss = model(**mine).loss
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": (ref_loss, _mean_over_ranks(loss.detach())), "grads": (ref_grads, grads)}


def saved_bytes_per_rank() -> dict:
    """Bytes autograd saves for backward in one training forward (no checkpointing, so every activation
    is saved; each storage counted once, the weights left out): tiny GLM-5 on the whole sequence in one
    process, and on this rank's share under context parallelism; with the bytes of the tensors
    ``gather_tokens`` returned."""
    from hyscale_hf import context_parallel

    base, options = _model("glm5")
    ref = hyscale_hf.patch_model(base, **options).train()
    cp = copy.deepcopy(ref)
    hyscale_hf.enable_context_parallel(cp)
    ids = torch.randint(3, 128, (1, 4 * LENGTH), generator=torch.Generator().manual_seed(6))

    def measure(model) -> tuple[int, int]:
        gathered = []
        original = context_parallel._GatherTokens.apply

        def counting(*args):
            out = original(*args)
            gathered.append(out.numel() * out.element_size())
            return out

        context_parallel._GatherTokens.apply = counting
        try:
            with saved_bytes(model) as storages:
                loss = model(input_ids=ids, labels=ids).loss
        finally:
            context_parallel._GatherTokens.apply = original
        del loss
        return sum(storages.values()), sum(gathered)

    # Under context parallelism the indexer loss is computed in forward (its loss sink); the one-process
    # MLA step defers it to backward, where it saves the indexer's outputs and the selections. Measure the
    # reference on the forward path too, so both count the same things.
    deferred = _dsa_step._deferred_target
    _dsa_step._deferred_target = lambda *args: None
    try:
        single, _ = measure(ref)
    finally:
        _dsa_step._deferred_target = deferred
    rank, gathered = measure(cp)
    return {"single": single, "rank": rank, "gathered": gathered, "tokens": ids.shape[1]}


def positional_call() -> tuple:
    """The LM loss of a model with the chunked LM loss (an instance forward taking ``*args``) called with
    ``input_ids`` by position, by keyword, and with their embeddings as ``inputs_embeds``."""
    model, options = _model("llama")
    model = hyscale_hf.patch_model(model, lm_loss_chunk=8, **options)
    hyscale_hf.enable_context_parallel(model)
    ids = torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        return (model(ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss,
                model(inputs_embeds=embeds, labels=ids).loss)


def bad_inputs() -> dict:
    """The messages the group's pre-hook gives for inputs it refuses (before any work)."""
    model, options = _model("llama")
    model = hyscale_hf.patch_model(model, **options)
    hyscale_hf.enable_context_parallel(model)
    ids = torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(4))
    attempts = {
        "length": lambda: model(input_ids=ids[:, :30]),
        "different_batches": lambda: model(input_ids=ids + dist.get_rank()),
        "output_attentions": lambda: model(input_ids=ids, output_attentions=True),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    return messages


CASES = {
    2: [("glm5", "plain", False), ("glm5", "plain", True), ("glm5", "padded", False), ("llama", "plain", False),
        ("llama", "padded", False), ("llama", "packed", False), ("llama", "plain", True), ("llama_share", "padded", False),
        ("glm5", "plain", False, 12)],  # tile_tokens: the one-process reference tiles its MLA query side too
    4: [("glm5", "plain", False), ("llama", "packed", False)],
}


def main(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = {case: run_case(*case) for case in CASES[world]}
        results["errors"] = bad_inputs()
        results["positional"] = positional_call()
        results["saved_bytes"] = saved_bytes_per_rank()
        if world == 4:
            results["fsdp2_2d"] = fsdp2_2d()
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
