"""Losses against NumPy: ``cross_entropy`` on every placement of the logits (batch- and
class-sharded, 1-D and 2-D meshes, uneven class counts, C below the rank count, empty
pieces), its gradient against float64 finite differences, the exact collectives it makes
(CommCounter), and ``mse_loss``'s gradient. The DTensor tests run per array backend (NumPy
pieces, and CuPy ones on a "cuda" mesh: the emulated CuPy under ``--device emulated``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import SIZE, Checker, on_mesh, reference
from helpers import (
    numeric_grad,
)

import dtorch_mpi as dt
from dtorch_mpi.nn import functional as F

# the losses communicate with all_reduce only (the same MPI call on every path)
pytestmark = pytest.mark.path_independent

R, S0, S1, S2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)


@pytest.fixture
def mesh2d(xp_mesh1d: dt.DeviceMesh, xp_mesh2d: dt.DeviceMesh) -> dt.DeviceMesh:
    """``mesh2d`` per array backend (see helpers.mesh1d_per_backend), of ``mesh1d``'s: every case here runs on one
    mesh, so a NumPy mesh with a CuPy one would repeat the single-backend cases."""
    if xp_mesh2d.device_type != xp_mesh1d.device_type:
        pytest.skip("one mesh per case: mixed array backends repeat the single-backend cases")
    return xp_mesh2d


def ce_rows(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Per-row cross-entropy, class dim last, in float64."""
    m = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(-1)) + m[..., 0]
    return lse - np.take_along_axis(x, t[..., None], -1)[..., 0]


def ce_grad_rows(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """d ce_rows / d x, row by row: softmax minus the one-hot of the target."""
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.put_along_axis(p, t[..., None], np.take_along_axis(p, t[..., None], -1) - 1, -1)
    return p


REDUCE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "none": lambda r: r, "sum": lambda r: np.asarray(r.sum()), "mean": lambda r: np.asarray(r.mean())}

LAYOUTS_1D = [[R], [S0], [S1]]
LAYOUTS_2D = [[S0, S1], [S1, S0], [R, S1], [S1, R], [S1, S1], [S0, S0], [S0, R], [R, R]]


def _target_placements(plc: list[dt.Placement], ndim: int) -> list[dt.Placement]:
    return [p if isinstance(p, dt.Shard) and p.dim != ndim - 1 else R for p in plc]


def _case(mesh: dt.DeviceMesh, full: np.ndarray, tgt: np.ndarray, plc: list[dt.Placement], reduction: str,
          as_dtensor: bool, check: Checker) -> None:
    label = f"{mesh.shape} {full.shape} {plc} {reduction} dtensor-target={as_dtensor}"
    x = dt.distribute_tensor(full, mesh, plc).requires_grad_()
    # a plain target: the whole array, in the mesh's array library for "mean", else NumPy (a
    # host array moves to the device, as distribute_tensor's does)
    plain = on_mesh(mesh, tgt) if reduction == "mean" else tgt
    target = dt.distribute_tensor(tgt, mesh, _target_placements(plc, full.ndim)) if as_dtensor else plain
    loss = F.cross_entropy(x, target, reduction=reduction)
    rows = ce_rows(full, tgt)
    check.equal(loss.to_torch(), REDUCE[reduction](rows), label, exact=False, rtol=1e-12, atol=1e-12)
    # backward of sum(loss * C): a random cotangent per row for "none"
    cot = reference(rows.shape, seed=5) if reduction == "none" else np.asarray(1.0)
    (loss * dt.distribute_tensor(cot, mesh, [R] * mesh.ndim) if reduction == "none" else loss).sum().backward()
    scale = cot[..., None] / (rows.size if reduction == "mean" else 1)
    assert x.grad is not None
    check.equal(x.grad.to_torch(), ce_grad_rows(full, tgt) * scale, f"grad {label}", exact=False, rtol=1e-10,
                atol=1e-12)
    check.true(x.grad.placements == x.placements, f"grad {label}: placed {x.grad.placements}")


