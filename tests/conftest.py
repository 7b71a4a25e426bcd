import os

# Triton kernels run under Triton's CPU interpreter in tests on machines without a GPU. The flag is
# read when a kernel is decorated, so it must be set before hyscale_hf is imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
