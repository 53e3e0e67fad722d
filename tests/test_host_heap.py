"""``host_heap.retain_freed_memory``: memory a step frees is reused without page faults.

Each case runs in a fresh interpreter (glibc's thresholds are per process and cannot be
unset): many mid-sized tensors are allocated, written and freed together (a zero-bubble
stage's ``W`` freeing what its microbatches held), then allocated and written again; the
second round's minor page faults are counted. 96 MiB of 1 MiB blocks: by default glibc either maps
each block (its mmap threshold below 1 MiB) or trims the heap top (its trim threshold, twice that one,
at most 64 MiB), whatever it adjusted them to while the interpreter started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_CYCLE = """
import resource, sys, torch
from parallel3d.host_heap import retain_freed_memory
retained = retain_freed_memory() if sys.argv[1] == "retain" else None
blocks, numel = 96, 256 * 1024  # 1 MiB each, 96 MiB together: above any trim threshold glibc picks itself (<= 64 MiB)
def cycle():
    held = [torch.empty(numel).fill_(1.0) for _ in range(blocks)]
    del held
cycle()  # the first touch faults either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(retained, faults, blocks * numel * 4 // 4096)
"""


def _faults(mode: str, leave: bool = False) -> tuple[str, int, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD", "P3D_HOST_HEAP"):
        env.pop(var, None)
    if leave:
        env["P3D_HOST_HEAP"] = "leave"
    out = subprocess.run([sys.executable, "-c", _CYCLE, mode], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout.split()
    return out[0], int(out[1]), int(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_memory_is_reused_without_faults():
    if not os.confstr("CS_GNU_LIBC_VERSION"):
        pytest.skip("not glibc")
    _, base_faults, pages = _faults("default")
    # The problem being fixed: by default the freed heap top goes back to the kernel and faults back in.
    assert base_faults > pages // 2, (base_faults, pages)
    retained, faults, pages = _faults("retain")
    assert retained == "True"
    assert faults < pages // 4, (faults, pages)  # a few pages at the heap's new edge; the rest reused


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_a_process_that_tunes_malloc_itself_keeps_its_settings():
    """``P3D_HOST_HEAP=leave`` (set by ``tests/peak_rss.py``, whose resident-memory peaks need every
    tensor in its own mapping): nothing changes, the freed memory faults back in as by default."""
    if not os.confstr("CS_GNU_LIBC_VERSION"):
        pytest.skip("not glibc")
    retained, faults, pages = _faults("retain", leave=True)
    assert retained == "False"
    assert faults > pages // 2, (faults, pages)
