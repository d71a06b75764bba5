"""The vLLM plugin's process hygiene: engine processes spawned by an engine host die with their parent."""

import os
import signal
import subprocess
import sys
import time

import psutil

PARENT = r"""
import os, subprocess, sys, time
os.environ["PDSERVE_VLLM_PLUGIN"] = "1"
os.environ["PDSERVE_NIXL_PROG_THREAD"] = "1"  # this test is about processes, not NIXL
os.environ["PDSERVE_ENGINE_HOST_PID"] = str(os.getpid())
CHILD = "from engine.vllm_plugin import register; register(); print('ready', flush=True); time.sleep(120)"
child = subprocess.Popen([sys.executable, "-c", "import time; " + CHILD], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_an_engine_child_process_dies_when_its_host_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    assert child.is_running()
    os.kill(parent.pid, signal.SIGKILL)  # what a hard kill of a Serve replica does
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_the_plugin_does_nothing_outside_pdserve_engines() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    code = (
        "from engine.vllm_plugin import register; register(); "
        "import os; print(os.environ.get('UCX_RCACHE_MAX_UNRELEASED'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
