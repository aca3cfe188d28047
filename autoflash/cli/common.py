"""What the command modules share: the console, problem options, parameter checks, GPU/interpreter
set-up, opening a results DB, and turning library errors into one-line CLI errors."""

from __future__ import annotations

import functools
import os
import sqlite3
import tomllib

import click
from rich.console import Console

from autoflash.problem import DTYPES, MAX_HEAD_DIM, OPS, Problem, seqlen_bucket

console = Console()


# --------------------------------------------------------------------------- errors
def one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def friendly_errors(fn):
    """Command boundary: library errors from a user's input (a bad file, a DB that cannot be
    used, an unreadable path) become one-line click errors, never tracebacks."""
    from autoflash.store import StoreError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except tomllib.TOMLDecodeError as e:
            raise click.ClickException(f"invalid TOML: {one_line(e)}") from None
        except sqlite3.OperationalError as e:
            hint = " (another process is using the DB; try again when it is done)" if "locked" in str(e) else ""
            raise click.ClickException(f"database error: {one_line(e)}{hint}") from None
        except (StoreError, sqlite3.Error) as e:
            raise click.ClickException(one_line(e)) from None
        except OSError as e:
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            raise click.ClickException(f"cannot access{where}: {e.strerror or one_line(e)}") from None
        except ValueError as e:
            raise click.ClickException(one_line(e)) from None
    return wrapper


class FriendlyGroup(click.Group):
    """A click group whose commands report library errors in one line and whose Ctrl-C says
    'interrupted' and exits 130 (click alone prints 'Aborted!' and exits 1)."""

    def add_command(self, cmd, name=None):
        if cmd.callback is not None and not isinstance(cmd, click.Group):
            cmd.callback = friendly_errors(cmd.callback)
        super().add_command(cmd, name)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            interrupted(e)


def interrupted(e: KeyboardInterrupt | None = None):
    """Say that the run was stopped (finished work is stored) and exit like a shell: 130 after
    Ctrl-C, 143 after a SIGTERM (`autoflash.tuning.stopping`)."""
    from autoflash.tuning.stopping import Terminated

    word, code = ("terminated", 143) if isinstance(e, Terminated) else ("interrupted", 130)
    console.print(f"[yellow]{word}[/] (finished work is stored; a re-run resumes)")
    raise click.exceptions.Exit(code)


# --------------------------------------------------------------------------- options
def problem_options(f):
    f = click.option("--gqa-group", type=click.IntRange(1, 64), default=1, show_default=True,
                     help="Query heads per KV head (GQA_SPLIT of the backward needs a group).")(f)
    f = click.option("--causal/--no-causal", default=False, show_default=True, help="Causal problem.")(f)
    f = click.option("--head-dim", type=click.IntRange(1, MAX_HEAD_DIM), default=128, show_default=True,
                     help="Head dim (up to 256; TMA variants need a multiple of 8 in 16-bit types).")(f)
    f = click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", show_default=True)(f)
    f = click.option("--op", type=click.Choice(OPS), default="fwd", show_default=True, help="Kernel op.")(f)
    return f


def problem(op, dtype, head_dim, causal, seqlen=4096, gqa_group=1) -> Problem:
    return Problem(op=op, dtype=dtype, head_dim=head_dim, causal=causal, gqa_group=gqa_group,
                   seqlen_q=seqlen_bucket(seqlen), seqlen_k=seqlen_bucket(seqlen))


_SQLITE_HEADER = b"SQLite format 3\x00"
# What lies beside a results DB: SQLite's own companions and the tuner's Optuna journal.
_DB_COMPANIONS = ("-wal", "-shm", "-journal", ".optuna.journal")


def _is_sqlite_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:
        return False


def database_in_the_way(value: str) -> str | None:
    """The SQLite database that writing a text or image file at `value` would destroy (that file
    itself, or the DB whose -wal/-shm/journal or Optuna journal it is), or None."""
    candidates = [value] + [value[:-len(s)] for s in _DB_COMPANIONS if value.endswith(s)]
    return next((c for c in candidates if _is_sqlite_file(c)), None)


def refuse_database(value, replaces_databases: bool = False, param_hint: str | None = None) -> None:
    """BadParameter where writing `value` would destroy a database (a results DB, a shipped DB) or
    one of its companions; an output that writes a whole SQLite file itself (`replaces_databases`)
    may replace another DB, never a DB's companion. '-' and None are not files."""
    if value is None or value == "-" or not (db := database_in_the_way(value)):
        return
    if db == value and replaces_databases:
        return
    what = "is an SQLite database" if db == value else f"belongs to the SQLite database {db}"
    raise click.BadParameter(f"{value} {what}: refusing to overwrite it (choose another file)", param_hint=param_hint)


