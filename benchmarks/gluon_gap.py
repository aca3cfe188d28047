"""Where the Gluon Hopper forward (family gluon_sm90_fwd) loses time to cuDNN: the served variant
timed whole and with parts of its work left out, next to torch SDPA (cuDNN, flash), in one process.

For each shape the Gluon family's stored winner (cache/*.db; the space's default where the shipped
DB has no Gluon row for the problem) is rendered, and ablated copies of the rendered source are made
by text edits (the template is never touched):

  full          the kernel as served (checked against fp32 SDPA before timing)
  no_softmax    P = S cast to the input dtype: no mask, row max, exp2, row sum, no O rescale
  no_pv         no O += P V GEMM (nor its P operand): S GEMM, softmax, O rescale, all loads stay
  no_store      the epilogue's O (TMA) and LSE stores skipped at run time (branch on sm_scale < 0,
                never true), so everything feeding them still runs
  loads_only    the TMA producer and the consumers' ring hand-shakes, Q load and O store; no GEMM,
                no softmax (the memory pipeline alone)
  no_load_wait  the producer fills the K/V ring once (the first NUM_STAGES blocks of a program) and
                consumers stop waiting for loads after that: the math on stale ring slots, no K/V
                traffic (the compute side alone)
  gemms_only    no_softmax and no_load_wait together: the two GEMMs, the hand-shakes, the epilogue

Ablated kernels compute wrong numbers by design; only full kernels (the served one and the
alternative tilings timed next to it) are checked. Also printed: the tile count and wave
quantization of each variant on 132 SMs (equal tiles, and a work-weighted schedule for causal).

Usage (repo root on the package path):
  python benchmarks/gluon_gap.py --compile-only            # CPU: render, ablate, compile for sm90a
  python benchmarks/gluon_gap.py --out gap.json            # GPU: check, time, print the tables
  python benchmarks/gluon_gap.py --precompile-bench        # GPU: compile `autoflash bench`'s kernels in parallel
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

FAMILY = "gluon_sm90_fwd"
NUM_SMS = 132  # H200

# label, batch, heads, seqlen (q = k), head_dim, causal (bf16, causal aligned top-left)
SHAPES = [
    ("d128 full N16k", 1, 16, 16384, 128, False),
    ("d128 causal N512", 32, 16, 512, 128, True),
    ("d128 causal N1k", 16, 16, 1024, 128, True),
    ("d64 causal N1k", 16, 32, 1024, 64, True),
    ("d64 full N512", 32, 32, 512, 64, False),
]

ABLATIONS = ("full", "no_softmax", "no_pv", "no_store", "loads_only", "no_load_wait", "gemms_only")
# Ablations that change which barriers are waited on (a mistake there can hang the GPU): run last,
# or in a separate process (--ablations).
RISKY = ("no_load_wait", "gemms_only")

# Other full-kernel tilings timed next to the served one (knob overrides of the served variant);
# each must pass the space's constraints and the correctness check.
PERSISTENT_ONLY = {"PERSISTENT": True}
TWO_64 = dict(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, CONSUMER_REGS=240)
ONE_128 = dict(NUM_CONSUMERS=1, CONSUMER_WARPGROUPS=2, BLOCK_M=128, INTRA_OVERLAP=True, CONSUMER_REGS=240)
THREE_64 = dict(NUM_CONSUMERS=3, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, CONSUMER_REGS=160)
# Causal, persistent, heavy-first runs the heaviest query tile of every head first (M-major): the
# programs running at one time work on different heads. Head-major orders (not persistent, or
# HEAVY_FIRST off) run a head's query tiles together, so they share its K/V in L2. "_ablation" times
# that ablation of the override instead of the full kernel.
ORDER_CHECKS = {"not persistent, loads_only": {"PERSISTENT": False, "_ablation": "loads_only"},
                "head-major persistent (HEAVY_FIRST off)": {"HEAVY_FIRST": False},
                "head-major persistent, loads_only": {"HEAVY_FIRST": False, "_ablation": "loads_only"}}
ALTERNATES = {
    "d128 full N16k": {"not persistent": {"PERSISTENT": False},
                       "not persistent, 3-stage ring": {"NUM_STAGES": 3, "PERSISTENT": False},
                       "ping-pong": {"PINGPONG": True}},
    "d128 causal N512": {"not persistent": {"PERSISTENT": False},
                         "2x64 rows": dict(TWO_64, PERSISTENT=False),
                         "2x64 rows persistent": dict(TWO_64, PERSISTENT=True), **ORDER_CHECKS},
    "d128 causal N1k": {"not persistent": {"PERSISTENT": False},
                        "2x64 rows": dict(TWO_64, PERSISTENT=False),
                        "2x64 rows persistent": dict(TWO_64, PERSISTENT=True), **ORDER_CHECKS},
    "d64 causal N1k": {"not persistent": {"PERSISTENT": False},
                       "2x64 rows": dict(TWO_64, PERSISTENT=False),
                       "3x64 rows persistent": dict(THREE_64, PERSISTENT=True), **ORDER_CHECKS},
    "d64 full N512": {"not persistent": {"PERSISTENT": False},
                      "2x64 rows persistent": dict(TWO_64, PERSISTENT=True),
                      "1x128 rows persistent": dict(ONE_128, PERSISTENT=True)},
}


class AblationError(ValueError):
    """The rendered source does not have the lines an ablation edits (the template changed)."""


# ------------------------------------------------------------------------------------------ winners
def h200_fingerprint():
    """This GPU's fingerprint; on a machine without a Hopper GPU, the H200 one the shipped DB was
    tuned on (its gpus table), so that the same rows and rules apply for a CPU check."""
    from autoflash import resources
    from autoflash.device import GPUFingerprint, gpu_fingerprint
    from autoflash.store import Store

    fp = gpu_fingerprint()
    if fp.cc_major == 9:
        return fp
    fields = {f.name for f in dataclasses.fields(GPUFingerprint)}
    for path in resources.shipped_databases():
        store = Store(path, readonly=True)
        try:
            for row in store.db["gpus"].rows:
                if row["name"] == "NVIDIA H200":
                    return GPUFingerprint(**{k: v for k, v in row.items() if k in fields})
        finally:
            store.close()
    raise RuntimeError("no H200 row in the shipped DBs")


def problem_for(B, H, N, D, causal):
    from autoflash.problem import Shape

    return Shape(batch=B, heads_q=H, heads_kv=H, seqlen_q=N, seqlen_k=N, head_dim=D, causal=causal,
                 dtype="bfloat16").problem_on(NUM_SMS)


def gluon_winner(problem, device):
    """(variant, where from): the Gluon family's stored winner for this problem in the shipped DBs
    (this GPU's key first, else any H200 row), else the space's default for the problem."""
    from autoflash import codegen, resources
    from autoflash.space import load_space
    from autoflash.store import Store

    space = load_space(FAMILY)
    thash = codegen.template_hash(FAMILY)
    # this problem, or the same problem stored without an occupancy bucket (rows tuned before the key had one)
    keys = {problem.key, dataclasses.replace(problem, work=None).key}
    rows = []
    for path in resources.shipped_databases():
        store = Store(path, readonly=True)
        try:
            rows += [(r, path.name) for r in store.winners(op="fwd", template_hash=thash) if r["problem"] in keys]
        finally:
            store.close()
    for want in (device.key, "NVIDIA H200|"):
        mine = [(r, p) for r, p in rows if r["gpu_key"].startswith(want)]
        if mine:
            row, path = min(mine, key=lambda rp: rp[0].get("median_ms") or math.inf)
            return space.validate(json.loads(row["variant"]), problem, device), f"winner in {path}"
    return space.nearest_valid(space.default_for(problem, device), problem, device), "space default (no Gluon winner stored)"


def served_variant(problem, device):
    """What `autoflash.attention` serves for this problem from the shipped DBs (any family)."""
    from autoflash import resources
    from autoflash.dispatch import WinnerTable
    from autoflash.space import default_variant

    variant, how = WinnerTable(device, resources.shipped_databases()).lookup(problem)
    return (variant, how) if variant is not None else (default_variant("fwd", problem, device), "default")


# ----------------------------------------------------------------------------------------- ablation
def _replace(src: str, old: str, new: str, count: int | None = None, what: str = "") -> str:
    """Replace whole lines whose stripped text is `old` by `new` at the same indentation ('' drops them)."""
    pat = re.compile(r"^([ ]*)" + re.escape(old.strip()) + r"[ ]*\n", flags=re.M)
    n = len(pat.findall(src))
    if n == 0 or (count is not None and n != count):
        raise AblationError(f"{what}: expected {count if count is not None else '>= 1'} line(s) {old.strip()!r}, found {n}")
    return pat.sub(lambda m: "".join(m.group(1) + ln + "\n" for ln in new.splitlines()) if new else "", src)


def _function_span(src: str, name: str) -> tuple[int, int]:
    """[start of the body, start of the next top-level statement) of top-level function `name`."""
    m = re.search(rf"^def {name}\(.*?\):\n", src, flags=re.M | re.S)
    if m is None:
        raise AblationError(f"no function {name}")
    nxt = re.search(r"^\S", src[m.end():], flags=re.M)
    return m.end(), m.end() + (nxt.start() if nxt else len(src) - m.end())


def _no_softmax(src: str) -> str:
    a, b = _function_span(src, "_softmax")
    body = "    # ablation no_softmax: P = S (no mask, max, exp2, sum); alpha unused\n    return s, m_i, l_i, m_i\n\n\n"
    src = src[:a] + body + src[b:].lstrip("\n")
    return _replace(src, "acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)", "",
                    3, "no_softmax")


def _no_pv(src: str) -> str:
    # Every rendering holds both loops (INTRA_OVERLAP is a constexpr): edit both.
    w = "no_pv"
    # the plain step
    src = _replace(src, "o_tok = warpgroup_mma(p, v, acc, is_async=True)", "", 1, w)
    src = _replace(src, "acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))", "", 1, w)
    # the overlapped step (its opening wait), the wait after the loop, and the drain
    src = _replace(src, "acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))", "", 2, w)
    src = _replace(src, "acc = warpgroup_mma_init(acc)", "", 1, w)  # acc stays a plain register tensor
    src = _replace(src, "acc = warpgroup_mma(p, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)",
                   "", 1, w)
    src = _replace(src, "s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))",
                   "s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))", 1, w)
    src = _replace(src, "o_tok = warpgroup_mma(p, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)",
                   "", 1, w)
    src = _replace(src, "acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))", "", 1, w)
    if "warpgroup_mma(p," in src:
        raise AblationError("no_pv: a P V GEMM is left")
    return src


def _no_store(src: str) -> str:
    w = "no_store"
    store = ("            o_buf.reshape([BLOCK_M, HEAD_DIM]).store(out.to(dtype))\n"
             "            fence_async_shared()\n"
             "            tma.async_copy_shared_to_global(o_desc, [off_b, off_h, row0, 0], o_buf)\n")
    if src.count(store) != 1:
        raise AblationError(f"{w}: O store block found {src.count(store)} times")
    guarded = ("            if sm_scale < 0.0:  # ablation no_store: never true (launch refuses sm_scale <= 0)\n"
               + "".join("    " + ln + "\n" for ln in store.splitlines()))
    src = src.replace(store, guarded)
    lse = "gl.store(LSE + bh.to(gl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)"
    return _replace(src, lse, lse.replace("mask=offs_m < N_Q", "mask=(offs_m < N_Q) & (sm_scale < 0.0)"), 1, w)


def _loads_only(src: str) -> str:
    # The plain (not overlapped) loop with a step that only waits for and releases its ring slot.
    src = src.replace("INTRA_OVERLAP = True\n", "INTRA_OVERLAP = False\n")
    a, b = _function_span(src, "_plain_step")
    body = ("    # ablation loads_only: the ring hand-shakes of one step, no GEMM, no softmax\n"
            "    s_idx = it % NUM_STAGES\n"
            "    mbarrier.wait(k_ready.index(s_idx), (it // NUM_STAGES) & 1)\n"
            "    mbarrier.arrive(k_empty.index(s_idx), count=1)\n"
            "    mbarrier.wait(v_ready.index(s_idx), (it // NUM_STAGES) & 1)\n"
            "    mbarrier.arrive(v_empty.index(s_idx), count=1)\n"
            "    return acc, m_i, l_i, it + 1, ks\n\n\n")
    return src[:a] + body + src[b:].lstrip("\n")


def _no_load_wait(src: str) -> str:
    w = "no_load_wait"
    start = "                mbarrier.wait(k_empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)\n"
    end = "                                                v_smem.index(s))\n"
    i = src.find(start)
    j = src.find(end, i)
    if i < 0 or j < 0:
        raise AblationError(f"{w}: producer K/V block not found")
    j += len(end)
    block = src[i:j]
    if block.count("async_copy_global_to_shared") != 2:
        raise AblationError(f"{w}: unexpected producer block")
    guarded = ("                if it < NUM_STAGES:  # ablation no_load_wait: fill the ring once\n"
               + "".join("    " + ln + "\n" for ln in block.splitlines()))
    src = src[:i] + guarded + src[j:]
    pat = re.compile(r"mbarrier\.wait\(([kv])_ready\.index\((\w+)\), \(\((it - 1)\) // NUM_STAGES\) & 1\)"
                     r"|mbarrier\.wait\(([kv])_ready\.index\((\w+)\), \((it) // NUM_STAGES\) & 1\)")

    def sub(m):
        pos = m.group(3) or m.group(6)
        return m.group(0)[:-1] + f", pred=({pos}) < NUM_STAGES)"

    src, n = pat.subn(sub, src)
    if n < 2 or re.search(r"mbarrier\.wait\([kv]_ready\.index\([^\n]*& 1\)\n", src):
        raise AblationError(f"{w}: consumer K/V waits not all guarded ({n} edited)")
    return src


def ablate(src: str, kind: str) -> str:
    if kind == "full":
        return src
    if kind == "no_softmax":
        return _no_softmax(src)
    if kind == "no_pv":
        return _no_pv(src)
    if kind == "no_store":
        return _no_store(src)
    if kind == "loads_only":
        return _loads_only(src)
    if kind == "no_load_wait":
        return _no_load_wait(src)
    if kind == "gemms_only":
        return _no_load_wait(_no_softmax(src))
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------ modules
def work_dir() -> Path:
    d = Path(os.environ.get("GLUON_GAP_DIR") or Path(tempfile.gettempdir()) / "autoflash-gluon-gap")
    d.mkdir(parents=True, exist_ok=True)
    return d


_MODULES: dict = {}


def load_source(src: str, knobs_json: str):
    """The family's host over a rendered (possibly ablated) source, imported from a real file (@jit
    reads it with inspect); knobs_json: the variant's knobs (the host's launch reads them)."""
    from autoflash.families.gluon_sm90_fwd.host import GluonSm90Forward

    return GluonSm90Forward(json.loads(knobs_json), _import_source(src))


def _import_source(src: str):
    name = "gluon_gap_" + hashlib.sha256(src.encode()).hexdigest()[:16]
    if name in _MODULES:
        return _MODULES[name]
    path = work_dir() / f"{name}.py"
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    from autoflash import codegen

    with codegen.interpreter_off():
        spec.loader.exec_module(module)
    _MODULES[name] = module
    return module


def rendered(variant, kind: str) -> str:
    from autoflash import codegen

    return ablate(codegen.render(variant), kind)


def jobs(ablations=ABLATIONS, alternates=True, shapes=None):
    """Every (label, shape, name, variant, ablation) to measure; name 'full' is the served kernel."""
    from autoflash.space import load_space

    device = h200_fingerprint()
    space = load_space(FAMILY)
    out = []
    for label, B, H, N, D, causal in SHAPES:
        if shapes and label not in shapes:
            continue
        problem = problem_for(B, H, N, D, causal)
        variant, origin = gluon_winner(problem, device)
        for kind in ablations:
            out.append(dict(label=label, shape=(B, H, N, D, causal), name=kind, ablation=kind,
                            variant=variant, origin=origin))
        if "full" in ablations and alternates:
            for alt, over in ALTERNATES.get(label, {}).items():
                over = dict(over)
                kind = over.pop("_ablation", "full")
                v = space.validate(variant.replace(**over).as_dict(), problem, device)
                out.append(dict(label=label, shape=(B, H, N, D, causal), name=f"alt: {alt}", ablation=kind,
                                variant=v, origin="knob override"))
    return out


# ------------------------------------------------------------------------------------------ waves
def wave_report(B, H, N, D, causal, variant, sms=NUM_SMS) -> dict:
    """Tiles of the variant and how evenly they fill `sms` SMs (one program per SM at a time).
    Work of a tile: the KV blocks it visits. Persistent: the kernel's static order (causal with
    heavy-first: heaviest first, snake); not persistent: the hardware hands the next tile to the
    first free SM (greedy, heavy-first order)."""
    import heapq

    rows = variant["NUM_CONSUMERS"] * variant["BLOCK_M"]
    bn = variant["BLOCK_N"]
    n_m = -(-N // rows)
    tiles = B * H * n_m
    per_m = [(-(-min(N, (m + 1) * rows) // bn) if causal else -(-N // bn)) for m in range(n_m)]
    total = B * H * sum(per_m)
    equal_eff = tiles / (math.ceil(tiles / sms) * sms)
    if variant["PERSISTENT"]:
        grid = min(tiles, sms)
        load = [0] * grid
        m_major = causal and variant["HEAVY_FIRST"]
        for r in range(-(-tiles // grid)):
            for pid in range(grid):
                t = r * grid + pid + ((r & 1) * (grid - 1 - 2 * pid) if m_major else 0)
                if t < tiles:
                    m = n_m - 1 - t // (B * H) if m_major else t % n_m
                    if causal and variant["HEAVY_FIRST"] and not m_major:
                        m = n_m - 1 - m
                    load[pid] += per_m[m]
        makespan = max(load)
    else:
        order = sorted((per_m[m] for _ in range(B * H) for m in range(n_m)), reverse=bool(causal and variant["HEAVY_FIRST"]))
        heap = [0] * min(sms, tiles)
        for w in order:
            heapq.heapreplace(heap, heap[0] + w)
        makespan = max(heap)
    # the flops counted (4 B H N^2 D, halved causal) over the flops the tiles compute (padded rows,
    # whole KV blocks across the causal diagonal)
    counted = N * N * (0.5 if causal else 1.0)
    computed = sum(per_m) * rows * bn
    return dict(rows_per_tile=rows, tiles=tiles, waves=tiles / sms, equal_tile_eff=equal_eff,
                kv_blocks_total=total, kv_blocks_per_sm_ideal=total / sms, kv_blocks_busiest_sm=makespan,
                work_eff=total / (sms * makespan), counted_over_computed=counted / computed)


# ------------------------------------------------------------------------------------------ CPU check
def compile_sm90(module, D, causal):
    """Compile for sm90a on any machine (the signature launch() passes), as tests/test_gluon_sm90.py."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty(2, 4, 333, D, dtype=torch.bfloat16)
    k = torch.empty(2, 4, 333, D, dtype=torch.bfloat16)
    v, o = torch.empty_like(k), torch.empty_like(q)
    lse = torch.empty(2, 4, 333, dtype=torch.float32)
    args, constexprs, grid, options = module.kernel_args(q, k, v, o, lse, 0.125, causal, 0)
    fn = module.kernels._attn_fwd_sm90
    values = iter(args)
    signature = {n: "constexpr" if n in constexprs else mangle_type(next(values)) for n in fn.arg_names}
    from autoflash import codegen

    with codegen.interpreter_off():
        return triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)


