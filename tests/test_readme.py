"""The README's code blocks, run as a reader would run them on a CPU-only machine.

Every fenced block has a language; a bash or Python block runs, in README order, in one scratch
folder with its own cache and DB (so the quick start's dry run is what the later blocks inspect),
unless a tag after its language says why it cannot run here (`NOT_RUN_HERE`). A toml block tagged
with a file name is written to that file first. `autoflash` runs this tree's CLI (`python -m
autoflash`); `pip` lines are the environment's setup, which CI performs from the same lines
(`.ci/run`), so they are echoed, not run. Python blocks run with TRITON_INTERPRET=1, as the README
tells a CPU-only reader to.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import autoflash

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

NOT_RUN_HERE = {  # a block's tag -> why it is not run by this test
    "gpu": "needs a CUDA GPU",
    "server": "starts a server or needs one (PostgreSQL, datasette)",
    "program": "runs the reader's own program",
    "install": "installs packages: the suite runs where they are installed",
}
LANGUAGES = ("bash", "python", "toml", "text")


@dataclasses.dataclass
class Block:
    line: int  # of the opening fence, 1-based
    language: str
    tags: list[str]
    code: str

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.language}{' ' + ' '.join(self.tags) if self.tags else ''})"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text (fences may be indented, as in a list item)."""
    blocks, current, indent = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if current is None and stripped.startswith("```"):
            words = stripped[3:].split()
            current = Block(number, words[0] if words else "", words[1:], "")
            indent = len(line) - len(stripped)
        elif current is not None and stripped.startswith("```"):
            blocks.append(current)
            current = None
        elif current is not None:
            current.code += line[indent:] + "\n"
    assert current is None, f"README.md:{current.line}: a code block is never closed"
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


def test_every_block_has_a_language_and_runs_or_says_why():
    for block in BLOCKS:
        assert block.language in LANGUAGES, f"{block}: give it a language, one of {LANGUAGES}"
        if block.language == "toml":
            assert len(block.tags) <= 1, f"{block}: a toml block's one tag is the file it is saved as"
        else:
            unknown = [t for t in block.tags if t not in NOT_RUN_HERE]
            assert not unknown, f"{block}: unknown tag(s) {unknown}; the tags are {sorted(NOT_RUN_HERE)}"
    assert [b for b in BLOCKS if b.language in ("bash", "python") and not b.tags], "no block runs"


def test_ci_installs_torch_as_the_quick_start_says():
    """The quick start's first command is the one CI installs torch with."""
    quick_start = BLOCKS[0]
    first = quick_start.code.splitlines()[0].split("#")[0].strip()
    assert first.startswith("pip install torch"), first
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"python -m {first.replace('pip install', 'pip install -q', 1)}" in ci, (first, ".ci/run")


def _env(scratch: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOFLASH_DB", "TRITON_INTERPRET", "XDG_CACHE_HOME")}
    env["XDG_CACHE_HOME"] = str(scratch / "cache")  # the reader's ~/.cache: the user and interpreter DBs
    env["HOME"] = str(scratch / "home")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # (sqlite-utils)
    package_root = str(Path(autoflash.__file__).resolve().parent.parent)  # the autoflash these tests import
    env["PYTHONPATH"] = os.pathsep.join(p for p in [package_root, env.get("PYTHONPATH")] if p)
    env["COLUMNS"] = "200"
    return env


BASH_PRELUDE = f"""
autoflash() {{ {shlex.quote(sys.executable)} -m autoflash "$@"; }}
python() {{ {shlex.quote(sys.executable)} "$@"; }}
pip() {{ echo "(not run by the README test: pip $*)"; }}
"""


@pytest.mark.interpreter
def test_the_readme_code_blocks_run(tmp_path):
    (tmp_path / "home").mkdir()
    env = _env(tmp_path)
    ran = []
    for i, block in enumerate(BLOCKS):
        if block.tags and block.language != "toml":
            continue  # (said why by its tag, checked above)
        if block.language == "toml":
            if block.tags:
                (tmp_path / block.tags[0]).write_text(block.code)
            continue
        if block.language == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", BASH_PRELUDE + block.code]
            run_env = env
        elif block.language == "python":
            script = tmp_path / f"readme_block_{i}.py"
            script.write_text(block.code)
            cmd, run_env = [sys.executable, str(script)], {**env, "TRITON_INTERPRET": "1"}
        else:
            continue
        done = subprocess.run(cmd, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{block} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ran.append((block, done.stdout))
    assert len(ran) >= 6
    said = " ".join(" ".join(out for _, out in ran).split())
    # The quick start's dry run went to the interpreter's own DB and said so; the GPU DB stays untouched.
    assert f"Results go to {tmp_path / 'cache' / 'autoflash' / 'interpret.db'} (the interpreter's own DB" in said
    assert "Real tuning needs a CUDA GPU" in said
    assert not (tmp_path / "cache" / "autoflash" / "autoflash.db").exists()
    assert re.search(r"\d+ winner\(s\) written to winners.json", said)


def test_every_extra_the_readme_installs_exists():
    """`pip install ".[name]"` in the README names an extra of pyproject.toml (datasette had none)."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set(re.findall(r"""pip install ['"]\.\[(\w+)\]['"]""", README.read_text(encoding="utf-8")))
    assert {"datasette", "postgres", "test"} <= named
    assert named <= extras, named - extras


def test_the_options_of_the_gpu_blocks_exist():
    """Blocks that need a GPU are not run here: the options their autoflash commands pass are at
    least ones the command takes."""
    from click.testing import CliRunner

    from autoflash.cli import cli

    for block in BLOCKS:
        if "gpu" not in block.tags:
            continue
        for line in block.code.splitlines():
            words = shlex.split(line.split("#")[0])
            if len(words) < 2 or words[0] != "autoflash":
                continue
            command = [w for w in words[1:3] if not w.startswith("-")][:2]
            said = CliRunner().invoke(cli, [*command, "--help"]).output
            if "Usage:" not in said or "Commands:" in said:
                command = command[:1]
                said = CliRunner().invoke(cli, [*command, "--help"]).output
            unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in said]
            assert not unknown, f"{block}: `{line.strip()}` passes {unknown}, which `autoflash {' '.join(command)}` lacks"
