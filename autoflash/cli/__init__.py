"""The `autoflash` command line: thin click commands over the library, rich output.

The commands live in one module per group: `space_cmds` (space, render), `tune_cmds` (tune,
search-quality), `bench_cmds` (bench), `inspect_cmds` (info, which), `db_cmds` (the `db` group);
`common` holds what they share (console, options, error handling). Entry point: `main()`.
"""

from __future__ import annotations

import sys

import click

from autoflash.cli.bench_cmds import bench
from autoflash.cli.common import FriendlyGroup, console
from autoflash.cli.db_cmds import db
from autoflash.cli.inspect_cmds import info, which
from autoflash.cli.space_cmds import render, space
from autoflash.cli.tune_cmds import search_quality_cmd, tune

__all__ = ["cli", "main", "console"]


@click.group(cls=FriendlyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="autoflash")
def cli():
    """autoflash: tune Triton flash-attention kernels for this GPU and serve the winners.

    Example: autoflash tune --interpret
    """


for _command in (space, render, bench, tune, search_quality_cmd, info, which, db):
    cli.add_command(_command)


def main():
    """The `autoflash` script: the click group, with Ctrl-C anywhere an 'interrupted' and exit 130."""
    try:
        cli(prog_name="autoflash")
    except KeyboardInterrupt:  # outside a command (e.g. while importing): finished work is stored
        console.print("[yellow]interrupted[/]")
        sys.exit(130)
