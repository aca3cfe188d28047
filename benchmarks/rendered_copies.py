"""Render one copy of each kernel family's module with every optional part on, to measure the
templates as a kernel engineer reads them: a duplicate-code checker and line counts see Python, not
Jinja.

Each family's module is rendered once with all attention variants (window, softcap, ALiBi, sinks),
dropout and a value head dim of its own where the family renders them, and the knob choices that
render the most device code (the split masked/unmasked loops, TMA descriptors, warp specialization,
the head split, a GQA split, the Gluon dK/dV kernel). Files are written as `<family>.py`, so that
tools that read sources by their ending read them.

    python benchmarks/rendered_copies.py /tmp/rendered   # then point the checker at /tmp/rendered
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The knob choices (over each knob's first declared choice) that render the most device code.
FULLEST = {
    "triton_fwd": {"LOADS": "tma", "MASK_MODE": "split", "WARP_SPECIALIZE": True, "HEAD_SPLIT": True},
    "triton_bwd": {"DQ_MODE": "tma_reduce", "LOADS": "tma", "GQA_SPLIT": 2, "DKDV_KERNEL": "gluon_sm90",
                   "GRID_ORDER": "heavy_first"},
    "triton_decode": {"LOADS": "tma", "NUM_SPLITS": "auto", "COMBINE": "tile"},
    "gluon_sm90_fwd": {"NUM_CONSUMERS": 2, "PINGPONG": True, "PERSISTENT": True, "HEAVY_FIRST": True},
}


def render_all(folder: pathlib.Path) -> list[pathlib.Path]:
    from autoflash import families
    from autoflash.rendering import render
    from autoflash.score_variant import ScoreVariant
    from autoflash.space import Variant, load_space

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for family in families.HOSTS:
        space = load_space(family)
        host = families.host_class(family)
        knobs = {k: choices[0] for k, choices in space.knobs.items()} | FULLEST.get(family, {})
        score = ScoreVariant(True, True, True, True) if host.serves_score_variants else ScoreVariant()
        source = render(Variant.of(family, knobs), score=score, value_dim=host.serves_value_dim,
                        dropout=host.serves_dropout)
        path = folder / f"{family}.py"
        path.write_text(source, encoding="utf-8")
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=pathlib.Path, help="where the rendered copies go (<family>.py each)")
    args = parser.parse_args()
    for path in render_all(args.folder):
        print(f"{path}: {len(path.read_text(encoding='utf-8').splitlines())} lines")


if __name__ == "__main__":
    main()
