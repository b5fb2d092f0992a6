"""The autograd engine's hook points (docs/autograd.md "Hooks"): a tensor's gradient hook runs
once with the complete gradient before it flows into the tensor's producer (and may replace
it), a leaf's post-accumulate-grad hook runs once per backward as soon as its .grad is
complete (not at the end of backward), and queued callbacks run when backward has finished."""

from __future__ import annotations

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import Checker, to_numpy

import dtorch_mpi as dt
from dtorch_mpi.autograd import queue_callback, register_hook, register_post_accumulate_grad_hook

R, S0 = dt.Replicate(), dt.Shard(0)


def _leaf(mesh: dt.DeviceMesh, a: np.ndarray, placement: dt.Placement) -> dt.DTensor:
    return dt.distribute_tensor(a, mesh, [placement], requires_grad=True)


@pytest.mark.parametrize("placement", [R, S0], ids=["replicate", "shard0"])
def test_tensor_hook_sees_the_complete_gradient_and_may_replace_it(mesh1d: dt.DeviceMesh, placement: dt.Placement,
                                                                   check: Checker) -> None:
    x_full = np.linspace(-1, 1, 7)
    x = _leaf(mesh1d, x_full, placement)
    h = x * 3.0
    seen: list[np.ndarray] = []

    def hook(g: dt.DTensor) -> dt.DTensor:
        seen.append(to_numpy(g.to_torch()))
        return g * 2.0

    handle = h.register_hook(hook)
    (h * h + h).sum().backward()  # two uses of h: the hook gets their sum, once
    check.true(len(seen) == 1, f"the hook ran {len(seen)} times")
    check.equal(seen[0], 2 * (3 * x_full) + 1, "d loss / d h", exact=False, rtol=0, atol=1e-12)
    check.equal(x.grad.to_torch(), 3 * 2 * (2 * (3 * x_full) + 1), "the replaced gradient flows on",
                exact=False, rtol=0, atol=1e-12)
    handle.remove()
    handle.remove()  # idempotent
    x.grad = None
    h2 = x * 3.0
    h2.sum().backward()
    check.true(len(seen) == 1, "a removed hook does not run")
    check.done()


def test_post_accumulate_hook_runs_once_when_the_leaf_gradient_is_complete(mesh1d: dt.DeviceMesh,
                                                                           check: Checker) -> None:
    w_full = np.arange(1.0, 6.0)
    w = _leaf(mesh1d, w_full, R)
    x = _leaf(mesh1d, np.linspace(0.5, 1.5, 5), S0)
    events: list[str] = []
    grads: list[np.ndarray] = []

    def done(leaf: dt.DTensor) -> None:
        events.append("w complete")
        grads.append(to_numpy(leaf.grad.redistribute(placements=[R]).to_torch()))  # a collective in a hook

    w.register_post_accumulate_grad_hook(done)
    (w * x).sum().backward()  # the first backward made w's accumulator: it is older than what follows
    events.clear()
    grads.clear()
    w.grad = None
    a = x.exp()
    a.register_hook(lambda g: events.append("into exp") or None)
    loss = (a * w + w * w).sum()  # w used twice, after exp
    loss.backward()
    check.true(events == ["w complete", "into exp"], f"the leaf's hook waits for nothing older: {events}")
    xf = np.linspace(0.5, 1.5, 5)
    check.equal(grads[0], np.exp(xf) + 2 * w_full, "w.grad is complete in its hook", exact=False, rtol=0, atol=1e-12)
    check.done()


def test_queued_callbacks_run_after_every_node(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    w = _leaf(mesh1d, np.ones(4), R)
    x = _leaf(mesh1d, np.ones(4), S0)
    events: list[str] = []

    def second() -> None:
        events.append("second")

    def first() -> None:
        events.append("first")
        queue_callback(second)  # a callback may queue another

    def on_w(leaf: dt.DTensor) -> None:
        events.append("w")
        queue_callback(first)

    register_post_accumulate_grad_hook(w, on_w)
    register_post_accumulate_grad_hook(x, lambda leaf: events.append("x") or None)
    (w * x).sum().backward()
    check.true(events[-2:] == ["first", "second"] and sorted(events[:2]) == ["w", "x"], f"{events}")
    check.done()


def test_hook_refusals(mesh1d: dt.DeviceMesh) -> None:
    plain = dt.distribute_tensor(np.ones(3), mesh1d, [R])
    with pytest.raises(RuntimeError, match="does not require grad"):
        register_hook(plain, lambda g: None)
    leaf = _leaf(mesh1d, np.ones(3), R)
    with pytest.raises(RuntimeError, match="needs a leaf"):
        register_post_accumulate_grad_hook(leaf * 2.0, lambda t: None)
    with pytest.raises(RuntimeError, match="no backward is running"):
        queue_callback(lambda: None)
    with pytest.raises(TypeError, match="must be callable"):
        register_hook(leaf, 3)  # type: ignore[arg-type]
