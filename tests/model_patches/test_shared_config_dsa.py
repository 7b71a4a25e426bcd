"""A native DSA model (GLM-5) patched in place leaves other models built from its config alone."""

import pytest
import torch

import hyscale_hf

from . import dsa_checks
from .tiny_models import build, has_family

FAMILY = "glm_moe_dsa"
pytestmark = pytest.mark.skipif(not has_family(FAMILY), reason=f"the installed Transformers has no {FAMILY}")


def test_patching_a_dsa_model_leaves_a_model_sharing_its_config_unpatched():
    first, _ = build(FAMILY, index_topk=4)
    config = first.config
    second = type(first)(config).eval()
    second.load_state_dict(first.state_dict())
    x = dsa_checks.tokens(1, 9)
    with torch.no_grad():
        expected = second(x).logits
    hyscale_hf.patch_model(first, backend="torch")
    assert "hyscale_config" not in config.__dict__ and config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(second(x).logits, expected, atol=0, rtol=0)
        hyscale_hf.patch_model(second, backend="torch", topk=2)  # patches on its own options
        assert hyscale_hf.patched_config(second).topk == 2 and hyscale_hf.patched_config(first).topk == 4
    hyscale_hf.unpatch_model(first)
    assert first.config is config