def _compile_job(job):
    src, knobs_json, D, causal = job
    t0 = time.time()
    try:
        kernel = compile_sm90(load_source(src, knobs_json), D, causal)
        ptx = kernel.asm["ptx"]
        n_wgmma = ptx.count("wgmma.mma_async")
        return (f"ok {time.time() - t0:.0f}s ptx: wgmma {n_wgmma} ex2 {ptx.count('ex2.approx')} "
                f"bulk.tensor {ptx.count('cp.async.bulk.tensor')}")
    except Exception as e:  # noqa: BLE001 - report every failure
        return "FAIL " + repr(e)[-400:]


def compile_only(parallel: int) -> int:
    import multiprocessing as mp

    todo, names = {}, {}
    for j in jobs():
        B, H, N, D, causal = j["shape"]
        try:
            src = rendered(j["variant"], j["ablation"])
        except AblationError as e:
            print(f"{j['label']:<18} {j['name']:<24} ABLATION FAILED: {e}")
            continue
        key = (src, j["variant"].json(), D, causal)
        todo.setdefault(key, key)
        names.setdefault(key, []).append(f"{j['label']} / {j['name']}")
    bad = 0
    with mp.get_context("spawn").Pool(parallel) as pool:
        for key, res in zip(todo, pool.imap(_compile_job, list(todo))):
            bad += res.startswith("FAIL")
            print(f"{res:<70} {'; '.join(names[key])}", flush=True)
    print(f"{len(todo)} distinct kernels, {bad} failed")
    return bad


