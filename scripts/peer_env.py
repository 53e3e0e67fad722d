"""What the benchmarks and their DeepSpeed peer scripts share: DeepSpeed's own environment, a
peer run as a subprocess that prints one JSON line, and the peer's spawned ranks.

Standard library only: the peer scripts import it under DeepSpeed's interpreter, which has no
parallel3d installed (``scripts/`` is on their path as the running script's directory).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_python(venv: str, no_install: bool) -> str | None:
    """DeepSpeed's own interpreter, its venv created on first use (never the project's); None: skipped."""
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        if no_install:
            print(f"[bench] no DeepSpeed environment at {venv} (--no-install): DeepSpeed skipped", flush=True)
            return None
        print(f"[bench] installing DeepSpeed into its own environment {venv} (once; torch==2.13.0 CPU)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0",
                        "deepspeed"], check=True, env=dict(os.environ, DS_BUILD_OPS="0"))
    return str(py)


def run_peer(py: str, script: str, args: list[str]) -> dict:
    """Run ``scripts/<script>`` under ``py`` (on CPU, one thread) and return the JSON it prints last."""
    cmd = [py, str(Path(__file__).resolve().parent / script), "--port", str(free_port()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"DeepSpeed peer failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def rank_zero_result(worker: Callable, world: int, port: int, args: Any) -> Any:
    """Spawn ``worker(rank, world, port, args, out)`` on ``world`` ranks; each puts ``(rank, "ok"|"err",
    payload)``. Returns rank 0's payload; on any rank's error prints ``{"error": ...}`` and exits 1."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = {}
    for _ in procs:
        rank, status, payload = out.get(timeout=1800)
        if status == "err":
            for proc in procs:
                proc.kill()
            print(json.dumps({"error": f"rank {rank}: {payload}"}))
            sys.exit(1)
        got[rank] = payload
    for proc in procs:
        proc.join()
    return got[0]
