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
    t.add_row("serves", _serving_summary(device, table, paths))
    console.print(t)


def _serving_summary(device, table, paths) -> str:
    """Who serves the problems this GPU has winners for, and what serves the rest."""
    from autoflash.dispatch import Dispatcher
    from autoflash.problem import Problem
    from autoflash.space import load_space

    rest = ("SDPA-cuDNN serves every problem it takes (a GPU, float16/bfloat16) that no measurement here or near "
            "shows the own kernels faster on, the built-in defaults the rest" if device.on_gpu else
            "the interpreter: the own kernels (the built-in defaults where untuned)")
    if not table.rows:
        return (f"no winners for this GPU: {rest}; `autoflash tune` measures which is faster" if device.on_gpu
                else f"no winners here: {rest}")
    disp = Dispatcher(paths)
    vendor = sum(bool(load_space(disp.variant_for(Problem.from_key(key), device).family).vendor) for key in table.rows)
    return (f"of its {len(table.rows)} tuned problems, own kernels {len(table.rows) - vendor}, torch SDPA {vendor}; "
            f"elsewhere {rest} (per shape and why: autoflash which --shapes ...)")


@click.command()
@click.option("--shapes", default=None, help=shapes_help("Shapes to resolve"))
@click.option("--op", type=click.Choice(OPS), default="fwd", show_default=True,
              help="Kernel op (decode: flash_attn_with_kvcache; a shape's seqlen_k is its cache's capacity).")
@click.option("--db", "db_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Results DB to serve from, before the shipped ones (default: the user DB).")
@click.option("--interpret", is_flag=True, help="Resolve for the Triton CPU interpreter instead of the GPU.")
def which(shapes, op, db_file, interpret):
    """Which kernel autoflash.attention serves for each shape on this machine, and where it comes from.

    For each shape: the problem key, whether autoflash's own kernel or torch SDPA (vendor) serves
    it and why (a tuned winner of the exact or nearest bucket, the serving policy's evidence, the
    built-in default), the DB file the winner was read from, and the variant. Nothing is compiled
    or launched.

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
    from autoflash.serving_policy import VENDOR_FAMILIES, cudnn_variant
    from autoflash.space import load_space

    shape_list = load_shapes(shapes or default_shape_set(op, interpret), op)
    device = gpu_fingerprint()
    disp = get_dispatcher() if db_file is None else Dispatcher([Path(db_file), *resources.shipped_databases()])
    t = Table(title=f"kernels served on {device.name} ({op}; tensors in their default layout)")
    for col in ("shape", "problem", "serves", "winner", "why", "from", "variant"):
        t.add_column(col)
    for shape in shape_list:
        problem = dataclasses.replace(shape, op=op).problem
        variant, how = disp.choose(problem, device)
        tuned = how == "exact" or how.startswith("nearest (")  # (else the serving policy or the default)
        vendor = bool(load_space(variant.family).vendor)
        if vendor:
            why = "SDPA won the tune" if tuned else "serving policy: SDPA-cuDNN until own kernels measure faster"
        elif cudnn_variant(problem, device) is None:
            why = "SDPA-cuDNN cannot take it here" if op in VENDOR_FAMILIES else ""
        else:  # (the policy let the own kernel serve: on this evidence)
            why = disp.winners(device).evidence.own_faster(problem)[1]
        origin = disp.winners(device).explain(problem)[2] if tuned else None
        served = f"{variant.family}: {variant.short()}"
        knobs = variant.as_dict()
        for half, op_of_half in (("FORWARD", "fwd"), ("BACKWARD", "bwd")):  # a pair with one SDPA half
            if knobs.get(half) == "autoflash":
                own = disp.variant_for(dataclasses.replace(shape, op=op_of_half).problem, device, own_only=True)
                served += f" ({half.lower()}: {own.family}: {own.short()})"
        source = Path(origin).name if origin else "built-in" if how == "default" else "serving policy"
        t.add_row(shape.label(), problem.key, "vendor" if vendor else "own", how, why, source, served)
    console.print(t)
