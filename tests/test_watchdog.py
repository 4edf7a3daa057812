"""The GPU tests' hang watchdog (conftest.hang_watchdog): a block still running after its
seconds ends the process with every thread's stack; one that ends in time disarms it."""

import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    code = f"import sys, time\nsys.path.insert(0, {str(TESTS)!r})\n"
    code += "from conftest import hang_watchdog\n" + body
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


def test_a_hang_ends_the_process_with_its_stack():
    done, took = _run("def stuck():\n    time.sleep(100)\nwith hang_watchdog(1):\n    stuck()\n")
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "Timeout" in done.stderr and "in stuck" in done.stderr, done.stderr[-2000:]
    assert took < 60


def test_a_block_that_ends_in_time_disarms_it():
    done, _ = _run("with hang_watchdog(1):\n    pass\ntime.sleep(3)\nprint('alive')\n")
    assert done.returncode == 0 and "alive" in done.stdout, done.stderr[-2000:]
