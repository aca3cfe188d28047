"""Print `autoflash which` for every GPU stored in the shipped DBs (shapes standard/models, fwd/bwd),
with that GPU's fingerprint standing in for this machine's (CPU-only)."""
import dataclasses, sqlite3, sys, os, warnings
os.environ.pop("TRITON_INTERPRET", None)
os.environ["COLUMNS"] = "400"
os.environ["AUTOFLASH_DB"] = "/tmp/which_check_empty.db"
import autoflash.device as device
from autoflash import resources
from click.testing import CliRunner
fields = [f.name for f in dataclasses.fields(device.GPUFingerprint)]
gpus = {}
for path in resources.shipped_databases():
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True); db.row_factory = sqlite3.Row
    for row in db.execute("select * from gpus"):
        g = device.GPUFingerprint(**{f: row[f] for f in fields}); gpus[g.key] = g
import autoflash.cli as cli_mod
from autoflash.cli import cli
import autoflash.dispatch as dispatch
for key, g in sorted(gpus.items()):
    device.gpu_fingerprint = lambda device_index=None, g=g: g
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("autoflash") and hasattr(mod, "gpu_fingerprint"):
            mod.gpu_fingerprint = device.gpu_fingerprint
    for shapes in ("standard", "models"):
        for op in ("fwd", "bwd"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = CliRunner().invoke(cli, ["which", "--shapes", shapes, "--op", op], catch_exceptions=False,
                                       terminal_width=400)
            print(f"### {g.name} {shapes} {op}")
            print(r.output)
