import pytest

from hyscale_hf import HyScaleConfig


def test_defaults_and_replace():
    cfg = HyScaleConfig()
    assert cfg.topk is None and cfg.selection_replay and cfg.backend == "auto"
    new = cfg.replace(topk=64, relu=False)
    assert (new.topk, new.relu) == (64, False) and cfg.topk is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"topk": 0}, "HyScaleConfig.topk must be a positive int"),
        ({"index_n_heads": -1}, "index_n_heads"),
        ({"index_head_dim": 2.5}, "index_head_dim"),
        ({"backend": "cuda"}, "HyScaleConfig.backend must be one of"),
        ({"indexer_loss_coef": -1.0}, "indexer_loss_coef"),
    ],
)
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HyScaleConfig(**kwargs)


def test_unknown_override_is_named():
    with pytest.raises(TypeError, match=r"unknown HyScaleConfig option\(s\) \['top_k'\]"):
        HyScaleConfig().replace(top_k=3)