# ------------------------------------------------------------------------------------------ GPU
def _gpu_compile_job(job):
    src, knobs_json, D, causal = job
    import torch

    from autoflash import codegen
    t0 = time.time()
    try:
        codegen.ensure_allocator()
        m = load_source(src, knobs_json)
        q = torch.randn(1, 2, 300, D, device="cuda", dtype=torch.bfloat16)
        k, v, o = torch.randn_like(q), torch.randn_like(q), torch.empty_like(q)
        lse = torch.empty(1, 2, 300, device="cuda")
        m.launch(q=q, k=k, v=v, o=o, lse=lse, sm_scale=0.1, causal=causal, causal_offset=0, compile_only=True)
        return f"ok {time.time() - t0:.0f}s"
    except Exception as e:  # noqa: BLE001
        return "FAIL " + repr(e)[-300:]


def _bench_compile_job(job):
    """Compile one kernel `autoflash bench` will launch (same rendered file, same argument types)."""
    variant_json, family, shape_fields = job
    import torch

    from autoflash import codegen
    from autoflash.problem import Shape
    from autoflash.reference import causal_offset_for, make_inputs
    from autoflash.space import Variant
    t0 = time.time()
    try:
        shape = Shape(**shape_fields)
        q, k, v = make_inputs(shape, "cuda", seed=7)
        kernel = codegen.load(Variant.of(family, json.loads(variant_json)))
        kernel.compile_for(q, k, v, shape.causal, causal_offset_for(shape, "top_left"))
        return f"ok {time.time() - t0:.0f}s {family} {shape.label()}"
    except Exception as e:  # noqa: BLE001
        return "FAIL " + repr(e)[-300:]


