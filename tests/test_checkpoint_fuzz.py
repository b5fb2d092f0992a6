"""Single-byte flips of a tiny checkpoint's metadata (every byte outside the datasets' contiguous
data): each load either raises CheckpointError naming the file, on every rank, with the target
unchanged, or loads exactly the saved values. Never h5py's raw RuntimeError ("bad version number
for attribute message"), never a crash (a damaged string type made h5py segfault) or a hang (a
damaged global-heap object under a variable-length string). Bounded: a fixed sample of the
metadata bytes, stopped after ``BUDGET_S`` seconds."""

from __future__ import annotations

import os
import time
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import RANK, SIZE, WORLD, Checker

import dtorch_mpi as dt

# loads of damaged metadata: agreed refusals and plain MPI exchanges, no collective that takes a path
pytestmark = pytest.mark.path_independent

FLIPS = 160  # sampled metadata bytes (nonzero ones first: headers, type and attribute messages)
BUDGET_S = 20.0
FULL = np.arange(2 * SIZE + 1, dtype=np.float64)


def _metadata_bytes(path: str) -> list[int]:
    """Offsets of the bytes outside every dataset's contiguous storage."""
    data = set()
    with h5py.File(path, "r") as f:
        def visit(_: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset) and obj.id.get_offset() is not None:
                data.update(range(obj.id.get_offset(), obj.id.get_offset() + obj.id.get_storage_size()))
        f.visititems(visit)
    return [i for i in range(os.path.getsize(path)) if i not in data]


def _sample(raw: bytes, offsets: list[int]) -> list[int]:
    rng = np.random.default_rng(23)
    nonzero = [i for i in offsets if raw[i]]
    zero = [i for i in offsets if not raw[i]]
    picked = list(rng.permutation(nonzero)[: FLIPS * 3 // 4]) + list(rng.permutation(zero)[: FLIPS // 4])
    return sorted(int(i) for i in picked)


def test_single_byte_metadata_flips_are_refused_or_harmless(shared_dir: str, check: Checker) -> None:
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    src, path = os.path.join(shared_dir, "src.h5"), os.path.join(shared_dir, "flip.h5")
    dt.save({"w": dt.distribute_tensor(FULL, mesh, [dt.Shard(0)]), "step": 7, "seq": [1, "a"]}, src)
    raw = open(src, "rb").read()
    offsets = _sample(raw, _metadata_bytes(src)) if RANK == 0 else []
    offsets = WORLD.bcast(offsets, root=0)
    start, tried, refused = time.monotonic(), 0, 0
    for offset in offsets:
        if WORLD.bcast(time.monotonic() - start > BUDGET_S if RANK == 0 else None, root=0):
            break  # the same decision on every rank
        WORLD.Barrier()  # every rank closed the previous file
        if RANK == 0:
            flipped = bytearray(raw)
            flipped[offset] ^= 0xFF
            with open(path, "wb") as fh:
                fh.write(flipped)
        WORLD.Barrier()
        target: dict[str, Any] = {"w": dt.zeros(*FULL.shape, dtype=np.float64, device_mesh=mesh),
                                  "step": 0, "seq": None}
        tried += 1
        try:
            dt.load(path, target)
        except dt.CheckpointError as exc:
            refused += 1
            check.true(path in str(exc), f"byte {offset}: the error does not name the file: {exc}")
            check.true(not target["w"].to_local().any() and target["step"] == 0 and target["seq"] is None,
                       f"byte {offset}: a refused load changed the target")
            continue
        except Exception as exc:  # the point: nothing but CheckpointError
            check.true(False, f"byte {offset}: {type(exc).__name__}: {exc}")
            continue
        check.equal(target["w"].full_tensor(), FULL, f"byte {offset}: loaded other values")
        check.true(target["step"] == 7 and target["seq"] == [1, "a"], f"byte {offset}: loaded {target}")
    mesh.free()
    check.true(tried >= 30, f"only {tried} flips in {BUDGET_S} s")
    check.true(refused > 0, "no flip was refused: the sample missed the metadata")
    check.done()
