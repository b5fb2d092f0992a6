"""visualize_sharding: which ranks hold which block of a DTensor (metadata only)."""

from __future__ import annotations

import itertools
import sys
from typing import IO

from mpi4py import MPI

from .dtensor import DTensor
from .placement import Partial, Replicate
from .split import local_shape_and_offset


def sharding_table(x: DTensor) -> str:
    """The block layout of ``x`` as text: a grid over the tensor's (1-D or 2-D) index space,
    each cell naming its size and offsets and the world ranks holding it. Computed from the
    split rule alone: no communication."""
    if x.ndim not in (1, 2):
        raise ValueError(f"visualize_sharding shows 1-D and 2-D tensors; this one is {x.ndim}-D")
    mesh = x.device_mesh
    plc = x.placements
    blocks: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        local, off = local_shape_and_offset(x.shape, mesh.shape, plc, coord)
        if x.ndim == 1:
            local, off = (1,) + local, (0,) + off
        key = ((off[0], local[0]), (off[1], local[1]))
        blocks.setdefault(key, []).append(int(mesh.mesh[coord]))
    rows = sorted({k[0] for k in blocks})
    cols = sorted({k[1] for k in blocks})

    def span(o: int, n: int) -> str:
        return f"{o}:{o + n}" if n else f"{o}:{o} (empty)"

    head = (f"DTensor {x.shape} {x.dtype}  placements {list(plc)}  mesh {mesh.shape}"
            + (f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""))
    notes = []
    for k, p in enumerate(plc):
        if isinstance(p, Partial):
            notes.append(f"mesh dim {k}: Partial({p.reduce_op!r}) - each rank along it holds a term; "
                         f"the value is their {p.reduce_op}")
        elif isinstance(p, Replicate):
            notes.append(f"mesh dim {k}: Replicate - the ranks along it hold the same block")
    cells = []
    for r in rows:
        line = []
        for c in cols:
            ranks = blocks.get((r, c))
            if ranks is None:
                line.append("")
                continue
            size = f"[{r[1]}x{c[1]}]" if x.ndim == 2 else f"[{c[1]}]"
            where = (f"rows {span(*r)} cols {span(*c)}" if x.ndim == 2 else f"{span(*c)}")
            tag = "P " if any(isinstance(p, Partial) for p in plc) else ""
            who = f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, sorted(ranks)))}"
            line.append(f"{tag}{who}\n{size} {where}")
        cells.append(line)
    width = max((len(part) for line in cells for cell in line for part in cell.split("\n")), default=10) + 2
    bar = "+" + "+".join("-" * width for _ in cols) + "+"
    out = [head] + notes + [bar]
    for line in cells:
        parts = [cell.split("\n") + [""] * (2 - len(cell.split("\n"))) for cell in line]
        for i in range(2):
            out.append("|" + "|".join(p[i].center(width) for p in parts) + "|")
        out.append(bar)
    return "\n".join(out)


def visualize_sharding(x: DTensor, *, file: IO[str] | None = None, rank: int = 0) -> None:
    """Print ``sharding_table(x)`` from world rank ``rank`` only (no communication)."""
    if MPI.COMM_WORLD.Get_rank() == rank:
        print(sharding_table(x), file=file or sys.stdout, flush=True)


__all__ = ["sharding_table", "visualize_sharding"]
