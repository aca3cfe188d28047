"""Are the kernel families' kernels the same kernels as before the templates were reorganised?

Every variant that matters is checked: each winner in the shipped DBs (`cache/*.db`) and each
family's default variant for the shipped problems (and a few decode problems). For each one the
kernel rendered from the earlier templates (frozen in `family_identity_baseline.json.gz`, taken
from git at BASELINE_COMMIT) is compared with today's family (`codegen.load`):

- device code: the `@triton.jit` / `@gluon.jit` functions of both rendered modules (and the module
  constants they read), compared as Python syntax trees (comments and line numbers left out);
  identical trees compile to identical kernels for the same arguments;
- outputs: both kernels run on the same random inputs and must agree bit for bit: O and LSE for a
  forward, dQ, dK and dV for a backward, O and LSE for decode. `--gpu` runs them on the GPU (every
  family, the problem's dtype); without it they run in Triton's CPU interpreter (Triton families,
  float16, tiny shapes; Gluon kernels do not run there and are checked by their device code, plus
  and so checked by their device code only).

One command, torch + triton + jinja2 only (no optuna, no sqlite-utils):
    python benchmarks/family_identity.py --gpu --out identity.json
Prints one summary line; exits 1 when any variant differs.
"""

from __future__ import annotations

import argparse
import ast
import base64
import dataclasses
import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import sqlite3
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASELINE_COMMIT = "5f74ac25a4ffcf86b19ca14a2b379108d2e7df66"  # main before the family folders
BASELINE_FILE = pathlib.Path(__file__).with_name("family_identity_baseline.json.gz")
# The earlier templates, per family (the families' names did not change).
BASELINE_TEMPLATES = {"triton_fwd": "templates/attn_fwd.py.jinja", "triton_bwd": "templates/attn_bwd.py.jinja",
                      "gluon_sm90_fwd": "templates/attn_fwd_sm90.py.jinja",
                      "triton_decode": "templates/attn_decode.py.jinja"}


