"""`autoflash bench`: autoflash vs the untuned default vs torch SDPA, TFLOP/s."""

from __future__ import annotations

import click
from rich.table import Table

from autoflash.cli.common import console, load_shapes, output_option, require_gpu, use_interpreter


def _overhead(bench_mod, device):
    r = bench_mod.dispatch_overhead()
    console.print(f"bare kernel launch {r['bare_launch_us']:.1f} µs/call, autoflash.attention "
                  f"{r['autoflash_attention_us']:.1f} µs/call (dispatch overhead {r['overhead_us']:+.1f} µs), "
                  f"torch SDPA {r['torch_sdpa_us']:.1f} µs/call "
                  f"({device.name}, torch {device.torch_version}, triton {device.triton_version})")


def _llama(device, rounds):
    from autoflash.bench_llama import llama_step_times

    r = llama_step_times(rounds=rounds)
    t = Table(title=f"Llama (8 layers, hidden 2048, GQA 16/4, d128, bf16, batch 4 x 2048 tokens) on {device.name}")
    for col in ("step", "sdpa ms", f"{r['name']} ms", "speed-up (median of pairs)", "interquartile range"):
        t.add_column(col)
    for step in ("inference", "train_step"):
        base, mine, up = r["ms"][("sdpa", step)], r["ms"][(r["name"], step)], r["speedup"][step]
        t.add_row(step, f"{base:.2f}", f"{mine:.2f}", f"{up['median']:.4f}x", f"{up['q1']:.4f}-{up['q3']:.4f}")
    console.print(t)
    console.print(f"{r['pairs']} adjacent pairs of steps per row, the order reversed every other pair; "
                  f"logits vs sdpa: relative difference {r['logits_rel_diff']:.2e}")


def _generate(device, rounds):
    from autoflash.bench_llama import llama_generate

    r = llama_generate(rounds=rounds)
    t = Table(title=f"Llama generate() (8 layers, GQA 16/4, d128, bf16; batch 4, prompt 1024, 128 new tokens, greedy) "
                    f"on {device.name}")
    for col in ("attention", "tokens/s", "speed-up"):
        t.add_column(col)
    base = r["tokens_per_s"]["sdpa"]
    for impl, rate in r["tokens_per_s"].items():
        t.add_row(impl, f"{rate:.0f}", f"{rate / base:.3f}x")
    console.print(t)
    console.print("greedy tokens: " + ("the same as sdpa's" if r["same_tokens"] else
                                       f"differ from sdpa's; first difference per sequence: {r['first_difference']}"))


def _save(bench_mod, rows, methods, title, md_path, plot_path, base=None, json_path=None, metric="fwd_tflops"):
    extra = {} if base is None else {"base": base}
    if json_path:
        import json

        from autoflash.device import gpu_fingerprint

        with click.open_file(json_path, "w") as f:  # ("-": standard output)
            json.dump(bench_mod.json_rows(rows, methods, metric, gpu_fingerprint()), f, indent=1)
        console.print(f"rows saved to {json_path}")
    if md_path:
        with click.open_file(md_path, "w") as f:  # ("-": standard output)
            f.write(bench_mod.markdown_table(rows, methods, **extra) + "\n")
    if plot_path:
        bench_mod.plot(rows, methods, plot_path, title)
        console.print(f"plot saved to {plot_path}")


def _fwdbwd(bench_mod, device, shape_list, rounds, memory, md_path, plot_path, json_path):
    import dataclasses

    with console.status("benchmarking forward+backward") as status:
        methods = ["autoflash", "autoflash-own", *(f"sdpa_{b}" for b in bench_mod.sdpa_backends(shape_list))]
        rows, peaks = bench_mod.run_fwdbwd(shape_list, methods=tuple(methods), rounds=rounds, memory=memory,
                                           progress=lambda label: status.update(f"benchmarking {label}"))
    _say_served(bench_mod, rows, shape_list, device, "bwd")
    title = f"forward+backward TFLOP/s on {device.name}, torch {device.torch_version}, triton {device.triton_version}"
    console.print(bench_mod.rich_table(rows, methods, title))
    console.print(bench_mod.versus_best_sdpa(rows))
    if memory:
        mt = Table(title="peak memory above the inputs (GiB), forward+backward")
        for col in ("shape", *methods, "autoflash / sdpa_flash"):
            mt.add_column(col)
        for r in rows:
            label = dataclasses.replace(r.shape, op="fwd").label()
            gib = {m: peaks.get((label, m), float("nan")) / 2**30 for m in methods}
            mt.add_row(label, *(f"{gib[m]:.2f}" for m in methods), f"{gib['autoflash'] / gib['sdpa_flash']:.3f}")
        console.print(mt)
    _save(bench_mod, rows, methods, title, md_path, plot_path, json_path=json_path, metric="fwdbwd_tflops")


