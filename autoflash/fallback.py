"""Fallbacks to torch: one `FallbackWarning` per reason, attributed to the caller's own line, or
with AUTOFLASH_STRICT=1 a `FallbackError`. Shared by every public function (api, decode, varlen)."""

from __future__ import annotations

import os
import sys
import warnings


class FallbackWarning(UserWarning):
    """autoflash handed a call to torch SDPA (the reason is in the message)."""


class FallbackError(RuntimeError):
    """Raised instead of a fallback when AUTOFLASH_STRICT=1."""


warned_reasons: set[str] = set()  # (cleared by `api.reset()`)


def strict_mode() -> bool:
    """AUTOFLASH_STRICT: 1/true/yes/on turn fallbacks into errors; 0/false/no/off/empty do not."""
    value = os.environ.get("AUTOFLASH_STRICT", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _first_frame_outside_package() -> int:
    """The `warnings.warn` stacklevel, from the function that calls this one, of the first frame
    outside autoflash: the user's line, however many of autoflash's functions lie between (a
    varlen call that falls back per sequence goes through three)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _in_package(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    return level


def _in_package(module: str) -> bool:
    """By module name, not file path: right however the package was imported (a path with '..', a
    symlink, a zip, byte code compiled elsewhere)."""
    return module == "autoflash" or module.startswith("autoflash.")


def fall_back(reason: str, to: str = "torch SDPA") -> None:
    """Say (once per reason and target) or, in strict mode, refuse that a call goes to `to`."""
    _say_once(f"{to}: {reason}", f"autoflash: falling back to {to}: {reason}",
              f"autoflash cannot run this call on its kernels: {reason}")


def ignored(argument: str, where: str) -> None:
    """An argument autoflash does not know arrived and is not used: one warning per argument (a
    `FallbackError` under AUTOFLASH_STRICT=1), never dropped without a word."""
    _say_once(f"ignored: {where}: {argument}",
              f"autoflash: {where} does not know the argument {argument!r}: it is ignored; if it changes "
              "attention's result, the answer is not that of the model's eager attention",
              f"{where} does not know the argument {argument!r} and cannot serve it")


def _say_once(key: str, warning: str, refusal: str) -> None:
    """A `FallbackWarning` once per key, attributed to the caller's line; a `FallbackError` in strict mode."""
    if strict_mode():
        raise FallbackError(f"{refusal} (AUTOFLASH_STRICT=1 turns fallbacks into errors)")
    if key not in warned_reasons:
        warned_reasons.add(key)
        warnings.warn(warning, FallbackWarning, stacklevel=_first_frame_outside_package())
