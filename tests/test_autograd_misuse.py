"""Autograd misuse is refused on every rank, as PyTorch refuses it: ``.grad`` assignment checks
type, mesh, shape and dtype; ``backward(gradient=...)`` takes a DTensor of the tensor's dtype; a
Parameter that requires grad is floating or complex. Correct uses keep working (an assigned
gradient in any placements accumulates with backward's)."""

from __future__ import annotations

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import SIZE, Checker, lengths_for, reference, to_numpy

import dtorch_mpi as dt
from dtorch_mpi.nn import Parameter

ROWS = lengths_for(SIZE)


def _leaf(mesh: dt.DeviceMesh, rows: int) -> dt.DTensor:
    return dt.distribute_tensor(reference((rows, 3)), mesh, [dt.Shard(0)]).requires_grad_()


@pytest.mark.parametrize("rows", ROWS)
def test_wrong_grad_assignment_is_refused_everywhere(mesh1d: dt.DeviceMesh, rows: int) -> None:
    x = _leaf(mesh1d, rows)
    other = dt.init_device_mesh("cpu", (SIZE, 1))  # (a mesh equal to mesh1d would be accepted)
    try:
        cases = [(dt.zeros(rows * 3 + 7, device_mesh=mesh1d, dtype=np.float64), dt.ShapeMismatchError, r"has shape"),
                 (dt.zeros(rows, 3, device_mesh=mesh1d, dtype=np.float32), dt.DTypeMismatchError, r"float32"),
                 (np.zeros((rows, 3)), TypeError, r"must be a DTensor or None, got numpy\.ndarray.*distribute_tensor"),
                 (0.0, TypeError, r"got builtins\.float"),
                 (dt.zeros(rows, 3, device_mesh=other, dtype=np.float64), dt.MeshMismatchError, r"another mesh")]
        for value, error, match in cases:
            with pytest.raises(error, match=match):
                x.grad = value  # type: ignore[assignment]
            assert x.grad is None, "a refused assignment left a gradient"
    finally:
        other.free()


@pytest.mark.parametrize("placement", [dt.Shard(0), dt.Replicate()], ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_assigned_grad_in_any_placement_accumulates(mesh1d: dt.DeviceMesh, check: Checker, rows: int,
                                                    placement: dt.Placement) -> None:
    """x.grad = g (the complete value g, in ``placement``), then backward of sum(2 x): x.grad is
    g + 2 as a complete array. (A Partial one is accepted too, for reduce_gradients, but does
    not add to backward's Shard(0) contribution without communication: that raises.)"""
    x = _leaf(mesh1d, rows)
    g = reference((rows, 3), seed=4)
    x.grad = dt.distribute_tensor(g, mesh1d, [dt.Replicate()]).redistribute(placements=[placement])
    (x * 2.0).sum().backward()
    assert x.grad is not None
    check.equal(x.grad.to_torch(), g + 2.0, f"{rows} rows, assigned {placement}", exact=False, rtol=1e-14)
    x.grad = dt.distribute_tensor(g, mesh1d, [dt.Replicate()]).redistribute(placements=[dt.Partial("sum")])
    check.equal(x.grad.to_torch(), g, "a Partial gradient is accepted", exact=False, rtol=1e-14)
    check.done()


@pytest.mark.parametrize("rows", ROWS)
def test_backward_gradient_argument(mesh1d: dt.DeviceMesh, check: Checker, rows: int) -> None:
    x = _leaf(mesh1d, rows)
    y = x * 3.0
    for value, error, match in ((np.ones((rows, 3)), TypeError, r"backward\(gradient=\.\.\.\) takes a DTensor"),
                                (1.0, TypeError, r"takes a DTensor"),
                                (dt.ones(rows, 3, device_mesh=mesh1d, placements=[dt.Shard(0)], dtype=np.float32),
                                 dt.DTypeMismatchError, r"the gradient is float32, the tensor float64")):
        with pytest.raises(error, match=match):
            y.backward(gradient=value, retain_graph=True)
    check.true(x.grad is None, "a refused backward left a gradient")
    y.backward(gradient=dt.ones(rows, 3, device_mesh=mesh1d, placements=[dt.Shard(0)], dtype=np.float64))
    assert x.grad is not None
    check.equal(x.grad.to_torch(), np.full((rows, 3), 3.0), "d(3x)/dx")
    check.done()


def test_parameter_requiring_grad_is_floating(mesh1d: dt.DeviceMesh) -> None:
    ints = dt.distribute_tensor(np.arange(2 * SIZE + 1), mesh1d, [dt.Shard(0)])
    with pytest.raises(TypeError, match=r"Parameter that requires grad must be floating or complex.*int64.*"
                                        r"requires_grad=False"):
        Parameter(ints)
    frozen = Parameter(ints, requires_grad=False)
    assert not frozen.requires_grad and np.array_equal(to_numpy(frozen.to_torch()), np.arange(2 * SIZE + 1))
    assert Parameter(dt.zeros(3, device_mesh=mesh1d, dtype=np.complex128)).requires_grad
