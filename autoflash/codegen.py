"""Kernel families: Variant -> source (Jinja) -> a .py file in the kernel cache -> module -> `Kernel`.

`@triton.jit` reads its function's source with `inspect`, so kernels must come from real files:
each variant is rendered once to `<kernel cache>/<family>_<hash>.py` (hash of the template source,
its includes, and the variant) and imported from there, in this process and the next.

The family contract. A rendered module defines `OP` ("fwd" | "bwd"), `LOADS` and
  launch(q, k, v, o, lse, sm_scale, is_causal, causal_offset, compile_only=False)               (fwd)
  launch(q, k, v, o, lse, do, dq, dk, dv, sm_scale, is_causal, causal_offset, compile_only=False) (bwd)
and may define `supports(q, k, v, o) -> str | None` (why it cannot take these tensors). Everything
else (the dispatcher, the correctness gate, timing, bench) goes through `Kernel`, which owns the
launch preparation (the TMA descriptor allocator, the TMA alignment check).

A variant can also be rendered from another template file (`template_file=`), e.g. the previous
version of a template, to time both with the same knobs before retuning (`autoflash bench
--baseline-template`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import pathlib
import sys
import tempfile
import threading
from types import ModuleType

import jinja2
import torch
import triton

from autoflash import resources
from autoflash.space import Variant, load_space

INCLUDE_PREFIX = "_"  # templates/_*.jinja are includes: part of every family's template hash

_lock = threading.Lock()
_modules: dict[tuple[str, str, str], ModuleType] = {}


def kernel_cache_dir() -> pathlib.Path:
    """$AUTOFLASH_KERNEL_CACHE, else $XDG_CACHE_HOME/autoflash/kernels, else ~/.cache/autoflash/kernels."""
    if os.environ.get("AUTOFLASH_KERNEL_CACHE"):
        return pathlib.Path(os.environ["AUTOFLASH_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autoflash" / "kernels"


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources.data_dir("templates"))),
        undefined=jinja2.StrictUndefined,  # a knob the template reads but the variant lacks: error
        keep_trailing_newline=True,
        autoescape=False,
    )


@functools.lru_cache(maxsize=None)
def template_source(family: str) -> str:
    """A family's template followed by every shared include (what its hash covers)."""
    folder = resources.data_dir("templates")
    includes = "".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob(f"{INCLUDE_PREFIX}*.jinja")))
    return resources.read_text("templates", load_space(family).template) + includes


@functools.lru_cache(maxsize=None)
def template_hash(family: str) -> str:
    """Part of every stored result's key: a changed template (or include) never serves stale winners.
    family: a family name, or an op name for its default family."""
    return _source_hash(template_source(family))


def family_for_hash(op: str, thash: str) -> str | None:
    """Which current family of `op` a stored template hash belongs to (None: an older template)."""
    from autoflash.space import families_for

    return next((f for f in families_for(op) if template_hash(f) == thash), None)


def _source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def render(variant: Variant, template_file: str | os.PathLike | None = None) -> str:
    """The Triton source of one variant. Only declared knob values ever reach the template.
    template_file: render from this template instead of the package's (knobs it does not read are
    ignored; a knob it reads that the variant lacks is an error)."""
    checked = load_space(variant.family).check_declared(variant.as_dict())
    if template_file is None:
        template = _environment().get_template(load_space(variant.family).template)
    else:
        template = _environment().from_string(pathlib.Path(template_file).read_text(encoding="utf-8"))
    return template.render(**checked.as_dict())


def variant_hash(variant: Variant, template_file: str | os.PathLike | None = None) -> str:
    thash = template_hash(variant.family) if template_file is None else _source_hash(
        pathlib.Path(template_file).read_text(encoding="utf-8"))
    return hashlib.sha256(f"{thash}:{variant.json()}".encode()).hexdigest()[:20]