def bench_kernels(device) -> list:
    """(variant json, family, shape fields) of every kernel `autoflash bench --shapes standard` launches."""
    from autoflash.cli.common import load_shapes
    from autoflash.dispatch import get_dispatcher
    from autoflash.space import default_variant

    disp = get_dispatcher()
    todo = {}
    # One job per binary: lengths are run-time arguments (the Gluon family does not specialize
    # them; all grid lengths are multiples of 16), but Triton specializes an integer equal to 1.
    for shape in sorted(load_shapes("standard"), key=lambda s: s.seqlen_q):
        problem = shape.problem_on(device.sm_count)
        for v in (disp.variant_for(problem, device), default_variant("fwd", problem, device)):
            key = (v.json(), v.family, shape.head_dim, shape.causal, shape.batch == 1)
            todo.setdefault(key, (v.json(), v.family, dataclasses.asdict(shape)))
    return list(todo.values())


def precompile_bench(parallel: int) -> None:
    """Compile every kernel `autoflash bench --shapes standard` launches, in parallel processes,
    so that its serial first calls find them in Triton's cache."""
    import multiprocessing as mp

    from autoflash.device import gpu_fingerprint

    work = bench_kernels(gpu_fingerprint())
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(parallel, len(work))) as pool:
        for res in pool.imap_unordered(_bench_compile_job, work):
            print("precompile bench:", res, flush=True)
    print(f"precompiled {len(work)} bench kernels in {time.time() - t0:.0f}s", flush=True)


