"""One measuring process per GPU: the GPU lock itself, with real processes contending for one
lock name on the CPU (the lock is keyed by the GPU's UUID on a GPU machine)."""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import uuid

# The module alone, loaded from the installed package's file (it imports nothing of autoflash, so
# torch's import time stays out of these processes).
GPULOCK_PY = pathlib.Path(importlib.util.find_spec("autoflash").origin).parent / "tuning" / "gpulock.py"
LOAD = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("gpulock", {str(GPULOCK_PY)!r})
gpulock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpulock)
GPULock, GPUBusyError = gpulock.GPULock, gpulock.GPUBusyError
"""

HOLD = LOAD + """
import sys, time
GPULock(sys.argv[1], "0 (Test GPU)").acquire()
print("locked", flush=True)
time.sleep(600)
"""

TRY = LOAD + """
import json, sys
try:
    lock = GPULock(sys.argv[1], "0 (Test GPU)").acquire()
    print(json.dumps({"acquired": True, "path": lock.path}))
except GPUBusyError as e:
    print(json.dumps({"acquired": False, "message": str(e)}))
"""


def _try(key: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", TRY, key], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_on_the_same_gpu_is_refused_until_the_first_one_dies(tmp_path):
    env = {**os.environ, "AUTOFLASH_GPU_LOCK_DIR": str(tmp_path / "locks")}
    key, other = f"GPU-{uuid.uuid4()}", f"GPU-{uuid.uuid4()}"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, key], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = _try(key, env)
        assert not refused["acquired"]
        message = refused["message"]
        assert f"GPU 0 (Test GPU) is already being used for timing by pid {holder.pid}" in message, message
        assert "disturb each other's measurements" in message and "CUDA_VISIBLE_DEVICES" in message
        assert _try(other, env)["acquired"]  # another GPU is free
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no chance to clean up
        holder.wait()
    again = _try(key, env)  # the kernel dropped the dead holder's lock: no stale lock to clear
    assert again["acquired"] and again["path"].startswith(str(tmp_path / "locks"))
    assert oct(os.stat(tmp_path / "locks").st_mode & 0o7777) == "0o1777"  # every user's tuner shares it


def test_the_lock_is_released_with_its_holder_in_one_process(tmp_path, monkeypatch):
    from autoflash.tuning.gpulock import GPUBusyError, GPULock

    monkeypatch.setenv("AUTOFLASH_GPU_LOCK_DIR", str(tmp_path))
    with GPULock("GPU-x") as lock:
        try:  # flock is per open file: a second open in this process is refused as well
            GPULock("GPU-x").acquire()
            raise AssertionError("a second lock of one GPU was granted")
        except GPUBusyError as e:
            assert f"pid {os.getpid()}" in str(e)
        assert lock.path.endswith("GPU-x.lock")
    GPULock("GPU-x").acquire().release()
