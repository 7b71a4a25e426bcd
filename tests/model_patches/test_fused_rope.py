"""The fused RoPE kernel stands in for a family's Transformers RoPE function only where the two give
the same bits: every MLA family's declared layout holds for this Transformers version (the probe
``_rope_matches`` passes), a function that computes something else is refused with a warning (and
then runs itself), and tables that learn keep the family's function; patching probes the family."""

import importlib

import pytest
import torch

from hyscale_hf.model_patches import _mla_dsa

FAMILY_FILES = ["glm_moe_dsa", "deepseek_v32", "axk2", "dots3_note", "mistral_large4", "hy_v4"]


def families():
    out = []
    for name in FAMILY_FILES:
        module = importlib.import_module(f"hyscale_hf.model_patches.{name}")
        if hasattr(module, "FAMILY"):  # the family's Transformers module exists in this version
            out.append(pytest.param(module.FAMILY, id=name))
    return out


@pytest.mark.parametrize("family", families())
def test_declared_layouts_hold_in_this_transformers(family):
    for fn, interleaved in ((family.main_rope, family.main_rope_interleaved),
                            (family.indexer_rope, family.indexer_rope_interleaved)):
        assert interleaved is not None
        assert _mla_dsa._rope_matches(fn, interleaved), fn


def test_a_function_that_differs_is_refused_with_a_warning():
    def swapped(q, k, cos, sin, unsqueeze_dim=1):  # rotates the other way
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        rot = lambda x: torch.cat([x[..., x.shape[-1] // 2:], -x[..., : x.shape[-1] // 2]], -1)  # noqa: E731
        return q * c + rot(q) * s, k * c + rot(k) * s

    with pytest.warns(UserWarning, match="fused RoPE kernel is off"):
        assert not _mla_dsa._rope_matches(swapped, False)
    _mla_dsa._ROPE_MATCHES[swapped, False] = False  # as probe_family_ropes records it
    cos = sin = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    assert _mla_dsa._fused_rope(swapped, False, cos, sin) is None
    assert _mla_dsa._fused_rope(lambda *a, **k: None, False, cos, sin) is None  # never probed: not fused


def test_the_family_function_runs_where_tables_learn_or_have_another_shape():
    family = families()[0].values[0]
    _mla_dsa.probe_family_ropes(family)
    assert _mla_dsa._ROPE_MATCHES[family.main_rope, True]
    cos = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    assert _mla_dsa._fused_rope(family.main_rope, True, cos, cos) is True
    assert _mla_dsa._fused_rope(family.main_rope, True, cos.requires_grad_(), cos) is None
    assert _mla_dsa._fused_rope(family.main_rope, True, cos.detach()[0], cos.detach()[0]) is None
    assert _mla_dsa._fused_rope(family.main_rope, None, cos.detach(), cos.detach()) is None
