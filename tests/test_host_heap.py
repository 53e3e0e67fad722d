"""``host_heap.retain_freed_memory``: memory a step frees is reused without page faults.

Each case runs in a process of its own (glibc's thresholds are per process and cannot be
unset), forked from one interpreter that has imported torch and done nothing else, so each starts with
a fresh interpreter's malloc state without paying torch's import again: many mid-sized tensors are
allocated, written and freed together (a zero-bubble
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

_CYCLES = """
import os, resource, sys, torch
from parallel3d.host_heap import LEAVE_ENV, retain_freed_memory
blocks, numel = 96, 256 * 1024  # 1 MiB each, 96 MiB together: above any trim threshold glibc picks itself (<= 64 MiB)
def cycle():
    held = [torch.empty(numel).fill_(1.0) for _ in range(blocks)]
    del held
def case(mode):  # in a forked child: the parent's malloc state is a fresh interpreter's (it cycled nothing)
    if mode == "leave":
        os.environ[LEAVE_ENV] = "leave"
    retained = retain_freed_memory() if mode in ("retain", "leave") else None
    cycle()  # the first touch faults either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cycle()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(mode, retained, faults, blocks * numel * 4 // 4096, flush=True)
for mode in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            case(mode)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0, mode
"""


def _faults(*modes: str) -> dict[str, tuple[str, int, int]]:
    """Per mode (``default``, ``retain``, ``leave``: retain under ``P3D_HOST_HEAP=leave``): what
    ``retain_freed_memory`` returned, the second cycle's minor faults, and the pages it wrote."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD", "P3D_HOST_HEAP"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", _CYCLES, *modes], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in out}
    assert sorted(rows) == sorted(modes), out
    return {mode: (r[0], int(r[1]), int(r[2])) for mode, r in rows.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_memory_is_reused_without_faults():
    if not os.confstr("CS_GNU_LIBC_VERSION"):
        pytest.skip("not glibc")
    got = _faults("default", "retain")
    _, base_faults, pages = got["default"]
    # The problem being fixed: by default the freed heap top goes back to the kernel and faults back in.
    assert base_faults > pages // 2, (base_faults, pages)
    retained, faults, pages = got["retain"]
    assert retained == "True"
    assert faults < pages // 4, (faults, pages)  # a few pages at the heap's new edge; the rest reused


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_a_process_that_tunes_malloc_itself_keeps_its_settings():
    """``P3D_HOST_HEAP=leave`` (set by ``tests/peak_rss.py``, whose resident-memory peaks need every
    tensor in its own mapping): nothing changes, the freed memory faults back in as by default."""
    if not os.confstr("CS_GNU_LIBC_VERSION"):
        pytest.skip("not glibc")
    retained, faults, pages = _faults("leave")["leave"]
    assert retained == "False"
    assert faults > pages // 2, (faults, pages)