def test_cross_entropy_every_placement(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """Values and gradients for N in {0, 1, m-1, m+1, 2m+1} and C in {1, m-1, m+1, 7} on the
    1-D mesh, and the corner cases of those on the 2-D mesh (whose dims are at most 2 long)."""
    classes = sorted({1, max(SIZE - 1, 1), SIZE + 1, 7})
    for n in sorted({0, 1, max(SIZE - 1, 0), SIZE + 1, 2 * SIZE + 1}):
        for c in classes:
            full = reference((n, c), seed=n * 10 + c)
            tgt = np.random.default_rng(c).integers(0, c, size=n)
            meshes = [(mesh1d, LAYOUTS_1D)] + ([(mesh2d, LAYOUTS_2D)] if n in (0, 1, 2 * SIZE + 1) and c in (1, 7)
                                               else [])
            for mesh, layouts in meshes:
                for plc in layouts:
                    for reduction in ("none", "sum") + (("mean",) if n else ()):
                        _case(mesh, full, tgt, plc, reduction, as_dtensor=reduction == "sum", check=check)
    check.done()


def test_cross_entropy_leading_dims(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """[B, T, C] logits with [B, T] targets, any dim sharded."""
    full = reference((2, SIZE + 1, 2 * SIZE + 1), seed=3)
    tgt = np.random.default_rng(4).integers(0, full.shape[-1], size=full.shape[:-1])
    for mesh, layouts in ((mesh1d, [[S0], [S1], [S2], [R]]), (mesh2d, [[S0, S2], [S1, S2], [S2, S1], [S2, S2]])):
        for plc in layouts:
            for reduction in ("mean", "none"):
                _case(mesh, full, tgt, plc, reduction, as_dtensor=reduction == "none", check=check)
    check.done()


def test_cross_entropy_gradient_is_the_finite_difference() -> None:
    """The analytic reference the placement tests use is the true gradient (float64)."""
    full = reference((4, 5), seed=1)
    tgt = np.array([0, 4, 2, 2])
    cot = reference((4,), seed=2)
    want = numeric_grad(lambda x: ce_rows(x, tgt), [full], 0, cot)
    np.testing.assert_allclose(ce_grad_rows(full, tgt) * cot[:, None], want, rtol=1e-6, atol=1e-8)


def test_cross_entropy_collectives(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """Per class-sharded mesh dim: one MAX all-reduce of the row maxima and one SUM all-reduce
    of [2, rows] (float64: 8 and 16 bytes a row); batch-sharded and replicated mesh dims move
    nothing; backward moves nothing. The logits are never gathered."""
    n, c = 2 * SIZE + 1, SIZE + 2
    full = reference((n, c), seed=8)
    tgt = np.random.default_rng(9).integers(0, c, size=n)
    for mesh, plc in ((mesh1d, [S1]), (mesh1d, [S0]), (mesh1d, [R]), (mesh2d, [S0, S1]), (mesh2d, [S1, S0]),
                      (mesh2d, [S1, S1]), (mesh2d, [R, R])):
        x = dt.distribute_tensor(full, mesh, plc).requires_grad_()
        rows = x.spec.local_shape[0]
        with dt.CommCounter() as fwd:
            loss = F.cross_entropy(x, tgt)
        with dt.CommCounter() as bwd:
            loss.backward()
        want = [(k, 8 * rows) for k in range(mesh.ndim) if plc[k] == S1 and mesh.shape[k] > 1]
        want = [(k, b) for k, b in want] + [(k, 2 * b) for k, b in want]
        got = [(r.mesh_dim, r.bytes_sent) for r in fwd.records]
        check.true(fwd.kinds() == ["all_reduce"] * len(want), f"{plc}: forward made {fwd.kinds()}")
        check.true(sorted(got) == sorted(want), f"{plc} on {mesh.shape}: (mesh dim, bytes) {got}, want {want}")
        check.true(bwd.count == 0, f"{plc}: backward made {bwd.kinds()}")
    # a Partial row gradient on a class-sharded mesh dim is all-reduced once (rows-sized)
    x = dt.distribute_tensor(full, mesh1d, [S1]).requires_grad_()
    terms = dt.DTensor.from_local(on_mesh(mesh1d, np.full(n, 1.0 / SIZE)), mesh1d, [dt.Partial()], shape=(n,))
    loss = (F.cross_entropy(x, tgt, reduction="none") * terms).sum()
    with dt.CommCounter() as bwd:
        loss.backward()
    check.true(bwd.kinds() == (["all_reduce"] if SIZE > 1 else []), f"Partial row gradient: {bwd.kinds()}")
    assert x.grad is not None
    check.equal(x.grad.to_torch(), ce_grad_rows(full, tgt), "grad through a Partial cotangent", exact=False,
                rtol=1e-10)
    check.done()


def test_cross_entropy_errors(mesh1d: dt.DeviceMesh) -> None:
    full = reference((SIZE + 1, 3), seed=1)
    x = dt.distribute_tensor(full, mesh1d, [S1])
    with pytest.raises(ValueError, match="reduction"):
        F.cross_entropy(x, np.zeros(SIZE + 1, dtype=np.int64), reduction="avg")
    with pytest.raises(dt.ShapeMismatchError, match="shape"):
        F.cross_entropy(x, np.zeros(SIZE, dtype=np.int64))
    with pytest.raises(TypeError, match="integer"):
        F.cross_entropy(x, np.zeros(SIZE + 1))
    with pytest.raises(IndexError, match="out of range"):
        F.cross_entropy(x, np.full(SIZE + 1, 3))
    bad = np.zeros(SIZE + 1, dtype=np.int64)
    bad[-1] = -1  # only on the last rank's piece of a sharded target
    xs = dt.distribute_tensor(full, mesh1d, [S0])
    with pytest.raises(IndexError, match="out of range"):
        F.cross_entropy(xs, dt.distribute_tensor(bad, mesh1d, [S0]))
    with pytest.raises(dt.PlacementError, match="redistribute the target"):
        F.cross_entropy(xs, dt.distribute_tensor(np.zeros(SIZE + 1, dtype=np.int64), mesh1d, [R]))
    part = dt.DTensor.from_local(on_mesh(mesh1d, full.copy()), mesh1d, [dt.Partial()], shape=full.shape)
    with pytest.raises(dt.PlacementError, match="Partial"):
        F.cross_entropy(part, np.zeros(SIZE + 1, dtype=np.int64))


def test_mse_loss_gradient(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    for n in sorted({0, 1, SIZE + 1, 2 * SIZE + 1}):
        full, tfull = reference((n, 3), seed=n), reference((n, 3), seed=n + 1)
        for mesh, layouts in ((mesh1d, LAYOUTS_1D), (mesh2d, [[S0, S1], [R, S0], [R, R]])):
            for plc in layouts:
                for reduction, scale in (("sum", 2.0), ("mean", 2.0 / max(full.size, 1))):
                    if reduction == "mean" and not n:
                        continue
                    x = dt.distribute_tensor(full, mesh, plc).requires_grad_()
                    F.mse_loss(x, dt.distribute_tensor(tfull, mesh, plc), reduction=reduction).backward()
                    assert x.grad is not None
                    check.equal(x.grad.to_torch(), scale * (full - tfull), f"mse {reduction} {n} {plc}",
                                exact=False, rtol=1e-12, atol=1e-12)
                    check.true(x.grad.placements == x.placements, f"mse grad placed {x.grad.placements}")
    check.done()
