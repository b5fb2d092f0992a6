"""DTensor construction: from_local, distribute_tensor, factories; against NumPy."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import RANK, SIZE, Checker, lengths_for, reference

import dtorch_mpi as dt
from dtorch_mpi.split import local_shape_and_offset


def placements_1d() -> list[list[dt.Placement]]:
    return [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()], [dt.Partial("sum")], [dt.Partial("max")]]


def placements_2d() -> list[list[dt.Placement]]:
    singles = [dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial("sum"), dt.Partial("min")]
    return [list(p) for p in itertools.product(singles, repeat=2)]


def expected_piece(full: np.ndarray, mesh: dt.DeviceMesh, placements: list[dt.Placement]) -> np.ndarray:
    shape, off = dt.compute_local_shape_and_offset(full.shape, mesh, placements)
    piece = full[(*(slice(o, o + n) for o, n in zip(off, shape)), ...)]  # 0-d stays an array
    coord = mesh.get_coordinate()
    for k, p in enumerate(placements):  # SPEC: the value at coordinate 0, the identity elsewhere
        if isinstance(p, dt.Partial) and p.reduce_op != "avg" and coord[k] != 0:
            return np.full_like(piece, {"sum": 0, "max": -np.inf, "min": np.inf}[p.reduce_op])
    return piece


def test_readme_example(mesh1d: dt.DeviceMesh) -> None:
    full = np.arange(44, dtype=np.float32).reshape(4, 11)
    x = dt.distribute_tensor(full, mesh1d, [dt.Shard(1)])
    assert x.shape == (4, 11) and x.dtype == np.float32 and x.placements == (dt.Shard(1),)
    assert np.array_equal(x.to_local(), expected_piece(full, mesh1d, [dt.Shard(1)]))
    assert np.array_equal(x.to_torch(), full) and np.array_equal(x.full_tensor(), full)


@pytest.mark.parametrize("src", [0, None, SIZE - 1])
def test_distribute_tensor_every_placement(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                           check: Checker, src: int | None) -> None:
    for mesh, plist in ((mesh1d, placements_1d()), (mesh2d, placements_2d())):
        for n in lengths_for(mesh.size()):
            full = reference((n, 3), seed=n)
            for placements in plist:
                arg = full if src is None or src == RANK else None
                x = dt.distribute_tensor(arg, mesh, placements, src_data_rank=src)
                what = f"mesh {mesh.shape} {placements} n={n}"
                check.equal(x.to_local(), expected_piece(full, mesh, placements), what)
                check.equal(x.to_torch(), full, what)
                check.true(x.to_local().flags.c_contiguous, f"{what}: piece not contiguous")
    check.done()


@pytest.mark.parametrize("layout", ["fortran", "strided"])
def test_distribute_tensor_of_a_non_c_contiguous_source(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                                        check: Checker, layout: str) -> None:
    """MPI moves memory order: a Fortran-ordered or strided source must still arrive as its
    values (it is made C-contiguous at the root) for every placement, from the last rank."""
    for mesh, plist in ((mesh1d, placements_1d()), (mesh2d, placements_2d())):
        for n in lengths_for(mesh.size()):
            full = reference((n, 3), seed=n)
            src = np.asfortranarray(full) if layout == "fortran" else np.repeat(full, 2, axis=1)[:, ::2]
            for placements in plist:
                x = dt.distribute_tensor(src if RANK == SIZE - 1 else None, mesh, placements, src_data_rank=SIZE - 1)
                what = f"{layout} mesh {mesh.shape} {placements} n={n}"
                check.equal(x.to_local(), expected_piece(full, mesh, placements), what)
    check.done()


def test_distribute_tensor_does_not_alias(mesh1d: dt.DeviceMesh) -> None:
    full = np.zeros((SIZE * 2, 2))
    x = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)], src_data_rank=None)
    full[:] = 1
    assert not x.to_local().any()


def test_from_local_derives_uneven_shapes(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                          check: Checker) -> None:
    for mesh, plist in ((mesh1d, placements_1d()), (mesh2d, placements_2d())):
        for n in lengths_for(mesh.size()):
            full = reference((n, 5), seed=1)
            for placements in plist:
                piece = expected_piece(full, mesh, placements).copy()
                x = dt.DTensor.from_local(piece, mesh, placements)
                check.equal(np.array(x.shape), np.array(full.shape), f"{placements} n={n} shape")
                check.true(x.to_local() is piece, "from_local copied the piece")
                y = dt.DTensor.from_local(piece, mesh, placements, shape=full.shape, run_check=True)
                check.equal(y.to_torch(), full, f"{placements} n={n}")
    check.done()


def test_from_local_with_shape_and_no_check_does_not_communicate(mesh1d: dt.DeviceMesh) -> None:
    piece = np.ones(dt.compute_local_shape_and_offset((7,), mesh1d, [dt.Shard(0)])[0])
    with dt.CommCounter() as counter:
        x = dt.DTensor.from_local(piece, mesh1d, [dt.Shard(0)], shape=(7,))
    assert counter.count == 0 and x.shape == (7,)


@pytest.mark.mpi(min_size=2)
def test_from_local_pieces_off_the_split_rule_raise_everywhere(mesh1d: dt.DeviceMesh) -> None:
    # rank 0 holds one element too many: only rank 0 is wrong, every rank must raise
    sizes = [3 if r == 0 else 2 for r in range(SIZE)]
    sizes[0] = 2 + 2
    with pytest.raises(dt.ShapeMismatchError, match=r"rank \d .* split rule gives"):
        dt.DTensor.from_local(np.zeros((sizes[RANK], 2)), mesh1d, [dt.Shard(0)])


@pytest.mark.mpi(min_size=2)
def test_from_local_rank_divergent_dtype_and_ndim(mesh1d: dt.DeviceMesh) -> None:
    with pytest.raises(dt.DTypeMismatchError, match="differ in dtype"):
        dt.DTensor.from_local(np.zeros(2, np.float32 if RANK else np.float64), mesh1d, [dt.Shard(0)])
    with pytest.raises(dt.ShapeMismatchError, match="differ in ndim"):
        dt.DTensor.from_local(np.zeros((2,) * (1 + (RANK == 1))), mesh1d, [dt.Shard(0)])
    with pytest.raises(TypeError, match="array piece"):
        dt.DTensor.from_local([1, 2] if RANK == 1 else np.zeros(2), mesh1d, [dt.Shard(0)])
    with pytest.raises(dt.ShapeMismatchError, match="different shape= values"):
        dt.DTensor.from_local(np.zeros(1), mesh1d, [dt.Replicate()], shape=(1 + (RANK == 1),), run_check=True)


def test_from_local_invalid_placement_raises(mesh1d: dt.DeviceMesh) -> None:
    with pytest.raises(dt.PlacementError, match="out of range"):
        dt.DTensor.from_local(np.zeros(2), mesh1d, [dt.Shard(1)])
    with pytest.raises(dt.DTypeMismatchError, match="not supported"):
        dt.DTensor.from_local(np.zeros(2, dtype="U3"), mesh1d, [dt.Shard(0)])


@pytest.mark.mpi(min_size=2)
def test_distribute_tensor_source_errors_reach_every_rank(mesh1d: dt.DeviceMesh) -> None:
    with pytest.raises(dt.PlacementError, match="out of range"):
        dt.distribute_tensor(np.zeros(3) if RANK == 0 else None, mesh1d, [dt.Shard(2)])
    with pytest.raises(TypeError, match="needs an array"):
        dt.distribute_tensor("abc" if RANK == 0 else None, mesh1d, [dt.Shard(0)])
    with pytest.raises(dt.ShapeMismatchError, match="same array shape"):
        dt.distribute_tensor(np.zeros(3 + RANK), mesh1d, [dt.Shard(0)], src_data_rank=None)


FACTORIES = [
    ("zeros", lambda s, **kw: dt.zeros(*s, **kw), lambda s, d: np.zeros(s, d)),
    ("ones", lambda s, **kw: dt.ones(*s, **kw), lambda s, d: np.ones(s, d)),
    ("full", lambda s, **kw: dt.full(s, 2.5, **kw), lambda s, d: np.full(s, 2.5, d)),
]


@pytest.mark.path_independent  # factories make each piece locally
def test_factories_every_placement(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    for mesh, plist in ((mesh1d, placements_1d()), (mesh2d, placements_2d())):
        for n in lengths_for(mesh.size()):
            for name, make, ref in FACTORIES:
                for placements in plist:
                    x = make((n, 2), dtype=np.float64, device_mesh=mesh, placements=placements)
                    what = f"{name} {placements} n={n}"
                    want_shape = dt.compute_local_shape_and_offset((n, 2), mesh, placements)[0]
                    check.equal(np.array(x.to_local().shape), np.array(want_shape), what)
                    check.equal(x.to_torch(), ref((n, 2), np.float64), what)
            for placements in ([dt.Shard(0)] + [dt.Replicate()] * (mesh.ndim - 1),
                               [dt.Partial()] * mesh.ndim):
                a = dt.arange(n, device_mesh=mesh, placements=placements)
                check.equal(a.to_torch(), np.arange(n), f"arange {placements} {n}")
                b = dt.arange(1.5, n, 0.5, device_mesh=mesh, placements=placements)
                check.equal(b.to_torch(), np.arange(1.5, n, 0.5), f"arange float {placements} {n}", exact=False)
    e = dt.empty(3, 4, device_mesh=mesh1d, placements=[dt.Shard(0)])
    check.true(e.shape == (3, 4) and e.dtype == np.float32, "empty default dtype is float32")
    check.true(dt.full((2,), 3, device_mesh=mesh1d).dtype == np.int64, "full(int) is int64")
    check.done()


def test_factories_allocate_only_the_local_piece(mesh1d: dt.DeviceMesh) -> None:
    with dt.CommCounter() as counter:
        x = dt.zeros(1000, 8, device_mesh=mesh1d, placements=[dt.Shard(0)])
        dt.randn(1000, 8, device_mesh=mesh1d, placements=[dt.Shard(0)])
    assert counter.count == 0
    assert x.to_local().nbytes == local_shape_and_offset((1000, 8), (SIZE,), (dt.Shard(0),), (RANK,))[0][0] * 8 * 4


def test_factory_errors(mesh1d: dt.DeviceMesh) -> None:
    with pytest.raises(dt.DTypeMismatchError, match="floating-point"):
        dt.randn(3, dtype=np.int32, device_mesh=mesh1d)
    with pytest.raises(dt.ShapeMismatchError, match="negative"):
        dt.zeros(-1, device_mesh=mesh1d)
    with pytest.raises(TypeError, match="device_mesh"):
        dt.ones(3)


NON_NATIVE = [np.dtype(">f4"), np.dtype(">f8"), np.dtype(">i4"), np.dtype(">c8")]
"""Non-native byte orders (on this little-endian machine): converted to native on entry."""


@pytest.mark.parametrize("dtype", NON_NATIVE, ids=str)
def test_non_native_byte_order_is_converted_on_entry(mesh1d: dt.DeviceMesh, check: Checker,
                                                     dtype: np.dtype) -> None:
    native = dtype.newbyteorder("=")
    for n in lengths_for(SIZE):
        full = reference((n, 3), native, seed=n)
        swapped = full.astype(dtype)
        for placements in ([dt.Shard(0)], [dt.Replicate()], [dt.Partial("sum")]):
            for src in (0, None):
                x = dt.distribute_tensor(swapped, mesh1d, placements, src_data_rank=src)
                what = f"distribute_tensor {dtype} {placements} src={src} n={n}"
                check.true(x.dtype == native and x.to_local().dtype == native, f"{what}: dtype")
                check.equal(x.to_torch(), full, what)
            piece = expected_piece(full, mesh1d, placements).astype(dtype)
            y = dt.DTensor.from_local(piece, mesh1d, placements)
            check.true(y.to_local().dtype == native, f"from_local {dtype}: piece dtype")
            check.equal(y.to_torch(), full, f"from_local {dtype} {placements} n={n}")
            z = dt.DTensor.from_local(piece, mesh1d, placements, shape=full.shape)
            check.equal(z.to_torch(), full, f"trusted from_local {dtype} {placements} n={n}")
    f = dt.full((5,), 2, dtype=dtype, device_mesh=mesh1d, placements=[dt.Partial()])
    check.true(f.dtype == native and f.to_local().dtype == native, "factory dtype")
    check.equal(f.to_torch(), np.full(5, 2, native), "full with a non-native dtype")
    check.done()


def test_load_state_dict_converts_non_native_values(mesh1d: dt.DeviceMesh) -> None:
    model = dt.nn.Linear(3, 2 * SIZE + 1, device_mesh=mesh1d, dtype=np.float64)
    dt.parallelize_module(model, mesh1d, dt.ColwiseParallel())
    weight, bias = reference((2 * SIZE + 1, 3)), reference((2 * SIZE + 1,), seed=1)
    model.load_state_dict({"weight": weight.astype(">f8"), "bias": bias.astype(">f4")})
    assert model.weight.to_local().dtype == np.float64
    assert np.array_equal(model.weight.to_torch(), weight)
    assert np.allclose(model.bias.to_torch(), bias.astype(np.float32))


def test_trusted_from_local_checks_this_ranks_piece(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh) -> None:
    # shape given, run_check=False: no communication, but a piece off the split rule raises
    # (a one-element piece claiming a 6-long Shard(0) would otherwise be read past its end)
    for mesh in (mesh1d, mesh2d):
        for n in lengths_for(mesh.size()):
            placements = [dt.Shard(0)] * mesh.ndim
            good = np.zeros(dt.compute_local_shape_and_offset((n, 2), mesh, placements)[0])
            with dt.CommCounter() as counter:
                dt.DTensor.from_local(good, mesh, placements, shape=(n, 2))
                with pytest.raises(dt.ShapeMismatchError, match=r"this rank \(coordinate .*split rule gives"):
                    dt.DTensor.from_local(np.zeros((good.shape[0] + 1, 2)), mesh, placements, shape=(n, 2))
                with pytest.raises(dt.ShapeMismatchError, match="has 1 dims but the local piece has 2"):
                    dt.DTensor.from_local(good, mesh, placements, shape=(n,))
            assert counter.count == 0


ZERO_D_PLACEMENTS = [[dt.Replicate()], [dt.Partial("sum")], [dt.Partial("max")], [dt.Partial("avg")]]


def test_zero_d_through_every_constructor(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    value = np.array(3.5)
    for mesh in (mesh1d, mesh2d):
        for single in ZERO_D_PLACEMENTS:
            placements = single * mesh.ndim
            what = f"0-d {mesh.shape} {placements}"
            for src in (0, None, SIZE - 1):
                x = dt.distribute_tensor(value if src in (None, RANK) else None, mesh, placements, src_data_rank=src)
                check.true(x.shape == () and x.to_local().shape == (), f"{what} src={src}: {x.to_local().shape}")
                check.equal(x.to_torch(), value, f"{what} distribute_tensor src={src}")
            piece = expected_piece(value, mesh, placements)
            for kwargs in ({}, {"shape": ()}, {"shape": (), "run_check": True}):
                y = dt.DTensor.from_local(piece.copy(), mesh, placements, **kwargs)  # type: ignore[arg-type]
                check.true(y.shape == () and y.to_local().shape == (), f"{what} from_local {kwargs}")
                check.equal(y.to_torch(), value, f"{what} from_local {kwargs}")
            for name, make, want in (("zeros", lambda **kw: dt.zeros(**kw), np.zeros(())),
                                     ("full", lambda **kw: dt.full((), 3.5, **kw), value),
                                     ("rand", lambda **kw: dt.rand(**kw), None)):
                z = make(dtype=np.float64, device_mesh=mesh, placements=placements)
                check.true(z.to_local().shape == (), f"{what} {name} piece shape")
                got = z.to_torch()
                check.true(got.shape == () and (want is None or got == want), f"{what} {name}: {got}")
    check.done()


def test_zero_d_round_trips_through_partial(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    value = np.array(-2.25)
    for mesh in (mesh1d, mesh2d):
        x = dt.distribute_tensor(value, mesh, [dt.Replicate()] * mesh.ndim)
        for op in ("sum", "avg", "max", "min"):
            p = x.redistribute(placements=[dt.Partial(op)] * mesh.ndim)
            check.equal(p.to_torch(), value, f"0-d R->P({op}) {mesh.shape}")
            r = p.redistribute(placements=[dt.Replicate()] * mesh.ndim)
            check.true(r.to_local().shape == (), f"0-d P({op})->R piece shape")
            check.equal(r.to_local(), value, f"0-d R->P({op})->R {mesh.shape}")
    check.done()


@pytest.mark.mpi(min_size=2)
def test_distribute_tensor_agrees_its_arguments(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    full = reference((2 * SIZE + 1, 5))
    with pytest.raises(dt.SPMDDivergenceError, match=r"placements: rank 0: \[Shard\(dim=0\)\]; rank 1: \[Shard\(dim=1\)\]"):
        dt.distribute_tensor(full, mesh1d, [dt.Shard(0) if RANK == 0 else dt.Shard(1)])
    with pytest.raises(dt.SPMDDivergenceError, match="src_data_rank: rank 0: 0; rank 1: 1"):
        dt.distribute_tensor(full, mesh1d, [dt.Shard(0)], src_data_rank=min(RANK, 1))
    with pytest.raises(dt.SPMDDivergenceError, match="src_data_rank: rank 0: None; rank 1: 0"):
        dt.distribute_tensor(full, mesh1d, [dt.Shard(0)], src_data_rank=None if RANK == 0 else 0)
    with pytest.raises(ValueError, match=f"src_data_rank={SIZE} is not a rank"):
        dt.distribute_tensor(full, mesh1d, [dt.Shard(0)], src_data_rank=SIZE if RANK == 1 else 0)
    # nothing was left queued: the next, correct calls get the right data
    for src in (0, 1, None):
        x = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)], src_data_rank=src)
        check.equal(x.to_torch(), full, f"after the divergent calls, src={src}")
    # the same placements spelled differently are the same placements
    y = dt.distribute_tensor(full, mesh1d, [dt.Shard(-1) if RANK == 0 else dt.Shard(1)])
    check.equal(y.to_torch(), full, "Shard(-1) on rank 0, Shard(1) elsewhere")
    check.done()


@pytest.mark.mpi(min_size=2)
def test_from_local_agrees_placements(mesh1d: dt.DeviceMesh) -> None:
    piece = np.ones((2, 3))
    for kwargs in ({}, {"shape": (2, 3), "run_check": True}):
        with pytest.raises(dt.SPMDDivergenceError, match=r"from_local: ranks disagree on placements: rank 0: \[Replicate\(\)\]"):
            dt.DTensor.from_local(piece, mesh1d, [dt.Replicate() if RANK == 0 else dt.Partial()], **kwargs)  # type: ignore[arg-type]
    x = dt.DTensor.from_local(piece, mesh1d, [dt.Shard(-1) if RANK == 0 else dt.Shard(1)])
    assert x.shape == (2, 3 * SIZE)


TOO_BIG = 2**63


def test_shapes_beyond_numpys_limit_raise_clearly(mesh1d: dt.DeviceMesh) -> None:
    for make in (lambda: dt.zeros(TOO_BIG, device_mesh=mesh1d),
                 lambda: dt.full((2**40, 2**40), 1.0, device_mesh=mesh1d),
                 lambda: dt.DTensor.from_local(np.zeros(1), mesh1d, [dt.Shard(0)], shape=(TOO_BIG,)),
                 lambda: dt.DTensor.from_local(np.zeros(1), mesh1d, [dt.Shard(0)], shape=(TOO_BIG,), run_check=True)):
        with pytest.raises(dt.ShapeMismatchError, match=r"at most 2\*\*63 - 1"):
            make()
    with pytest.raises(TypeError, match="a shape holds ints"):
        dt.zeros(2.5, device_mesh=mesh1d)


@pytest.mark.parametrize("op", ["max", "min"])
def test_complex_partial_max_min_is_refused_at_creation(mesh1d: dt.DeviceMesh, op: str) -> None:
    plc = [dt.Partial(op)]
    z = np.ones(3, np.complex64)
    for make in (lambda: dt.zeros(3, dtype=np.complex64, device_mesh=mesh1d, placements=plc),
                 lambda: dt.distribute_tensor(z, mesh1d, plc),
                 lambda: dt.distribute_tensor(z, mesh1d, plc, src_data_rank=None),
                 lambda: dt.DTensor.from_local(z, mesh1d, plc),
                 lambda: dt.DTensor.from_local(z, mesh1d, plc, shape=(3,))):
        with pytest.raises(dt.DTypeMismatchError, match=rf"Partial\('{op}'\) is undefined for complex"):
            make()
    assert dt.zeros(3, dtype=np.complex64, device_mesh=mesh1d, placements=[dt.Partial()]).to_torch().sum() == 0


@pytest.mark.mpi(min_size=2)
def test_distribute_tensor_outside_the_mesh_gives_empty_pieces(check: Checker) -> None:
    full = reference((5, 3))
    with dt.DeviceMesh("cpu", [0]) as mesh:
        for src in (0, None):
            for placements in ([dt.Shard(0)], [dt.Replicate()], [dt.Partial()]):
                x = dt.distribute_tensor(full, mesh, placements, src_data_rank=src)
                what = f"{placements} src={src}"
                check.true(x.shape == (5, 3) and x.dtype == full.dtype, f"{what}: metadata")
                if RANK == 0:
                    check.equal(x.to_torch(), full, what)
                else:
                    check.true(x.to_local().size == 0 and x.to_torch() is None, f"{what}: outside piece")
        if RANK != 0:
            with pytest.raises(dt.MeshMismatchError, match=r"not in .* pass the array"):
                dt.distribute_tensor(None, mesh, [dt.Shard(0)])
    check.done()


@pytest.fixture
def spmd_debug() -> Iterator[None]:
    from dtorch_mpi.comm.config import set_spmd_debug
    from dtorch_mpi.comm.config import spmd_debug as was_on

    before = was_on()
    set_spmd_debug(True)
    try:
        yield
    finally:
        set_spmd_debug(before)


@pytest.mark.mpi(min_size=2)
def test_debug_mode_checks_trusted_from_local(mesh1d: dt.DeviceMesh, spmd_debug: None) -> None:
    good = np.zeros(dt.compute_local_shape_and_offset((SIZE + 1,), mesh1d, [dt.Shard(0)])[0])
    with pytest.raises(dt.SPMDDivergenceError, match="ranks disagree on placements"):
        dt.DTensor.from_local(good, mesh1d, [dt.Shard(0) if RANK else dt.Replicate()], shape=(SIZE + 1,))
    wrong = np.zeros(good.size + (RANK == 1))  # one rank's piece is wrong: every rank raises
    with pytest.raises(dt.ShapeMismatchError, match=r"rank 1 \(coordinate \(1,\)\) has"):
        dt.DTensor.from_local(wrong, mesh1d, [dt.Shard(0)], shape=(SIZE + 1,))
    assert dt.DTensor.from_local(good, mesh1d, [dt.Shard(0)], shape=(SIZE + 1,)).shape == (SIZE + 1,)


@pytest.mark.mpi(min_size=2)
def test_debug_mode_catches_ranks_on_different_meshes(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                                      spmd_debug: None, check: Checker) -> None:
    # two meshes over the same ranks: different communicators, which no mesh-level check sees
    with dt.DeviceMesh("cpu", list(range(SIZE))) as other:
        mine = mesh1d if RANK == 0 else other
        full = np.arange(6.0)
        with pytest.raises(dt.SPMDDivergenceError, match=r"distribute_tensor \(DTORCH_SPMD_DEBUG=1\): ranks disagree on mesh: rank 0: cpu mesh of shape"):
            dt.distribute_tensor(full, mine, [dt.Shard(0)])
        with pytest.raises(dt.SPMDDivergenceError, match="ranks disagree on mesh"):
            dt.DTensor.from_local(np.zeros(1), mine, [dt.Replicate()], shape=(1,))
        check.equal(dt.distribute_tensor(full, other, [dt.Shard(0)]).to_torch(), full, "same mesh everywhere")
    # a sub-mesh holds different ranks on different rows, yet it is one mesh on every rank
    tp = mesh2d["tp"]
    x = dt.DTensor.from_local(np.ones(2), tp, [dt.Shard(0)])
    check.equal(x.to_torch(), np.ones(2 * tp.size()), "sub-mesh in debug mode")
    # ranks outside the mesh take part in the check and get their empty pieces
    with dt.DeviceMesh("cpu", [0]) as first:
        y = dt.distribute_tensor(full, first, [dt.Shard(0)])
        check.true(y.to_local().size == (6 if RANK == 0 else 0), "outside the mesh in debug mode")
    check.done()