# --------------------------------------------------------------------------- the earlier templates
def write_baseline() -> None:
    """Freeze the earlier templates from git (run once, in a checkout that has BASELINE_COMMIT)."""
    files = {f: subprocess.run(["git", "show", f"{BASELINE_COMMIT}:{path}"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout for f, path in BASELINE_TEMPLATES.items()}
    blob = gzip.compress(json.dumps({"commit": BASELINE_COMMIT, "templates": files}, sort_keys=True).encode(), mtime=0)
    BASELINE_FILE.write_bytes(blob)


def baseline_templates() -> dict[str, str]:
    data = json.loads(gzip.decompress(BASELINE_FILE.read_bytes()))
    assert data["commit"] == BASELINE_COMMIT
    return data["templates"]


def baseline_hashes() -> dict[str, str]:
    """family -> its template hash at BASELINE_COMMIT (the hash the shipped winners are keyed by)."""
    return {f: hashlib.sha256(text.encode()).hexdigest()[:16] for f, text in baseline_templates().items()}


def render_baseline(variant) -> str:
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(baseline_templates()[variant.family]).render(**variant.as_dict())


def import_source(source: str, name: str, folder: pathlib.Path):
    """A module from rendered source, imported from a real file (`@triton.jit` reads it)."""
    path = folder / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- which variants
def shipped_variants(device) -> list[tuple[str, object, object]]:
    """(where, variant, problem) for each shipped winner of an own family, and each problem's default."""
    from autoflash.problem import Problem
    from autoflash.space import load_space

    by_hash = {h: f for f, h in baseline_hashes().items()}
    out, seen = [], set()
    for db in sorted((ROOT / "cache").glob("*.db")):
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        for problem_key, thash, variant_json in con.execute(
                "select problem, template_hash, variant from winners order by problem, template_hash"):
            family = by_hash.get(thash)
            if family is None:
                continue  # a vendor (SDPA) winner, or a template older than the baseline
            problem = Problem.from_key(problem_key)
            space = load_space(family)
            for where, variant in ((f"winner {db.name}", space.check_declared(json.loads(variant_json))),
                                   ("default", space.nearest_valid(space.default_for(problem, device), problem,
                                                                   device))):
                if (variant, problem.head_dim, problem.causal, problem.gqa_group) not in seen:
                    seen.add((variant, problem.head_dim, problem.causal, problem.gqa_group))
                    out.append((where, variant, problem))
        con.close()
    for d in (64, 128):  # decode: no shipped winners; its defaults for a few problems
        for group, q_len, n in ((1, 1, 4096), (4, 1, 32768), (8, 4, 1024)):
            problem = Problem("decode", "bfloat16", d, q_len > 1, group, q_len, n)
            space = load_space("triton_decode")
            variant = space.nearest_valid(space.default_for(problem, device), problem, device)
            if (variant, d, problem.causal, group) not in seen:
                seen.add((variant, d, problem.causal, group))
                out.append(("default", variant, problem))
    return out


# --------------------------------------------------------------------------- device code
def device_code(source: str) -> dict[str, str]:
    """name -> syntax tree dump of each jit function and of each module constant a jit function reads."""
    tree = ast.parse(source)
    jits = [n for n in tree.body if isinstance(n, ast.FunctionDef) and any(
        (d.func if isinstance(d, ast.Call) else d).attr == "jit" for d in n.decorator_list
        if isinstance(d.func if isinstance(d, ast.Call) else d, ast.Attribute))]
    # globals a kernel reads: names it uses that are none of its arguments (Triton inlines constants)
    read = {n.id for f in jits for n in ast.walk(f) if isinstance(n, ast.Name)
            and n.id not in {a.arg for a in f.args.args + f.args.kwonlyargs}}
    out = {}
    for node in jits:
        if ast.get_docstring(node):
            node.body = node.body[1:]
        out[node.name] = ast.dump(node)
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in read:
            out[node.targets[0].id] = ast.dump(node.value)
    return out


# --------------------------------------------------------------------------- running both
def _inputs(op, problem, dtype, device, gpu: bool, seed: int):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    d, group = problem.head_dim, problem.gqa_group
    if op == "decode":
        b, q_len, hkv, n = (3, problem.seqlen_q, 2, 1000) if gpu else (2, problem.seqlen_q, 1, 70)
        shapes = dict(q=(b, q_len, hkv * group, d), k=(b, n, hkv, d), v=(b, n, hkv, d))
    else:
        b, hkv, nq, nk = (2, 3, 777, 1029) if gpu else (1, 1, 37, 45)
        shapes = dict(q=(b, hkv * group, nq, d), k=(b, hkv, nk, d), v=(b, hkv, nk, d), do=(b, hkv * group, nq, d))
    return {name: torch.randn(s, generator=g).to(dtype=dtype, device=device) for name, s in shapes.items()}


def _run(kernel_call, op, t, problem, old: bool):
    """Run one kernel (the earlier module, or today's `Kernel`) and return its outputs."""
    import torch

    q, k, v = t["q"], t["k"], t["v"]
    scale = q.shape[-1] ** -0.5
    if op == "decode":
        o = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device, dtype=torch.float32)
        seqlens = torch.tensor([k.shape[1] - 7 * i for i in range(q.shape[0])], dtype=torch.int32, device=q.device)
        if old:
            from autoflash.codegen import tma_compatible
            kernel_call.launch(q, k, v, o, lse, scale, problem.causal, seqlens, None, sm_count=8,
                               tma_ok=kernel_call.LOADS == "tma" and tma_compatible(k, v))
        else:
            kernel_call.decode(q, k, v, o, lse, scale, problem.causal, seqlens, None, sm_count=8)
        return {"o": o, "lse": lse}
    offset = k.shape[2] - q.shape[2]  # bottom-right causal (the top-left is offset 0: same code path)
    o = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
    fwd = (lambda *a: kernel_call.launch(*a)) if old else kernel_call.forward
    if op == "fwd":
        fwd(q, k, v, o, lse, scale, problem.causal, offset)
        return {"o": o, "lse": lse}
    # the same forward (today's default) gives both backward kernels their O and LSE
    o, lse = t["o"], t["lse"]
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    call = (lambda *a: kernel_call.launch(*a)) if old else kernel_call.backward
    call(q, k, v, o, lse, t["do"], dq, dk, dv, scale, problem.causal, offset)
    return {"dq": dq, "dk": dk, "dv": dv}


def check_outputs(where, variant, problem, old_module, gpu: bool, seed: int) -> dict:
    import torch

    from autoflash import codegen
    from autoflash.space import Variant

    dtype = getattr(torch, problem.dtype) if gpu else torch.float16  # (bf16 is wrong in the interpreter)
    device = "cuda" if gpu else "cpu"
    op = variant.op
    t = _inputs(op, problem, dtype, device, gpu, seed)
    if op == "bwd":
        fwd = codegen.load(Variant.of("fwd", _plain_forward_knobs()))
        t["o"] = torch.empty_like(t["q"])
        t["lse"] = torch.empty(t["q"].shape[:3], device=device, dtype=torch.float32)
        fwd.forward(t["q"], t["k"], t["v"], t["o"], t["lse"], t["q"].shape[-1] ** -0.5, problem.causal,
                    t["k"].shape[2] - t["q"].shape[2])
    new = codegen.load(variant)
    why = new.unsupported(t["q"], t["k"], t["v"], t.get("do", t["q"])) if op != "decode" else None
    if why:
        return {"outputs": "skipped", "why": why}
    codegen.ensure_allocator()
    before = _run(old_module, op, t, problem, old=True)
    after = _run(new, op, t, problem, old=False)
    if gpu:
        torch.cuda.synchronize()
    differ = _differing(before, after)
    nan = [name for name in before if bool(before[name].isnan().any()) and name != "lse"]
    if differ:
        # Atomic float adds (dQ of the "atomic" and "tma_reduce" modes) land in any order: where the
        # earlier kernel differs from itself run again on the same inputs, those outputs cannot be
        # compared bit for bit; everything else must still be identical.
        again = _differing(before, _run(old_module, op, t, problem, old=True))
        if set(differ) <= set(again):
            return {"outputs": "identical but for atomic order", "differ": differ, "nan_outputs": nan,
                    "max_abs_diff": {n: float((before[n] - after[n]).abs().max()) for n in differ}}
    return {"outputs": "differ" if differ else "identical", "differ": differ, "nan_outputs": nan}


def _differing(before: dict, after: dict) -> list[str]:
    import torch

    return [name for name in before if not torch.equal(before[name].nan_to_num(7.0), after[name].nan_to_num(7.0))
            or bool((before[name].isnan() != after[name].isnan()).any())]


def _describe(x):
    """A launch argument as comparable data: a TMA descriptor by its tensor, shape, strides, box and
    shared-memory layout; a tensor by identity; anything else as is."""
    import torch

    if hasattr(x, "block_shape"):
        return ("descriptor", id(x.base), list(x.shape), list(x.strides), list(x.block_shape), repr(x.layout))
    return ("tensor", id(x)) if isinstance(x, torch.Tensor) else x


def gluon_args_same(variant, old_module) -> str:
    """Do the earlier module and today's host build the same Gluon launch (arguments, constexprs,
    grid, options) for the same tensors? Checked on CPU tensors (no launch)."""
    import torch

    from autoflash import codegen

    with codegen.interpreter_off():
        host = codegen.load(variant).host
    q, do = (torch.empty(2, 4, 333, 128, dtype=torch.bfloat16) for _ in range(2))
    k, v, dk, dv = (torch.empty(2, 2, 517, 128, dtype=torch.bfloat16) for _ in range(4))
    lse, delta = (torch.empty(2, 4, 333, dtype=torch.float32) for _ in range(2))
    if variant.family == "gluon_sm90_fwd":
        before = old_module._kernel_args(q, k, v, do, lse, 0.125, True, 517 - 333, num_sms=132)
        after = host.kernel_args(q, k, v, do, lse, 0.125, True, 517 - 333, sms=132)
    else:
        from autoflash.families.triton_bwd import gluon_dkdv

        before = old_module._gl_dkdv_args(q, k, v, do, dk, dv, lse, delta, 0.125, True, 517 - 333)
        after = gluon_dkdv.launch_args(host.knobs, q, k, v, do, dk, dv, lse, delta, 0.125, True, 517 - 333)
    same = [_describe(a) for a in before[0]] == [_describe(a) for a in after[0]] and before[1:] == after[1:]
    return "identical" if same else f"differ: {before[1:]} vs {after[1:]}"


def ttir_same(variant, old_module) -> str:
    """Where outputs cannot be compared here: do the earlier module and today's host launch kernels
    whose Triton IR for sm90 (inlined, optimized, locations left out) is the same? Both launches are
    captured on CPU tensors (compile_only) and each captured kernel compiled on this machine."""
    import re

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type

    from autoflash import codegen

    def captured(module, launch):
        launches = []
        for jit in [f for f in vars(module).values() if isinstance(f, JITFunction)]:
            jit.warmup = (lambda jit: lambda *a, **kw: launches.append((jit, a, kw)))(jit)
        launch()
        return launches

    def ttir(jit, args, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k != "grid"}
        constexprs = {n: kwargs[n] for n in jit.arg_names if n in kwargs}
        constexprs.update({prm.name: prm.default for prm in jit.params[len(args) + len(constexprs):]
                           if prm.name not in constexprs})  # (constexprs left at their defaults)
        values = iter(args)
        signature = {n: "constexpr" if n in constexprs else mangle_type(next(values)) for n in jit.arg_names}
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        with codegen.interpreter_off():
            asm = triton.compile(ASTSource(jit, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                 options=options).asm
        ir = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", re.sub(r"^#loc.*$", "", asm["ttir"], flags=re.M))
        # PTX without its debug sections, line records, inlined-scope labels and comments: what the GPU runs
        ptx = re.sub(r"^\s*\.section\s+\.debug.*?^\s*}", "", asm["ptx"], flags=re.M | re.S)
        ptx = "\n".join(line for line in ptx.splitlines()
                        if line.strip() and not line.strip().startswith((".loc", ".file", "//"))
                        and not re.fullmatch(r"\$L__tmp\d+:", line.strip()))  # (debug scopes of inlined calls)
        entry = re.search(r"\.entry\s+(\w+)", ptx)  # (the kernel's compiled name: readable names are newer)
        ptx = ptx.replace(entry.group(1), "KERNEL") if entry else ptx
        return ir, ptx

    d = 128
    q, o, do, dq = (torch.empty(2, 4, 333, d, dtype=torch.bfloat16) for _ in range(4))
    k, v, dk, dv = (torch.empty(2, 2, 517, d, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(2, 4, 333, dtype=torch.float32)
    with codegen.interpreter_off():
        new = codegen.load(variant)
    if variant.op == "bwd":
        before = captured(old_module, lambda: old_module.launch(q, k, v, o, lse, do, dq, dk, dv, 0.1, True, 184,
                                                                compile_only=True))
        after = captured(new.module, lambda: new.host.launch(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv,
                                                             sm_scale=0.1, causal=True, causal_offset=184,
                                                             compile_only=True))
    else:
        before = captured(old_module, lambda: old_module.launch(q, k, v, o, lse, 0.1, True, 184, compile_only=True))
        after = captured(new.module, lambda: new.host.launch(q=q, k=k, v=v, o=o, lse=lse, sm_scale=0.1, causal=True,
                                                             causal_offset=184, compile_only=True))
    if [j.fn.__name__ for j, _, _ in before] != [j.fn.__name__ for j, _, _ in after]:
        return "differ: other kernels launched"
    pairs = [(ttir(*b), ttir(*a)) for b, a in zip(before, after)]
    if all(b[0] == a[0] for b, a in pairs):
        return "identical"
    # (Triton IR that differs in the order of independent operations can still compile to the same PTX)
    return "identical PTX" if all(b[1] == a[1] for b, a in pairs) else "differ"


def _plain_forward_knobs() -> dict:
    from autoflash.space import load_space

    knobs = {k: c[0] for k, c in load_space("triton_fwd").knobs.items()}
    return {**knobs, "LOADS": "pointer", "BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="run both kernels on the GPU (default: the CPU interpreter)")
    parser.add_argument("--out", help="write the per-variant results as JSON here")
    parser.add_argument("--limit", type=int, default=0, help="check only the first N variants (0: all)")
    parser.add_argument("--no-run", action="store_true", help="compare the device code only")
    parser.add_argument("--jobs", type=int, default=0,
                        help="worker processes (default: 8 with --gpu, else 1)")
    parser.add_argument("--ptx", action="store_true",
                        help="also compile both kernels of every Triton variant whose device code differs for sm90 "
                             "here and compare their Triton IR and PTX (what the GPU runs; a CPU machine can)")
    parser.add_argument("--write-baseline", action="store_true", help="freeze the earlier templates from git")
    parser.add_argument("--ttir-index", type=int, help=argparse.SUPPRESS)  # (the clean child of a TTIR check)
    parser.add_argument("--write-replaces", action="store_true",
                        help="record, for each family whose every variant is identical, that its template "
                             "replaces the earlier one (autoflash/families/<name>/replaces.toml)")
    args = parser.parse_args(argv)
    args.jobs = args.jobs or (8 if args.gpu else 1)
    if args.write_baseline:
        write_baseline()
        return 0
    if args.ttir_index is not None:
        print(_ttir_of_index(args.ttir_index))
        return 0
    if not args.gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("AUTOFLASH_KERNEL_CACHE", tempfile.mkdtemp(prefix="autoflash-identity-"))
    import torch

    from autoflash import codegen
    from autoflash.device import gpu_fingerprint

    device = gpu_fingerprint() if args.gpu else dataclasses.replace(gpu_fingerprint(), cc_major=9, cc_minor=0)
    variants = shipped_variants(device)[:args.limit or None]
    start = time.time()
    jobs = max(1, min(args.jobs, len(variants)))
    if jobs == 1:
        results = [check_variant(i, *v, args.gpu, args.no_run, args.ptx) for i, v in enumerate(variants)]
    else:  # variants split over worker processes (spawned: CUDA), compiling in parallel on one GPU
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_check_share, [(i, *v) for i, v in enumerate(variants) if i % jobs == w],
                                   args.gpu, args.no_run, dict(os.environ), args.ptx) for w in range(jobs)]
            results = sorted((row for f in futures for row in f.result()), key=lambda r: r["index"])
    count = lambda key, value: sum(r.get(key) == value for r in results)  # noqa: E731
    summary = {"variants": len(results), "device_code_identical": count("device_code", "identical"),
               "outputs_identical": count("outputs", "identical"), "outputs_differ": count("outputs", "differ"),
               "identical_but_for_atomic_order": count("outputs", "identical but for atomic order"),
               "errors": count("outputs", "error"),
               "gluon_launch_args_identical": count("gluon_launch_args", "identical"),
               "ttir_sm90_identical": count("ttir_sm90", "identical") + count("ttir_sm90", "identical PTX"), "not_run": count("outputs", "not run") + count("outputs", "skipped"),
               "mode": "gpu" if args.gpu else ("cpu-interpreter + sm90 IR/PTX compiled" if args.ptx else "cpu-interpreter"), "seconds": round(time.time() - start, 1),
               "torch": torch.__version__, "baseline_commit": BASELINE_COMMIT,
               "device": torch.cuda.get_device_name() if args.gpu else "cpu"}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"summary": summary, "variants": results}, indent=1))
    print("identity: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    # A variant not run (Gluon on the CPU) counts as identical only by its device code.
    unproven = [r for r in results if not _same(r)]
    if args.write_replaces:
        write_replaces(results, summary)
    return 1 if summary["outputs_differ"] or summary["errors"] or unproven else 0


def check_variant(i, where, variant, problem, gpu: bool, no_run: bool, ptx: bool = False) -> dict:
    """One variant: its device code, and its outputs (or, where they cannot run here, its Gluon
    launch arguments / sm90 Triton IR), earlier template against today's family."""
    from autoflash import codegen

    folder = pathlib.Path(tempfile.mkdtemp(prefix="autoflash-identity-old-"))
    row = {"index": i, "family": variant.family, "where": where, "problem": problem.key, "variant": variant.as_dict()}
    old_source = render_baseline(variant)
    row["device_code"] = "identical" if device_code(old_source) == device_code(codegen.render(variant)) else "differ"
    gluon = variant.family.startswith("gluon") or variant.as_dict().get("DKDV_KERNEL") == "gluon_sm90"
    if no_run:
        row["outputs"] = "not run"
    else:
        try:
            # (the Gluon forward only compiles for the GPU: imported with the interpreter off)
            with codegen.interpreter_off() if variant.family.startswith("gluon") else _nothing():
                old = import_source(old_source, f"identity_old_{i}", folder)
            if gluon:
                row["gluon_launch_args"] = gluon_args_same(variant, old)
            if variant.family.startswith("gluon") and not gpu:
                row["outputs"] = "not run"  # (Gluon kernels do not run in the interpreter)
            else:
                row.update(check_outputs(where, variant, problem, old, gpu, seed=i))
        except Exception as e:  # a failure to run is a finding, not a crash of the whole check
            limit = not gpu and "InterpreterBuilder" in str(e)  # (e.g. TMA reductions: GPU only)
            row.update(outputs="not run" if limit else "error", error=f"{type(e).__name__}: {e}"[:500])
            if limit and row["device_code"] != "identical":
                row["ttir_sm90"] = _ttir_in_clean_process(i)
    if ptx and "ttir_sm90" not in row and row["device_code"] != "identical" and variant.op in ("fwd", "bwd") \
            and not variant.family.startswith("gluon"):  # (ttir_same launches forward and backward kernels)
        row["ttir_sm90"] = _ttir_in_clean_process(i)  # (what the GPU would run, compiled here)
    print(f"[{i + 1}] {variant.family} {problem.key} {variant.short()}: device code "
          f"{row['device_code']}, outputs {row['outputs']}"
          + (f", Gluon launch {row['gluon_launch_args']}" if "gluon_launch_args" in row else "")
          + (f", sm90 TTIR {row['ttir_sm90']}" if "ttir_sm90" in row else ""), flush=True)
    return row


def _ttir_in_clean_process(index: int) -> str:
    """`ttir_same` for shipped variant `index`, in a child process without TRITON_INTERPRET: in a process
    started with it, Triton's own @jit library (tl.sum included) was defined interpreted, and a kernel
    that calls it compiles only in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, "--ttir-index", str(index)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return f"error: {(done.stderr or done.stdout).strip()[-300:]}"
    return lines[-1]


def _ttir_of_index(index: int) -> str:
    """The child's side of `_ttir_in_clean_process`."""
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint

    device = dataclasses.replace(gpu_fingerprint(), cc_major=9, cc_minor=0)
    _, variant, _ = shipped_variants(device)[index]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="autoflash-identity-ttir-"))
    with codegen.interpreter_off():
        old = import_source(render_baseline(variant), f"identity_old_{index}_compiled", folder)
    try:
        return ttir_same(variant, old)
    except Exception as e:  # noqa: BLE001 - said in the row, not a crash of the whole check
        return f"error: {type(e).__name__}: {e}"[:300]


