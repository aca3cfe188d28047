"""CLI commands through click's CliRunner (and one real subprocess for `python -m autoflash`)."""

import json
import subprocess
import sys

from click.testing import CliRunner

from autoflash.cli import cli


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_space_prints_axes_and_counts():
    r = invoke("space", "--op", "fwd", "--head-dim", "64", "--causal")
    assert r.exit_code == 0
    assert "BLOCK_M" in r.output and "WARP_SPECIALIZE" in r.output
    assert "variants before constraints: 1728" in r.output
    after = int(r.output.rsplit("after:", 1)[1].split()[0])
    assert 0 < after < 1728


def test_space_list_is_json_lines():
    r = invoke("space", "--list", "--head-dim", "128")
    lines = r.output.strip().splitlines()
    assert len(lines) > 10
    assert {"BLOCK_M", "LOADS"} <= set(json.loads(lines[0]))


def test_render_prints_source():
    r = invoke("render", "--op", "fwd", "--variant", '{"BLOCK_M": 64, "num_warps": 4, "LOADS": "block_ptr"}')
    assert r.exit_code == 0
    assert "@triton.jit" in r.output and "BLOCK_M = 64" in r.output and "make_block_ptr" in r.output
    compile(r.output, "<rendered>", "exec")


def test_render_names_the_violated_constraint():
    r = CliRunner().invoke(cli, ["render", "--variant", '{"BLOCK_M": 64, "num_warps": 8}'])
    assert r.exit_code != 0 and "warps_vs_tile" in r.output
    r = CliRunner().invoke(cli, ["render", "--variant", '{"BLOCK_M": 96}'])
    assert r.exit_code != 0 and "not a declared choice" in r.output
    r = CliRunner().invoke(cli, ["render", "--variant", "not json"])
    assert r.exit_code != 0 and "not valid JSON" in r.output


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "autoflash", "space", "--head-dim", "80"],
                         capture_output=True, text=True, check=True)
    assert "after:" in out.stdout


def test_info_reports_fingerprint_and_db_paths():
    r = invoke("info")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "template hash" in text and "user DB" in text and "winners that apply here" in text


def test_db_path_and_list(tmp_path, monkeypatch):
    from autoflash.problem import Problem, gpu_fingerprint
    from autoflash.store import Store

    db = tmp_path / "x.db"
    monkeypatch.setenv("AUTOFLASH_DB", str(db))
    assert invoke("db", "path").output.strip() == str(db)
    store = Store(db)
    dev = gpu_fingerprint()
    store.add_gpu(dev)
    for d in (64, 128):
        store.set_winner(gpu_key=dev.key, problem=Problem("fwd", "float16", d, False, 1, 64, 64), template_hash="t",
                         variant_json='{"BLOCK_M": 64, "BLOCK_N": 32}', median_ms=1.0, spread=0.0, tflops=2.0, trials=3)
    store.close()
    r = invoke("db", "list", "--head-dim", "128")
    assert r.exit_code == 0 and "1 winner(s)" in r.output
    assert "2 winner(s)" in invoke("db", "list").output
    r = CliRunner().invoke(cli, ["db", "list", "--db", str(tmp_path / "missing.db")])
    assert r.exit_code != 0 and "no database" in r.output


def test_search_quality_on_a_recorded_sweep(tmp_path, monkeypatch):
    import autoflash.cli

    monkeypatch.setattr(autoflash.cli.console, "width", 200)
    from autoflash.problem import Problem, gpu_fingerprint
    from autoflash.space import load_space
    from autoflash.store import Store

    dev = gpu_fingerprint()
    prob = Problem("fwd", "float16", 256, False, 1, 2048, 2048)
    store = Store(tmp_path / "sweep.db")
    store.add_gpu(dev)
    run = store.start_run(dev.key, "sweep")
    for i, v in enumerate(load_space("fwd").valid_variants(prob, dev)):
        store.add_trial(run_id=run, gpu_key=dev.key, problem=prob, template_hash="t", variant_json=v.json(),
                        status="ok", median_ms=1.0 + 0.5 * (v["BLOCK_N"] != 64) + (i % 7) / 100)
    store.close()
    r = CliRunner().invoke(cli, ["search-quality", "--db", str(tmp_path / "sweep.db"), "--seeds", "2", "--trials", "30"],
                           catch_exceptions=False, terminal_width=200)
    assert r.exit_code == 0 and "fwd/float16/d256/full/g1/q2048/k2048" in r.output
    row = next(line for line in r.output.splitlines() if "d256" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert int(cells[1]) == len(load_space("fwd").valid_variants(prob, dev))  # variants in the sweep
