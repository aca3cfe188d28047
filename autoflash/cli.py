"""The `autoflash` command line: thin click commands over the library, rich output."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from autoflash.problem import DTYPES, Problem, seqlen_bucket

console = Console()


def _problem_options(f):
    f = click.option("--causal/--no-causal", default=False, show_default=True, help="Causal problem.")(f)
    f = click.option("--head-dim", type=int, default=128, show_default=True, help="Head dim.")(f)
    f = click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", show_default=True)(f)
    f = click.option("--op", type=click.Choice(["fwd"]), default="fwd", show_default=True, help="Kernel op.")(f)
    return f


def _problem(op, dtype, head_dim, causal, seqlen=4096) -> Problem:
    return Problem(op=op, dtype=dtype, head_dim=head_dim, causal=causal, gqa_group=1,
                   seqlen_q=seqlen_bucket(seqlen), seqlen_k=seqlen_bucket(seqlen))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="autoflash")
def cli():
    """autoflash: tune Triton flash-attention kernels for this GPU and serve the winners.

    Example: autoflash tune --interpret
    """


@cli.command()
@_problem_options
@click.option("--list", "list_variants", is_flag=True, help="Print every valid variant as JSON, one a line.")
def space(op, dtype, head_dim, causal, list_variants):
    """The search space of an op: its axes, and its size before and after constraints.

    Constraints are evaluated for one problem (--dtype/--head-dim/--causal) on this machine's GPU
    (or, without one, for the Triton interpreter, which allows every structural variant).

    Example: autoflash space --op fwd --head-dim 64 --causal
    """
    from autoflash.problem import gpu_fingerprint
    from autoflash.space import count_by_constraint, load_space

    sp = load_space(op)
    device = gpu_fingerprint()
    problem = _problem(op, dtype, head_dim, causal)
    valid = sp.valid_variants(problem, device)
    if list_variants:
        for v in valid:
            click.echo(v.json())
        return
    table = Table(title=f"search space: {op} ({sp.template})")
    table.add_column("knob")
    table.add_column("choices")
    for knob, choices in sp.knobs.items():
        table.add_row(knob, ", ".join(json.dumps(c) for c in choices))
    console.print(table)
    rejected = count_by_constraint(sp, problem, device)
    ct = Table(title=f"constraints for {problem.key} on {device.name} (sm{device.cc_major}{device.cc_minor})")
    ct.add_column("constraint")
    ct.add_column("rejects (first failing rule)", justify="right")
    ct.add_column("why")
    for c in sp.constraints:
        ct.add_row(c.name, str(rejected[c.name]), c.why)
    console.print(ct)
    console.print(f"variants before constraints: [bold]{sp.size}[/]   after: [bold green]{len(valid)}[/]")


@cli.command()
@_problem_options
@click.option("--variant", "variant_json", default="{}", show_default=True,
              help="Variant as JSON; knobs left out take the built-in default's values.")
def render(op, dtype, head_dim, causal, variant_json):
    """Print the generated Triton source of one variant.

    The variant is checked against the declared space and its constraints for the given problem
    on this machine; an invalid one is an error naming the violated rule.

    Example: autoflash render --op fwd --variant '{"BLOCK_M": 64, "LOADS": "block_ptr"}'
    """
    from autoflash import codegen
    from autoflash.dispatch import default_variant
    from autoflash.problem import gpu_fingerprint
    from autoflash.space import InvalidVariant, load_space, parse_variant_json

    device = gpu_fingerprint()
    problem = _problem(op, dtype, head_dim, causal)
    try:
        given = parse_variant_json(op, variant_json)
        values = {**default_variant(op, dtype, head_dim, device.cc_major >= 9).as_dict(), **given}
        variant = load_space(op).validate(values, problem, device)
    except InvalidVariant as e:
        raise click.ClickException(f"invalid variant: {e}") from None
    click.echo(codegen.render(variant), nl=False)


def _require_gpu(what: str) -> None:
    import torch

    from autoflash.problem import interpreter_enabled

    if not torch.cuda.is_available() or interpreter_enabled():
        raise click.ClickException(
            f"{what} needs a CUDA GPU: none is visible here. Use --interpret to run the whole "
            "pipeline on tiny shapes in Triton's CPU interpreter (correctness only, no real timings).")


@cli.command()
@click.option("--shapes", default="standard", show_default=True,
              help="Shape set: standard, gqa, tiny, or a TOML file.")
@click.option("--rounds", default=3, show_default=True, help="Interleaved timing rounds per shape.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Save a bar chart (PNG) here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Write the table as Markdown here.")
def bench(shapes, rounds, plot_path, md_path):
    """autoflash (dispatched, and the untuned default) vs torch SDPA (cuDNN, flash), TFLOP/s.

    All methods are timed in this one process, interleaved, median of do_bench medians.

    Example: autoflash bench --shapes standard --plot bench.png
    """
    _require_gpu("autoflash bench")
    from autoflash import bench as bench_mod
    from autoflash.dispatch import default_variant, get_dispatcher
    from autoflash.problem import gpu_fingerprint, load_shape_set

    device = gpu_fingerprint()
    shape_list = load_shape_set(shapes)
    disp = get_dispatcher()
    choosers = {
        "autoflash": lambda s: disp.variant_for(s.problem, device, tma_ok=True),
        "default": lambda s: default_variant("fwd", s.dtype, s.head_dim, device.cc_major >= 9),
    }
    with console.status("benchmarking") as status:
        rows = bench_mod.run_bench(shape_list, choosers, rounds=rounds,
                                   progress=lambda label: status.update(f"benchmarking {label}"))
    methods = ["autoflash", "default", "sdpa_cudnn", "sdpa_flash"]
    title = f"forward TFLOP/s on {device.name}, torch {device.torch_version}, triton {device.triton_version}"
    console.print(bench_mod.rich_table(rows, methods, title))
    if md_path:
        with open(md_path, "w") as f:
            f.write(bench_mod.markdown_table(rows, methods) + "\n")
    if plot_path:
        bench_mod.plot(rows, methods, plot_path, title)
        console.print(f"plot saved to {plot_path}")


def main():
    try:
        cli(prog_name="autoflash")
    except KeyboardInterrupt:  # finished work is already stored; say so instead of a traceback
        console.print("[yellow]interrupted[/]")
        sys.exit(130)
