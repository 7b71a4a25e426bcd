"""Selection replay on a toy DSA stack (tests/replay_toy.py): Transformers checkpointing layers that
run HyTopK / reuse_indices + sparse attention + the indexer loss, patched through patch_model."""

from __future__ import annotations

import functools

import pytest
import torch

import hyscale_hf
from hyscale_hf import HyScaleConfig, SelectionReplayMismatch, patch_model, unpatch_model
from hyscale_hf.model_patches._checkpointing import _ReplayCheckpointFunc
from hyscale_hf.replay import ReplayContextFn
from hyscale_hf.state import in_backward, patch_state
from tests import replay_toy
from tests.replay_toy import make_toy
from tests.trainer_run import trained_parameters

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Transformers 5.23+ deprecation notices

B, T, VOCAB = 2, 16, 32
N_LAYERS, N_FULL = 4, 2  # toy layer types: full, shared, full, shared


def _ids(seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _grads(model):
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    return _grads(model)


def _assert_bitwise(a, b):
    assert set(a) == set(b)
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"gradients differ in {bad}"


def _reference_grads(ids, **config):
    model = patch_model(make_toy(**config), selection_replay=False)
    return _step(model, ids)


@pytest.fixture(scope="module", autouse=True)
def _toy_family():
    with replay_toy.toy_family():
        yield


@pytest.fixture(autouse=True)
def _fresh_stats():
    hyscale_hf.reset_selection_stats()
    replay_toy.GLOBAL_HOLDER.clear()
    yield


ENABLES = {
    "gradient_checkpointing_enable()": lambda m: m.gradient_checkpointing_enable(),
    "gradient_checkpointing_enable(kwargs)": lambda m: m.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": True}),
    "activation_checkpointing_enable()": lambda m: m.activation_checkpointing_enable(),
}


@pytest.mark.parametrize("enable", list(ENABLES))
def test_replay_skips_indexer_in_recompute_and_keeps_gradients_bitwise(enable):
    if enable.startswith("activation") and not hasattr(make_toy(), "activation_checkpointing_enable"):
        pytest.skip("Transformers < 5.23 has no activation_checkpointing_enable")
    ids = _ids()
    reference = _reference_grads(ids)
    model = patch_model(make_toy())
    ENABLES[enable](model)
    assert model.is_gradient_checkpointing if not hasattr(model, "is_activation_checkpointing") \
        else model.is_activation_checkpointing
    hyscale_hf.reset_selection_stats()
    grads = _step(model, ids)
    _assert_bitwise(reference, grads)
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_forward"] == N_FULL and stats["indexer_recompute"] == 0
    assert stats["shared_forward"] == N_LAYERS - N_FULL and stats["shared_recompute"] == 0
    assert stats["replayed_selections"] == N_LAYERS
    assert stats["replayed_indices"] == N_LAYERS * B * T * model.config.topk
    assert stats["verified_selections"] == 0


def test_without_replay_checkpointing_reruns_the_indexer():
    model = patch_model(make_toy(), selection_replay=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _step(model, _ids())
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == N_FULL and stats["replayed_selections"] == 0


def test_every_n_layers_and_extra_kwargs_pass_through():
    model = patch_model(make_toy())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.layers] == [True, False, True, False]
    func = model.layers[0]._gradient_checkpointing_func
    assert isinstance(func, _ReplayCheckpointFunc) and func.context_fn.layer == "layers.0"
    _assert_bitwise(_reference_grads(_ids()), _step(model, _ids()))
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] == 2  # layers 0 and 2


def test_checkpointing_enabled_before_patching_gets_the_policy():
    model = make_toy()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patch_model(model)
    _assert_bitwise(_reference_grads(_ids()), _step(model, _ids()))
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 0


def test_micro_batches_in_flight_use_their_own_shared_indices():
    """Megatron-LM PRs 6793/7010: shared layers read a holder that a later micro-batch overwrites.
    Replay keeps each micro-batch's copy; plain recompute uses the other micro-batch's indices."""
    ids1, ids2 = _ids(1), _ids(2)
    ref = patch_model(make_toy(global_holder=True), selection_replay=False)
    ref.zero_grad()
    losses = [ref(i, labels=i).loss for i in (ids1, ids2)]  # both graphs alive at once
    for loss in losses:
        loss.backward()
    reference = _grads(ref)

    def run(selection_replay):
        model = patch_model(make_toy(global_holder=True), selection_replay=selection_replay)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        losses = [model(i, labels=i).loss for i in (ids1, ids2)]
        for loss in losses:
            loss.backward()
        return _grads(model)

    _assert_bitwise(reference, run(True))
    plain = run(False)
    assert any(not torch.equal(reference[n], plain[n]) for n in reference)


