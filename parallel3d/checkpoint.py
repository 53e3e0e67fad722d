"""Checkpoint directories: atomic saves by all ranks, keep-last-K, and finding one to resume.

Layout (``root`` = ``<train.out_dir>/checkpoints``, on a filesystem every rank sees)::

    root/step_00000100/            a complete checkpoint (only ever created by a rename)
        meta.json                  step, format, model, layout, config, every file with its size and CRC-32
        state/                     what the ranks wrote (``parallel3d.checkpoint_io``: layout-free)
    root/step_00000200.tmp/        a save in progress or a failed one: never resumed from

Invariants:
- A directory named ``step_<N>`` is complete: every rank created ``step_<N>.tmp`` and all agreed it did (so
  ``write_rank``, which may be collective, runs on every rank or on none), every rank wrote and fsynced its files, all
  ranks agreed that they succeeded (a MIN all-reduce of their success flags, which is also the barrier), then rank 0
  wrote ``meta.json`` and renamed the directory. A kill at any earlier point leaves only ``.tmp``. The agreement runs
  on ``group`` when given (a gloo group of the whole job, so a save can run in a background thread), else on the
  pstate's world group.
- A failed save (disk full, permissions) on any rank warns on the ranks that saw it, removes the ``.tmp`` directory,
  keeps the previous checkpoints and returns False; training goes on.
- Only after a new checkpoint is complete does rank 0 delete older ones beyond the newest ``keep_last``. Complete
  checkpoints of the saved step or *later* ones are another branch of the run (``train.resume`` named an older step,
  or ``auto`` fell back past a damaged one): before the new one is renamed into place they are renamed
  ``step_<N>.superseded`` (kept, never resumed by ``auto``) rather than counted or replaced, so the save neither
  deletes itself nor the good checkpoint before it, and ``auto`` continues this run, not the abandoned branch. A run
  that resumed step ``B`` sets aside those of steps after ``B`` already as it starts training (``branch_from``), so a
  kill before its first save leaves ``auto`` at ``B``, not on the abandoned branch; a kill among those renames has
  them finished by the next job's rank 0 (``_recover``, from ``root/branch_point`` while they run). Resuming a
  set-aside ``step_<B>.superseded`` of this root also sets aside step ``B`` and those written after it (not its
  history) and renames it back to ``step_<B>``. A ``step_<N>.tmp`` holding its ``meta.json`` is complete (rank 0
  writes it last, once every rank agreed): a job killed among these renames has them finished by the next job's rank
  0 (``_recover``), which every rank's ``find`` waits for, so a kill at any point loses no checkpoint and ``auto``
  never resumes the abandoned branch once the new checkpoint was complete.
- An explicit ``train.resume=<dir>`` (``keep``) wins over recovery: a ``branch_point`` set-aside that would move it
  is dropped (``branch_from`` sets aside what follows it), a complete ``.tmp`` that would is set aside instead.
- ``find("auto")`` verifies sizes and checksums (``checkpoint_verify``, spread over the ranks) and falls back to the
  previous complete checkpoint with a warning naming the damaged file; an explicit ``train.resume=<dir>`` that is
  damaged fails in one line.
What each rank stores is the caller's business (``write_rank`` / ``read_rank``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from parallel3d import comm, user_warnings
from parallel3d.atomic_io import atomic_write_bytes, fsync_dir
from parallel3d.checkpoint_io.options import CheckpointOptions
from parallel3d.checkpoint_verify import crc32_of, damage, gather, my_share
from parallel3d.faults import inject

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

STEP_DIR = re.compile(r"^step_(\d{8})$")
TMP_DIR = re.compile(r"^step_(\d{8})\.tmp$")
META = "meta.json"
SUPERSEDED = ".superseded"
BRANCH_POINT = "branch_point"  # "<step> [<set-aside dir to restore>]" of a branch_from, while it runs
SET_ASIDE = re.compile(r"^step_(\d{8})\.superseded\d*$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (missing files, other layout)."""


def read_branch_point(path: str) -> tuple[int, str | None]:
    """``(step, set-aside directory name to restore or None)`` of a ``branch_point`` record (ValueError: unreadable)."""
    with open(path) as fh:
        step, *restore = fh.read().split()
    return int(step), (restore[0] if restore else None)


