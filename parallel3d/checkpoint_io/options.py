"""``CheckpointOptions``: when a run saves, how many checkpoints it keeps, and where its
weights start from (``train.save_every/keep_last/resume/async_save/init_from``).

Invariant: a constructed ``CheckpointOptions`` holds valid values; errors are ``ConfigError``
naming ``train.<key>``. What is on disk (a ``resume`` directory, old checkpoints under
``resume=none``, the ``init_from`` directory's tensors) is ``parallel3d.preflight``'s check.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.option_checks import ConfigError, check_bool, check_int

HF_PREFIX = "hf:"
RESUME_KEYWORDS: tuple[str, ...] = ("auto", "none")  # anything else is a checkpoint directory


def hf_dir_of(spec: str) -> str:
    """The directory of an ``init_from`` spec ``hf:<dir>`` (ValueError if it is spelled otherwise)."""
    if not isinstance(spec, str) or not spec.startswith(HF_PREFIX) or not spec[len(HF_PREFIX):]:
        raise ValueError("must be hf:<directory of a transformers checkpoint>")
    return spec[len(HF_PREFIX):]


@dataclass(frozen=True)
class CheckpointOptions:
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end
    keep_last: int = 2  # checkpoints kept (K)
    resume: str = "auto"  # auto (newest complete checkpoint in out_dir) | none | <checkpoint dir>
    async_save: bool = True  # write checkpoints in a background thread while training goes on
    init_from: str | None = None  # hf:<dir>: start (step 0) from a transformers checkpoint directory

    def __post_init__(self) -> None:
        check_int("train.save_every", self.save_every, 0)
        check_int("train.keep_last", self.keep_last, 1)
        if not isinstance(self.resume, str) or not self.resume:
            raise ConfigError(f"train.resume={self.resume!r}: must be auto, none or an existing checkpoint directory")
        check_bool("train.async_save", self.async_save)
        if self.init_from is not None:
            try:
                hf_dir_of(self.init_from)
            except ValueError as exc:
                raise ConfigError(f"train.init_from={self.init_from!r}: {exc}") from None

    @property
    def resume_dir(self) -> str | None:
        """The checkpoint directory ``resume`` names, or None for ``auto`` / ``none``."""
        return None if self.resume in RESUME_KEYWORDS else self.resume