def _check_share(share, gpu: bool, no_run: bool, environ: dict, ptx: bool = False) -> list[dict]:
    """A worker process's variants (its environment as the parent's: the interpreter flag, caches)."""
    os.environ.update(environ)
    return [check_variant(*item, gpu, no_run, ptx) for item in share]


def _same(row) -> bool:
    """Shown identical: outputs bit for bit, else (not run here) the device code or its Triton IR."""
    not_run = row["outputs"] in ("not run", "skipped")
    if row.get("ttir_sm90", "identical").startswith(("differ", "error")):
        return False  # (compiled for sm90 and not shown the same: interpreter outputs alone do not show it)
    return row.get("gluon_launch_args", "identical") == "identical" and (
        row["outputs"] in ("identical", "identical but for atomic order")
        or (not_run and (row["device_code"] == "identical" or row.get("ttir_sm90") in ("identical", "identical PTX"))))


def write_replaces(results: list[dict], summary: dict) -> None:
    """Add (or renew) `[[replaces]]` earlier hash -> today's hash for each family all of whose
    variants were shown identical in this run, with the run's evidence."""
    from autoflash import codegen, families

    old = baseline_hashes()
    for family in sorted({r["family"] for r in results}):
        rows = [r for r in results if r["family"] == family]
        if family not in families.HOSTS or not all(_same(r) for r in rows):
            continue
        ran = sum(r["outputs"] == "identical" for r in rows)
        atomic = sum(r["outputs"] == "identical but for atomic order" for r in rows)
        evidence = (f"benchmarks/family_identity.py ({summary['mode']}, {summary['device']}, torch {summary['torch']}, "
                    f"{time.strftime('%Y-%m-%d')}): {len(rows)} variants (shipped winners and defaults), device code "
                    f"identical in {sum(r['device_code'] == 'identical' for r in rows)}, outputs bitwise identical "
                    f"in {ran}" + (f" (and in {atomic} but for the order of atomic adds)" if atomic else "")
                    + ", the rest not run there and identical by device code")
        record = {"hash": old[family], "by": codegen.template_hash(family), "evidence": evidence}
        earlier = [r for r in families.replacements(family) if r["hash"] == old[family]]
        kept = [r for r in families.replacements(family) if r["hash"] != old[family]]
        # The template the earlier record was checked against was itself the baseline's kernels: the
        # records chained to it (older hashes' winners) reach today's family through it.
        bridges = [{"hash": r["by"], "by": record["by"], "evidence": f"through {old[family]}: its kernels were "
                    f"shown identical to {r['by']}'s (the earlier record) and to today's ({record['by']}, this run)"}
                   for r in earlier if r["by"] != record["by"]]
        kept = [r for r in kept if r["hash"] not in {b["hash"] for b in bridges}] + bridges
        path = families.FOLDER / family / "replaces.toml"
        lines = ["# Earlier template hashes whose stored winners this family serves: the kernels they name are",
                 "# today's, unchanged (`by`: the template hash the evidence was taken against; a template edit",
                 "# since carries nothing over until it is checked again, see benchmarks/family_identity.py).", ""]
        for r in [*kept, record]:
            lines += ["[[replaces]]", *(f"{k} = {json.dumps(r[k])}" for k in ("hash", "by", "evidence")), ""]
        path.write_text("\n".join(lines))
        print(f"{path}: {record['hash']} -> {record['by']}")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
