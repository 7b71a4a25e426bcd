"""pytest plugin of ``run_transformers_model_tests.py``: every Transformers model a test builds is passed
through ``hyscale_hf.patch_model`` right after its construction (``-p _transformers_tests_plugin``).

"Right after construction" is the end of the outermost model's ``__init__``, just before its
``post_init``: the patched model then goes through Transformers' own weight initialisation and, inside
``from_pretrained``, its own loading (so the added indexers are part of what a checkpoint or a
``state_dict`` fills), as a model class with the indexer built in would. Nested models (``LlamaModel``
inside ``LlamaForCausalLM``) are patched with their parent, once. Models of a type hyscale_hf does not
support are left alone.

Environment: ``HYSCALE_TF_TESTS_MODE`` = ``patched`` (default) or ``unpatched`` (the plugin then does
nothing, for the baseline run); ``HYSCALE_TF_TESTS_OPTIONS`` = JSON of ``HyScaleConfig`` overrides
(e.g. ``{"topk": 2}`` for the sparse regime; default: every key selected, so a patched model must
behave as the unpatched one).
"""

from __future__ import annotations

import json
import os

MODE = os.environ.get("HYSCALE_TF_TESTS_MODE", "patched")
OPTIONS = json.loads(os.environ.get("HYSCALE_TF_TESTS_OPTIONS", "{}"))
_building: list = []  # models whose __init__ began and whose post_init has not run, outermost first


def _install() -> None:
    from transformers import PreTrainedModel

    import hyscale_hf

    supported = set(hyscale_hf.supported_model_types())
    original_init, original_post_init = PreTrainedModel.__init__, PreTrainedModel.post_init

    def __init__(self, *args, **kwargs):
        _building.append(self)
        original_init(self, *args, **kwargs)

    def post_init(self, *args, **kwargs):
        outermost = bool(_building) and _building[0] is self
        if self in _building:
            del _building[_building.index(self):]  # it and the models built inside it are done
        if outermost and getattr(self.config, "model_type", None) in supported and not hyscale_hf.is_patched(self):
            hyscale_hf.patch_model(self, backend="torch", **OPTIONS)
        return original_post_init(self, *args, **kwargs)

    PreTrainedModel.__init__ = __init__
    PreTrainedModel.post_init = post_init


def pytest_configure(config):
    if MODE == "patched":
        _install()


def pytest_report_header(config):
    return f"hyscale_hf Transformers tests: {MODE}" + (f", options {OPTIONS}" if OPTIONS else "")
