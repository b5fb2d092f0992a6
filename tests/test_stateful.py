"""The Stateful protocol: modules, optimizers and fully_shard-ed modules implement it, a user's own
stateful object checkpoints through it, and the package's import graph has the cycles the
protocol removed gone (scripts/import_graph.py)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import SIZE

import dtorch_mpi as dt
from dtorch_mpi.errors import ShapeMismatchError, StateDictError
from dtorch_mpi.nn.state import load_into
from dtorch_mpi.stateful import InPlaceLoad, Stateful, is_stateful

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import import_graph

pytestmark = pytest.mark.path_independent  # checkpoint exchanges are plain MPI; the backend's paths are tested elsewhere


def _model(mesh: dt.DeviceMesh, seed: int) -> dt.nn.Module:
    dt.manual_seed(seed)
    return dt.nn.Sequential(dt.nn.Linear(3, SIZE + 1, device_mesh=mesh), dt.nn.ReLU(),
                            dt.nn.Linear(SIZE + 1, 2, device_mesh=mesh))


def test_modules_optimizers_and_fully_shard_are_stateful(mesh1d: dt.DeviceMesh) -> None:
    model = _model(mesh1d, 0)
    assert isinstance(model, Stateful)
    assert isinstance(dt.optim.AdamW(model.parameters(), lr=0.1), Stateful)
    assert isinstance(dt.fully_shard(_model(mesh1d, 0), mesh=mesh1d), Stateful)
    assert not isinstance({"a": 1}, Stateful) and not isinstance(model.state_dict()["0.weight"], Stateful)
    for value in (model, dt.optim.SGD(model.parameters(), lr=0.1), Counter(mesh1d, 0.0, 0), {"a": 1}, 3, None,
                  model.state_dict()["0.weight"], np.zeros(2)):
        assert is_stateful(value) == isinstance(value, Stateful), type(value)


def test_module_prepare_load_checks_and_changes_nothing(mesh1d: dt.DeviceMesh) -> None:
    model = _model(mesh1d, 0)
    before = {k: p.to_torch().copy() for k, p in model.state_dict().items()}
    whole = {k: np.full(p.shape, 7.0) for k, p in model.state_dict().items()}
    pending = model.prepare_load(whole)
    assert isinstance(pending, InPlaceLoad) and list(pending.targets) == list(whole)
    assert all(pending.targets[k] is model.state_dict()[k] for k in whole)
    with pytest.raises(StateDictError, match="missing keys"):
        model.prepare_load({"0.weight": whole["0.weight"]})
    assert list(model.prepare_load({"0.weight": whole["0.weight"]}, strict=False).targets) == ["0.weight"]
    with pytest.raises(ShapeMismatchError, match=r"0\.bias"):
        model.prepare_load({**whole, "0.bias": np.zeros(SIZE + 2)})
    pending.apply()  # filling the targets is the load: apply installs nothing
    for k, p in model.state_dict().items():
        assert np.array_equal(p.to_torch(), before[k]), k


class Counter:
    """A user's stateful object that is neither a Module nor an Optimizer: a DTensor and a count
    (the count is a copy in state_dict(), so it loads through prepare_load)."""

    def __init__(self, mesh: dt.DeviceMesh, value: float, count: int) -> None:
        self.total = dt.distribute_tensor(np.full((SIZE + 1,), value), mesh, [dt.Shard(0)])
        self.count = count

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state_dict: Any) -> None:
        pending = self.prepare_load(state_dict)
        load_into(pending.targets, pending.values)
        pending.apply()

    def prepare_load(self, state_dict: Any) -> Any:
        if set(state_dict) != {"total", "count"}:
            raise StateDictError(f"a Counter's state has keys total and count, got {sorted(state_dict)}")
        fresh = dt.DTensor(np.zeros_like(self.total.to_local()), self.total.spec)
        return CounterLoad(self, {"total": fresh}, {"total": state_dict["total"]}, int(state_dict["count"]))


@dataclass
class CounterLoad:
    owner: Counter
    targets: dict[str, dt.DTensor]
    values: dict[str, Any]
    count: int

    def apply(self) -> None:
        self.owner.total, self.owner.count = self.targets["total"], self.count


def test_a_users_stateful_object_checkpoints_through_the_protocol(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "counter.h5")
    model = _model(mesh1d, 1)
    dt.save({"counter": Counter(mesh1d, 2.5, 4), "model": model}, path)
    target, other = Counter(mesh1d, 0.0, 0), _model(mesh1d, 2)
    assert isinstance(target, Stateful)
    dt.load(path, {"counter": target, "model": other})
    assert target.count == 4 and np.array_equal(target.total.to_torch(), np.full(SIZE + 1, 2.5))
    direct = Counter(mesh1d, 0.0, 0)
    direct.load_state_dict({"total": np.full(SIZE + 1, 1.5), "count": 3})
    assert direct.count == 3 and np.array_equal(direct.total.to_torch(), np.full(SIZE + 1, 1.5))
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert np.array_equal(a.to_torch(), b.to_torch()), k


# the cycles issue 24 item 4 names, all gone (REMAINING lists any that come back on purpose)
NAMED = [("module", "dtorch_mpi.nn.module", "dtorch_mpi.nn.state"), ("package", "checkpoint", "nn"),
         ("package", "checkpoint", "optim"), ("package", "dtensor", "autograd"), ("package", "dtensor", "ops"),
         ("package", "autograd", "ops")]
REMAINING: set[tuple[str, str, str]] = set()


@pytest.mark.rank_independent
@pytest.mark.parametrize("level,a,b", NAMED)
def test_named_import_cycles(level: str, a: str, b: str) -> None:
    modules = import_graph.module_graph()
    graph = modules if level == "module" else import_graph.package_graph(modules)
    assert a in graph and b in graph
    cyclic = import_graph.in_one_cycle(graph, a, b)
    assert cyclic == ((level, a, b) in REMAINING), f"{a} <-> {b}: cyclic={cyclic}; update REMAINING"
    if (level, a, b) not in REMAINING:
        assert level == "module" or b not in graph[a] or a not in graph[b]


@pytest.mark.rank_independent
def test_no_package_import_cycles() -> None:
    """Beyond the named ones: no two packages import each other, lazily or not (a comm <-> spmd
    cycle, the divergence check's text exchange, came in after those were removed)."""
    assert import_graph.cycles(import_graph.package_graph(import_graph.module_graph())) == []


@pytest.mark.rank_independent
def test_import_graph_sees_lazy_imports_and_skips_type_checking(tmp_path: Any) -> None:
    pkg = tmp_path / "dtorch_mpi"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import X\n"
                                      "def f():\n    from .. import c\n")
    (pkg / "b.py").write_text("from .sub.a import f\n")
    (pkg / "c.py").write_text("import dtorch_mpi.b\n")
    graph = import_graph.module_graph(pkg)
    assert graph["dtorch_mpi.sub.a"] == {"dtorch_mpi.c"} and graph["dtorch_mpi.sub"] == {"dtorch_mpi.sub.a"}
    assert graph["dtorch_mpi.b"] == {"dtorch_mpi.sub.a"} and graph["dtorch_mpi.c"] == {"dtorch_mpi.b"}
    assert import_graph.cycles(graph) == [["dtorch_mpi.b", "dtorch_mpi.c", "dtorch_mpi.sub.a"]]
