"""Where a thread is, seen from another thread: the heartbeat's view of the training thread.

A rank whose collective timed out cannot tell a peer that waits in the same collective from a peer that is
stuck elsewhere (a deadlock, a blocked read, a hung callback): both are silent on the wire and both keep
beating, because the heartbeat is a thread of its own. So at each beat the heartbeat samples the training
thread's stack: ``probe`` says where it is (the innermost frame of code outside Python's standard library)
and whether it waits for peers: a frame of ``torch.distributed`` on the stack, or an innermost frame of ours
blocked on a ``.wait(`` of an asynchronous collective (gloo's and NCCL's ``Work.wait`` run in C++, so the
Python frame that called it is the innermost one). A thread parked at one place that is not such a wait
is stuck there (``heartbeat.diagnose``).

Invariant: probing never blocks or changes the probed thread (``sys._current_frames`` is a snapshot).
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from types import FrameType

_STDLIB = os.path.normpath(sysconfig.get_paths()["stdlib"]) + os.sep
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def _is_stdlib(filename: str) -> bool:
    path = os.path.normpath(filename)
    return path.startswith(_STDLIB) and "site-packages" not in path


def _waits_for_peers(innermost: FrameType) -> bool:
    frame: FrameType | None = innermost
    while frame is not None:
        if _DISTRIBUTED in os.path.normpath(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    line = linecache.getline(innermost.f_code.co_filename, innermost.f_lineno)
    return not _is_stdlib(innermost.f_code.co_filename) and ".wait(" in line


def _shown(innermost: FrameType) -> str:
    """``file:line in function`` of the innermost frame outside the standard library (else the innermost)."""
    frame: FrameType | None = innermost
    while frame is not None and _is_stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or innermost
    name = frame.f_code.co_filename
    try:
        name = os.path.relpath(name)
    except ValueError:  # another drive (Windows)
        pass
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"


def probe(thread_id: int) -> tuple[str, bool] | None:
    """(where thread ``thread_id`` is, whether it waits for peers); None if it has ended."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    return _shown(frame), _waits_for_peers(frame)