def _bench_shapes(shapes: str, op: str) -> list:
    """The shapes `bench --shapes` times: plain ones only, so far (the bench times plain attention
    beside SDPA, which computes no variants; a shape with window or softcap values would be timed
    without them under a variant's label)."""
    shape_list = load_shapes(shapes, op)
    if any(s.score is not None for s in shape_list):
        raise click.BadParameter(f"{shapes} has shapes with attention-variant values (window, softcap, alibi, "
                                 f"sinks): `bench --shapes` times plain attention only; `bench --variants` "
                                 f"times the variants beside FlexAttention and masked SDPA", param_hint="'--shapes'")
    return shape_list


def _compile_ahead(shape_list, mode, jobs):
    from autoflash.bench_warm import compile_ahead, default_jobs

    jobs = default_jobs() if jobs is None else jobs
    if jobs > 1 and len(shape_list) > 1:
        with console.status(f"compiling the kernels of {len(shape_list)} shapes ahead in {jobs} processes"):
            failed = compile_ahead(shape_list, mode, jobs)
        if failed:
            console.print(f"[yellow]{failed} of the compile-ahead processes failed: their kernels compile "
                          f"while timing instead[/yellow]")


def _say_served(bench_mod, rows, shape_list, device, op):
    """Each row's dispatched implementation, for its table column (rows and shapes in one order)."""
    from autoflash.dispatch import get_dispatcher

    disp = get_dispatcher()
    for row, shape in zip(rows, shape_list, strict=True):
        row.served = bench_mod.served_by(disp, shape, device, op)


