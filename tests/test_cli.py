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
