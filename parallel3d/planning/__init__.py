"""Scale readiness: per-rank memory estimates, a step-time cost model and a layout planner.

- ``memory.estimate_memory(config, layout)``: bytes per rank by category, per stage;
- ``cost.estimate_step(config, layout, cluster)``: predicted step time, TFLOP/s, MFU;
- ``planner.plan(config, cluster, PlanRequest(...))``: layouts ranked by step time;
- ``cli``: the Hydra entry points of scripts/estimate_memory.py and scripts/plan.py.
"""

from parallel3d.planning.cluster import DEVICES, ClusterSpec, DeviceSpec
from parallel3d.planning.cost import CostOptions, StepEstimate, estimate_step
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import MemoryEstimate, estimate_memory
from parallel3d.planning.planner import Plan, evaluate, plan
from parallel3d.planning.request import PlanRequest

__all__ = ["DEVICES", "ClusterSpec", "CostOptions", "DeviceSpec", "Layout", "MemoryEstimate", "Plan", "PlanRequest",
           "StepEstimate", "estimate_memory", "estimate_step", "evaluate", "plan"]
