"""Hypothesis profiles of the property-based kernel tests (tests/kernels/*/test_properties.py).

``ci`` (the default): a fixed, derandomized budget, so every run draws the same examples and the
suite's share of CI stays small (the Triton kernels run under the CPU interpreter there).
``long``: many more, freshly random examples, for a search on demand. ``HYSCALE_HYPOTHESIS_PROFILE``
picks one: ``HYSCALE_HYPOTHESIS_PROFILE=long python -m pytest tests/kernels -k properties``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=_SLOW_OK,
)  # fmt: skip
settings.register_profile(
    "long", max_examples=400, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=_SLOW_OK,
)  # fmt: skip

PROFILE = os.environ.get("HYSCALE_HYPOTHESIS_PROFILE", "ci")


def load() -> None:
    settings.load_profile(PROFILE)
