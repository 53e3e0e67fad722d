"""Host memory a split backward frees, kept in the process for the next microbatch instead of returned.

Why: CPU tensors' storage comes from the C library's ``malloc``. glibc hands a block of at least
its mmap threshold (128 KiB, raised as such blocks are freed) out as a fresh ``mmap`` and unmaps it
on ``free``, and returns the top of its heap to the kernel (``sbrk`` down) whenever more than its
trim threshold is free there; memory taken again afterwards is faulted back in page by page
(the kernel zeroes each page, in the thread that touches it). A zero-bubble stage holds each
microbatch's ``W`` tensors (its linears' inputs and output gradients) across other actions, so
its heap grows and shrinks at the top every few actions, and its ``B``s and ``F``s fault pages
in where 1F1B's reuse what the previous backward freed (2026-12-06, pp 2, hidden 128, the last
stage, after the first step: ~100 minor faults per ``B`` against none for 1F1B's backward; about
4% of ``B + W`` in thread CPU time; ``scripts/profile_pipeline_actions.py``).

``retain_freed_memory`` fixes glibc's two thresholds, so that blocks up to 32 MiB come from the
heap and a freed heap top stays mapped: each step's allocations, which recur step after step,
reuse memory already faulted in. The price: the process keeps its high-water mark of host memory
mapped (what a caching allocator keeps on a GPU), and blocks of 128 KiB - 32 MiB share one heap,
whose holes can grow the peak (2026-12-06, a tiny pp 2 zbv job through the Trainer: peak RSS +19
MiB from 4 to 12 microbatches per step against +4 MiB without; ``tests/test_pipeline_engine.py``'s
peak-RSS test). On another C library (musl, macOS) nothing
changes, nor where ``P3D_HOST_HEAP=leave`` is set in the environment: a process that tunes malloc
itself (``tests/peak_rss.py`` makes resident memory follow the live tensors) keeps its settings.

Invariant: changes only where memory comes from, never a value; idempotent.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["retain_freed_memory"]

# glibc's <malloc.h> parameter numbers for mallopt
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# the largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2); larger blocks stay mmap-ed
MMAP_THRESHOLD_MAX = 32 << 20
# free heap top that glibc may keep mapped: beyond any step's transient peak on a host
TRIM_THRESHOLD = 1 << 30
# set to "leave": malloc's settings are the process's own (module doc)
LEAVE_ENV = "P3D_HOST_HEAP"


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module doc); True when they took effect, False on a C
    library without glibc's ``mallopt`` or with ``P3D_HOST_HEAP=leave`` (then nothing changed)."""
    if os.environ.get(LEAVE_ENV) == "leave":
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # set by glibc only
            return False
    except (ValueError, OSError, AttributeError):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Both, and the mmap threshold first: setting either one ends glibc's dynamic adjustment of both.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
