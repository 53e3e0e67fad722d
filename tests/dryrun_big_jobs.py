"""Large jobs for the dry run, drawn: published models on 1,024-16,384 ranks in layouts no other test names.

``big_jobs()``: the first ``BIG_JOBS`` draws of the RNG seeded by ``BIG_SEED`` that the training validator
accepts (``config.resolve`` at the job's world size: validity is its business). A draw takes a published
model (dense and MoE), tp, pp, cp with a ``cp_comm``, ep and etp on MoE models, a schedule from
``config.SCHEDULES`` (virtual stages for interleaving and ZB-V; uneven stages, sometimes with an empty
first and last chunk, as Llama 3 405B's published layout), ZeRO 0-3 and the experts' own stage, host
offload, and a dp that puts the world between ``MIN_WORLD`` and ``MAX_WORLD``. ``chosen_ranks`` are the
first, one in the middle and the last.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from parallel3d import config as cfg
from parallel3d.config import ConfigError, resolve
from parallel3d.context_parallel import CP_COMM_VARIANTS
from parallel3d.topology import LayoutError
from parallel3d.train import compose_job
from tests import layout_matrix as lm
from tests.layer_splits import composition, empty_ends

BIG_SEED = 2026120726
BIG_JOBS = 10
CI_BIG = (2,)  # the jobs CI dry-runs (chosen for cost: measured in docs/dryrun.md, "Drawn layouts no other test names"; big0, 41-75 s, left to --extended in session 39 for CI time: the zero-bubble agreement it showed is checked in CI on llama_tiny, test_planner_agrees_on_zero_bubble_schedules); --extended runs all
MIN_WORLD, MAX_WORLD = 1024, 16384
MODELS = ("gpt3_175b", "llama31_405b", "llama3_70b", "mixtral_8x7b", "deepseek_v3_671b", "qwen3_235b_a22b")
MOE_MODELS = {"mixtral_8x7b": 8, "deepseek_v3_671b": 256, "qwen3_235b_a22b": 128}  # their expert counts
MAX_DRAWS = 400


@dataclass(frozen=True)
class BigJob:
    name: str
    world: int
    overrides: tuple[str, ...]

    def chosen_ranks(self) -> list[int]:
        return [0, self.world // 2 + 3, self.world - 1]  # + 3: off the tp / cp grid's first coordinate


@functools.lru_cache(maxsize=None)  # a Hydra compose is ~0.1 s; collection used to compose each draw's model again
def _layers(model: str) -> int:
    return compose_job([f"model={model}"])[0].model.num_layers


def _draw(rng: random.Random, index: int) -> BigJob:
    model = rng.choice(MODELS)
    tp, pp, cp = rng.choice((1, 2, 4, 8)), rng.choice((2, 4, 8, 16)), rng.choice((1, 1, 2, 4))
    dps = [d for d in (2**k for k in range(15)) if MIN_WORLD <= tp * pp * cp * d <= MAX_WORLD]
    dp = rng.choice(dps)
    schedule = rng.choice(cfg.SCHEDULES)
    v = rng.choice((2, 4)) if schedule == "interleaved_1f1b" else 2 if schedule == "zbv" else 1
    layers = _layers(model)
    ov = [f"model={model}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}",
          f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}", "train.precision=bf16",
          f"parallel.zero_stage={(stage := rng.choice(cfg.ZERO_STAGES))}", "train.micro_batch_size=1",
          f"train.seq_len={rng.choice((2048, 4096))}", f"train.recompute={rng.choice(cfg.RECOMPUTE)}",
          f"train.global_batch_size={dp * pp * rng.choice((1, 2))}"]
    if pp * v <= layers and rng.random() < 0.6:  # uneven stages (an empty first and last chunk sometimes)
        counts = empty_ends(rng, composition(rng, layers, pp * v))
        ov.append("parallel.pp_layers=[" + ",".join(map(str, counts)) + "]")
    if tp > 1 and rng.random() < 0.7:
        ov.append("parallel.sequence_parallel=true")
    if cp > 1:
        comm = rng.choice(CP_COMM_VARIANTS)
        ov.append(f"parallel.cp_comm={comm}")
        if comm == "a2a+p2p":
            ov.append(f"parallel.cp_a2a_size={rng.choice([d for d in (1, 2, cp) if cp % d == 0])}")
    if model in MOE_MODELS:
        ov += [f"parallel.ep={rng.choice([e for e in (2, 4, 8, 16, 32) if MOE_MODELS[model] % e == 0])}",
               f"parallel.etp={rng.choice((1, tp))}", "parallel.sequence_parallel=true" if tp > 1 else ""]
        if rng.random() < 0.5:
            ov.append(f"parallel.expert_zero_stage={rng.choice([s for s in cfg.ZERO_STAGES if s != stage])}")
    if rng.random() < 0.25:
        ov.append("parallel.offload=cpu")
    ov = list(dict.fromkeys(o for o in ov if o))
    world = tp * pp * cp * dp
    name = f"big{index}-{model}-tp{tp}pp{pp}cp{cp}dp{dp}-{schedule}v{v}-w{world}"
    return BigJob(name, world, tuple(ov))


def _valid(job: BigJob) -> bool:
    try:
        resolve(compose_job(list(job.overrides))[0], world_size=job.world)
    except (ConfigError, LayoutError, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def big_jobs(count: int = BIG_JOBS) -> tuple[BigJob, ...]:
    """The first ``count`` jobs (at most ``BIG_JOBS``): the draws are sequential, so a shorter list is a prefix of
    the whole (CI collects up to its last ``CI_BIG`` job only and skips validating the draws after it)."""
    rng = random.Random(BIG_SEED)
    out: list[BigJob] = []
    for _ in range(MAX_DRAWS):
        job = _draw(rng, len(out))
        if _valid(job):
            out.append(job)
            if len(out) == min(count, BIG_JOBS):
                return tuple(out)
    raise RuntimeError(f"only {len(out)} valid large jobs in {MAX_DRAWS} draws")
