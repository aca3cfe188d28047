"""What a new user meets first: the interpreter's dry run kept apart from a GPU's winners, and
messages that name the cause and the fix (CLI through CliRunner, real SQLite files)."""

import json

import pytest
from click.testing import CliRunner

from autoflash.cli import cli
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
from autoflash.space import Variant, load_space
from autoflash.store import Store
from helpers import db_with_winners


def invoke(*args, **kwargs):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, terminal_width=240, **kwargs)


def flat(text: str) -> str:
    """Output with rich's line wrapping undone."""
    return " ".join(text.split())


@pytest.fixture
def wide(monkeypatch):
    import autoflash.cli

    monkeypatch.setattr(autoflash.cli.console, "width", 400)  # one table row per line


ONE_SHAPE = """
[[shape]]
batch = 1
heads_q = 2
seqlen_q = 37
seqlen_k = 37
head_dim = 32
causal = false
dtype = "float32"
"""


# --------------------------------------------------------------------------- the dry run's own DB
@pytest.mark.interpreter
def test_tune_interpret_writes_its_own_db_and_says_where(tmp_path, monkeypatch, wide):
    """Without --db and $AUTOFLASH_DB, the interpreter's results go to interpret.db beside the
    user DB, never into it; the run says where and that real tuning needs a GPU; `which
    --interpret` serves them from there, `db path --interpret` names it."""
    monkeypatch.delenv("AUTOFLASH_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shapes = tmp_path / "one.toml"
    shapes.write_text(ONE_SHAPE)
    r = invoke("tune", "--interpret", "--shapes", shapes, "--trials", "1")
    assert r.exit_code == 0, r.output
    interpret_db, gpu_db = tmp_path / "cache" / "autoflash" / "interpret.db", tmp_path / "cache" / "autoflash" / "autoflash.db"
    said = flat(r.output)
    assert f"Results go to {interpret_db} (the interpreter's own DB, never among a GPU's winners)" in said
    assert "Real tuning needs a CUDA GPU" in said
    assert not gpu_db.exists()
    assert Store(interpret_db, readonly=True).counts()["winners"] == 1
    assert invoke("db", "path", "--interpret").output.strip() == str(interpret_db)
    import autoflash.dispatch

    monkeypatch.setattr(autoflash.dispatch, "_dispatcher", None)  # as a new process: a dispatcher reading the DBs now
    r = invoke("which", "--interpret", "--shapes", shapes)
    row = next(line for line in r.output.splitlines() if "fwd/float32/d32" in line)
    assert "exact" in row and "interpret.db" in row
    # A DB the user names is used as named, and not called the interpreter's own.
    r = invoke("tune", "--interpret", "--shapes", shapes, "--trials", "1", "--db", tmp_path / "chosen.db")
    said = flat(r.output)
    assert r.exit_code == 0 and f"Results go to {tmp_path / 'chosen.db'}." in said and "own DB" not in said


def test_the_gpu_db_and_the_interpreters_are_two_files(tmp_path, monkeypatch):
    from autoflash.store import default_db_path

    monkeypatch.delenv("AUTOFLASH_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_db_path(interpret=False) == tmp_path / "autoflash" / "autoflash.db"
    assert default_db_path(interpret=True) == tmp_path / "autoflash" / "interpret.db"
    monkeypatch.setenv("AUTOFLASH_DB", str(tmp_path / "mine.db"))  # an explicit choice holds for both
    assert default_db_path(interpret=True) == default_db_path(interpret=False) == tmp_path / "mine.db"


# --------------------------------------------------------------------------- db import
@pytest.mark.parametrize("content, expected", [
    (b"", "it is not JSON (Expecting value"),
    (b"name,ms\nx,1\n", "it is not JSON ("),
    (b"\xd0\xcf\x11\xe0 binary", "it is not a text file, so no winners export"),
    (b'[{"problem": "fwd/x"}]', 'it is JSON but no winners export (those have "format": "autoflash-winners")'),
])
def test_db_import_of_a_file_that_is_no_export_names_it_and_the_fix(tmp_path, content, expected):
    bad = tmp_path / "winners.json"
    bad.write_bytes(content)
    r = invoke("db", "import", bad, "--db", tmp_path / "t.db")
    said = flat(r.output)
    assert r.exit_code == 1 and f"cannot import {bad}" in said and expected in said
    assert "autoflash db export -o FILE.json" in said
    assert "codec can't decode" not in said


def test_db_import_of_a_database_points_to_merge(tmp_path):
    other = db_with_winners(tmp_path / "other.db")
    r = invoke("db", "import", other, "--db", tmp_path / "t.db")
    assert r.exit_code == 1
    assert f"it is an SQLite database, not a JSON export; to take its winners, run `autoflash db merge {other}`" in flat(r.output)


# --------------------------------------------------------------------------- exports
@pytest.mark.parametrize("fmt, what", [("json", "2 winner(s)"), ("csv", "2 winners row(s)")])
def test_json_and_csv_exports_say_what_they_wrote(tmp_path, fmt, what):
    src, out = db_with_winners(tmp_path / "src.db"), tmp_path / f"out.{fmt}"
    r = invoke("db", "export", "--db", src, "--format", fmt, "-o", out)
    assert r.exit_code == 0 and f"{what} written to {out}" in flat(r.output)
    assert out.stat().st_size > 0
    piped = invoke("db", "export", "--db", src, "--format", "json")  # standard output: the data alone
    assert len(json.loads(piped.output)["winners"]) == 2


# --------------------------------------------------------------------------- shape files
@pytest.mark.parametrize("entry, expected", [
    ("[[shape]]\nbatch = 1\nheads_q = 2\nseqlen_q = 8\nseqlen_k = 8\nheaddim = 64\ncausal = true\ndtype = 'float16'\n",
     "[[shape]] 1: unknown key 'headdim' (did you mean 'head_dim'?)"),
    ("[[shape]]\nbatch = 1\nheads_q = 2\nseqlen_q = 8\nseqlen_k = 8\ncausal = true\ndtype = 'float16'\n",
     "[[shape]] 1: missing key 'head_dim'"),
    ("[[grid]]\ndtype = ['float16']\nhead_dim = [64]\ncausal = [true]\nseqlens = [128]\ntokens = 1024\nhidden = 512\n",
     "[[grid]] 1: unknown key 'seqlens' (did you mean 'seqlen'?)"),
    ("[[grid]]\ndtype = ['float16']\nhead_dim = [64]\ncausal = [true]\nseqlen = [128]\nhidden = 512\n",
     "[[grid]] 1: missing key 'batch' or 'tokens'"),
    ("[[shapes]]\nbatch = 1\n", "unknown table(s) ['shapes']"),
])
def test_a_shape_file_with_a_wrong_key_names_the_key_and_the_spelling(tmp_path, entry, expected):
    shapes = tmp_path / "s.toml"
    shapes.write_text(entry)
    r = invoke("tune", "--interpret", "--shapes", shapes, "--db", tmp_path / "t.db")
    said = flat(r.output)
    assert r.exit_code == 2 and expected in said and "--shapes" in said
    assert "unexpected keyword" not in said and not (tmp_path / "t.db").exists()


# --------------------------------------------------------------------------- db list, db show
def test_db_list_labels_the_numbers_of_a_gluon_variant(tmp_path, wide):
    dev = gpu_fingerprint()
    space = load_space("gluon_sm90_fwd")
    knobs = {k: v[0] for k, v in space.knobs.items()}
    knobs.update(NUM_STAGES=2, CONSUMER_REGS=240, PRODUCER_REGS=24, HEAVY_FIRST=True)
    variant = Variant.of(space.family, knobs)
    store = Store(tmp_path / "g.db")
    store.add_gpu(dev)
    store.set_winner(gpu_key=dev.key, problem=Problem("fwd", "bfloat16", 128, True, 1, 4096, 4096),
                     template_hash="g", variant_json=variant.json(), median_ms=1.0, spread=0.0, tflops=500.0, trials=40)
    store.close()
    r = invoke("db", "list", "--db", tmp_path / "g.db")
    row = next(line for line in r.output.splitlines() if "d128" in line)
    assert "NUM_STAGES=2" in row and "CONSUMER_REGS=240" in row and "PRODUCER_REGS=24" in row and "HEAVY_FIRST" in row
    assert "wNone" not in row and "sNone" not in row


def test_db_show_explains_a_winner_slower_than_its_trials(tmp_path, wide):
    dev = gpu_fingerprint()
    prob = Problem("fwd", "float16", 64, False, 1, 64, 64)
    valid = load_space("fwd").valid_variants(prob, dev)
    store = Store(tmp_path / "w.db")
    store.add_gpu(dev)
    run = store.start_run(dev.key, "tune")
    for i, ms in enumerate((0.9, 1.2)):
        store.add_trial(run_id=run, gpu_key=dev.key, problem=prob, template_hash="t", variant_json=valid[i].json(),
                        status="ok", median_ms=ms)
    store.set_winner(gpu_key=dev.key, problem=prob, template_hash="t", variant_json=valid[0].json(), median_ms=1.0,
                     spread=0.0, tflops=1.0, trials=2)
    store.close()
    said = flat(invoke("db", "show", prob.key, "--db", tmp_path / "w.db").output)
    assert "note: 1 trial(s) above read faster than a winner's median_ms" in said
    assert "re-measuring the best candidates" in said
    # (a winner no trial beats needs no note)
    store = Store(tmp_path / "w.db")
    store.set_winner(gpu_key=dev.key, problem=prob, template_hash="t", variant_json=valid[0].json(), median_ms=0.8,
                     spread=0.0, tflops=1.0, trials=2)
    store.close()
    assert "note:" not in invoke("db", "show", prob.key, "--db", tmp_path / "w.db").output


# --------------------------------------------------------------------------- search-quality
def test_search_quality_says_a_partial_db_is_no_exhaustive_sweep(tmp_path, wide):
    dev = gpu_fingerprint()
    prob = Problem("fwd", "float16", 256, False, 1, 2048, 2048)
    valid = load_space("fwd").valid_variants(prob, dev)
    store = Store(tmp_path / "partial.db")
    store.add_gpu(dev)
    run = store.start_run(dev.key, "tune --trials 40")
    for i, v in enumerate(valid[:40]):
        store.add_trial(run_id=run, gpu_key=dev.key, problem=prob, template_hash="t", variant_json=v.json(),
                        status="ok", median_ms=1.0 + i / 100)
    store.close()
    r = invoke("search-quality", "--db", tmp_path / "partial.db", "--seeds", "1", "--trials", "10")
    said = flat(r.output)
    assert r.exit_code == 0 and "exhaustive best" not in said
    assert f"40 / {len(valid)}" in said and "best recorded variant" in said
    assert f"not an exhaustive sweep: 1 problem(s) hold fewer variants than the space has valid ({prob.key}: 40 of {len(valid)})" in said


# --------------------------------------------------------------------------- which
def test_which_op_decode_resolves_decode_shapes_from_a_given_db(tmp_path, wide):
    r = invoke("which", "--op", "decode", "--interpret")
    problems = [line for line in r.output.splitlines() if "decode/" in line]
    assert len(problems) == 3  # decode_tiny's problems, not the standard grid's 512-16k "new tokens"
    assert all("/q16/" in line for line in problems), r.output  # (a few new tokens: the decode bucket)
    from autoflash import codegen
    from autoflash.shapes import load_shape_set

    dev, shape = gpu_fingerprint(), load_shape_set("tiny")[0]
    winner = load_space("fwd").valid_variants(shape.problem, dev)[5]
    store = Store(tmp_path / "mine.db")
    store.add_gpu(dev)
    store.set_winner(gpu_key=dev.key, problem=shape.problem, template_hash=codegen.template_hash("fwd"),
                     variant_json=winner.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    store.close()
    r = invoke("which", "--interpret", "--shapes", "tiny", "--db", tmp_path / "mine.db")
    row = next(line for line in r.output.splitlines() if shape.problem.key in line)
    assert "exact" in row and "mine.db" in row and winner.short() in row  # the given DB's winner is served
    r = invoke("which", "--db", tmp_path / "missing.db")
    assert r.exit_code == 2 and "does not exist" in r.output


def test_tune_and_which_help_name_every_shape_set():
    from autoflash.shapes import shape_set_names

    for command in ("tune", "which"):
        said = flat(invoke(command, "--help").output)
        missing = [name for name in shape_set_names() if f" {name}," not in said and f" {name} " not in said]
        assert not missing, (command, missing)
    assert {"models", "models_large", "decode", "decode_tiny", "cliffs"} <= set(shape_set_names())
