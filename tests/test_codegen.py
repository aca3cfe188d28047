"""Codegen: render to a file in the kernel cache, import, reuse in this and the next process."""

import os
import subprocess
import sys

from autoflash import codegen, resources
from helpers import default_for


def test_data_files_are_found():
    assert (resources.data_dir("families") / "triton_fwd" / "kernel.py.jinja").is_file()
    assert (resources.data_dir("families") / "triton_fwd" / "space.toml").is_file()
    assert (resources.data_dir("search_spaces") / "shapes_standard.toml").is_file()


def test_load_writes_file_and_reuses_module():
    v = default_for("fwd", "float16", 64, has_tma=False)
    m1 = codegen.load(v)
    path = codegen.source_path(v)
    assert path.is_file() and path.parent == codegen.kernel_cache_dir()
    assert path.read_text() == codegen.render(v)
    assert codegen.load(v) is m1
    assert callable(m1.module._attn_fwd.run) and m1.host.knobs["BLOCK_M"] == v["BLOCK_M"]


def test_next_process_reuses_the_cached_file():
    v = default_for("fwd", "float16", 128, has_tma=False)
    codegen.load(v)
    path = codegen.source_path(v)
    before = path.stat().st_mtime_ns
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); from autoflash import codegen; from helpers import default_for; "
            "v = default_for('fwd', 'float16', 128, has_tma=False); m = codegen.load(v); "
            "print(m.module.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ})
    assert out.stdout.strip() == str(path)
    assert path.stat().st_mtime_ns == before  # not rewritten


def test_variant_hash_depends_on_template_and_variant():
    a = default_for("fwd", "float16", 64, has_tma=False)
    b = a.replace(BLOCK_N=32)
    assert codegen.variant_hash(a) != codegen.variant_hash(b)
    assert len(codegen.template_hash("fwd")) == 16
