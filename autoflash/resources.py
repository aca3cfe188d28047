"""Package data: the kernel families' templates and spaces, shape sets and the shipped databases.

The kernel families (`autoflash/families/<name>/`: kernel.py.jinja, space.toml) are package data
inside the package itself, in a checkout and in a wheel alike. The other folders live in a wheel in
`autoflash/_data/<folder>/` (hatchling force-include); in a source checkout or an editable install
they are the top-level `search_spaces/` (shape sets, vendor spaces) and `cache/` folders. Both are
read through `importlib.resources`-style paths.
"""

from __future__ import annotations

import importlib.resources
import pathlib

FOLDERS = ("families", "search_spaces", "cache")


def data_dir(folder: str) -> pathlib.Path:
    if folder not in FOLDERS:
        raise ValueError(f"unknown data folder {folder!r}")
    if folder == "families":
        return pathlib.Path(__file__).resolve().parent / "families"
    packaged = importlib.resources.files("autoflash") / "_data" / folder
    if packaged.is_dir():
        return pathlib.Path(str(packaged))
    return pathlib.Path(__file__).resolve().parent.parent / folder


def read_text(folder: str, name: str) -> str:
    path = data_dir(folder) / name
    if not path.is_file():
        raise FileNotFoundError(f"autoflash data file {folder}/{name} not found (looked in {path.parent})")
    return path.read_text(encoding="utf-8")


def shipped_databases() -> list[pathlib.Path]:
    """The pre-tuned winner DBs shipped in cache/, in a fixed order."""
    return sorted(data_dir("cache").glob("*.db"))
