"""dots3_note_text specifics of the patch; the checks every DSA family shares are in test_dsa_families.py."""

import pytest

from . import dsa_checks
from .tiny_models import has_family

FAMILY = "dots3_note_text"
pytestmark = pytest.mark.skipif(not has_family(FAMILY), reason=f"the installed Transformers has no {FAMILY}")


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
