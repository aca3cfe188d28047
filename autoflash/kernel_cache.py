"""The kernel cache: where rendered kernel sources are written (`@triton.jit` reads its function's
source from a real file), and what happens when that place is not writable: a private temporary
directory for this process, with one warning, else `KernelCacheError` (which the API turns into an
SDPA fallback)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile


class KernelCacheError(RuntimeError):
    """No writable place for rendered kernels: neither the kernel cache nor a private temporary
    directory. The API turns it into an SDPA fallback."""


_fallback_dirs: dict[str, pathlib.Path] = {}  # configured cache dir -> this process's private one
_private_dir: pathlib.Path | None = None


def configured_kernel_cache_dir() -> pathlib.Path:
    """$AUTOFLASH_KERNEL_CACHE, else $XDG_CACHE_HOME/autoflash/kernels, else ~/.cache/autoflash/kernels."""
    if os.environ.get("AUTOFLASH_KERNEL_CACHE"):
        return pathlib.Path(os.environ["AUTOFLASH_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autoflash" / "kernels"


def kernel_cache_dir() -> pathlib.Path:
    """The configured kernel cache (see `configured_kernel_cache_dir`), or, once it proved
    unwritable in this process, the private temporary directory used instead."""
    configured = configured_kernel_cache_dir()
    return _fallback_dirs.get(str(configured), configured)


def _cache_fallback(configured: pathlib.Path, cause: BaseException) -> pathlib.Path:
    """The private temporary kernel directory (made once per process) that replaces an unwritable
    `configured` cache; one RuntimeWarning per unwritable cache names the cause."""
    global _private_dir
    import warnings

    if _private_dir is None:
        try:
            _private_dir = pathlib.Path(tempfile.mkdtemp(prefix="autoflash-kernels-"))
        except OSError as e:
            raise KernelCacheError(f"kernel cache {configured} is not writable ({cause}) and no temporary "
                                   f"directory could be made ({e})") from e
    if str(configured) not in _fallback_dirs:
        _fallback_dirs[str(configured)] = _private_dir
        warnings.warn(f"autoflash: kernel cache {configured} is not writable ({type(cause).__name__}: {cause}); "
                      f"rendering kernels into {_private_dir} for this process (set AUTOFLASH_KERNEL_CACHE "
                      "to a writable directory to keep them)", RuntimeWarning, stacklevel=3)
    return _private_dir


def _cached_source_file(path: pathlib.Path, source: str) -> pathlib.Path:
    """A file holding exactly `source` for `inspect` (which `@triton.jit` reads): `path` when it
    already holds it or can be written, else the same name in the private fallback directory."""
    for attempt in range(2):
        try:
            if path.is_file() and path.read_text(encoding="utf-8") == source:
                return path
        except (OSError, UnicodeDecodeError):
            pass
        try:
            _write_atomically(path, source)
            return path
        except OSError as e:
            if attempt or path.parent == _private_dir:
                raise KernelCacheError(f"cannot write the rendered kernel {path}: {e}") from e
            path = _cache_fallback(path.parent, e) / path.name
    raise AssertionError("unreachable")


def _write_atomically(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # concurrent writers of the same variant write identical text
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
