"""One measuring process per GPU.

Two tuners timing kernels on one GPU disturb each other's numbers (shared SMs, clocks, memory
bandwidth) without any error. So a tuning process holds, for its whole life, an exclusive
`fcntl.flock` on a file named after the GPU's UUID (or PCI bus id) in a temp directory
($AUTOFLASH_GPU_LOCK_DIR, default `<tmp>/autoflash-gpu-locks`, shared by every user). A second
process on the same GPU is refused with a message naming the holder. The kernel drops the lock
when its holder exits, however it dies (kill -9 included): no stale lock to clear. In Triton's
interpreter (no GPU) no lock is taken.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import sys
import tempfile


class GPUBusyError(RuntimeError):
    """Another process is tuning (timing kernels) on this GPU."""


def lock_dir() -> str:
    path = os.environ.get("AUTOFLASH_GPU_LOCK_DIR") or os.path.join(tempfile.gettempdir(), "autoflash-gpu-locks")
    os.makedirs(path, exist_ok=True)
    try:
        os.chmod(path, 0o1777)  # one directory for every user of the machine (sticky, like /tmp)
    except PermissionError:
        pass  # someone else's: it already has its mode
    return path


class GPULock:
    """An exclusive lock on one GPU, by key (UUID or PCI bus id); `label` names it in messages."""

    def __init__(self, key: str, label: str = ""):
        self.key = key
        self.label = label or key
        self.path = os.path.join(lock_dir(), re.sub(r"[^A-Za-z0-9._-]", "_", key) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> "GPULock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                os.fchmod(fd, 0o666)  # (the umask's cut) other users lock the same file
            except PermissionError:
                pass
        except PermissionError:  # another user's file: a read-only descriptor locks it as well
            fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise GPUBusyError(
                f"GPU {self.label} is already being used for timing by {holder}. Two tuning processes "
                f"on one GPU would disturb each other's measurements: wait for that one to finish, or "
                f"run this one on another GPU (CUDA_VISIBLE_DEVICES). Lock: {self.path}") from None
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]
        try:  # who holds it, for the message of the next one
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} ({command})\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "GPULock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def current_gpu_lock() -> GPULock:
    """The lock of this process's current CUDA device (after CUDA_VISIBLE_DEVICES), by UUID."""
    import torch

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    pci = "{:04x}:{:02x}:{:02x}".format(getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", 0),
                                        getattr(props, "pci_device_id", 0))
    uuid = str(getattr(props, "uuid", "") or "")
    key = f"GPU-{uuid}" if uuid and not uuid.startswith("GPU-") else uuid or f"pci-{pci}"
    return GPULock(key, f"{index} ({props.name}, {key}, PCI {pci})")
