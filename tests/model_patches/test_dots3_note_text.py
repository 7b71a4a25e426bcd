"""Patched dots3_note_text against the unpatched Transformers model (tiny config, CPU, torch backend)."""

import pytest

from . import dsa_checks
from .tiny_models import has_family

FAMILY = "dots3_note_text"
pytestmark = pytest.mark.skipif(not has_family(FAMILY), reason=f"the installed Transformers has no {FAMILY}")


def test_matches_unpatched_when_topk_covers_all_keys():
    dsa_checks.check_matches_unpatched_full_topk(FAMILY)


def test_matches_unpatched_selection_when_topk_is_smaller(monkeypatch):
    dsa_checks.check_matches_unpatched_sparse(FAMILY, monkeypatch)


def test_unpatch_restores_bit_identical_outputs():
    dsa_checks.check_unpatch_restores(FAMILY)


def test_save_load_round_trip(tmp_path):
    dsa_checks.check_save_load(FAMILY, tmp_path)


def test_generate_matches_unpatched_with_left_padding():
    dsa_checks.check_generate(FAMILY)


def test_chunked_prefill_and_decode_read_the_cache():
    dsa_checks.check_chunked_prefill(FAMILY)


def test_packed_sequences_never_cross_a_boundary():
    dsa_checks.check_packed_sequences(FAMILY)


def test_right_padding():
    dsa_checks.check_right_padding(FAMILY)


def test_indexer_learns_only_from_its_loss():
    dsa_checks.check_indexer_isolation(FAMILY)


def test_dense_warmup_attends_to_all_keys():
    dsa_checks.check_dense_warmup(FAMILY)


def test_full_attention_layers_run_dense_without_a_mask_tensor():
    """A dots3 config may mix dense "full_attention" layers in; patched, they attend over every
    visible key (padding included) and match the unpatched model."""
    import torch

    ref, _ = dsa_checks.build(FAMILY, index_topk=5, use_dsa=None,
                              layer_types=["indexed_attention", "full_attention", "sliding_attention"])
    assert ref.config.layer_types[1] == "full_attention"
    pat = dsa_checks.patched_copy(ref)
    x = dsa_checks.tokens(2, 16)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    with torch.no_grad():
        for m in (None, mask):
            real = torch.ones_like(x, dtype=torch.bool) if m is None else m.bool()
            dsa_checks.assert_close(ref(x, attention_mask=m).logits[real], pat(x, attention_mask=m).logits[real],
                                    what="dots3 with a full-attention layer")
