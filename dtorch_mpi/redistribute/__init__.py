"""Redistribute: planning (pure) and execution (explicit communication)."""

from .executor import PlanHandle, array_namespace, run_plan, run_step
from .planner import Step, plan_redistribute

__all__ = ["PlanHandle", "Step", "array_namespace", "plan_redistribute", "run_plan", "run_step"]
