"""Selection replay on real patched models: a tiny GLM-5 (glm_moe_dsa with an IndexShare "shared"
layer) and a tiny Llama (indexer added), Transformers gradient checkpointing on."""

from __future__ import annotations

import pytest
import torch

import hyscale_hf
from hyscale_hf import SelectionReplayMismatch, patch_model
from hyscale_hf.state import in_backward
from tests.trainer_run import trained_parameters

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

B, T, VOCAB = 2, 24, 128
MODELS = ["glm_moe_dsa", "llama"]
DENSE_OPTIONS = dict(topk=8, index_n_heads=2, index_head_dim=16)  # T > topk: a real selection


def _build(model_type: str, seed: int = 0):
    if model_type not in hyscale_hf.supported_model_types():
        pytest.skip(f"{model_type} is not patchable here")
    if model_type == "glm_moe_dsa":
        from tests.model_patches.tiny_models import build

        model, config = build("glm_moe_dsa", seed=seed)  # layers: full, shared, full; index_topk 8
        assert config.indexer_types == ["full", "shared", "full"]
        return model.train(), {}
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.train(), DENSE_OPTIONS


def _layout(model_type: str) -> tuple[int, int]:
    """(full indexer layers, IndexShare shared layers) of the tiny model."""
    return (2, 1) if model_type == "glm_moe_dsa" else (2, 0)


def _patched(model_type: str, seed: int = 0, **config):
    model, options = _build(model_type, seed)
    return patch_model(model, **options, **config)


def _ids(seed=0):
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return _grads(model)


def _assert_bitwise(a, b):
    assert set(a) == set(b)
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"differ: {bad}"


@pytest.fixture(autouse=True)
def _fresh_stats():
    hyscale_hf.reset_selection_stats()


@pytest.mark.parametrize("model_type", MODELS)
def test_checkpointing_replays_selection_with_bitwise_gradients(model_type):
    ids = _ids()
    reference = _step(_patched(model_type, selection_replay=False), ids)
    assert any(".indexer." in n for n in reference), "the indexer must receive gradients (its KL loss)"
    model = _patched(model_type)
    model.gradient_checkpointing_enable()
    hyscale_hf.reset_selection_stats()
    _assert_bitwise(reference, _step(model, ids))
    full, shared = _layout(model_type)
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_forward"] == full and stats["indexer_recompute"] == 0
    assert stats["shared_forward"] == shared and stats["shared_recompute"] == 0
    assert stats["replayed_selections"] == full + shared


@pytest.mark.parametrize("model_type", MODELS)
def test_without_replay_the_indexer_reruns_in_recompute(model_type):
    model = _patched(model_type, selection_replay=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _step(model, _ids())
    assert hyscale_hf.selection_stats()["indexer_recompute"] == _layout(model_type)[0]


def test_index_share_with_micro_batches_in_flight():
    ids = [_ids(1), _ids(2)]
    ref = _patched("glm_moe_dsa", selection_replay=False)
    ref.zero_grad()
    for loss in [ref(input_ids=i, labels=i).loss for i in ids]:  # both graphs alive, then both backwards
        loss.backward()
    model = _patched("glm_moe_dsa", verify_replay=True)
    model.gradient_checkpointing_enable()
    hyscale_hf.reset_selection_stats()
    for loss in [model(input_ids=i, labels=i).loss for i in ids]:
        loss.backward()
    _assert_bitwise(_grads(ref), _grads(model))
    stats = hyscale_hf.selection_stats()
    assert stats["replayed_selections"] == 2 * 3 and stats["verified_selections"] == 2 * 3


@pytest.mark.parametrize("model_type", MODELS)
def test_verify_mode_raises_on_a_perturbed_recompute(model_type):
    model = _patched(model_type, verify_replay=True)
    model.gradient_checkpointing_enable()
    _step(model, _ids())  # unperturbed: verify passes
    assert hyscale_hf.selection_stats()["verified_selections"] == sum(_layout(model_type))
    name, wk = next((n, m) for n, m in model.named_modules() if n.endswith("indexer.wk"))

    def perturb_in_recompute(module, args, output):
        # Flip the indexer keys only in recompute (the same op in both passes, as SAC requires).
        return output * (-1.0 if in_backward() else 1.0)

    wk.register_forward_hook(perturb_in_recompute)
    layer = name.rsplit(".self_attn", 1)[0]
    with pytest.raises(SelectionReplayMismatch, match=rf"HyTopK selection.*'{layer}'"):
        _step(model, _ids())


@pytest.mark.parametrize("model_type", MODELS)
def test_reentrant_checkpointing_is_refused(model_type):
    model = _patched(model_type)
    with pytest.raises(ValueError, match="non-reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


@pytest.mark.parametrize("model_type", MODELS)
def test_trainer_with_gradient_checkpointing(model_type, tmp_path):
    data = [{"input_ids": _ids(s)[0], "labels": _ids(s)[0]} for s in range(6)]

    def train(checkpointing):
        return trained_parameters(_patched(model_type), data, tmp_path / str(checkpointing),
                                  checkpointing=checkpointing, learning_rate=1e-3)

    reference = train(False)
    hyscale_hf.reset_selection_stats()
    trained = train(True)
    stats = hyscale_hf.selection_stats()
    full, shared = _layout(model_type)
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] == 3 * (full + shared)
    _assert_bitwise(reference, trained)


def test_enabling_checkpointing_on_the_inner_model_also_replays():
    model = _patched("llama")
    model.model.gradient_checkpointing_enable()  # the decoder stack, not the CausalLM
    _step(model, _ids())
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] == 2


