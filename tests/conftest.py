"""Test-wide set-up.

Without a GPU, Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET must be set before the first
`import triton`, which is why it is set here, before any test module is imported. Tests marked `gpu` are
skipped (and reported as skipped) when CUDA is absent.
"""
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# kernels/tuning.py's store of tuned choices goes to a throwaway folder: tests never write the user's ~/.cache
os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="nanopara-test-cache-"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR",
                      os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "tiktoken_cache"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
