"""Variant -> Triton source (Jinja) -> a .py file in the kernel cache -> imported module.

`@triton.jit` reads its function's source with `inspect`, so kernels must come from real files:
each variant is rendered once to `<kernel cache>/<op>_<hash>.py` (hash of the template source and
the variant) and imported from there, in this process and the next. The module exposes
`launch(...)` and `grid(...)`; see the template for their signatures.

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

from autoflash import resources
from autoflash.space import Variant, load_space

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
def template_source(op: str) -> str:
    return resources.read_text("templates", load_space(op).template)


@functools.lru_cache(maxsize=None)
def template_hash(op: str) -> str:
    """Part of every stored result's key: a changed template never serves stale winners."""
    return _source_hash(template_source(op))


def _source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def render(variant: Variant, template_file: str | os.PathLike | None = None) -> str:
    """The Triton source of one variant. Only declared knob values ever reach the template.
    template_file: render from this template instead of the package's (knobs it does not read are
    ignored; a knob it reads that the variant lacks is an error)."""
    checked = load_space(variant.op).check_declared(variant.as_dict())
    if template_file is None:
        template = _environment().get_template(load_space(variant.op).template)
    else:
        template = _environment().from_string(pathlib.Path(template_file).read_text(encoding="utf-8"))
    return template.render(**checked.as_dict())


def variant_hash(variant: Variant, template_file: str | os.PathLike | None = None) -> str:
    thash = template_hash(variant.op) if template_file is None else _source_hash(
        pathlib.Path(template_file).read_text(encoding="utf-8"))
    return hashlib.sha256(f"{thash}:{variant.json()}".encode()).hexdigest()[:20]


def source_path(variant: Variant, template_file: str | os.PathLike | None = None) -> pathlib.Path:
    return kernel_cache_dir() / f"{variant.op}_{variant_hash(variant, template_file)}.py"


def _write_atomically(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)  # concurrent writers of the same variant write identical text


def load(variant: Variant, template_file: str | os.PathLike | None = None) -> ModuleType:
    """Render (if not cached on disk), import (if not imported yet) and return the module."""
    # The interpreter flag is part of the key: @triton.jit decides at import time whether the
    # kernel runs compiled or interpreted.
    key = (variant.op, variant_hash(variant, template_file), os.environ.get("TRITON_INTERPRET", "0"))
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        path = source_path(variant, template_file)
        source = render(variant, template_file)
        if not path.is_file() or path.read_text(encoding="utf-8") != source:
            _write_atomically(path, source)
        name = f"autoflash_kernels.{path.stem}_{key[2]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _modules[key] = module
        return module
