"""Redistribute: planning (pure), compilation (metadata, cached) and execution (explicit communication)."""

from .executor import CompiledHandle, CompiledPlan, array_namespace, compile_plan, run_compiled
from .planner import Step, plan_redistribute

__all__ = ["CompiledHandle", "CompiledPlan", "Step", "array_namespace", "compile_plan", "plan_redistribute",
           "run_compiled"]
