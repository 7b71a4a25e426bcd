"""Patched hy_v4 against the unpatched Transformers model (tiny config, CPU, torch backend)."""

import pytest

from . import dsa_checks
from .tiny_models import has_family

FAMILY = "hy_v4"
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
