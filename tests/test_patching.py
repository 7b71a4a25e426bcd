import pytest
import torch
from transformers import PretrainedConfig, PreTrainedModel

import hyscale_hf
from hyscale_hf.patching import family_of
from hyscale_hf.state import base_model


class _Unknown(PreTrainedModel):
    config_class = PretrainedConfig

    def __init__(self):
        cfg = PretrainedConfig()
        cfg.model_type = "not_a_model"
        super().__init__(cfg)
        self.lin = torch.nn.Linear(2, 2)


def test_unsupported_model_lists_supported_types():
    with pytest.raises(ValueError, match="does not support model_type 'not_a_model'; supported:"):
        hyscale_hf.patch_model(_Unknown())


def test_non_transformers_module_is_rejected():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hyscale_hf.patch_model(torch.nn.Linear(2, 2))


def test_config_type_is_checked():
    with pytest.raises(TypeError, match="config must be a HyScaleConfig"):
        hyscale_hf.patch_model(_Unknown(), config={"topk": 4})


def test_unpatching_an_unpatched_model_is_an_error():
    with pytest.raises(ValueError, match="not patched"):
        hyscale_hf.unpatch_model(_Unknown())
    assert not hyscale_hf.is_patched(_Unknown())


def test_family_lookup_error_and_peft_unwrap():
    with pytest.raises(ValueError, match="supported"):
        family_of("nope")

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

    inner = _Unknown()
    assert base_model(Wrapper(Wrapper(inner))) is inner


def test_supported_model_types_is_sorted_list():
    types = hyscale_hf.supported_model_types()
    assert types == sorted(types)
