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


def _language_objects():
    """What Triton's interpreter patches while a kernel runs (its `_patch_lang`)."""
    import triton.language as tl

    named = (tl.core.tensor, getattr(tl.core, "tensor_descriptor_base", None), tl.core.dtype)
    return (tl, tl.core, tl.math) + tuple(obj for obj in named if obj is not None)


_MISSING = object()
_PRISTINE = [(obj, dict(vars(obj))) for obj in _language_objects()]  # (before any kernel ran)


@pytest.fixture(autouse=True)
def _language_as_it_was():
    """Undo what an interpreted kernel left patched in triton.language. Triton 3.6's interpreter
    patches it around each launch and restores it after, but a nested @triton.jit call patches it
    again without restoring: `tensor.__bool__` and `__index__` then read an interpreter value
    (`handle.data`), and compiling a kernel for the GPU later in the same process fails on
    compile-time values ("'block_argument' object has no attribute 'data'"), depending on which tests
    ran before."""
    yield
    for obj, saved in _PRISTINE:
        current = vars(obj)
        for name, value in saved.items():
            if current.get(name, _MISSING) is not value:
                setattr(obj, name, value)
        if isinstance(obj, type):  # (a module may gain submodules and lazy attributes legitimately)
            for name in [n for n in current if n not in saved]:
                delattr(obj, name)


@pytest.fixture(autouse=True, scope="session")
def _isolated_caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("autoflash")
    os.environ["AUTOFLASH_KERNEL_CACHE"] = str(root / "kernels")
    os.environ.setdefault("AUTOFLASH_DB", str(root / "autoflash.db"))
    yield


@pytest.fixture
def strict(monkeypatch):
    """AUTOFLASH_STRICT=1: every fallback is an error."""
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")


@pytest.fixture
def fresh_api():
    """autoflash.api's per-process caches (memoized calls, dispatcher) empty before and after."""
    from autoflash import api

    api.reset()
    yield
    api.reset()


@pytest.fixture
def own_kernels(monkeypatch):
    """The own kernels serve wherever they take a call (the serving policy's SDPA-cuDNN default off):
    for GPU tests of the own kernels' paths through the public API."""
    from autoflash import api, dispatch

    monkeypatch.setattr(dispatch, "cudnn_variant", lambda problem, device: None)
    api.reset()
    yield
    api.reset()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
    skip_interp = pytest.mark.skip(reason="runs kernels in the Triton interpreter: set TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)
