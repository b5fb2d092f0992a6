"""Redistribute: planning (pure), compilation (metadata, cached) and execution (explicit communication)."""

from ..arrays import array_namespace  # re-exported for compatibility; the home is dtorch_mpi.arrays
from .executor import CompiledHandle, CompiledPlan, compile_plan, run_compiled
from .planner import Step, plan_redistribute

__all__ = ["CompiledHandle", "CompiledPlan", "Step", "array_namespace", "compile_plan", "plan_redistribute",
           "run_compiled"]
