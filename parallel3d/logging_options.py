"""``LoggingOptions`` / ``WandbOptions``: how often a run reports and where (``logging.*``).

Invariant: a constructed options object holds valid values; errors are ``ConfigError``
naming ``logging.<key>``. ``metrics.WandbSink`` takes its defaults from ``WandbOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel3d.option_checks import ConfigError, check_choice, check_int, check_range

WANDB_MODES: tuple[str, ...] = ("online", "offline", "disabled")


@dataclass(frozen=True)
class WandbOptions:
    mode: str = "disabled"  # online | offline | disabled
    project: str = "parallel3d"
    entity: str | None = None
    name: str | None = None  # run name; null = W&B picks one
    init_timeout_s: float = 60.0  # give up on an unreachable server after this (training goes on)

    def __post_init__(self) -> None:
        check_choice("logging.wandb.mode", self.mode, WANDB_MODES)
        check_range("logging.wandb.init_timeout_s", self.init_timeout_s, 0.0, lo_open=True)
        if not isinstance(self.project, str) or not self.project:
            raise ConfigError(f"logging.wandb.project={self.project!r}: must be a non-empty string")


@dataclass(frozen=True)
class LoggingOptions:
    log_every: int = 10  # console/JSONL/W&B every N steps (and the last step)
    wandb: WandbOptions = field(default_factory=WandbOptions)

    def __post_init__(self) -> None:
        check_int("logging.log_every", self.log_every, 1)
