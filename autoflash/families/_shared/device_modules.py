"""The shared device-function modules (`triton_device.py` beside this file) as the rendered kernel
modules import them: `from autoflash.families._shared.device_modules import triton_device`.

@triton.jit decides when a function is defined whether it runs compiled or in Triton's interpreter
(TRITON_INTERPRET), and a kernel calls only functions of its own kind; codegen keys the kernel modules
by that setting, so each shared module is executed once per setting too (a process may compile for
the GPU with the interpreter off after interpreting, e.g. `codegen.interpreter_off`)."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import sys

FOLDER = pathlib.Path(__file__).resolve().parent
MODULES = ("triton_device",)


@functools.lru_cache(maxsize=None)
def _load(name: str, interpret: str):
    mode = "compiled" if interpret in ("", "0") else "interpreted"
    spec = importlib.util.spec_from_file_location(f"{__package__}.{name}__{mode}", FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def __getattr__(name: str):
    if name in MODULES:
        return _load(name, os.environ.get("TRITON_INTERPRET", "0"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
