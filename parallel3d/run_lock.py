"""One job at a time per run directory: ``<train.out_dir>/.lock``, held by the job's rank 0 while it runs.

Invariant: while a job runs, no second job starts in its ``train.out_dir``. Two jobs there (a job
launched again while the first still runs, two launches of one sweep) would resume each other's
checkpoints mid-write, fail or supersede each other's saves, overwrite ``.hydra/`` and interleave
their ``metrics.jsonl`` records; the second is refused instead, with one ``ConfigError`` line naming
the job that holds the directory. The lock is an advisory ``flock`` on the file, so it goes when its
process does, however it ends (SIGKILL included): a crashed job never leaves a stale lock behind.
Only global rank 0 takes it (the ranks of one job share the directory); a filesystem without
``flock`` support runs the job unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from typing import IO, Iterator

from parallel3d.option_checks import ConfigError
from parallel3d.user_warnings import warn

LOCK_NAME = ".lock"
# Filesystems that cannot lock answer with one of these; anything else is a real failure to report.
NO_LOCKING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def lock_path(out_dir: str) -> str:
    return os.path.join(out_dir, LOCK_NAME)


def _holder(fh: IO[str]) -> str:
    """What the holder wrote into the lock file (who, where, since when), or a fallback."""
    fh.seek(0)
    text = fh.read().strip()
    return text or "a process that has not yet written its name"


def acquire(out_dir: str) -> IO[str] | None:
    """Lock ``out_dir`` for this process (created if missing); the open lock file, to keep open while the
    job runs, or None where the filesystem cannot lock. Raises ConfigError if another job holds it."""
    os.makedirs(out_dir, exist_ok=True)
    try:
        fh = open(lock_path(out_dir), "a+")  # "a+": never truncate what the holder wrote before we know
    except OSError as exc:  # another user's lock file, a directory of that name: the job's line, not a traceback
        raise _cannot_lock(out_dir, exc) from None
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = _holder(fh)
            fh.close()
            raise ConfigError(
                f"train.out_dir={out_dir!r}: in use by another job ({holder}); two jobs in one run directory "
                f"would resume and overwrite each other's checkpoints and metrics: wait for it to end, or use "
                f"another train.out_dir") from None
        fh.close()
        if exc.errno in NO_LOCKING:
            warn(f"train.out_dir={out_dir!r}: this filesystem cannot lock {LOCK_NAME} ({exc.strerror}); "
                 f"nothing stops a second job from starting in this run directory")
            return None
        raise _cannot_lock(out_dir, exc) from None
    fh.seek(0)
    fh.truncate()
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    fh.write(f"process {os.getpid()} on {socket.gethostname()} since {since}\n")
    fh.flush()
    return fh


def _cannot_lock(out_dir: str, exc: OSError) -> ConfigError:
    return ConfigError(f"train.out_dir={out_dir!r}: cannot lock {lock_path(out_dir)}: {exc.strerror}")


@contextlib.contextmanager
def holding(out_dirs: list[str]) -> Iterator[None]:
    """Lock every directory of ``out_dirs`` (all or none: raises ConfigError naming the first one taken)
    for the duration of the block."""
    with contextlib.ExitStack() as stack:
        for out_dir in dict.fromkeys(out_dirs):
            fh = acquire(out_dir)
            if fh is not None:
                stack.callback(fh.close)
        yield