def _flops(B, H, N, D, causal):
    return 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)


def run_gpu(out_path: str, ablations, rounds: int, parallel: int, alternates: bool = True, shapes=None) -> None:
    import multiprocessing as mp

    import torch
    import triton
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autoflash import codegen
    from autoflash.device import gpu_fingerprint

    device = gpu_fingerprint()
    todo = jobs(ablations, alternates, shapes)
    srcs = {}
    for j in todo:
        try:
            j["src"] = rendered(j["variant"], j["ablation"])
            srcs[(j["src"], j["variant"].json(), j["shape"][3], j["shape"][4])] = None
        except AblationError as e:
            j["error"] = f"ablation: {e}"
            print("ABLATION FAILED", j["label"], j["name"], e, flush=True)
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(parallel, len(srcs))) as pool:
        for key, res in zip(srcs, pool.imap(_gpu_compile_job, list(srcs))):
            if not res.startswith("ok"):
                print("compile", res, flush=True)
    print(f"compiled {len(srcs)} kernels in {time.time() - t0:.0f}s", flush=True)

    codegen.ensure_allocator()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cudnn=torch.backends.cudnn.version(), cuda=torch.version.cuda, sms=device.sm_count,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), rounds=rounds,
               do_bench="warmup=25, rep=100, return_mode=median")
    # the matrix-unit ceiling on this card: a large bf16 GEMM through torch (cuBLAS), random data
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    gemm_ms = float(triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median"))
    env["cublas_bf16_8192_tflops"] = 2 * 8192**3 / gemm_ms / 1e9
    del a, b
    results = dict(env=env, shapes=[])

    def dump():
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)

    for label, B, H, N, D, causal in SHAPES:
        mine = [j for j in todo if j["label"] == label]
        if not mine:
            continue
        torch.manual_seed(0)
        q = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        o, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        scale = 1.0 / math.sqrt(D)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                                               scale=scale)
        fns, info = {}, {}

        def sdpa(backend):
            def f():
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            return f

        fns["sdpa_cudnn"], fns["sdpa_flash"] = sdpa(SDPBackend.CUDNN_ATTENTION), sdpa(SDPBackend.FLASH_ATTENTION)
        for name in ("sdpa_cudnn", "sdpa_flash"):
            err = ((fns[name]().float() - ref).norm() / ref.norm()).item()
            info[name] = dict(err=err)
        problem = problem_for(B, H, N, D, causal)
        if "full" in ablations:
            sv, how = served_variant(problem, device)
            if sv.family != FAMILY:  # the dispatcher serves another family here: time it too
                kern = codegen.load(sv)
                fns["served"] = lambda kern=kern: kern.forward(q, k, v, o, lse, scale, causal, 0)
                info["served"] = dict(variant=f"{sv.family}: {sv.short()}", origin=how)
        for j in mine:
            name = j["name"]
            info[name] = dict(variant=j["variant"].as_dict(), origin=j["origin"], ablation=j["ablation"],
                              waves=wave_report(B, H, N, D, causal, j["variant"]))
            if "error" in j:
                info[name]["error"] = j["error"]
                continue
            m = load_source(j["src"], j["variant"].json())
            fns[name] = lambda m=m: m.launch(q=q, k=k, v=v, o=o, lse=lse, sm_scale=scale, causal=causal,
                                             causal_offset=0)
        for name in [n for n in fns if n == "served" or info.get(n, {}).get("ablation") == "full"]:
            o.fill_(float("nan"))
            try:
                fns[name]()
                torch.cuda.synchronize()
                err = ((o.float() - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001
                err = float("nan")
                info[name]["error"] = repr(e)[-300:]
            info[name]["err"] = err
            if not err < 2e-2:
                print(f"WRONG {label} {name}: rel err {err}", flush=True)
                fns.pop(name)
        for name in list(fns):  # ablated kernels: must launch without error (numbers are wrong by design)
            if name not in info or "err" in info[name] or name.startswith("sdpa"):
                continue
            try:
                fns[name]()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                info[name]["error"] = repr(e)[-300:]
                fns.pop(name)
        samples = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                samples[n].append(float(triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")))
        flops = _flops(B, H, N, D, causal)
        row = dict(label=label, B=B, H=H, N=N, D=D, causal=causal, flops=flops, ms={}, tflops={}, samples=samples,
                   info=info)
        for n, s in samples.items():
            row["ms"][n] = statistics.median(s)
            row["tflops"][n] = flops / row["ms"][n] / 1e9
        results["shapes"].append(row)
        dump()
        print(f"{label}: " + ", ".join(f"{n} {row['ms'][n]:.4f} ms ({row['tflops'][n]:.0f})" for n in row["ms"]),
              flush=True)
        del q, k, v, o, lse, ref
        torch.cuda.empty_cache()
    print_tables(results)


def print_tables(results: dict) -> None:
    print(f"\n{results['env']}")
    for row in results["shapes"]:
        ms = row["ms"]
        print(f"\n{row['label']} (B{row['B']} H{row['H']} N{row['N']} d{row['D']}"
              f"{' causal' if row['causal'] else ''})")
        for n in ms:
            r = ms.get("sdpa_cudnn")
            extra = ""
            if n in row["info"] and "waves" in row["info"][n]:
                w = row["info"][n]["waves"]
                extra = (f"  tiles {w['tiles']} ({w['waves']:.2f} waves, work eff {w['work_eff']:.3f}, "
                         f"counted/computed {w['counted_over_computed']:.3f})")
            err = row["info"].get(n, {}).get("err")
            print(f"  {n:<26} {ms[n]:8.4f} ms {row['tflops'][n]:6.0f} TFLOP/s"
                  f"{'' if r is None else f'  cuDNN/this {r / ms[n]:.3f}'}"
                  f"{'' if err is None else f'  err {err:.1e}'}{extra}")
        if "full" in ms:
            a = ms["full"]
            parts = {"softmax": "no_softmax", "P@V GEMM": "no_pv", "O/LSE store": "no_store",
                     "load waits": "no_load_wait"}
            print("  shares of t(full) = " + ", ".join(
                f"{k} {a - ms[v]:+.4f} ms ({(a - ms[v]) / a:+.0%})" for k, v in parts.items() if v in ms)
                + (f"; gap to cuDNN {a - ms['sdpa_cudnn']:+.4f} ms ({(a - ms['sdpa_cudnn']) / a:+.0%})"
                   if "sdpa_cudnn" in ms else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="render, ablate and compile for sm90a (no GPU)")
    ap.add_argument("--precompile-bench", action="store_true",
                    help="compile the kernels of `autoflash bench --shapes standard` in parallel (GPU)")
    ap.add_argument("--ablations", default=",".join(ABLATIONS), help="comma-separated subset of " + ",".join(ABLATIONS))
    ap.add_argument("--out", default="gluon_gap.json")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved do_bench rounds (median)")
    ap.add_argument("--parallel", type=int, default=max(1, min(16, (os.cpu_count() or 2))))
    ap.add_argument("--shapes", default="", help="';'-separated subset of the shape labels " +
                    "; ".join(label for label, *_ in SHAPES))
    ap.add_argument("--no-alternates", action="store_true", help="time only the served variant's ablations")
    ap.add_argument("--waves", action="store_true", help="print the tile / wave table only (no GPU)")
    args = ap.parse_args(argv)
    ablations = tuple(a for a in args.ablations.split(",") if a)
    unknown = set(ablations) - set(ABLATIONS)
    if unknown:
        ap.error(f"unknown ablations {sorted(unknown)}")
    if args.waves:
        for j in jobs(("full",)):
            if j["ablation"] != "full":
                continue
            B, H, N, D, causal = j["shape"]
            w = wave_report(B, H, N, D, causal, j["variant"])
            print(f"{j['label']:<18} {j['name']:<24} rows/tile {w['rows_per_tile']:>3} tiles {w['tiles']:>5} "
                  f"waves {w['waves']:6.2f} equal-tile eff {w['equal_tile_eff']:.3f} work eff {w['work_eff']:.3f} "
                  f"counted/computed flops {w['counted_over_computed']:.3f}")
        return 0
    if args.compile_only:
        return 1 if compile_only(args.parallel) else 0
    if args.precompile_bench:
        precompile_bench(args.parallel)
        return 0
    shapes = [x.strip() for x in args.shapes.split(";") if x.strip()]
    if set(shapes) - {label for label, *_ in SHAPES}:
        ap.error(f"unknown shapes {sorted(set(shapes) - {label for label, *_ in SHAPES})}")
    run_gpu(args.out, ablations, args.rounds, args.parallel, not args.no_alternates, shapes)
    return 0


if __name__ == "__main__":
    if importlib.util.find_spec("autoflash") is None:  # not installed, not on PYTHONPATH: this checkout's
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