def test_verify_mode_passes_and_counts_when_the_recompute_agrees():
    model = patch_model(make_toy(), verify_replay=True)
    model.gradient_checkpointing_enable()
    _assert_bitwise(_reference_grads(_ids()), _step(model, _ids()))
    stats = hyscale_hf.selection_stats()
    assert stats["verified_selections"] == N_LAYERS
    assert stats["indexer_recompute"] == N_FULL  # verify mode reruns the selection


def test_verify_mode_raises_naming_the_layer_on_a_perturbed_recompute():
    model = patch_model(make_toy())
    model.gradient_checkpointing_enable()
    target = model.layers[2].attn.index_k

    def perturb_in_recompute(module, args, output):
        # Flips the indexer keys only in recompute (the same op in both passes, as SAC requires).
        return output * (-1.0 if in_backward() else 1.0)

    target.register_forward_hook(perturb_in_recompute)
    _step(model, _ids())  # verify off: replay hides the perturbation
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 0
    patch_state(model).config.verify_replay = True  # live switch
    with pytest.raises(SelectionReplayMismatch, match=r"HyTopK selection.*'layers\.2'.*indices differ"):
        _step(model, _ids())


def test_verify_mode_flags_a_shared_holder_leaking_between_micro_batches():
    model = patch_model(make_toy(global_holder=True), verify_replay=True)
    model.gradient_checkpointing_enable()
    losses = [model(i, labels=i).loss for i in (_ids(1), _ids(2))]
    with pytest.raises(SelectionReplayMismatch, match=r"IndexShare indices.*'layers\.3'"):
        losses[0].backward()


@pytest.mark.parametrize("where", ["kwargs", "positional", "already_enabled"])
def test_reentrant_checkpointing_is_refused(where):
    model = make_toy()
    if where == "already_enabled":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        with pytest.raises(ValueError, match="non-reentrant checkpointing"):
            patch_model(model)
        assert not hyscale_hf.is_patched(model)
        assert model.layers[0].attn.state is None and "gradient_checkpointing_enable" not in model.__dict__
        return
    patch_model(model)
    with pytest.raises(ValueError, match="use_reentrant=True"):
        if where == "kwargs":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": True})
    assert not any(layer.gradient_checkpointing for layer in model.layers)


def test_a_foreign_context_fn_is_refused():
    model = patch_model(make_toy())
    from torch.utils.checkpoint import noop_context_fn

    with pytest.raises(ValueError, match="context_fn"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                          "context_fn": noop_context_fn})


def test_unpatch_restores_checkpointing_without_the_policy():
    model = make_toy()
    patch_model(model)
    model.gradient_checkpointing_enable()
    unpatch_model(model)
    assert not {"gradient_checkpointing_enable", "activation_checkpointing_enable", "_hyscale_replay"} & set(model.__dict__)
    funcs = [layer._gradient_checkpointing_func for layer in model.layers]
    assert all(isinstance(f, functools.partial) and f.keywords == {"use_reentrant": False} for f in funcs)
    _step(model, _ids())  # the toy still runs its indexer: now recomputed, not replayed
    assert hyscale_hf.selection_stats()["indexer_recompute"] == N_FULL
    model.gradient_checkpointing_enable()  # the original entry point again: no policy installed
    assert not isinstance(model.layers[0]._gradient_checkpointing_func, _ReplayCheckpointFunc)


def test_enable_is_idempotent_and_config_flag_off_leaves_model_alone():
    model = patch_model(make_toy(), selection_replay=False)
    assert "gradient_checkpointing_enable" not in model.__dict__
    undo = hyscale_hf.enable_selection_replay(model)
    assert hyscale_hf.enable_selection_replay(model) is undo
    model.gradient_checkpointing_enable()
    _step(model, _ids())
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 0
    undo()
    assert not isinstance(model.layers[0]._gradient_checkpointing_func, _ReplayCheckpointFunc)


def test_verify_needs_replay():
    with pytest.raises(ValueError, match="verify_replay"):
        HyScaleConfig(selection_replay=False, verify_replay=True)


