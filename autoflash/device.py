"""The device a result belongs to: the GPU fingerprint (chip and software stack), and whether
kernels run in Triton's CPU interpreter instead."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform


INTERPRETER_NAME = "triton-interpreter"


@dataclasses.dataclass(frozen=True)
class GPUFingerprint:
    """What a tuned result depends on besides the problem: the chip and the software stack."""

    name: str
    cc_major: int
    cc_minor: int
    sm_count: int
    smem_per_block: int  # bytes, opt-in maximum
    torch_version: str
    triton_version: str
    cuda_version: str
    autoflash_version: str

    @property
    def on_gpu(self) -> bool:
        """False for the CPU interpreter's stand-in fingerprint."""
        return not self.name.startswith(INTERPRETER_NAME)

    @property
    def key(self) -> str:
        """The GPU part of a DB key. Versions are part of it: a new Triton may change the winner."""
        return (f"{self.name}|sm{self.cc_major}{self.cc_minor}|{self.sm_count}sm"
                f"|torch{self.torch_version}|triton{self.triton_version}|cuda{self.cuda_version}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


INTERPRETER_SM_COUNT = 8  # a stand-in SM count in the interpreter, so that split heuristics split tiny problems


def compile_processes() -> int:
    """Processes for parallel kernel compiles: the CPUs this process may run on (its affinity, not the
    machine's count) but two, at most 12 (compiles are CPU-bound and single-threaded; each process
    also holds a CUDA context)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity call on this platform)
        usable = os.cpu_count() or 2
    return max(1, min(12, usable - 2))


@functools.lru_cache(maxsize=None)
def launch_sm_count(device) -> int:
    """SMs a launcher sizes its grid for: the GPU's, or the interpreter's stand-in."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SM_COUNT


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")



@functools.lru_cache(maxsize=None)
def gpu_fingerprint(device_index: int | None = None) -> GPUFingerprint:
    """Fingerprint of the current CUDA device, or of the CPU interpreter when there is none."""
    import torch
    import triton

    from autoflash._version import __version__

    versions = dict(torch_version=torch.__version__, triton_version=triton.__version__,
                    cuda_version=str(torch.version.cuda), autoflash_version=__version__)
    if torch.cuda.is_available() and not interpreter_enabled():
        idx = torch.cuda.current_device() if device_index is None else device_index
        props = torch.cuda.get_device_properties(idx)
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 49152
        return GPUFingerprint(name=props.name, cc_major=props.major, cc_minor=props.minor,
                              sm_count=props.multi_processor_count, smem_per_block=int(smem),
                              **versions)
    # The interpreter has no hardware limits or compiler bugs; report a recent compute capability
    # and Hopper's shared memory so every structural variant can be checked on the CPU.
    return GPUFingerprint(name=f"{INTERPRETER_NAME} ({platform.machine()})", cc_major=10, cc_minor=0,
                          sm_count=1, smem_per_block=232448, **versions)


# interpreter_numpy_problem's answer, once computed. A plain memo, not functools.cache: the API
# asks it on every call, torch.compile traces those calls, and Dynamo warns about each
# lru_cache-wrapped function it traces ("Silent incorrectness is only a potential risk").
_NUMPY_PROBLEM: list = []


def interpreter_numpy_problem() -> str | None:
    """Triton 3.6's interpreter fails with numpy >= 2.4 ("only 0-dimensional arrays can be
    converted"); newer Triton releases do not. Checked here, where it matters, not by a pin."""
    if not _NUMPY_PROBLEM:
        _NUMPY_PROBLEM.append(_numpy_problem_now())
    return _NUMPY_PROBLEM[0]


def _numpy_problem_now() -> str | None:
    import numpy
    import triton

    numpy_release = tuple(int(x) for x in numpy.__version__.split(".")[:2] if x.isdigit())
    if triton_release(triton.__version__) <= (3, 6) and numpy_release >= (2, 4):
        return f"Triton {triton.__version__}'s CPU interpreter needs numpy < 2.4 (installed: {numpy.__version__})"
    return None


def triton_release(version: str) -> tuple[int, int]:
    """'3.6.0' -> (3, 6); '3.9.0+git1234' -> (3, 9); unparsable -> (0, 0) (rules then take the
    oldest release's view)."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0
