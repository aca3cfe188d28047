"""`autoflash info` and `autoflash which`: what this machine is, and which kernels it is served."""

from __future__ import annotations

import click
from rich.table import Table

from autoflash.cli.common import OPS, console, default_shape_set, load_shapes, shapes_help, use_interpreter


@click.command()
def info():
    """This machine's GPU fingerprint, versions, DB paths and how many tuned winners apply here.

    Example: autoflash info
    """
    from autoflash import codegen
    from autoflash.space import FAMILIES
    from autoflash.device import gpu_fingerprint
    from autoflash.dispatch import WinnerTable

    device = gpu_fingerprint()
    t = Table(title="autoflash info", show_header=False)
    for k, v in device.as_dict().items():
        t.add_row(k, str(v))
    t.add_row("gpu key", device.key)
    for family in FAMILIES:
        t.add_row(f"template hash ({family})", codegen.template_hash(family))
    t.add_row("kernel cache", str(codegen.kernel_cache_dir()))
    paths = WinnerTable.default_paths()
    for i, path in enumerate(paths):
        label = "user DB" if i == 0 else "shipped DB"
        t.add_row(label, f"{path}{'' if path.is_file() else ' (absent)'}")
    table = WinnerTable(device, paths)
    t.add_row("winners that apply here", str(len(table.rows)))
    console.print(t)


@click.command()
@click.option("--shapes", default=None, help=shapes_help("Shapes to resolve"))
@click.option("--op", type=click.Choice(OPS), default="fwd", show_default=True,
              help="Kernel op (decode: flash_attn_with_kvcache; a shape's seqlen_k is its cache's capacity).")
@click.option("--db", "db_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Results DB to serve from, before the shipped ones (default: the user DB).")
@click.option("--interpret", is_flag=True, help="Resolve for the Triton CPU interpreter instead of the GPU.")
def which(shapes, op, db_file, interpret):
    """Which kernel autoflash.attention serves for each shape on this machine, and where it comes from.

    For each shape: the problem key, whether a tuned winner matched (exact or nearest seqlen bucket)
    or the built-in default is used, the DB file the winner was read from, and the variant.
    Nothing is compiled or launched.

    Example: autoflash which --shapes standard
    Example: autoflash which --op decode --db my-tuning.db
    """
    import dataclasses
    from pathlib import Path

    if interpret:
        use_interpreter()
    from autoflash import resources
    from autoflash.device import gpu_fingerprint
    from autoflash.dispatch import Dispatcher, get_dispatcher

    shape_list = load_shapes(shapes or default_shape_set(op, interpret), op)
    device = gpu_fingerprint()
    disp = get_dispatcher() if db_file is None else Dispatcher([Path(db_file), *resources.shipped_databases()])
    t = Table(title=f"kernels served on {device.name} ({op}; tensors in their default layout)")
    for col in ("shape", "problem", "winner", "from", "variant"):
        t.add_column(col)
    for shape in shape_list:
        problem = dataclasses.replace(shape, op=op).problem
        variant, how = disp.choose(problem, device)
        tuned = how == "exact" or how.startswith("nearest (")  # (else the serving policy or the default)
        origin = disp.winners(device).explain(problem)[2] if tuned else None
        served = f"{variant.family}: {variant.short()}"
        knobs = variant.as_dict()
        for half, op_of_half in (("FORWARD", "fwd"), ("BACKWARD", "bwd")):  # a pair with one SDPA half
            if knobs.get(half) == "autoflash":
                own = disp.variant_for(dataclasses.replace(shape, op=op_of_half).problem, device, own_only=True)
                served += f" ({half.lower()}: {own.family}: {own.short()})"
        source = Path(origin).name if origin else "built-in" if how == "default" else "serving policy"
        t.add_row(shape.label(), problem.key, how, source, served)
    console.print(t)
