"""Running model-state byte counts per category and their high-water marks.

Every allocation or release of a model-state tensor the ZeRO optimizer owns
(weights, gradient buffers/shards, master weights, moments, staging buffers and
in-flight reduction outputs) is reported here as it happens, and a gradient
hook reports the ``.grad`` it is about to consume as *transient* bytes. So the
peak is exact at every point where model-state memory changes, at O(1) per
event, without scanning thousands of parameters.
"""

from __future__ import annotations

import torch

# Device-resident model states, then what offloading keeps in host memory and on disk.
MEMORY_CATEGORIES = ("model_weights", "gradients", "master_weights", "optimizer_moments", "buckets",
                     "offload_host", "offload_disk")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryTracker:
    """Bytes held now and the most held since ``reset_peak``, per category (one rank)."""

    def __init__(self, categories: tuple[str, ...] = MEMORY_CATEGORIES) -> None:
        self.current: dict[str, int] = dict.fromkeys(categories, 0)
        self.peak: dict[str, int] = dict.fromkeys(categories, 0)

    def add(self, category: str, n: int) -> None:
        """``n`` bytes were allocated (negative: released) in ``category``."""
        value = self.current[category] + n
        self.current[category] = value
        if value > self.peak[category]:
            self.peak[category] = value

    def transient(self, category: str, n: int) -> None:
        """``n`` bytes live right now on top of the running count (e.g. a ``.grad`` a hook is consuming)."""
        value = self.current[category] + n
        if value > self.peak[category]:
            self.peak[category] = value

    def reset_peak(self) -> None:
        self.peak = dict(self.current)


def held_bytes(*, weights: list[torch.Tensor], gradients: list[torch.Tensor | None], masters: list[torch.Tensor | None],
               moments: list[torch.Tensor], buckets: list[torch.Tensor], offload_host: int,
               offload_disk: int) -> dict[str, int]:
    """Bytes held now per category, each storage counted once (in the first category naming it),
    measured from the tensors themselves rather than from the running counts."""
    seen: set[int] = set()

    def size(tensors: list) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen or not st.nbytes():
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    held = {"model_weights": size(weights)}
    held_buckets = size(buckets)  # before gradients: a stage-2 ``.grad`` may view a staging buffer
    held.update(gradients=size(gradients), master_weights=size(masters), optimizer_moments=size(moments),
                buckets=held_buckets, offload_host=offload_host, offload_disk=offload_disk)
    return held