def check_output_path(ctx, param, value):
    """An output file's folder must exist (checked before any work is done); '-' is stdout. A text
    or image output never replaces a database or one of its companions (`refuse_database`)."""
    _check_output_folder(value)
    refuse_database(value)
    return value


def _check_output_folder(value):
    if value is None or value == "-":
        return value
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise click.BadParameter(f"folder {parent} does not exist")
    if os.path.isdir(value):
        raise click.BadParameter(f"{value} is a folder")
    return value


def output_option(*decls, database: bool = False, **kwargs):
    """An option naming a file to write: its folder must exist; unless `database` (the option
    writes an SQLite file itself), it must not be a database (`check_output_path`)."""
    callback = (lambda ctx, param, value: _check_output_folder(value)) if database else check_output_path
    return click.option(*decls, type=click.Path(dir_okay=False), callback=callback, **kwargs)


def default_shape_set(op: str, interpret: bool) -> str:
    """The shape set `tune` and `which` take without --shapes: the decode op has its own (a few new
    tokens against a cache); the interpreter tiny ones."""
    if op == "decode":
        return "decode_tiny" if interpret else "decode"
    return "tiny" if interpret else "standard"


def shapes_help(what: str) -> str:
    """--shapes help naming every shape set there is (search_spaces/shapes_<name>.toml)."""
    from autoflash.shapes import shape_set_names

    return (f"{what}: a shape set, one of {', '.join(shape_set_names())} (default: standard; decode for the "
            "decode op; tiny and decode_tiny with --interpret), or a TOML file of [[shape]] / [[grid]] tables.")


def load_shapes(value: str, op: str = "fwd", param_hint: str = "'--shapes'"):
    """The shapes of a named set or TOML file; a bad name or file is a usage error naming the option."""
    from autoflash.shapes import load_shape_set

    try:
        return load_shape_set(value, op)
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{value} is not a valid TOML file: {one_line(e)}", param_hint=param_hint) from None
    except (KeyError, TypeError) as e:
        raise click.BadParameter(f"{value}: a shape entry is incomplete or malformed ({type(e).__name__}: "
                                 f"{one_line(e)})", param_hint=param_hint) from None
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(one_line(e), param_hint=param_hint) from None


# --------------------------------------------------------------------------- environment
def use_interpreter() -> None:
    """Run kernels in Triton's CPU interpreter from here on (set before any kernel module loads);
    the GPU fingerprint becomes the interpreter's."""
    import sys

    from autoflash.device import gpu_fingerprint

    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    # this process is the autoflash command (its console script or `python -m autoflash`), not a host
    # program such as pytest that runs the CLI in-process
    program = os.path.basename(sys.argv[0]) == "autoflash" or getattr(main, "name", "") == "autoflash.__main__"
    if program and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and "triton" in sys.modules:
        # Triton compiles or interprets its own library functions (tl.max's combine, ...) when it is
        # imported, which this process already did: start again with the interpreter on from the
        # beginning, same command (a kernel run now would fail inside the interpreter).
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "autoflash", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    os.environ["TRITON_INTERPRET"] = "1"
    gpu_fingerprint.cache_clear()


def require_gpu(what: str, hint: str = "") -> None:
    import torch

    from autoflash.device import interpreter_enabled

    if not torch.cuda.is_available() or interpreter_enabled():
        raise click.ClickException(f"{what} needs a CUDA GPU: none is visible here.{hint}")


def open_store(db_file, readonly: bool):
    """Open a results DB (the user DB when db_file is None). When another process holds its lock,
    say so before waiting for it; a DB that cannot be used is a one-line error."""
    from autoflash.store import Store, StoreError, default_db_path
    from autoflash.store_queries import is_locked

    path = db_file or default_db_path()
    if is_locked(path, write=not readonly):
        click.echo(f"waiting for the DB lock on {path} (another process is writing it)...", err=True)
    try:
        return Store(path, readonly=readonly)
    except StoreError as e:
        raise click.ClickException(one_line(e)) from None


db_file_option = click.option("--db", "db_file", type=click.Path(dir_okay=False), default=None,
                              help="DB file (default: the user DB).")