@pytest.mark.parametrize("model_type", MODELS)
@pytest.mark.parametrize("stage", ["sparse", "dense_warmup", "dense_warmup_base_frozen"])
def test_indexer_loss_runs_once_per_layer_under_checkpointing(model_type, stage, monkeypatch):
    """Issue 22: the KL forward ran again in every checkpoint recompute. Now once per full indexer layer
    per step, with the indexer's gradients those of a step without checkpointing (bit for bit). The sparse
    stage computes it in backward, from the target the sparse attention's backward leaves
    (``_deferred_target``, MLA and GQA alike); the warm-up stages in forward."""
    from hyscale_hf.model_patches import _dsa_step
    from hyscale_hf.state import patch_state

    calls = []

    def counted(real):
        def call(*args, **kwargs):
            calls.append(in_backward())
            return real(*args, **kwargs)

        return call

    for name in ("indexer_kl_loss", "indexer_kl_loss_given_target"):
        monkeypatch.setattr(_dsa_step, name, counted(getattr(_dsa_step, name)))
    deferred = stage == "sparse"
    grads = []
    for checkpointing in (False, True):
        model = _patched(model_type)
        if stage != "sparse":
            hyscale_hf.patched_config(model).dense_warmup = True
        if stage == "dense_warmup_base_frozen":  # what HyScaleCallback does in the warm-up
            indexer = set(hyscale_hf.indexer_parameter_names(model))
            for name, p in model.named_parameters():
                p.requires_grad_(name in indexer)
            patch_state(model).base_frozen = True
        if checkpointing:
            model.gradient_checkpointing_enable()
        calls.clear()
        grads.append(_step(model, _ids()))
        assert calls == [deferred] * _layout(model_type)[0]  # once per full indexer layer
    indexer_grads = [{n: g for n, g in step.items() if ".indexer." in n} for step in grads]
    assert indexer_grads[0], "the indexer must receive gradients"
    _assert_bitwise(*indexer_grads)
    _assert_bitwise(*grads)


@pytest.mark.parametrize("model_type", MODELS)
def test_patched_step_reads_no_index_range_on_the_host(model_type, monkeypatch):
    """The step's selections are its own: the ops skip the range check (a GPU sync per op and layer)."""
    from hyscale_hf.kernels import checks

    reads = []
    real = checks.check_indices

    def spy(indices, batch, queries, num_keys, check_range=True):
        reads.append(check_range)
        return real(indices, batch, queries, num_keys, check_range=check_range)

    for module in ("hyscale_hf.kernels.sparse_attn.op", "hyscale_hf.kernels.sparse_attn.mla",
                   "hyscale_hf.kernels.indexer_kl.op"):
        monkeypatch.setattr(f"{module}.check_indices", spy)
    model = _patched(model_type)
    model.gradient_checkpointing_enable()
    _step(model, _ids())
    assert reads and not any(reads)


def test_the_gqa_indexer_loss_walks_the_attention_tiles(monkeypatch):
    """Triton path (the interpreter here): the attention's backward walks query tiles and hands them to
    the deferred indexer KL, which walks them too, in one pass (the selection's lse from hytopk: no KL
    forward); the loss and every gradient match the per-query KL."""
    from hyscale_hf.kernels.indexer_kl import op as kl_op
    from hyscale_hf.kernels.indexer_kl import tiled
    from hyscale_hf.state import patch_state

    calls, forwards = [], []
    real = tiled.indexer_kl_backward_tiled
    monkeypatch.setattr(kl_op, "indexer_kl_backward_tiled", lambda *a, **k: calls.append(1) or real(*a, **k))
    for name in ("indexer_kl_forward_tiled", "indexer_kl_forward_triton"):
        fwd = getattr(kl_op, name)
        monkeypatch.setattr(kl_op, name, lambda *a, fwd=fwd, **k: forwards.append(1) or fwd(*a, **k))
    results = []
    for walk_tiles in (True, False):
        if not walk_tiles:
            monkeypatch.setattr(tiled, "takes_tiles", lambda *args: False)
        model = _patched("llama", backend="triton")
        model.gradient_checkpointing_enable()
        before = len(calls)
        results.append((_step(model, _ids()), patch_state(model).pop_indexer_loss()))
        assert len(calls) - before == (2 if walk_tiles else 0)  # once per layer (two), when tiles are walked
    assert not forwards
    (got, loss), (want, want_loss) = results
    assert loss == pytest.approx(want_loss, rel=1e-5) and want_loss > 0
    assert any(".indexer." in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("model_type", MODELS)
def test_deferred_indexer_loss_is_the_loss_computed_in_forward(model_type, padded, monkeypatch):
    """The sparse stage takes the KL target from its attention (here the torch path, which fills it in
    forward; the Triton path fills it in backward, ``tests/kernels/sparse_attn/test_mla.py`` and
    ``test_head_probs.py``) and its selection's lse from hytopk (with padding, selected in compacted order
    and moved back per query); the loss and every gradient match the loss computed in forward from the
    attention tensors."""
    from hyscale_hf.model_patches import _dsa_step
    from hyscale_hf.state import patch_state

    ids = _ids()
    mask = torch.ones_like(ids)
    if padded:  # left padding in one row, a hole in the other
        mask[0, :5] = 0
        mask[1, 9:12] = 0
    results = []
    for deferred in (True, False):
        if not deferred:
            monkeypatch.setattr(_dsa_step, "_deferred_target", lambda *args: None)
        model = _patched(model_type)
        model.gradient_checkpointing_enable()
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads = _grads(model)
        results.append((grads, patch_state(model).pop_indexer_loss()))
    (got, loss), (want, want_loss) = results
    assert loss == pytest.approx(want_loss, rel=1e-5) and want_loss > 0
    assert set(got) == set(want) and any(".indexer." in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
