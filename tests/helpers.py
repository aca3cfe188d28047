"""Shared test helpers (imported by test modules; fixtures live in conftest.py)."""

from __future__ import annotations

import dataclasses

from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
from autoflash.space import Variant, load_space


def default_for(op: str, dtype: str, head_dim: int, has_tma: bool = True, causal: bool = False) -> Variant:
    """The op's [[defaults]] variant for a problem, on this machine's device with or without TMA."""
    device = dataclasses.replace(gpu_fingerprint(), cc_major=9 if has_tma else 8, cc_minor=0)
    problem = Problem(op=op, dtype=dtype, head_dim=head_dim, causal=causal, gqa_group=1, seqlen_q=1024,
                      seqlen_k=1024)
    return load_space(op).default_for(problem, device)


def _triton_release() -> tuple[int, int]:
    import triton

    from autoflash.device import triton_release

    return triton_release(triton.__version__)


# A load strategy other than the default's that every supported Triton offers: block pointers
# where they exist (removed in Triton 3.9), else plain pointers.
OTHER_LOADS = "block_ptr" if _triton_release() < (3, 9) else "pointer"


def db_with_winners(path, n=2, ms=1.0, gpu_name=None):
    """A results DB at `path` with `n` forward winners (template hash 't') of this machine's device."""
    import dataclasses

    from autoflash.device import gpu_fingerprint

    from autoflash.problem import Problem
    from autoflash.space import load_space
    from autoflash.store import Store

    dev = gpu_fingerprint() if gpu_name is None else dataclasses.replace(gpu_fingerprint(), name=gpu_name)
    store = Store(path)
    store.add_gpu(dev)
    for i in range(n):
        prob = Problem("fwd", "float16", 64, False, 1, 64 << i, 64 << i)
        store.set_winner(gpu_key=dev.key, problem=prob, template_hash="t",
                         variant_json=load_space("fwd").valid_variants(prob, dev)[i].json(),
                         median_ms=ms, spread=0.0, tflops=1.0 / ms, trials=3)
    store.close()
    return path


def run_in_clean_process(code: str, tmp_path, timeout: int = 900):
    """Run `code` in a child Python without TRITON_INTERPRET and with empty Triton and kernel
    caches (the GPU compiler on a CPU machine: with the interpreter on, Triton's own @jit helpers are
    interpreted functions its compiler cannot inline, and a warm cache would hide that)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["AUTOFLASH_KERNEL_CACHE"] = str(tmp_path / "kernels")
    tests = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), tests, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(tests), env=env, capture_output=True,
                          text=True, timeout=timeout)


def capture_launches(jits):
    """Make each @jit kernel's `warmup` (what a module's launch calls with compile_only=True) record
    (kernel, args, kwargs) instead of compiling; returns the list it fills."""
    launches = []
    for jit in jits:
        jit.warmup = (lambda jit: lambda *args, **kwargs: launches.append((jit, args, kwargs)))(jit)
    return launches


def compile_for_sm90(jit, args, kwargs):
    """Compile one captured launch for Hopper (sm_90a) on this machine, GPU or not; returns its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    kwargs = {k: v for k, v in kwargs.items() if k != "grid"}
    constexprs = {name: kwargs[name] for name in jit.arg_names if name in kwargs}
    values = iter(args)
    signature = {name: "constexpr" if name in constexprs else mangle_type(next(values)) for name in jit.arg_names}
    assert next(values, None) is None, "the launch passes more arguments than the kernel takes"
    for name, kind in signature.items():  # an argument passed as None is a constexpr None
        if kind == "constexpr" and name not in constexprs:
            constexprs[name] = None
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    compiled = triton.compile(ASTSource(jit, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"] and ".target sm_90a" in compiled.asm["ptx"]
    return compiled.asm["ptx"]


def compile_gluon_for_sm90(fn, args, constexprs, options):
    """Compile a Gluon kernel's launch (its positional args, constexprs, options) for Hopper (sm_90a)
    on this machine, GPU or not, with the interpreter off; returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from autoflash import codegen

    values = iter(args)
    signature = {name: "constexpr" if name in constexprs else mangle_type(next(values)) for name in fn.arg_names}
    assert next(values, None) is None, "the launch passes more arguments than the kernel takes"
    with codegen.interpreter_off():
        return triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)


def rand(*shape, seed, dtype=None):
    """A reproducible standard-normal tensor (float32, or `dtype`)."""
    import torch

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x if dtype is None else x.to(dtype)


def quiet(fn, *args, **kwargs):
    """fn(*args, **kwargs) with autoflash's fallback warnings silenced."""
    import warnings

    from autoflash.fallback import FallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return fn(*args, **kwargs)
