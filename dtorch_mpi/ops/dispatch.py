"""Operator dispatch: signature inference (metadata only, cached) then local compute.

``infer`` matches every mesh dim against the op's rule table and returns what the output
placements are and which Replicate inputs are cut locally (plans of zero-byte slice steps).
No match raises ``PlacementError`` on every rank (the inputs' metadata is the same on every
rank, so so is the verdict) naming the op, the placements, the rules and a concrete fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import MeshMismatchError, PlacementError
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard
from ..redistribute import CompiledPlan, compile_plan
from ..spec import DTensorSpec
from .cost import redistribute_cost
from .signature import DimMap, Rule, Signature, match_mesh_dim

INFERENCE_CACHE_SIZE = 4096
"""Bound of every inference cache (PyTorch's is unbounded and grows every step)."""

RULE_HITS: set[tuple[str, int]] | None = None
"""When a set, every matched (op, rule index) is added to it (tests prove every rule runs)."""


@dataclass(frozen=True)
class OpPlan:
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    prepare: tuple[CompiledPlan | None, ...]
    """Per input: a zero-communication plan of slices to apply to its local piece (or None)."""
    reduced_sharded: bool = False
    xp: Any = None
    rules: tuple[Rule, ...] = ()
    """The rule matched on each mesh dim (one per mesh dim)."""
    kernel: Any = None
    """The op's local kernel for this plan's array library (set by the plan cache)."""
    aux: Any = None
    """What the planner derived for the kernel beyond placements (e.g. getitem's full key)."""
    out_specs: dict = field(default_factory=dict, compare=False, hash=False)
    """Output spec per result dtype, reused across calls (its hash is computed once)."""

    def out_spec(self, dtype: Any) -> DTensorSpec:
        spec = self.out_specs.get(dtype)
        if spec is None:
            import numpy as np

            spec = self.out_specs[dtype] = DTensorSpec(self.mesh, self.placements, self.shape,
                                                       np.dtype(dtype))
        return spec


def common_mesh(op: str, specs: Sequence[DTensorSpec | None]) -> DeviceMesh:
    meshes = [s.mesh for s in specs if s is not None]
    if not meshes:
        raise TypeError(f"{op}: at least one operand must be a DTensor")
    for m in meshes[1:]:
        if m != meshes[0]:
            raise MeshMismatchError(
                f"{op}: operands live on different meshes ({meshes[0]!r} and {m!r}); move one "
                f"with to_torch() + distribute_tensor() onto the other's mesh"
            )
    return meshes[0]


def infer(
    sig: Signature,
    specs: Sequence[DTensorSpec | None],
    dmap: DimMap,
    out_shape: tuple[int, ...],
    names: Sequence[str],
) -> OpPlan:
    mesh = common_mesh(sig.op, specs)
    out: list[Placement] = []
    targets: list[list[Placement] | None] = [
        list(s.placements) if s is not None else None for s in specs
    ]
    reduced_sharded = False
    rules: list[Rule] = []
    for k in range(mesh.ndim):
        per_dim = [s.placements[k] if s is not None else None for s in specs]
        m = match_mesh_dim(sig, per_dim, dmap)
        if m is None:
            raise placement_error(sig, specs, dmap, names, k)
        if RULE_HITS is not None:
            RULE_HITS.add((sig.op, sig.rules.index(m.rule) if m.rule in sig.rules else -1))
        if any(p.kind == "S" and p.arg == "r" for p in m.rule.inputs):
            reduced_sharded = True
        out.append(m.output)
        rules.append(m.rule)
        for i, d in m.slice_to:
            target = targets[i]
            assert target is not None
            target[k] = Shard(d)
    prepare: list[CompiledPlan | None] = []
    for spec, target in zip(specs, targets):
        if spec is None or target is None or tuple(target) == spec.placements:
            prepare.append(None)
        else:
            plan = compile_plan(spec, tuple(target))
            assert not plan.communicates, "an operator plan must never communicate"
            prepare.append(plan)
    from ..arrays import array_namespace

    return OpPlan(mesh, tuple(out), out_shape, tuple(prepare), reduced_sharded,
                  array_namespace(mesh.device_type), tuple(rules))


def placement_error(
    sig: Signature,
    specs: Sequence[DTensorSpec | None],
    dmap: DimMap,
    names: Sequence[str],
    mesh_dim: int,
) -> PlacementError:
    per_dim = [s.placements[mesh_dim] if s is not None else None for s in specs]
    shown = ", ".join("scalar" if p is None else repr(p) for p in per_dim)
    aligned = ", ".join(_aligned(dmap, i, s) for i, s in enumerate(per_dim))
    fix = _suggest(sig, specs, dmap, names, mesh_dim)
    inputs = "; ".join(
        f"{n}: {list(s.placements)} shape {s.shape}" for n, s in zip(names, specs) if s is not None
    )
    return PlacementError(
        f"{sig.op}: no rule accepts the input placements ({shown}) on mesh dim {mesh_dim} "
        f"[{inputs}].\nAligned to the output's dims, as the rules name them (each Shard above "
        f"names the input's own dim), the inputs are ({aligned}).\n"
        f"Accepted rules (each mesh dim is matched on its own):\n"
        + "\n".join(f"  {r!r}" for r in sig.rules)
        + (f"\n  note: {sig.doc}" if sig.doc else "")
        + f"\nNo data is moved implicitly. Make the call legal explicitly, e.g.:\n  {fix}"
    )


def _aligned(dmap: DimMap, i: int, p: Placement | None) -> str:
    """Input ``i``'s placement in the rules' terms: a Shard's dim as the output's dim (``d``),
    a fixed negative dim (matmul's ``Shard(-1)``) or ``r`` (a dim the op removes)."""
    if p is None:
        return "scalar"
    if not isinstance(p, Shard):
        return repr(p)
    if dmap.stretched(i, p.dim):
        return f"Shard(dim={p.dim}) stretched from size 1"
    out = dmap.to_out(i, p.dim)
    if out is not None:
        return f"Shard({out})"
    fixed = [d for d in (-1, -2) if dmap.fixed(i, d) == p.dim]
    return f"Shard({fixed[0]})" if fixed else f"Shard(r): dim {p.dim} is not in the output as such"


def _suggest(
    sig: Signature, specs: Sequence[DTensorSpec | None], dmap: DimMap, names: Sequence[str], k: int
) -> str:
    """The cheapest single-operand redistribute that makes mesh dim ``k`` match a rule: each
    candidate costed by the bytes its plan moves plus the piece it leaves on every rank
    (ops/cost.py; metadata only, the same verdict on every rank)."""
    per_dim = [s.placements[k] if s is not None else None for s in specs]
    options: list[tuple[int, int, str]] = []
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        candidates: list[Placement] = [p for p in per_dim if p is not None]
        candidates += [Shard(d) for d in range(len(spec.shape))] + [Replicate()]
        seen: set[Placement] = set()
        for cand in candidates:
            if cand in seen or cand == per_dim[i]:
                continue
            seen.add(cand)
            trial = list(per_dim)
            trial[i] = cand
            if match_mesh_dim(sig, trial, dmap) is not None:
                target = spec.placements[:k] + (cand,) + spec.placements[k + 1 :]
                cost = redistribute_cost(spec, target)
                text = (f"{_redistribute_text(names[i], spec, k, cand)}   # moves {cost.moved} bytes "
                        f"per rank, leaves a {cost.resident}-byte piece on each")
                options.append((cost.total, len(options), text))
    if options:
        return min(options)[2]
    fixes = [
        _redistribute_text(n, s, k, Replicate())
        for n, s in zip(names, specs)
        if s is not None and not isinstance(s.placements[k], Replicate)
    ]
    return "\n  ".join(fixes) or "redistribute the inputs to Replicate() on that mesh dim"


def _redistribute_text(name: str, spec: DTensorSpec, k: int, placement: Placement) -> str:
    new = list(spec.placements)
    new[k] = placement
    return f"{name} = {name}.redistribute(placements={new})"