def _written(directory: str) -> float:
    return os.path.getmtime(os.path.join(directory, META))


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def _world_all_true(flag: bool, pstate: "ParallelState", group: "dist.ProcessGroup | None" = None) -> bool:
    """True iff ``flag`` is true on every rank (MIN over ``group``, or over the world group)."""
    if group is not None:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)  # ``group`` is gloo: a host tensor
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=pstate.device)
    comm.all_reduce_world(t, pstate, op=dist.ReduceOp.MIN)
    return bool(t.item())


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, dir)`` of complete checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, META)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def publishable_steps(root: str) -> list[int]:
    """Steps of the complete ``.tmp`` directories under ``root`` (a kill came among a save's renames): the next
    job's rank 0 publishes them as checkpoints (``CheckpointManager._recover``), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(TMP_DIR.match, os.listdir(root))
                  if m and is_loadable(os.path.join(root, m.group(0))))


def _relative_files(directory: str) -> list[str]:
    """Every file under ``directory`` (relative paths), the list ``meta.json`` records."""
    out = []
    for parent, _, names in os.walk(directory):
        out += [os.path.relpath(os.path.join(parent, n), directory) for n in names if n != META]
    return sorted(out)


def read_meta(directory: str) -> dict[str, Any]:
    """``meta.json`` as a dict (ValueError when it is JSON of another shape: callers treat it as damaged)."""
    with open(os.path.join(directory, META)) as fh:
        meta = json.load(fh)
    if not isinstance(meta, dict) or not isinstance(meta.get("files", []), list):
        raise ValueError(f"{os.path.join(directory, META)}: not a checkpoint's meta.json (a JSON object with a "
                         f"list of files)")
    return meta


def is_loadable(directory: str) -> bool:
    """Complete and not partly pruned: meta.json and every file it lists exist (with their sizes)."""
    try:
        meta = read_meta(directory)
    except (OSError, ValueError):
        return False
    sizes = meta.get("file_bytes", {})
    for f in meta.get("files", []):
        path = os.path.join(directory, f)
        if not os.path.isfile(path) or (f in sizes and os.path.getsize(path) != sizes[f]):
            return False
    return True


class CheckpointManager:
    """Saves and finds checkpoints under ``root`` for one job (all ranks construct it)."""

    def __init__(self, root: str, pstate: "ParallelState", *, keep_last: int = CheckpointOptions.keep_last,
                 group: "dist.ProcessGroup | None" = None, keep: str | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: must be >= 1")
        self.root = root
        self.pstate = pstate
        self.keep_last = keep_last
        self.group = group  # agreement of ``save`` (see module doc); find() uses the pstate's groups
        if pstate.rank == 0:
            os.makedirs(root, exist_ok=True)
            self._recover(keep)
            self._remove_partial()

    def _recover(self, keep: str | None = None) -> None:
        """Finish a ``branch_from`` and publish the complete ``.tmp`` directories a kill left among the renames, neither
        moving ``keep`` (module doc)."""
        keep = None if keep is None else os.path.realpath(keep)
        marker = os.path.join(self.root, BRANCH_POINT)
        if os.path.isfile(marker):
            step, restore = read_branch_point(marker)
            aside, source = self._branch_moves(step, restore)
            if keep not in map(os.path.realpath, [*aside, *([source] if source else [])]):
                self._branch(step, restore, f"a run resumed from step {step}")
            os.remove(marker)
        for step in publishable_steps(self.root):
            if keep in map(os.path.realpath, self._later(step)):
                self._set_aside([step_dir(self.root, step) + ".tmp"], f"checkpoint step {step} (interrupted)", step)
                continue
            try:
                self._publish(step)
            except OSError as exc:
                user_warnings.warn(f"checkpoint {os.path.basename(step_dir(self.root, step))}.tmp was complete but "
                                   f"could not be renamed into place: {exc}")

    def _remove_partial(self) -> None:
        for name in os.listdir(self.root):
            if name.endswith(".tmp") or name.endswith(".old"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # ---- save ---------------------------------------------------------------------------
    def save(self, step: int, write_rank: Callable[[str], None], meta: dict[str, Any]) -> bool:
        """Collective: every rank writes its state with ``write_rank(tmp_dir)``; see module doc.

        Returns True when the checkpoint is complete on disk.
        """
        final = step_dir(self.root, step)
        tmp = final + ".tmp"
        rank = self.pstate.rank
        ok = self._attempt(step, lambda: (inject("checkpoint.mkdir", rank), os.makedirs(tmp, exist_ok=True)))
        if _world_all_true(ok, self.pstate, self.group):
            ok = self._attempt(step, lambda: write_rank(tmp))
            all_ok = _world_all_true(ok, self.pstate, self.group)
        else:
            all_ok = False
        crcs = self._checksums(step, tmp) if all_ok else None  # collective when all_ok (same on all ranks)
        all_ok = all_ok and crcs is not None
        committed = False
        if self.pstate.rank == 0:
            committed = all_ok and self._commit(step, tmp, final, dict(meta, file_crc32=crcs))
            if not committed:
                shutil.rmtree(tmp, ignore_errors=True)
        committed = _world_all_true(committed if self.pstate.rank == 0 else True, self.pstate, self.group)
        if committed and self.pstate.rank == 0:
            self._prune()
        if not committed and self.pstate.rank == 0:
            user_warnings.warn(f"checkpoint at step {step} was not saved; keeping the previous ones "
                               f"({[s for s, _ in complete_checkpoints(self.root)]})")
        return committed

    def _attempt(self, step: int, action: Callable[[], Any]) -> bool:
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001 - a failed save must not stop training
            user_warnings.warn(f"[rank {self.pstate.rank}] checkpoint at step {step} failed: {exc}")
            return False

    def _checksums(self, step: int, tmp: str) -> dict[str, int] | None:
        """Collective: CRC-32 of every file of ``tmp``, each rank reading its share; None if any failed."""
        mine: dict[str, int] | None = {}
        try:
            for f in my_share(_relative_files(tmp), self.pstate.rank, self.pstate.world_size):
                mine[f] = crc32_of(os.path.join(tmp, f))
        except OSError as exc:
            user_warnings.warn(f"[rank {self.pstate.rank}] checkpoint at step {step}: checksum failed: {exc}")
            mine = None
        parts = gather(mine, self.pstate.world_size, self.group)
        if any(p is None for p in parts):
            return None
        return {f: c for p in parts for f, c in p.items()}

    def _commit(self, step: int, tmp: str, final: str, meta: dict[str, Any]) -> bool:
        try:
            inject("checkpoint.commit", 0)
            files = _relative_files(tmp)
            sizes = {f: os.path.getsize(os.path.join(tmp, f)) for f in files}
            body = dict(meta, step=step, files=files, file_bytes=sizes, world_size=self.pstate.world_size)
            atomic_write_bytes(os.path.join(tmp, META), lambda fh: fh.write(json.dumps(body, indent=1).encode()))
            fsync_dir(tmp)
            self._publish(step)
            return True
        except Exception as exc:  # noqa: BLE001
            user_warnings.warn(f"[rank 0] committing checkpoint at step {step} failed: {exc}")
            return False

    def _publish(self, step: int) -> None:
        """Rename the complete ``step_<N>.tmp`` to ``step_<N>`` once the checkpoints of steps from ``N`` on are set
        aside (module doc). Every rename is one a repeat after a kill finishes (``_recover``)."""
        final = step_dir(self.root, step)
        self._set_aside(self._later(step), f"checkpoint step {step}", step)
        if os.path.exists(final):  # a step_<N> without meta.json (not a checkpoint, left aside above): replaced
            os.replace(final, final + ".old")
        os.replace(final + ".tmp", final)
        fsync_dir(self.root)
        shutil.rmtree(final + ".old", ignore_errors=True)

    def branch_from(self, resumed: str) -> None:
        """Rank 0, as a run that resumed ``resumed`` starts training: set aside the checkpoints of later steps (module
        doc), so ``auto`` never takes the branch this run abandons, even if it is killed before its first save."""
        if self.pstate.rank == 0:
            step, real = int(read_meta(resumed)["step"]), os.path.realpath(resumed)
            here = os.path.dirname(real) == os.path.realpath(self.root) and SET_ASIDE.match(os.path.basename(real))
            restore = os.path.basename(real) if here else None
            marker = os.path.join(self.root, BRANCH_POINT)  # the next job's _recover finishes what a kill cuts short
            atomic_write_bytes(marker, lambda fh: fh.write(f"{step} {restore or ''}".strip().encode()))
            fsync_dir(self.root)
            self._branch(step, restore, f"this run, resumed from step {step},")
            os.remove(marker)

    def _later(self, first: int, newer_than: float | None = None) -> list[str]:
        """The complete checkpoints of step ``first`` on, and (``newer_than``) those whose meta.json is newer."""
        return [path for step, path in complete_checkpoints(self.root)
                if step >= first or (newer_than is not None and _written(path) > newer_than)]

    def _branch_moves(self, step: int, restore: str | None) -> tuple[list[str], str | None]:
        """What ``_branch`` renames: the checkpoints it sets aside, and the set-aside one it restores (or None)."""
        source = os.path.join(self.root, restore) if restore else None
        if source is not None and os.path.isdir(source):
            return self._later(step, _written(source)), source
        return self._later(step + 1), None

    def _branch(self, step: int, restore: str | None, branch: str) -> None:
        """Set aside the checkpoints after ``step``; with ``restore`` (the set-aside checkpoint of ``step`` resumed) also
        step ``step`` and those written after it, then rename it back (module doc). A repeat after a kill finishes."""
        aside, source = self._branch_moves(step, restore)
        self._set_aside(aside, branch, step if source else step + 1)
        if source is None:
            return
        os.replace(source, step_dir(self.root, step))
        fsync_dir(self.root)
        user_warnings.warn(f"{restore} restored as {os.path.basename(step_dir(self.root, step))} in {self.root}: "
                           f"train.resume=auto continues this run from it")

    def _set_aside(self, paths: list[str], branch: str, first: int) -> None:
        """Rename ``paths`` (complete checkpoints, or a complete ``.tmp``) to ``step_<N>.superseded`` (module doc);
        ``branch`` names what branches off them from step ``first``, for the warning."""
        moved = []
        for path in paths:
            base = path[: -len(".tmp")] if path.endswith(".tmp") else path
            target, n = base + SUPERSEDED, 1
            while os.path.exists(target):
                target, n = f"{base}{SUPERSEDED}{n}", n + 1
            try:
                os.replace(path, target)
                moved.append(os.path.basename(target))
            except OSError:
                continue
        if moved:
            user_warnings.warn(f"{branch} branches off the run's checkpoints from step {first} on: set aside as "
                               f"{', '.join(moved)} in {self.root} (kept, and loadable with train.resume=<dir>); "
                               f"train.resume=auto continues this run")

    def _prune(self) -> None:
        done = complete_checkpoints(self.root)
        for _, path in done[: max(0, len(done) - self.keep_last)]:
            # Rename first so a kill mid-delete never leaves a half-deleted "complete" dir.
            trash = path + ".old"
            try:
                os.replace(path, trash)
            except OSError:
                continue
            shutil.rmtree(trash, ignore_errors=True)

    # ---- resume -------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The newest loadable checkpoint directory, or None."""
        for _, path in reversed(complete_checkpoints(self.root)):
            if is_loadable(path):
                return path
        return None

    def _damage(self, directory: str) -> str | None:
        """Collective: the first damaged file of ``directory`` found by any rank (each checks its share)."""
        try:
            meta = read_meta(directory)
            files = meta.get("files", [])
            mine = damage(directory, meta, my_share(files, self.pstate.rank, self.pstate.world_size))
        except (OSError, ValueError) as exc:
            mine = f"{os.path.join(directory, META)}: unreadable ({exc})"
        found = [d for d in gather(mine, self.pstate.world_size, self.group) if d]
        return found[0] if found else None

    def _newest_intact(self) -> str | None:
        """Collective: the newest complete checkpoint whose files verify; warns about each damaged one.

        Raises when checkpoints exist but none verifies (starting over silently would lose the run)."""
        damaged = []
        for _, path in reversed(complete_checkpoints(self.root)):
            bad = self._damage(path)
            if bad is None:
                return path
            damaged.append(bad)
            if self.pstate.rank == 0:
                user_warnings.warn(f"checkpoint {path} is damaged, not resuming from it: {bad}; "
                                   f"falling back to the previous complete checkpoint")
        if damaged:
            raise CheckpointError(f"no intact checkpoint under {self.root} (newest damage: {damaged[0]}); "
                                  f"move the damaged ones away to start over")
        return None

    def find(self, resume: str) -> str | None:
        """The checkpoint ``train.resume`` asks for: ``auto``, ``none`` or a directory.

        Collective: every rank must find the same step (a filesystem that is not
        shared would otherwise desynchronise them silently).
        """
        _world_all_true(True, self.pstate, self.group)  # after rank 0's ``_recover``: every rank lists the same
        if resume == "none":
            path = None
        elif resume == "auto":
            path = self._newest_intact()
        else:
            if not is_loadable(resume):
                bad = self._damage(resume) if os.path.isfile(os.path.join(resume, META)) else None
                raise CheckpointError(f"train.resume={resume!r}: " + (f"damaged checkpoint: {bad}" if bad else
                                      "not a complete checkpoint directory"))
            bad = self._damage(resume)
            if bad:
                raise CheckpointError(f"train.resume={resume!r}: damaged checkpoint: {bad}")
            path = resume
        step = -1 if path is None else int(read_meta(path)["step"])
        t = torch.tensor([step, -step], dtype=torch.int64, device=self.pstate.device)
        comm.all_reduce_world(t, self.pstate, op=dist.ReduceOp.MAX)
        if int(t[0]) != step or int(-t[1]) != step:
            raise CheckpointError(
                f"[rank {self.pstate.rank}] ranks disagree on the checkpoint to resume "
                f"(this rank: step {step}); is {self.root} on a shared filesystem?"
            )
        return path