def source_path(variant: Variant, template_file: str | os.PathLike | None = None) -> pathlib.Path:
    return kernel_cache_dir() / f"{variant.family}_{variant_hash(variant, template_file)}.py"


def _write_atomically(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)  # concurrent writers of the same variant write identical text


def load(variant: Variant, template_file: str | os.PathLike | None = None) -> "Kernel":
    """Render (if not cached on disk), import (if not imported yet) and return the variant's Kernel."""
    # The interpreter flag is part of the key: @triton.jit decides at import time whether the
    # kernel runs compiled or interpreted.
    key = (variant.family, variant_hash(variant, template_file), os.environ.get("TRITON_INTERPRET", "0"))
    kernel = _modules.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _modules.get(key)
        if kernel is not None:
            return kernel
        path = source_path(variant, template_file)
        source = render(variant, template_file)
        if not path.is_file() or path.read_text(encoding="utf-8") != source:
            _write_atomically(path, source)
        name = f"autoflash_kernels.{path.stem}_{key[2]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        kernel = _modules[key] = Kernel(variant, module)
        return kernel


# --------------------------------------------------------------------------- the typed wrapper
def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a unit last stride and 16-byte aligned base and strides."""
    for t in tensors:
        e = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * e) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _allocate_scratch(size: int, alignment: int, stream):
    """Global scratch for in-kernel tensor descriptors (Triton asks for it at launch)."""
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_allocator() -> None:
    # The allocator lives in a ContextVar: set it in each thread that launches TMA kernels,
    # unless the user already installed one.
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_allocate_scratch)


class Kernel:
    """One compiled variant behind the family contract: typed forward/backward launches that
    prepare what the module needs (TMA scratch allocator) and say which tensors it cannot take."""

    __slots__ = ("variant", "module", "op", "family", "uses_tma", "_supports")

    def __init__(self, variant: Variant, module: ModuleType):
        if module.OP != variant.op:
            raise ValueError(f"{variant.family}: the template renders an {module.OP!r} module, the space says {variant.op!r}")
        self.variant, self.module, self.op, self.family = variant, module, module.OP, variant.family
        self.uses_tma = module.LOADS == "tma"
        self._supports = getattr(module, "supports", None)

    def unsupported(self, q, k, v, o) -> str | None:
        """Why this kernel cannot take these (B, H, N, D) tensors, or None. o: the output (fwd) or dO (bwd)."""
        if self.uses_tma and not tma_compatible(q, k, v, o):
            return "TMA needs a unit last stride and 16-byte aligned base and strides"
        return self._supports(q, k, v, o) if self._supports is not None else None

    def forward(self, q, k, v, o, lse, sm_scale: float, causal: bool, causal_offset: int) -> None:
        """o (B, H, Nq, D) and lse (B, H, Nq) float32 written in place."""
        if self.uses_tma:
            ensure_allocator()
        self.module.launch(q, k, v, o, lse, sm_scale, causal, causal_offset)

    def backward(self, q, k, v, o, lse, do, dq, dk, dv, sm_scale: float, causal: bool, causal_offset: int) -> None:
        """dq, dk, dv written in place from the forward's o and lse."""
        if self.uses_tma:
            ensure_allocator()
        self.module.launch(q, k, v, o, lse, do, dq, dk, dv, sm_scale, causal, causal_offset)

    def compile_for(self, q, k, v, causal: bool, causal_offset: int) -> None:
        """Build (or fetch from Triton's cache) the binary for these argument types, no launch."""
        if self.uses_tma:
            ensure_allocator()
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if self.op == "bwd":
            grads = [torch.empty_like(t) for t in (q, k, v)]
            self.module.launch(q, k, v, torch.empty_like(q), lse, out, *grads, 1.0, causal, causal_offset,
                               compile_only=True)
        else:
            self.module.launch(q, k, v, out, lse, 1.0, causal, causal_offset, compile_only=True)

    def __repr__(self) -> str:
        return f"Kernel({self.family}: {self.variant.short()})"
