"""Scale readiness: per-rank memory estimates, a step-time cost model and a layout planner."""
