"""No command loses a database, and no bad shape or row gets into one: an output option pointed at
a DB (or its -wal/-shm/journal) is refused before anything is written; a shape file's shapes are
checked before tuning (a bogus shape's winner would be stored under a real problem's key); an
imported row's counts fit SQLite and its shape is a shape; recording writes each shape once across
runs of the model."""

import json

import pytest
from click.testing import CliRunner

from autoflash.cli import cli
from autoflash.problem import Shape
from autoflash.shapes import load_shape_set, record_shape
from autoflash.store import Store

from helpers import db_with_winners


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _unchanged(path, before: bytes) -> bool:
    return path.read_bytes() == before and Store(path, readonly=True).export_winners()["winners"]


def _one_line_error(r, text):
    assert r.exit_code not in (0, None) and "Traceback" not in r.output, r.output
    assert text in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("fmt", ["json", "csv"])
@pytest.mark.parametrize("target", ["db", "db-wal", "other-db"])
def test_db_export_as_text_never_overwrites_a_database(tmp_path, fmt, target):
    db = db_with_winners(tmp_path / "x.db")
    other = db_with_winners(tmp_path / "other.db")
    out = {"db": db, "db-wal": tmp_path / "x.db-wal", "other-db": other}[target]
    before = db.read_bytes(), other.read_bytes()
    r = run("db", "export", "--format", fmt, "-o", out, "--db", db)
    _one_line_error(r, "refusing to overwrite it")
    assert _unchanged(db, before[0]) and _unchanged(other, before[1])


def test_db_export_as_sqlite_still_replaces_another_db_but_not_its_source(tmp_path):
    db, other = db_with_winners(tmp_path / "x.db", n=2), db_with_winners(tmp_path / "other.db", n=1)
    r = run("db", "export", "--format", "sqlite", "-o", other, "--db", db)
    assert r.exit_code == 0, r.output
    assert len(Store(other, readonly=True).export_winners()["winners"]) == 2
    _one_line_error(run("db", "export", "--format", "sqlite", "-o", db, "--db", db), "refusing to export onto")


@pytest.mark.parametrize("option", ["--markdown"])
def test_tune_outputs_never_overwrite_the_db_it_writes(tmp_path, option):
    db = db_with_winners(tmp_path / "x.db")
    before = db.read_bytes()
    for target in (db, tmp_path / "x.db.optuna.journal"):
        r = run("tune", "--interpret", "--trials", 1, "--shapes", "tiny", "--db", db, option, target)
        _one_line_error(r, "refusing to overwrite it")
    assert _unchanged(db, before)


def test_db_plot_never_overwrites_a_database(tmp_path):
    db = db_with_winners(tmp_path / "x.db")
    before = db.read_bytes()
    _one_line_error(run("db", "plot", "--db", db, "-o", db), "refusing to overwrite it")
    assert _unchanged(db, before)


SHAPE = dict(batch=1, heads_q=2, heads_kv=2, seqlen_q=16, seqlen_k=16, head_dim=32, causal=False, dtype="float16")


@pytest.mark.parametrize("field, value, says", [
    ("heads_kv", 0, "heads_kv must be a positive integer"), ("seqlen_k", 0, "seqlen_k must be a positive"),
    ("batch", 0, "batch must be a positive"), ("seqlen_q", -4, "seqlen_q must be a positive"),
    ("seqlen_q", 16.5, "seqlen_q must be a positive integer"), ("heads_kv", 3, "must be a multiple of heads_kv"),
    ("head_dim", 257, "head dim 257 is not supported"), ("head_dim", 300, "head dim 300 is not supported"),
    ("causal", 1, "causal must be true or false")])
def test_a_shape_file_with_an_impossible_shape_is_refused_before_tuning(tmp_path, field, value, says):
    shape = {**SHAPE, field: value}
    (tmp_path / "bad.toml").write_text("[[shape]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in shape.items()))
    with pytest.raises(ValueError, match=says):
        load_shape_set(str(tmp_path / "bad.toml"))
    db = tmp_path / "t.db"
    for args in (("tune", "--interpret", "--trials", 1, "--db", db), ("which",)):
        r = run(*args, "--shapes", tmp_path / "bad.toml")
        _one_line_error(r, says)
    assert not db.exists() or not Store(db, readonly=True).export_winners()["winners"]


def _export_with(tmp_path, **changes):
    db = db_with_winners(tmp_path / "src.db", n=1)
    data = Store(db, readonly=True).export_winners()
    data["winners"][0].update(changes)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("changes, says", [
    ({"trials": 2 ** 70}, "field 'trials' must be empty or an integer in [0, 2**63)"),
    ({"shape": json.dumps({"batch": 1})}, "field 'shape' is not the JSON of a shape"),
    ({"shape": "xx"}, "field 'shape' is not the JSON of a shape"),
    ({"shape": json.dumps({**SHAPE, "heads_kv": 0})}, "field 'shape' is no valid shape: heads_kv must be"),
])
def test_db_import_refuses_rows_that_do_not_fit_sqlite_or_name_no_shape(tmp_path, changes, says):
    target = tmp_path / "target.db"
    r = run("db", "import", _export_with(tmp_path, **changes), "--db", target)
    _one_line_error(r, says)
    assert not target.exists() or not Store(target, readonly=True).export_winners()["winners"]


def test_db_import_takes_a_row_with_a_real_shape(tmp_path):
    r = run("db", "import", _export_with(tmp_path, shape=json.dumps({**SHAPE, "op": "fwd", "page": None})),
            "--db", tmp_path / "target.db")
    assert r.exit_code == 0, r.output


def test_recording_writes_a_shape_once_across_runs_of_the_model(tmp_path):
    path = tmp_path / "rec.toml"
    a, b = Shape(**SHAPE), Shape(**{**SHAPE, "seqlen_q": 37})
    for _ in range(2):  # two runs of the same model, each process recording what it sees
        record_shape(path, a)
        record_shape(path, b)
    assert [s.seqlen_q for s in load_shape_set(str(path))] == [16, 37]


@pytest.mark.parametrize("content", [b"my notes\n", b"SQLite format 3\x00 and more"])
def test_tune_storage_never_appends_to_a_file_that_is_no_journal(tmp_path, content):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    r = run("tune", "--interpret", "--trials", 1, "--shapes", "tiny", "--db", tmp_path / "t.db", "--storage", notes)
    _one_line_error(r, "as an Optuna journal")
    assert notes.read_bytes() == content