def test_wrap_layers_for_replay_checkpoints_with_the_policy():
    ids = _ids()
    reference = _reference_grads(ids)
    model = patch_model(make_toy())
    layers = list(model.layers)
    model.config.use_cache = True
    hyscale_hf.wrap_layers_for_replay(model)
    assert model.config.use_cache is False  # recomputed layers must not append to a KV cache
    assert all(type(m).__name__ == "CheckpointWrapper" for m in model.layers)
    assert hyscale_hf.wrap_layers_for_replay(model) is not None  # already wrapped with replay: no-op
    hyscale_hf.reset_selection_stats()
    _assert_bitwise(reference, _step(model, ids))
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] == N_LAYERS
    unpatch_model(model)
    assert list(model.layers) == layers and model.config.use_cache is True


def test_wrap_layers_refuses_double_checkpointing():
    model = patch_model(make_toy())
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="twice"):
        hyscale_hf.wrap_layers_for_replay(model)


def test_replay_context_fn_for_manual_checkpoint_calls():
    torch.manual_seed(0)
    q = torch.randn(1, 12, 2, 8, requires_grad=True)
    k = torch.randn(1, 12, 8, requires_grad=True)
    w = torch.rand(1, 12, 2)
    v = torch.randn(1, 12, 1, 8, requires_grad=True)

    def block(q, k, v):
        idx = hyscale_hf.hytopk(q.detach(), k.detach(), w, 3, backend="torch")
        return hyscale_hf.sparse_attention(q, k.unsqueeze(2), v, idx, backend="torch").square().sum()

    ref = torch.autograd.grad(block(q, k, v), (q, k, v))
    hyscale_hf.reset_selection_stats()
    out = torch.utils.checkpoint.checkpoint(block, q, k, v, use_reentrant=False,
                                            context_fn=hyscale_hf.replay_context_fn("block"))
    got = torch.autograd.grad(out, (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 0
    assert isinstance(hyscale_hf.replay_context_fn(), ReplayContextFn)


def test_the_region_runs_without_dispatch_modes():
    """Only the kept ops go through the replay: the region's other ops, in forward and in recompute, see
    no dispatch mode (selective checkpointing's modes over the region cost each op a Python trip)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from hyscale_hf.replay import in_replay_checkpoint, replaying

    seen = []
    q = torch.randn(1, 12, 2, 8, requires_grad=True)
    k = torch.randn(1, 12, 8, requires_grad=True)

    def block(q, k):
        seen.append((len(_get_current_dispatch_mode_stack()), in_replay_checkpoint(), replaying()))
        idx = hyscale_hf.hytopk(q.detach(), k.detach(), torch.rand(1, 12, 2), 3, backend="torch")
        return hyscale_hf.sparse_attention(q, k.unsqueeze(2), k.unsqueeze(2), idx, backend="torch").sum()

    hyscale_hf.reset_selection_stats()
    out = torch.utils.checkpoint.checkpoint(block, q, k, use_reentrant=False,
                                            context_fn=hyscale_hf.replay_context_fn("block"))
    out.backward()
    assert seen == [(0, True, False), (0, True, True)]  # forward, then the recompute
    assert not in_replay_checkpoint() and not replaying()
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] == 1


def test_kept_calls_without_the_replay_run_the_op():
    """The kernels' hook: without one installed, ``kept_call`` is the op itself."""
    from hyscale_hf.kernels import kept_ops

    hook = kept_ops._HOOK
    try:
        kept_ops.install(None)
        assert kept_ops.kept_call(lambda a, b: a + b, 2, 3) == 5
    finally:
        kept_ops.install(hook)
    assert hook is hyscale_hf.replay.kept_call


@pytest.mark.skipif(not hyscale_hf.kernels.sparse_attn.host.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("heads,dv,kept", [(2, 16, True), (8, 64, False)], ids=["small_output", "large_output"])
def test_replay_keeps_a_small_attention_output_and_skips_its_forward_in_recompute(heads, dv, kept, monkeypatch):
    """The Triton sparse attention's forward kernels run once under a replay checkpoint when o and lse are
    no larger than the selection (K = 40 int32 = 160 bytes a token: 2 fp32 heads x (16 x 4 + 4) fit,
    8 x (64 x 4 + 4) do not): the recompute takes them from the forward; gradients equal, bit for bit."""
    from hyscale_hf.kernels.sparse_attn import forward_op

    runs = []
    real = forward_op.forward_launch
    monkeypatch.setattr(forward_op, "forward_launch", lambda *a: runs.append(in_backward()) or real(*a))
    torch.manual_seed(0)
    q = torch.randn(1, 20, heads, 16, requires_grad=True)
    k = torch.randn(1, 20, 1, 16, requires_grad=True)
    v = torch.randn(1, 20, 1, dv, requires_grad=True)
    idx = torch.randint(0, 20, (1, 20, 40), dtype=torch.int32)

    def block(q, k, v):
        return hyscale_hf.sparse_attention(q, k, v, idx, backend="triton").square().sum()

    ref = torch.autograd.grad(block(q, k, v), (q, k, v))
    assert runs == [False]
    runs.clear()
    out = torch.utils.checkpoint.checkpoint(block, q, k, v, use_reentrant=False,
                                            context_fn=hyscale_hf.replay_context_fn("block"))
    got = torch.autograd.grad(out, (q, k, v))
    assert runs == ([False] if kept else [False, True])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_trainer_gradient_checkpointing_matches_training_without_it(tmp_path):
    data = [{"input_ids": _ids(s)[0], "labels": _ids(s)[0]} for s in range(8)]

    def train(checkpointing, **extra):
        return trained_parameters(patch_model(make_toy()), data, tmp_path / str(checkpointing),
                                  checkpointing=checkpointing, learning_rate=1e-2, **extra)

    reference = train(False)
    hyscale_hf.reset_selection_stats()
    trained = train(True)
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] == 3 * N_LAYERS
    _assert_bitwise(reference, trained)
    with pytest.raises(ValueError, match="non-reentrant"):
        train(True, gradient_checkpointing_kwargs={"use_reentrant": True})


def test_wrap_layers_for_replay_under_fsdp2(tmp_path):
    """The FSDP2 recipe: wrap the layers, then fully_shard them (one gloo process on the CPU)."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    from torch.distributed.fsdp import fully_shard

    ids = _ids()
    reference = _reference_grads(ids)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = patch_model(make_toy())
        hyscale_hf.wrap_layers_for_replay(model)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        hyscale_hf.reset_selection_stats()
        model(ids, labels=ids).loss.backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
                 for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    _assert_bitwise(reference, grads)
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] == N_LAYERS


class _Toy517(replay_toy.ToyModel):
    """Transformers 5.17's checkpointing surface: gradient_checkpointing_enable is the only entry
    point (its body, as in 5.17's modeling_utils, without offload) and there is no
    activation_checkpointing_enable."""

    activation_checkpointing_enable = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        if gradient_checkpointing_kwargs is None:
            gradient_checkpointing_kwargs = {"use_reentrant": False}
        func = functools.partial(torch.utils.checkpoint.checkpoint, **gradient_checkpointing_kwargs)
        self._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)


def test_transformers_517_entry_point():
    torch.manual_seed(0)
    model = patch_model(_Toy517(replay_toy.ToyConfig()).train())
    assert "gradient_checkpointing_enable" in model.__dict__
    with pytest.raises(ValueError, match="non-reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    # The call the 5.17 Trainer makes.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False)
    _assert_bitwise(_reference_grads(_ids()), _step(model, _ids()))
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 0
    unpatch_model(model)
    assert "gradient_checkpointing_enable" not in model.__dict__


def test_deepcopy_of_a_patched_model_is_independent():
    import copy

    model = patch_model(make_toy())
    model.gradient_checkpointing_enable()
    clone = copy.deepcopy(model)
    entry = next(n for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable") if n in vars(clone))
    assert vars(clone)[entry].model is clone and vars(model)[entry].model is model
    clone.gradient_checkpointing_disable()
    clone.gradient_checkpointing_enable(every_n_layers=2)  # acts on the clone only
    assert [layer.gradient_checkpointing for layer in model.layers] == [True] * N_LAYERS
    assert [layer.gradient_checkpointing for layer in clone.layers] == [True, False, True, False]
    _assert_bitwise(_reference_grads(_ids()), _step(clone, _ids()))
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 0
    unpatch_model(clone)
    assert entry not in vars(clone) and entry in vars(model) and hyscale_hf.is_patched(model)
    assert isinstance(model.layers[0]._gradient_checkpointing_func, _ReplayCheckpointFunc)
    assert not isinstance(clone.layers[0]._gradient_checkpointing_func, _ReplayCheckpointFunc)
