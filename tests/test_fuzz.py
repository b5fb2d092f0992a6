"""Differential fuzzing: random shapes, dtypes, meshes, placements and short op sequences
(redistribute and operators) against NumPy on the complete arrays. Hypothesis runs with
``derandomize=True`` (conftest), so every rank draws the same examples; the budget is
DTORCH_FUZZ_EXAMPLES (small in CI; `make fuzz` runs a longer one)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from conftest import SIZE
from helpers import make_pieces
from hypothesis import given, settings
from hypothesis import strategies as st

import dtorch_mpi as dt

BUDGET = int(os.environ.get("DTORCH_FUZZ_EXAMPLES", "30"))
LENGTHS = sorted({0, 1, 2, 3, 5, 7, max(SIZE - 1, 1), SIZE, SIZE + 1, 2 * SIZE + 1})
PLACEMENTS = [dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial("sum"), dt.Partial("max")]
DTYPES = [np.float64, np.float32, np.int64, np.int32]

OPS = st.one_of(
    st.tuples(st.just("redistribute"), st.lists(st.sampled_from(PLACEMENTS), min_size=2, max_size=2)),
    st.tuples(st.just("add_self"), st.none()),
    st.tuples(st.just("scale"), st.integers(-3, 3)),
    st.tuples(st.just("sum"), st.sampled_from([0, 1])),
    st.tuples(st.just("transpose"), st.none()),
    st.tuples(st.just("neg"), st.none()),
    st.tuples(st.just("maximum_self"), st.none()),
)


def apply(op: str, arg: Any, x: dt.DTensor, ref: np.ndarray) -> tuple[dt.DTensor, np.ndarray]:
    mesh = x.device_mesh
    if op == "redistribute":
        plc = [p for p in arg[: mesh.ndim]]
        plc = [dt.Shard(p.dim % max(x.ndim, 1)) if isinstance(p, dt.Shard) and x.ndim else
               (dt.Replicate() if isinstance(p, dt.Shard) else p) for p in plc]
        return x.redistribute(placements=plc), ref
    if op == "add_self":
        return x + x, ref + ref
    if op == "scale":
        return x * arg, ref * arg
    if op == "sum" and x.ndim:
        d = arg % x.ndim
        return x.sum(d), ref.sum(d)
    if op == "transpose":
        return x.T, ref.T
    if op == "neg":
        return -x, -ref
    if op == "maximum_self":
        return dt.maximum(x, x), np.maximum(ref, ref)
    return x, ref


@settings(max_examples=BUDGET)
@given(rows=st.sampled_from(LENGTHS), cols=st.sampled_from(LENGTHS), dtype=st.sampled_from(DTYPES),
       two_d=st.booleans(), start=st.lists(st.sampled_from(PLACEMENTS), min_size=2, max_size=2),
       ops=st.lists(OPS, max_size=4))
def test_random_programs_match_numpy(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, rows: int, cols: int,
                                     dtype: Any, two_d: bool, start: list, ops: list) -> None:
    mesh = mesh2d if two_d else mesh1d
    full = np.random.default_rng(rows * 31 + cols).integers(-20, 20, size=(rows, cols)).astype(dtype)
    plc = start[: mesh.ndim]
    x = dt.DTensor.from_local(make_pieces(full, mesh, plc), mesh, plc, shape=full.shape)
    ref = full
    for op, arg in ops:
        try:
            x, ref = apply(op, arg, x, ref)
        except dt.PlacementError as err:
            assert ".redistribute(placements=" in str(err)
            x = x.redistribute(placements=[dt.Replicate()] * mesh.ndim)
            x, ref = apply(op, arg, x, ref)
    got = x.to_torch()
    assert got.shape == ref.shape
    assert np.allclose(got, ref), (start, ops)
