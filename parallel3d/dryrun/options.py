"""``dryrun.*`` keys: the world size to lay out, the ranks to build, the JSON file; parsed to one-line errors."""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.option_checks import ConfigError

RANK_NAMES = ("first", "last")
PREFIX = "dryrun."


@dataclass(frozen=True)
class DryRunOptions:
    """``world_size``: ranks of the real job; ``ranks``: which of them to build ("0,7,1023", "first,last")."""

    world_size: int
    ranks: str = "first,last"
    json: str | None = None


def check_dry_runnable(offload: str) -> None:
    """What no dry run builds, as one ``ConfigError``: disk offload (``parallel.offload``), whose optimizer would
    create (sparse) state files of the real job's size. The command and ``dry_run_rank`` both ask here."""
    if offload == "disk":
        raise ConfigError("parallel.offload=disk: the dry run creates no optimizer state files; dry-run the "
                          "layout with parallel.offload=cpu (the same device bytes, the state counted as offloaded)")


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """The ranks ``spec`` names, in order, without repeats (raises ConfigError naming the bad item)."""
    out: list[int] = []
    for item in str(spec).split(","):
        item = item.strip()
        if item in RANK_NAMES:
            rank = 0 if item == "first" else world_size - 1
        else:
            try:
                rank = int(item)
            except ValueError:
                raise ConfigError(f"dryrun.ranks={spec!r}: {item!r} is not a rank number or one of "
                                  f"{', '.join(RANK_NAMES)}") from None
            if not 0 <= rank < world_size:
                raise ConfigError(f"dryrun.ranks={spec!r}: rank {rank} is outside 0..{world_size - 1} "
                                  f"(dryrun.world_size={world_size})")
        if rank not in out:
            out.append(rank)
    return out


def split_args(argv: list[str]) -> tuple[DryRunOptions, list[str]]:
    """``(dry-run options, the training overrides)`` from a command line (raises ConfigError)."""
    values: dict[str, str] = {}
    rest = []
    for arg in argv:
        if arg.startswith(PREFIX):
            key, sep, value = arg[len(PREFIX):].partition("=")
            if not sep or key not in ("world_size", "ranks", "json"):
                raise ConfigError(f"{arg!r}: expected dryrun.world_size=N, dryrun.ranks=LIST or dryrun.json=FILE")
            values[key] = value
        else:
            rest.append(arg)
    if "world_size" not in values:
        raise ConfigError("dryrun.world_size: missing (the number of ranks of the real job, e.g. dryrun.world_size=1024)")
    try:
        world = int(values["world_size"])
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(f"dryrun.world_size={values['world_size']!r}: must be an integer >= 1")
    return DryRunOptions(world_size=world, ranks=values.get("ranks", "first,last"), json=values.get("json")), rest