def _save_rows(device, title, head, lines, rows, md_path, json_path):
    """Print the table; write its lines as Markdown and the rows (with the device and versions) as JSON."""
    import json

    table = Table(title=title)
    for col in head:
        table.add_column(col)
    for line in lines:
        table.add_row(*line)
    console.print(table)
    if md_path:
        with click.open_file(md_path, "w") as f:  # ("-": standard output)
            f.write("\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                              + ["| " + " | ".join(line) + " |" for line in lines]) + "\n")
    if json_path:
        meta = {"gpu": device.name, "torch": device.torch_version, "triton": device.triton_version}
        with click.open_file(json_path, "w") as f:  # ("-": standard output)
            json.dump([{**r, **meta} for r in rows], f, indent=1)
        console.print(f"rows saved to {json_path}")


def _decode(device, rounds, interpret, md_path, json_path):
    from autoflash import bench_decode

    cases = bench_decode.INTERPRETER_CASES if interpret else bench_decode.GPU_CASES
    with console.status("benchmarking decode") as status:
        rows = bench_decode.run_decode(cases, rounds=rounds, device="cpu" if interpret else "cuda",
                                       progress=lambda label: status.update(f"benchmarking {label}"))
    title = f"decode, TB/s of K and V read, on {device.name}, torch {device.torch_version}, triton {device.triton_version}"
    if interpret:
        title += " (interpreter wall clock: not GPU performance)"
    head = ["case", "impl", "us", "TB/s", "/ sdpa_cudnn", "rel. err", "note"]
    lines = []
    for r in rows:
        label = f"{r['dtype']} B{r['batch']} H{r['heads_q']}/{r['heads_kv']} KV{r['kv_len']} d{r['head_dim']}"
        base = next((x["tb_s"] for x in rows if x["impl"] == "sdpa_cudnn" and x["batch"] == r["batch"]
                     and x["kv_len"] == r["kv_len"] and x["tb_s"]), None)
        lines.append([label, r["impl"], f"{r['ms'] * 1e3:.1f}" if r["ms"] else "-",
                      f"{r['tb_s']:.2f}" if r["tb_s"] else "-",
                      f"{r['tb_s'] / base:.2f}" if r["tb_s"] and base else "-",
                      f"{r['err']:.1e}" if r["err"] is not None else "-", r["note"]])
    _save_rows(device, title, head, lines, rows, md_path, json_path)


def _variants(device, rounds, fwdbwd, interpret, md_path, json_path):
    from autoflash import bench_variants

    cases = bench_variants.INTERPRETER_CASES if interpret else bench_variants.GPU_CASES
    with console.status("benchmarking attention variants") as status:
        rows = bench_variants.run_variants(cases, fwdbwd=fwdbwd, rounds=rounds, device="cpu" if interpret else "cuda",
                                           progress=lambda label: status.update(f"benchmarking {label}"))
    metric = "fwdbwd_tflops" if fwdbwd else "fwd_tflops"
    title = (f"attention variants, {'forward+backward' if fwdbwd else 'forward'} TFLOP/s of the visible (query, key) "
             f"pairs, on {device.name}, torch {device.torch_version}, triton {device.triton_version}")
    if interpret:
        title += " (interpreter wall clock: not GPU performance)"
    head, lines = bench_variants.table(rows, metric)
    _save_rows(device, title, head, lines, rows, md_path, json_path)


def _kernels(bench_mod, device, shape_list, op, rounds, baseline_template, interpret, md_path, plot_path, json_path):
    from autoflash.dispatch import get_dispatcher

    disp = get_dispatcher()
    choosers = bench_mod.kernel_choosers(disp, device, op)
    templates = None
    if baseline_template:  # the dispatched variant again, rendered from the other template
        choosers["baseline"] = choosers["autoflash"]
        templates = {"baseline": baseline_template}
    with console.status("benchmarking") as status:
        rows = bench_mod.run_bench(shape_list, choosers, rounds=rounds, device="cpu" if interpret else "cuda",
                                   progress=lambda label: status.update(f"benchmarking {label}"), templates=templates,
                                   pair_halves=bench_mod.served_pair_halves(disp, device),
                                   sdpa=bench_mod.sdpa_backends(shape_list))
    _say_served(bench_mod, rows, shape_list, device, op)
    methods = list(choosers) + ([] if interpret else [f"sdpa_{b}" for b in bench_mod.sdpa_backends(shape_list)])
    base = "baseline" if baseline_template else "default" if interpret else "sdpa_cudnn"
    title = (f"{'forward' if op == 'fwd' else 'backward problems (forward + backward)'} TFLOP/s on {device.name}, torch {device.torch_version}, "
             f"triton {device.triton_version}")
    if interpret:
        title += " (interpreter wall clock: not GPU performance)"
    console.print(bench_mod.rich_table(rows, methods, title, base=base))
    if not interpret:
        console.print(bench_mod.versus_best_sdpa(rows))
    _save(bench_mod, rows, methods, title, md_path, plot_path, base=base, json_path=json_path,
          metric=f"{op}_tflops")


def _check_template(ctx, param, value):
    """A template file that Jinja cannot parse is a usage error naming its file and line."""
    from autoflash.codegen import TemplateError, check_template

    if value is not None:
        try:
            check_template(value)
        except TemplateError as e:
            raise click.BadParameter(str(e)) from None
    return value


@click.command()
@click.option("--shapes", default="standard", show_default=True,
              help="Shape set: standard, gqa, tiny, ..., a TOML file, or random:N (N problems drawn from "
                   "realistic ranges, reproducibly from --seed, about one in three with strided (B, N, H, D) "
                   "q, k, v, the others contiguous (B, H, N, D)).")
@click.option("--seed", type=int, default=0, show_default=True, help="The seed of a random:N shape set.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved timing rounds per shape.")
@output_option("--plot", "plot_path", help="Save a bar chart (PNG) here.")
@output_option("--markdown", "md_path", help="Write the table as Markdown here.")
@output_option("--json", "json_path", help="Write one JSON row per (shape, implementation) here: shape fields, "
               "impl, fwd_tflops (bwd_tflops with --op bwd, fwdbwd_tflops with --fwdbwd).")
@click.option("--fwdbwd", is_flag=True, help="Time forward+backward through autograd instead of the forward.")
@click.option("--memory", is_flag=True, help="With --fwdbwd: also report each method's peak memory above its inputs.")
@click.option("--overhead", is_flag=True, help="Per-call host overhead of autoflash.attention vs a bare kernel launch.")
@click.option("--llama", is_flag=True,
              help="A small random-weight Llama (transformers) with 'sdpa' vs autoflash's attention: ms per step.")
@click.option("--generate", is_flag=True,
              help="The same Llama's greedy generate() with 'sdpa' vs autoflash (decoding steps on the decode "
                   "kernels): tokens/s and whether the tokens agree.")
@click.option("--op", type=click.Choice(["fwd", "bwd", "decode"]), default="fwd", show_default=True,
              help="Time the forward or the backward kernels (without --fwdbwd/--overhead/--llama), or decode "
                   "(flash_attn_with_kvcache, one query token, contiguous and paged caches; TB/s of K and V).")
@click.option("--baseline-template", type=click.Path(exists=True, dir_okay=False), default=None,
              callback=_check_template,
              help="Also time each shape's variant rendered from this template file (e.g. the previous "
                   "version of the op's template), as method 'baseline': an A/B of a template edit. A knob "
                   "value that template does not know renders as that template treats it.")
@click.option("--compile-jobs", type=click.IntRange(min=0), default=None,
              help="Processes that compile the kernels ahead of the timings (0 or 1: none; default: half "
                   "the CPUs, at most 8). Timings are the same either way; a large shape set starts sooner.")
@click.option("--variants", is_flag=True,
              help="Attention variants (sliding window 4096 at 16k/32k/64k tokens, softcap 50 at d256 8k, 8 ragged "
                   "causal documents in 16k; --shapes is not read): autoflash vs torch SDPA given the equivalent "
                   "boolean mask (skipped where the mask does not fit in memory; the softcap: torch's eager attention), "
                   "compiled FlexAttention with a block mask (max-autotune off and on), and for documents the varlen "
                   "kernel on the same packing; forward, or with --fwdbwd forward+backward. Every method's output "
                   "(and gradients) is checked against a reference first. FLOPs count only the visible (query, key) "
                   "pairs, the same for every method: 4 x head_dim x heads x pairs, 3.5x for forward+backward.")
@click.option("--interpret", is_flag=True,
              help="Tiny shapes in Triton's CPU interpreter: checks the bench pipeline; timings are not GPU performance.")
def bench(shapes, seed, rounds, plot_path, md_path, json_path, fwdbwd, memory, overhead, llama, generate, op,
          baseline_template, compile_jobs, variants, interpret):
    """autoflash (dispatched, and the untuned default) vs torch SDPA (cuDNN, flash), TFLOP/s.

    All methods are timed in this one process, interleaved, median of device-time medians.

    Example: autoflash bench --shapes standard --plot bench.png --json bench.json
    Example: autoflash bench --shapes random:64 --seed 1 --fwdbwd --json random.json
    Example: git show HEAD~1:autoflash/families/triton_fwd/kernel.py.jinja > old.jinja && autoflash bench --baseline-template old.jinja
    Example: autoflash bench --variants --fwdbwd --json variants-fwdbwd.json
    """
    if interpret:
        use_interpreter()
        shapes = "tiny" if shapes == "standard" else shapes
        if (fwdbwd and not variants) or overhead or llama or generate:
            raise click.ClickException("--fwdbwd (but with --variants), --overhead, --llama and --generate need a "
                                       "CUDA GPU")
    else:
        require_gpu("autoflash bench", " Use --interpret to check the pipeline on tiny shapes on the CPU.")
    from autoflash import bench as bench_mod
    from autoflash.device import gpu_fingerprint

    if shapes.startswith("random:") and shapes.count(":") == 1:
        shapes = f"{shapes}:{seed}"
    device = gpu_fingerprint()
    if overhead:
        _overhead(bench_mod, device)
    elif llama:
        _llama(device, rounds)
    elif generate:
        _generate(device, rounds)
    elif variants:
        _variants(device, rounds, fwdbwd, interpret, md_path, json_path)
    elif op == "decode":
        _decode(device, rounds, interpret, md_path, json_path)
    elif fwdbwd:
        shape_list = _bench_shapes(shapes, op)
        _compile_ahead(shape_list, "fwdbwd", compile_jobs)
        _fwdbwd(bench_mod, device, shape_list, rounds, memory, md_path, plot_path, json_path)
    else:
        shape_list = _bench_shapes(shapes, op)
        if not (interpret or baseline_template):
            _compile_ahead(shape_list, op, compile_jobs)
        _kernels(bench_mod, device, shape_list, op, rounds, baseline_template, interpret, md_path,
                 plot_path, json_path)
    _say_rejected(device)


def _say_rejected(device):
    """A stored winner this GPU cannot serve makes the numbers above those of its stand-in: say so
    under the table (the per-row warnings scroll away above it)."""
    from autoflash.dispatch import get_dispatcher

    rejected = get_dispatcher().winners(device).rejected
    if rejected:
        console.print(f"[yellow]warning:[/] {len(rejected)} stored winner(s) cannot be served on this GPU "
                      f"(first: {rejected[0]}); those problems were measured with what serves instead")
