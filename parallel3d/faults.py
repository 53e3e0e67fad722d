"""Fault injection at named points, for the tests of the failure paths (inert unless enabled).

``P3D_FAULT="<point>@<rank>[=<action>],..."`` makes ``inject(point, rank)`` misbehave on that
rank, so a test can fail *one* rank for real (this machine runs as root: permissions cannot
make a directory read-only for one rank only). Actions: ``enospc`` (default: OSError "No
space left on device"), ``erofs`` (read-only file system), ``sleep:<seconds>`` (a slow disk).
``<rank>`` may be ``*`` (every rank). Points: ``checkpoint.mkdir`` (creating the step
directory), ``checkpoint.write`` (a rank writing its state), ``checkpoint.commit`` (rank 0
before the rename), ``train.failure_line`` (a failed rank, before it prints its line),
``metrics.rewrite`` (a resume rewriting ``metrics.jsonl``; given rank 0, the file's one writer). The variable is read at each call; unset, ``inject`` does nothing.
"""

from __future__ import annotations

import errno
import os
import time

ENV = "P3D_FAULT"


def inject(point: str, rank: int) -> None:
    """Raise or stall here if ``$P3D_FAULT`` names ``point`` for ``rank`` (see module doc)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        target, _, action = item.strip().partition("=")
        name, _, who = target.partition("@")
        if name != point or who not in ("*", str(rank)):
            continue
        action = action or "enospc"
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
        elif action == "erofs":
            raise OSError(errno.EROFS, f"Read-only file system (injected at {point} on rank {rank})")
        else:
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point} on rank {rank})")
