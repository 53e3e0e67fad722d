"""Which command-line keys do not change what ``scripts/plan.py`` prints, said in one note line.

A training command pasted into the planner carries ``parallel.*`` and ``train.*`` keys that the search does not
read (it searches the layout; they are no constraints) and ``optimizer.*`` / ``data.*`` / ``logging.*`` keys
that nothing in it reads (but ``data.document_mask``: the step's per-microbatch tensors, in the memory estimate).
Invariant: a key is named only if neither the search (``SEARCH_READS``) nor, with
``plan.explain=true``, the pricing of the job's own layout (``EXPLAIN_READS`` less ``EXPLAIN_SKIPS``) reads it.
"""

from __future__ import annotations

from typing import Iterable, Optional

SEARCH_READS: tuple[str, ...] = ("model", "cluster", "plan", "hydra", "train.global_batch_size", "train.seq_len",
                                 "train.precision", "data.document_mask")
# plan.explain prices the job's layout (cli._layout_of, cli.job_chunk_layers); these parallel.* keys only
# place ranks or files, or size buffers the cost model takes from the runtime's defaults.
EXPLAIN_READS: tuple[str, ...] = ("parallel", "train.micro_batch_size", "train.recompute")
EXPLAIN_SKIPS: tuple[str, ...] = ("parallel.order", "parallel.bucket_size_mb", "parallel.offload_dir",
                                  "parallel.offload_buffer_mb", "parallel.overlap_param_gather")


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def override_key(arg: str) -> Optional[str]:
    """The key (or config group) a ``key=value`` override sets; None for flags and bare words."""
    if arg.startswith("-") or "=" not in arg:
        return None
    return arg.split("=", 1)[0].lstrip("+~")


def unread_keys(args: Iterable[str], explain: bool) -> list[str]:
    """The keys of ``args`` that do not change the plan, in command-line order."""
    out = []
    for key in filter(None, map(override_key, args)):
        read = _under(key, SEARCH_READS) or (explain and _under(key, EXPLAIN_READS)
                                             and not _under(key, EXPLAIN_SKIPS))
        if not read and key not in out:
            out.append(key)
    return out


def unread_keys_note(args: Iterable[str], explain: bool) -> Optional[str]:
    """One line naming the keys of ``args`` the plan does not read, or None if it reads them all."""
    keys = unread_keys(args, explain)
    if not keys:
        return None
    layout = [k for k in keys if _under(k, EXPLAIN_READS) and not _under(k, EXPLAIN_SKIPS)]
    hint = (" (the layout is searched; plan.explain=true compares the job's own parallel.*/train.* layout with "
            "the best)" if layout else "")
    return f"note: plan.py does not read {', '.join(keys)}{hint}"


__all__ = ["EXPLAIN_READS", "EXPLAIN_SKIPS", "SEARCH_READS", "override_key", "unread_keys", "unread_keys_note"]
