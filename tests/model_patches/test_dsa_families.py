"""Every patched DSA family against its unpatched Transformers model (tiny config, CPU, torch backend).

One parametrised set of checks (``dsa_checks``) per family; family-specific tests live in
``test_<family>.py`` beside this file.
"""

import pytest

from . import dsa_checks
from .tiny_models import has_family

COVERED_MODEL_TYPES = ["axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4", "mistral_large4"]

family = pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.skipif(not has_family(f), reason=f"the installed Transformers has no {f}"))
     for f in COVERED_MODEL_TYPES],
)


@family
def test_matches_unpatched_when_topk_covers_all_keys(family):
    dsa_checks.check_matches_unpatched_full_topk(family)


@family
def test_matches_unpatched_selection_when_topk_is_smaller(family, monkeypatch):
    dsa_checks.check_matches_unpatched_sparse(family, monkeypatch)


@family
def test_unpatch_restores_bit_identical_outputs(family):
    dsa_checks.check_unpatch_restores(family)


@family
def test_save_load_round_trip(family, tmp_path):
    dsa_checks.check_save_load(family, tmp_path)


@family
def test_generate_matches_unpatched_with_left_padding(family):
    dsa_checks.check_generate(family)


@family
def test_chunked_prefill_and_decode_read_the_cache(family):
    dsa_checks.check_chunked_prefill(family)


@family
def test_packed_sequences_never_cross_a_boundary(family):
    dsa_checks.check_packed_sequences(family)


@family
def test_right_padding(family):
    dsa_checks.check_right_padding(family)


@family
def test_a_mask_with_holes_matches_unpatched(family):
    dsa_checks.check_mask_with_holes(family)


@family
def test_indexer_learns_only_from_its_loss(family):
    dsa_checks.check_indexer_isolation(family)


@family
def test_dense_warmup_attends_to_all_keys(family):
    dsa_checks.check_dense_warmup(family)


@family
def test_right_padding_with_topk_covering_matches_everywhere(family):
    dsa_checks.check_right_padding_full_topk(family)


@family
def test_deepcopy_of_a_patched_model_is_independent(family):
    dsa_checks.check_deepcopy_is_independent(family)
