"""The kernel families as units: one folder each, a typed host, device-only templates, readable
kernel file names, and `replaces` records that carry stored winners over a template edit."""

import ast
import dataclasses
import logging
import sqlite3

import pytest
import triton

from autoflash import codegen, families, resources
from autoflash.device import triton_release
from autoflash.families.base import Family
from autoflash.space import FAMILIES, Variant, load_space

OWN = [f for f in FAMILIES if not load_space(f).vendor]


def test_every_own_family_is_a_folder_registered_with_a_typed_host():
    assert sorted(OWN) == sorted(families.HOSTS)
    for family in OWN:
        folder = families.FOLDER / family
        assert {"kernel.py.jinja", "host.py", "space.toml"} <= {p.name for p in folder.iterdir()}
        assert FAMILIES[family] == ("families", f"{family}/space.toml")
        if family.startswith("gluon") and triton_release(triton.__version__) != (3, 6):
            continue  # (written in Triton 3.6's Gluon API: its space offers it there only)
        host = families.host_class(family)
        assert issubclass(host, Family) and host.name == family and host.op == load_space(family).op
        assert not getattr(host, "__abstractmethods__", None), f"{family}'s host leaves {host.__abstractmethods__}"


@pytest.mark.parametrize("family", OWN)
def test_rendered_templates_hold_device_code_only(family):
    """No host function in a template: every function a variant renders is a @triton.jit or
    @gluon.jit kernel (the launch, grid and descriptors are in host.py)."""
    space = load_space(family)
    variants = [Variant(family, tuple(sorted(d.items())))
                for d in ({k: c[0] for k, c in space.knobs.items()}, {k: c[-1] for k, c in space.knobs.items()})]
    for variant in variants:
        tree = ast.parse(codegen.render(variant))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                names = [(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
                assert any(isinstance(n, ast.Attribute) and n.attr == "jit" for n in names), \
                    f"{family}: host-side function {node.name} in the template"


def test_no_template_part_over_150_lines():
    """The line budget holds for templates too: a part over 150 lines is split by concept (an include
    of its family's folder, or a shared one)."""
    parts = list(families.FOLDER.rglob("*.jinja"))
    assert len(parts) > len(OWN)
    too_long = {p.relative_to(families.FOLDER).as_posix(): n for p in parts
                if (n := len(p.read_text().splitlines())) > 150}
    assert too_long == {}


def test_kernel_file_names_say_family_op_and_knobs():
    space = load_space("triton_fwd")
    variant = Variant("triton_fwd", tuple(sorted({**{k: c[0] for k, c in space.knobs.items()},
                                                  "BLOCK_M": 128, "BLOCK_N": 64, "LOADS": "tma"}.items())))
    name = codegen.source_path(variant).name
    assert name.startswith("triton_fwd-fwd-bm128-bn64-") and "-tma-" in name and name.endswith(".py")
    assert codegen.variant_hash(variant)[:12] in name
    assert codegen.load(variant).module.__file__.endswith(name)


@pytest.mark.parametrize("family", OWN)
def test_replaces_records_were_checked_against_todays_templates(family):
    """A template (or host, or shared part) edit changes the family's hash: its `replaces` record must
    be renewed by re-running benchmarks/family_identity.py --write-replaces, which shows the kernels
    are unchanged, or the stored winners of the earlier hash stop being served (and are logged)."""
    records = families.replacements(family)
    assert records, f"{family}: no replaces.toml"
    current = codegen.template_hash(family)
    assert any(r["by"] == current for r in records), f"{family}: no record checked against today's hash {current}"
    assert set(codegen.replaced_hashes(family)) == {r["hash"] for r in records}


def test_replaced_hashes_follow_chains_and_ignore_unchecked_records(monkeypatch):
    records = ({"hash": "a", "by": "b", "evidence": "x"}, {"hash": "b", "by": "c", "evidence": "x"},
               {"hash": "z", "by": "other", "evidence": "x"})
    monkeypatch.setattr(families, "replacements", lambda family: records)
    assert families.replaced_hashes("triton_fwd", "c") == ("b", "a")
    assert families.replaced_hashes("triton_fwd", "b") == ("a",)
    assert families.replaced_hashes("triton_fwd", "q") == ()


def test_every_shipped_own_winner_is_carried_over():
    """No shipped winner of an autoflash family is lost: each row's template hash is today's or one a
    `replaces` record carries over to today's family."""
    carried = 0
    for path in resources.shipped_databases():
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            for problem, thash in db.execute("select problem, template_hash from winners"):
                op = problem.split("/")[0]
                family = codegen.family_for_hash(op, thash, earlier=True)
                assert family is not None, f"{path.name}: {problem} ({thash}) is served by no family"
                carried += family in OWN and thash != codegen.template_hash(family)
    assert carried > 0  # (the shipped DBs were tuned before the family folders)


def test_winners_no_record_carries_are_logged_once_per_db(tmp_path, caplog):
    from autoflash.device import gpu_fingerprint
    from autoflash.dispatch import WinnerTable
    from autoflash.problem import Problem
    from autoflash.store import Store

    dev = gpu_fingerprint()
    store = Store(tmp_path / "old.db")
    store.add_gpu(dev)
    for n in (64, 128):
        prob = Problem("fwd", "float16", 64, False, 1, n, n)
        store.set_winner(gpu_key=dev.key, problem=prob, template_hash="0123456789abcdef",
                         variant_json=load_space("fwd").valid_variants(prob, dev)[0].json(),
                         median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    store.close()
    with caplog.at_level(logging.WARNING, logger="autoflash"):
        table = WinnerTable(dataclasses.replace(dev), [tmp_path / "old.db"])
    assert table.rows == {}
    logged = [r for r in caplog.records if "earlier templates" in r.getMessage()]
    assert len(logged) == 1 and "2 winner(s)" in logged[0].getMessage()


def test_db_export_current_keeps_the_carried_over_winners(tmp_path):
    """`db export --current` (how cache/ DBs are made) keeps what today's families serve, the winners
    a `replaces` record carries over included."""
    import json

    from click.testing import CliRunner

    from autoflash.cli import cli

    shipped = next(p for p in resources.shipped_databases() if "forward" in p.name)
    with sqlite3.connect(f"file:{shipped}?mode=ro", uri=True) as db:
        rows = db.execute("select count(*) from winners").fetchone()[0]
    out = tmp_path / "w.json"
    r = CliRunner().invoke(cli, ["db", "export", "--db", str(shipped), "--current", "-o", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert len(json.loads(out.read_text())["winners"]) == rows
