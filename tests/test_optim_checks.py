"""Optimizers check everything before they change anything: hyperparameters as PyTorch does
(plus NaN/inf and types) in the constructor, add_param_group, load_state_dict and every step();
a state_dict's step counts and layout on load (also through dtorch.load); and before the first
update of a step, every parameter's gradient and state (a parameter re-placed by
parallelize_module after its optimizer was built is refused by name, and its state can be
re-homed with ``opt.load_state_dict(opt.state_dict())``)."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import SIZE, Checker, on_mesh, reference, to_numpy

import dtorch_mpi as dt
from dtorch_mpi.nn import Parameter

N = 2 * SIZE + 1  # rows not divisible by the rank count


def _params(mesh: dt.DeviceMesh) -> list[tuple[str, Parameter]]:
    w = Parameter(dt.distribute_tensor(reference((N, 3)), mesh, [dt.Shard(0)]))
    b = Parameter(dt.distribute_tensor(reference((3,), seed=1), mesh, [dt.Replicate()]))
    return [("fc.weight", w), ("fc.bias", b)]


def _grads(params: list[tuple[str, Parameter]], seed: int) -> None:
    for k, (_, p) in enumerate(params):
        p.grad = dt.distribute_tensor(reference(p.shape, seed=seed + k), p.device_mesh, p.placements)


def _snapshot(opt: dt.optim.Optimizer) -> Any:
    """Every parameter's and state tensor's complete value, the step counts and the groups."""
    params = [to_numpy(p.to_torch()).copy() for g in opt.param_groups for p in g["params"]]
    state = {id(p): {k: (to_numpy(v.to_torch()).copy() if isinstance(v, dt.DTensor) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, copy.deepcopy(groups)


def _same(a: Any, b: Any) -> bool:
    (pa, sa, ga), (pb, sb, gb) = a, b
    return (all(np.array_equal(x, y) for x, y in zip(pa, pb)) and ga == gb and sa.keys() == sb.keys()
            and all(sa[k].keys() == sb[k].keys() and all(np.array_equal(sa[k][n], sb[k][n]) for n in sa[k])
                    for k in sa))


# --- hyperparameters ------------------------------------------------------------------------------
BAD_HYPERPARAMETERS: list[tuple[str, Callable[[Any], Any], str]] = [
    ("SGD lr < 0", lambda p: dt.optim.SGD(p, lr=-1.0), r"invalid lr -1\.0"),
    ("SGD lr NaN", lambda p: dt.optim.SGD(p, lr=math.nan), r"invalid lr nan .must be finite"),
    ("SGD lr inf", lambda p: dt.optim.SGD(p, lr=math.inf), r"invalid lr inf"),
    ("SGD lr str", lambda p: dt.optim.SGD(p, lr="0.1"), r"invalid lr '0\.1': a real number"),
    ("SGD momentum < 0", lambda p: dt.optim.SGD(p, lr=0.1, momentum=-0.5), r"invalid momentum"),
    ("SGD weight_decay NaN", lambda p: dt.optim.SGD(p, lr=0.1, weight_decay=math.nan), r"invalid weight_decay"),
    ("SGD dampening NaN", lambda p: dt.optim.SGD(p, lr=0.1, momentum=0.9, dampening=math.nan), r"invalid dampening"),
    ("SGD nesterov not a flag", lambda p: dt.optim.SGD(p, lr=0.1, momentum=0.9, nesterov="yes"), r"invalid nesterov"),
    ("SGD nesterov without momentum", lambda p: dt.optim.SGD(p, lr=0.1, nesterov=True), r"Nesterov"),
    ("AdamW lr NaN", lambda p: dt.optim.AdamW(p, lr=math.nan), r"AdamW: invalid lr nan"),
    ("AdamW eps < 0", lambda p: dt.optim.AdamW(p, eps=-1e-8), r"invalid eps"),
    ("AdamW weight_decay < 0", lambda p: dt.optim.AdamW(p, weight_decay=-0.1), r"invalid weight_decay"),
    ("AdamW beta1 = 1", lambda p: dt.optim.AdamW(p, betas=(1.0, 0.9)), r"beta parameter at index 0"),
    ("AdamW beta2 NaN", lambda p: dt.optim.AdamW(p, betas=(0.9, math.nan)), r"beta parameter at index 1"),
    ("AdamW 3 betas", lambda p: dt.optim.AdamW(p, betas=(0.9, 0.99, 0.999)), r"invalid betas .* a pair"),
    ("AdamW 1 beta", lambda p: dt.optim.AdamW(p, betas=(0.9,)), r"invalid betas .* a pair"),
    ("AdamW betas a number", lambda p: dt.optim.AdamW(p, betas=0.9), r"invalid betas 0\.9"),
    ("AdamW amsgrad not a flag", lambda p: dt.optim.AdamW(p, amsgrad=1), r"invalid amsgrad"),
]


@pytest.mark.parametrize(("what", "make", "match"), BAD_HYPERPARAMETERS, ids=[c[0] for c in BAD_HYPERPARAMETERS])
def test_bad_hyperparameters_are_refused(mesh1d: dt.DeviceMesh, what: str, make: Callable[[Any], Any],
                                         match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(_params(mesh1d))


def test_add_param_group_and_step_check_hyperparameters(mesh1d: dt.DeviceMesh) -> None:
    """add_param_group refuses a bad group and keeps the others; a hyperparameter set to NaN in
    place (as a scheduler sets lr) is refused by step() before any parameter changes."""
    params = _params(mesh1d)
    opt = dt.optim.AdamW(params[:1], lr=0.1)
    with pytest.raises(ValueError, match=r"invalid lr nan"):
        opt.add_param_group({"params": [params[1][1]], "lr": math.nan})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [params[1][1]], "betas": [0.8, 0.9]})
    assert opt.param_groups[1]["betas"] == (0.8, 0.9)
    _grads(params, 0)
    opt.step()
    before = _snapshot(opt)
    opt.param_groups[1]["lr"] = math.nan  # the second group: the first would be updated first
    with pytest.raises(ValueError, match=r"invalid lr nan"):
        opt.step()
    opt.param_groups[1]["lr"] = 0.1
    assert _same(before, _snapshot(opt)), "a refused step changed a parameter or the state"


# --- loading: state_dict values --------------------------------------------------------------------
def _trained(mesh: dt.DeviceMesh, cls: Any = dt.optim.AdamW, **kw: Any) -> tuple[Any, dt.optim.Optimizer]:
    params = _params(mesh)
    opt = cls(params, **kw)
    for step in range(2):
        _grads(params, 10 * step)
        opt.step()
    return params, opt


def _edit(sd: dict[str, Any], how: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    out = {"state": {k: dict(v) for k, v in sd["state"].items()},
           "param_groups": [dict(g) for g in sd["param_groups"]]}
    how(out)
    return out


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def how(sd: dict[str, Any]) -> None:
        node = sd
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return how


BAD_LOADS: list[tuple[str, Callable[[dict[str, Any]], None], type[Exception], str]] = [
    ("step str", _set(("state", 1, "step"), "abc"), dt.StateDictError, r"fc\.bias: its state's step is 'abc'"),
    ("step None", _set(("state", 1, "step"), None), dt.StateDictError, r"step is None"),
    ("step -1", _set(("state", 0, "step"), -1), dt.StateDictError, r"fc\.weight: its state's step is -1"),
    ("step 1.5", _set(("state", 0, "step"), 1.5), dt.StateDictError, r"step is 1\.5"),
    ("step bool", _set(("state", 0, "step"), True), dt.StateDictError, r"step is True"),
    ("step missing", lambda sd: sd["state"][1].pop("step"), dt.StateDictError, r"lacks \['step'\]"),
    ("unexpected entry", _set(("state", 0, "momentum_buffer"), 1.0), dt.StateDictError,
     r"unexpected \['momentum_buffer'\]"),
    ("moment missing", lambda sd: sd["state"][0].pop("exp_avg_sq"), dt.StateDictError, r"lacks \['exp_avg_sq'\]"),
    ("lr NaN", _set(("param_groups", 0, "lr"), math.nan), ValueError, r"param_groups\[0\]: AdamW: invalid lr nan"),
    ("3 betas", _set(("param_groups", 0, "betas"), (0.9, 0.99, 0.999)), ValueError, r"invalid betas"),
    ("eps < 0", _set(("param_groups", 0, "eps"), -1.0), ValueError, r"invalid eps"),
    ("index twice", _set(("param_groups", 0, "params"), [0, 0]), dt.StateDictError, r"index twice"),
    ("index not an int", _set(("param_groups", 0, "params"), [0, "1"]), dt.StateDictError, r"holds '1'"),
    ("state key not an index", lambda sd: sd["state"].update({"x": sd["state"].pop(1)}), dt.StateDictError,
     r"state key 'x' is not a parameter index"),
    ("state twice", lambda sd: sd["state"].update({"1": sd["state"][1]}), dt.StateDictError, r"state twice"),
    ("state not a mapping", _set(("state", 0), [1, 2]), dt.StateDictError, r"is a list, not a mapping"),
]


@pytest.mark.parametrize(("what", "how", "error", "match"), BAD_LOADS, ids=[c[0] for c in BAD_LOADS])
def test_bad_state_dict_is_refused_and_changes_nothing(mesh1d: dt.DeviceMesh, what: str, how: Any,
                                                      error: type[Exception], match: str) -> None:
    params, opt = _trained(mesh1d)
    bad = _edit(opt.state_dict(), how)
    before = _snapshot(opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(bad)
    assert _same(before, _snapshot(opt)), "a refused load changed the optimizer"
    _grads(params, 5)
    opt.step()  # still trains
    assert all(np.isfinite(p.to_torch()).all() for _, p in params)


def test_valid_step_spellings_load(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """A NumPy integer, an integral float (PyTorch's float step) or a 0-d array is a count; string
    state keys (a checkpoint's) are indices; the loaded optimizer continues exactly."""
    for spelling in (np.int64(2), 2.0, np.array(2)):
        params, opt = _trained(mesh1d)
        sd = {"state": {str(k): {**v, "step": spelling} for k, v in opt.state_dict()["state"].items()},
              "param_groups": opt.state_dict()["param_groups"]}
        other_params, other = _trained(mesh1d)
        other.load_state_dict(sd)
        check.true(all(type(s["step"]) is int and s["step"] == 2 for s in other.state.values()),
                   f"{spelling!r}: step restored as the int 2")
        _grads(params, 7)
        _grads(other_params, 7)
        opt.step()
        other.step()
        for (name, p), (_, q) in zip(params, other_params):
            check.equal(p.to_torch(), q.to_torch(), f"{type(spelling).__name__}: {name} after a step")
    check.done()


def test_checkpoint_with_bad_training_state_is_refused(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """The same checks on dtorch.load's path (prepare_load): a saved step 'abc', None or -1, a
    NaN lr or three betas raise CheckpointError on every rank and leave the optimizer as it was."""
    path = os.path.join(shared_dir, "bad_optim.h5")
    for how, match in ((_set(("state", 0, "step"), "abc"), r"step is 'abc'"),
                       (_set(("state", 0, "step"), None), r"step is None"),
                       (_set(("state", 1, "step"), -1), r"step is -1"),
                       (_set(("param_groups", 0, "lr"), math.nan), r"invalid lr nan"),
                       (_set(("param_groups", 0, "betas"), [0.9, 0.99, 0.999]), r"invalid betas")):
        _, saved = _trained(mesh1d)
        dt.save({"optim": _edit(saved.state_dict(), how)}, path)
        _, opt = _trained(mesh1d, lr=0.5)
        before = _snapshot(opt)
        with pytest.raises(dt.CheckpointError, match=match):
            dt.load(path, {"optim": opt})
        assert _same(before, _snapshot(opt)), "a refused load changed the optimizer"


# --- step(): nothing updated before everything is checked -------------------------------------------
def test_corrupt_state_is_refused_before_any_update(mesh1d: dt.DeviceMesh) -> None:
    params, opt = _trained(mesh1d, dt.optim.SGD, lr=0.1, momentum=0.9)
    _grads(params, 3)
    for corrupt, error, match in (({"step": "abc"}, dt.StateDictError, r"fc\.bias: its state's step is 'abc'"),
                                  ({"step": -1}, dt.StateDictError, r"step is -1"),
                                  ({"momentum_buffer": None}, dt.StateDictError, r"fc\.bias: .*lacks the tensor")):
        state = opt.state[params[1][1]]
        saved = dict(state)
        state.update(corrupt)
        before = _snapshot(opt)
        with pytest.raises(error, match=match):
            opt.step()
        assert _same(before, _snapshot(opt)), f"{corrupt}: a refused step changed something"
        state.clear()
        state.update(saved)
    opt.step()


@pytest.mark.parametrize("cls", ["SGD", "AdamW"])
def test_step_after_parallelize_module_names_the_parameter(mesh1d: dt.DeviceMesh, check: Checker, cls: str) -> None:
    """Item 11: the optimizer's state was made for Replicate parameters; parallelize_module
    re-places them. step() raises PlacementError naming the parameter before anything changes;
    opt.load_state_dict(opt.state_dict()) re-homes the state, and training then equals the
    replicated run's."""
    make = (lambda ps: dt.optim.SGD(ps, lr=0.1, momentum=0.9)) if cls == "SGD" else (
        lambda ps: dt.optim.AdamW(ps, lr=0.1))
    x = on_mesh(mesh1d, reference((4, 3), seed=2))  # a plain piece of the mesh's array library

    def model_and_opt() -> tuple[dt.nn.Linear, dt.optim.Optimizer]:
        dt.manual_seed(0)
        lin = dt.nn.Linear(3, N, device_mesh=mesh1d, dtype=np.float64)
        opt = make(list(lin.named_parameters()))
        (lin(x) ** 2).sum().backward()
        opt.step()
        return lin, opt

    lin, opt = model_and_opt()
    ref, ref_opt = model_and_opt()
    dt.parallelize_module(lin, mesh1d, dt.ColwiseParallel())
    opt.zero_grad()
    (lin(x) ** 2).sum().backward()
    before = _snapshot(opt)
    with pytest.raises(dt.PlacementError, match=r"^weight \(\[Shard\(dim=0\)\].*re-placed.*opt\.load_state_dict"):
        opt.step()
    check.true(_same(before, _snapshot(opt)), "a refused step changed something")
    opt.load_state_dict(opt.state_dict())
    opt.step()
    ref_opt.zero_grad()
    (ref(x) ** 2).sum().backward()
    ref_opt.step()
    for (name, p), (_, q) in zip(lin.named_parameters(), ref.named_parameters()):
        check.equal(p.to_torch(), q.to_torch(), f"{name} after the re-homed step", exact=False, rtol=1e-12, atol=1e-14)
        check.true(all(t.placements == p.placements for t in opt.state[p].values() if isinstance(t, dt.DTensor)),
                   f"{name}: state follows the parameter's placements")
    check.done()
