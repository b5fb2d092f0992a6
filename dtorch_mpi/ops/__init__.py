"""Operators: declarations by family (each op's rule table, kernel and backward in one module;
``catalog`` gathers them), placement signatures (data), inference (metadata only), one plan
cache and one application point (apply.finish)."""

from __future__ import annotations

from . import catalog
from .apply import cache_info, clear_plan_cache, finish
from .registry import OPS, Op, exported, install_methods, lookup, signature
from .signature import Pat, Rule, Signature

__all__ = ["OPS", "catalog", "Op", "Pat", "Rule", "Signature", "cache_info", "clear_plan_cache", "exported", "finish",
           "install_methods", "lookup", "signature"]
