"""Where Triton kernels can run in this process, and how big their blocks are.

Invariants:
- Triton decides compiled-vs-interpreted when ``@triton.jit`` runs, i.e. when ``triton``
  and our kernel modules are imported. ``TRITON_INTERPRET=1`` must therefore be in the
  environment before the process imports triton; :func:`interpreter_active` checks that
  and names the problem instead of failing deep inside a launch ("0 active drivers").
- Nothing here holds configuration: the backend is always passed in by the caller.
  The ``lru_cache``d probes only remember facts about the installed packages.
- Launch sizes come from the heuristics below, never ``triton.autotune`` (which fails in
  the interpreter with "0 active drivers"), so tests interpret the very launches a GPU runs.
  The sizes were checked with ``ptxas -v`` for sm_90: no register spills at these blocks.
- Interpreter limits seen with triton 3.9 (TRITON_INTERPRET=1): bf16 ``tl.dot`` is wrong
  unless upcast (no kernel here uses ``tl.dot``); fp32 -> bf16 stores truncate instead of
  rounding to nearest even (bf16 results differ from a GPU run by <= 1 ulp).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

# Backward kernels with a 16384-wide block spill registers on sm_90 even at 32 warps (ptxas -v);
# 8192 at 16 warps does not. Longer rows are
# processed in several blocks by the same kernels.
MAX_ROW_BLOCK = 8192


class BackendUnavailableError(RuntimeError):
    """A kernel backend was requested explicitly but cannot run here."""


def interpreter_requested() -> bool:
    """True when the environment asks Triton to interpret kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except ImportError:
        return False
    return True


def interpreter_active() -> bool:
    """True when Triton kernels will run in the interpreter (CPU tensors allowed).

    Raises ``BackendUnavailableError`` if TRITON_INTERPRET=1 was set only after triton had
    been imported in compiled mode: the kernels would then fail at launch.
    """
    if not interpreter_requested() or not triton_importable():
        return False
    import triton.language.standard as tl_standard

    # triton.language's own helpers (tl.sum, tl.zeros, ...) are jit functions; their type
    # tells which mode triton was imported in.
    if type(tl_standard.sum).__name__ != "InterpretedFunction":
        raise BackendUnavailableError(
            "TRITON_INTERPRET=1 is set but triton was imported before it was set, so kernels "
            "are compiled for a GPU; set TRITON_INTERPRET=1 before the process imports triton"
        )
    return True


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``tensor``: CUDA tensors, or any tensor under the interpreter."""
    # Checked in this order so a CPU run that never asked for the interpreter never imports triton.
    if interpreter_requested():
        return interpreter_active()
    return tensor.is_cuda and triton_importable()


@functools.lru_cache(maxsize=None)
def apex_available() -> bool:
    """NVIDIA apex with its CUDA extensions (not the unrelated PyPI package called "apex")."""
    try:
        importlib.import_module("apex.normalization")
        importlib.import_module("apex.multi_tensor_apply")
        importlib.import_module("amp_C")
    except ImportError:
        return False
    return torch.cuda.is_available()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def row_block(n_cols: int, block_size: int | None = None) -> int:
    """Columns one program handles per iteration: the whole row up to ``MAX_ROW_BLOCK``.

    ``block_size`` (a power of two) forces a smaller block; tests use it to run the
    several-blocks-per-row path on small rows.
    """
    if block_size is not None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size} must be a power of two >= 1")
        return block_size
    return min(next_power_of_2(n_cols), MAX_ROW_BLOCK)


def num_warps_for(block: int) -> int:
    """More warps for wider blocks so each thread keeps a few elements in registers."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def reduction_programs(n_rows: int, device: torch.device) -> int:
    """Programs for kernels that reduce over rows (norm weight grads): a couple per SM.

    Each program sums its own contiguous block of rows into one fp32 partial row, so the
    count trades parallelism against the size of the partial buffer.
    """
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # interpreter: a few programs, so partial sums over several programs are exercised
    return max(1, min(n_rows, target))


BACKENDS = ("auto", "triton", "apex", "torch")


def resolve_backend(backend: str, op: str, tensor: torch.Tensor, apex_has_op: bool = False) -> str:
    """The backend that runs ``op`` on ``tensor``: ``"triton"``, ``"apex"`` or ``"torch"``.

    ``auto``: Triton where it can run (CUDA tensors, or anything under the interpreter),
    else the torch reference. ``apex`` for an op apex has no kernel for (RoPE, SwiGLU,
    cross-entropy) means the ``auto`` choice for that op. An explicit choice that cannot
    run raises ``BackendUnavailableError`` naming the op, the backend and the reason.
    """
    if backend not in BACKENDS:
        raise ValueError(f"kernels.backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "apex" and apex_has_op:
        if not apex_available():
            raise BackendUnavailableError(
                f"kernels.backend='apex' for {op}: NVIDIA apex with its CUDA extensions is not importable "
                "(note: the PyPI package named 'apex' is unrelated)"
            )
        if not tensor.is_cuda:
            raise BackendUnavailableError(f"kernels.backend='apex' for {op} needs CUDA tensors, got {tensor.device}")
        return "apex"
    if backend == "triton":
        if not triton_importable():
            raise BackendUnavailableError(f"kernels.backend='triton' for {op}: triton is not importable")
        if not triton_runs_on(tensor):
            raise BackendUnavailableError(
                f"kernels.backend='triton' cannot run {op} on a {tensor.device.type} tensor: Triton needs CUDA "
                "tensors, or TRITON_INTERPRET=1 in the environment before triton is imported"
            )
        return "triton"
    return "triton" if triton_runs_on(tensor) else "torch"
