"""lowering: passes from (dataflow graph, cluster shape) to a per-rank plan.

`compile_plan(spec, ranks, ...)` runs placement -> queues -> capture -> routes -> memory and returns
the versioned `Plan` that `save_plan` / `load_plan` write and read as PLAN_DIR/plan.json.
"""
from lowering.plan import PLAN_VERSION, Plan, compile_plan, load_plan, save_plan

__all__ = ["PLAN_VERSION", "Plan", "compile_plan", "load_plan", "save_plan"]
