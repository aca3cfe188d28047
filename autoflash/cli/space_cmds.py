"""`autoflash space` and `autoflash render`: the search space of an op, the source of one variant."""

from __future__ import annotations

import json

import click
from rich.table import Table

from autoflash.cli.common import console, problem, problem_options


@click.command()
@problem_options
@click.option("--list", "list_variants", is_flag=True, help="Print every valid variant as JSON, one a line.")
def space(op, dtype, head_dim, causal, gqa_group, list_variants):
    """The search space of an op: its axes, and its size before and after constraints.

    Constraints are evaluated for one problem (--dtype/--head-dim/--causal/--gqa-group) on this machine's GPU
    (or, without one, for the Triton interpreter, which allows every structural variant).

    Example: autoflash space --op fwd --head-dim 64 --causal
    """
    from autoflash.device import gpu_fingerprint
    from autoflash.space import count_by_constraint, load_space

    sp = load_space(op)
    device = gpu_fingerprint()
    prob = problem(op, dtype, head_dim, causal, gqa_group=gqa_group)
    valid = sp.valid_variants(prob, device)
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
    rejected = count_by_constraint(sp, prob, device)
    ct = Table(title=f"constraints for {prob.key} on {device.name} (sm{device.cc_major}{device.cc_minor})")
    ct.add_column("constraint")
    ct.add_column("rejects (first failing rule)", justify="right")
    ct.add_column("why")
    for c in sp.constraints:
        ct.add_row(c.name, str(rejected[c.name]), c.why)
    console.print(ct)
    console.print(f"variants before constraints: [bold]{sp.size}[/]   after: [bold green]{len(valid)}[/]")


def complete_variant(sp, given: dict, prob, device):
    """The variant to render for the knobs a user gave: the built-in default with `given` laid
    over it when that is valid here, else the valid variant that has every given knob and differs
    from the default in fewest other knobs. Returns (variant, {knob: value} filled in away from the
    default). InvalidVariant when a given knob is unknown or undeclared, or no valid variant has
    the given knobs (naming the constraint the default + given knobs violate)."""
    default = sp.default_for(prob, device).as_dict()
    wanted = {**default, **given}
    variant = sp.check_declared(wanted)  # unknown knobs, undeclared values
    if not sp.violations(variant, prob, device):
        return variant, {}
    matching = [v for v in sp.valid_variants(prob, device) if all(v[k] == x for k, x in given.items())]
    if not matching:
        sp.validate(wanted, prob, device)  # raises, naming the first violated constraint
    best = min(matching, key=lambda v: (sum(v[k] != default[k] for k in default), v.json()))
    return best, {k: best[k] for k in default if k not in given and best[k] != default[k]}


@click.command()
@problem_options
@click.option("--variant", "variant_json", default="{}", show_default=True,
              help="Variant as JSON; knobs left out come from the built-in default, or, where the default's "
                   "values do not fit the given knobs, from the nearest valid variant that has them.")
@click.option("--score", "score_key", default="", metavar="VARIANTS",
              help="Attention variants to render in, '+'-joined: window, softcap, alibi, sinks (fwd, bwd).")
def render(op, dtype, head_dim, causal, gqa_group, variant_json, score_key):
    """Print the generated Triton source of one variant.

    The variant is checked against the declared space and its constraints for the given problem
    on this machine; an invalid one is an error naming the violated rule.

    Example: autoflash render --op fwd --variant '{"BLOCK_M": 64, "LOADS": "pointer"}'
    Example: autoflash render --op bwd --gqa-group 4 --variant '{"GQA_SPLIT": 4}'
    Example: autoflash render --op fwd --causal --score window+softcap
    """
    from autoflash import codegen, families
    from autoflash.device import gpu_fingerprint
    from autoflash.score_variant import ScoreVariant
    from autoflash.space import InvalidVariant, load_space, parse_variant_json

    device = gpu_fingerprint()
    prob = problem(op, dtype, head_dim, causal, gqa_group=gqa_group)
    try:
        given = parse_variant_json(op, variant_json)
        variant, filled = complete_variant(load_space(op), given, prob, device)
    except InvalidVariant as e:
        raise click.BadParameter(f"invalid variant: {e}", param_hint="'--variant'") from None
    if filled:
        click.echo("note: knobs not given taken from the nearest valid variant: "
                   + ", ".join(f"{k}={json.dumps(v)}" for k, v in filled.items()), err=True)
    try:
        score = ScoreVariant.from_key(score_key)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--score'") from None
    if not families.host_class(variant.family).computes(score):
        raise click.BadParameter(f"{variant.family} computes no attention variants {score.key!r}", param_hint="'--score'")
    click.echo(codegen.render(variant, score=score), nl=False)
