"""What `autoflash which` serves on each GPU stored in the shipped DBs (cache/*.db), on any machine:
that GPU's fingerprint stands in for this one's. Shape sets standard and models, ops fwd and bwd.

A template change must not change this output (the shipped winners are carried over by the
families' `replaces` records): run it before and after and compare, e.g.
    PYTHONPATH=$PWD python benchmarks/which_shipped_gpus.py > after.txt
"""

import dataclasses
import os
import sqlite3
import sys
import tempfile
import warnings

os.environ.pop("TRITON_INTERPRET", None)
os.environ["COLUMNS"] = "400"  # (rich: whole rows, nothing cut short)
os.environ["AUTOFLASH_DB"] = os.path.join(tempfile.mkdtemp(), "none.db")  # the shipped DBs only

from click.testing import CliRunner  # noqa: E402

import autoflash.device as device  # noqa: E402
from autoflash import resources  # noqa: E402
from autoflash.cli import cli  # noqa: E402


def shipped_gpus() -> list:
    fields = [f.name for f in dataclasses.fields(device.GPUFingerprint)]
    gpus = {}
    for path in resources.shipped_databases():
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        db.row_factory = sqlite3.Row
        for row in db.execute("select * from gpus"):
            gpu = device.GPUFingerprint(**{f: row[f] for f in fields})
            gpus[gpu.key] = gpu
        db.close()
    return [gpus[k] for k in sorted(gpus)]


def main() -> None:
    for gpu in shipped_gpus():
        def fingerprint(device_index=None, gpu=gpu):
            return gpu
        for module in list(sys.modules.values()):  # (every module that took the name at import)
            if getattr(module, "__name__", "").startswith("autoflash") and hasattr(module, "gpu_fingerprint"):
                module.gpu_fingerprint = fingerprint
        for shapes in ("standard", "models"):
            for op in ("fwd", "bwd"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    r = CliRunner().invoke(cli, ["which", "--shapes", shapes, "--op", op], catch_exceptions=False)
                print(f"### {gpu.name} {shapes} {op}")
                print(r.output)


if __name__ == "__main__":
    main()
