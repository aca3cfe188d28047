"""Test setup: without CUDA, kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (`@triton.jit` decides at
import time), so it is set here, at collection, when no GPU is present. Each test run gets a
fresh kernel cache and results DB under pytest's temporary directory.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_GPU = torch.cuda.is_available() and not INTERPRET


@pytest.fixture(autouse=True, scope="session")
def _isolated_caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("autoflash")
    os.environ["AUTOFLASH_KERNEL_CACHE"] = str(root / "kernels")
    os.environ.setdefault("AUTOFLASH_DB", str(root / "autoflash.db"))
    yield


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
    skip_interp = pytest.mark.skip(reason="runs kernels in the Triton interpreter: set TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)
