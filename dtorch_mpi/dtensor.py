"""DTensor: one global array whose pieces live on the ranks of a DeviceMesh.

The class and its methods (metadata, autograd entry points, the Python and NumPy protocols,
redistribute, to_torch); making one from pieces (the ``from_local`` protocol) is construction.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import array_namespace
from .construction import local_and_spec
from .errors import DTypeMismatchError, MeshMismatchError, PlacementError, ShapeMismatchError
from .grad_mode import _GradMode, note_requires_grad
from .mesh import DeviceMesh
from .placement import Placement, Replicate, normalized_placements
from .redistribute import CompiledHandle, CompiledPlan, compile_plan, run_compiled
from .spec import DTensorSpec

_UNCACHEABLE = object()  # DTensor._plan_to: placements that cannot key the plan memo

_UFUNC_NAMES = {"absolute": "abs", "equal": "eq", "not_equal": "ne", "less": "lt", "less_equal": "le",
                "greater": "gt", "greater_equal": "ge", "invert": "bitwise_not"}
"""NumPy ufuncs whose dtorch operator has another name (``DTensor.__array_ufunc__``)."""


def _unwired(*_: Any) -> Any:
    raise RuntimeError("dtorch_mpi.dtensor was used before the autograd graph and the operators were wired in "
                       "(dtorch_mpi/__init__.py does it): import dtorch_mpi")


@dataclass
class Wiring:
    """What DTensor methods call but dtensor.py does not import: the autograd graph and the
    operator table import DTensor, so ``dtorch_mpi/__init__.py`` wires them in here once
    (``autograd.wire``, ``ops.exported``), as it installs the operator methods."""

    run_backward: Callable[..., None] = _unwired
    check_grad_layout: Callable[..., None] = _unwired
    register_hook: Callable[..., Any] = _unwired
    register_post_accumulate_grad_hook: Callable[..., Any] = _unwired
    record_redistribute: Callable[..., Any] = _unwired
    exported: Callable[[], Mapping[str, Callable[..., Any]]] = _unwired


WIRING = Wiring()


class DTensor:
    """A distributed array. Construct with ``from_local``, ``distribute_tensor`` or a factory.

    ``to_local()`` is this rank's piece (no copy); ``to_torch()`` gathers the complete value.
    """

    __slots__ = ("_local", "_spec", "_pending", "_requires_grad", "_grad_fn", "_grad_acc", "_grad", "_version",
                 "__weakref__")

    def __init__(self, local: Any, spec: DTensorSpec, *, _pending: CompiledHandle | None = None):
        self._local = local
        self._spec = spec
        self._pending = _pending
        self._requires_grad = False
        self._grad_fn: Any = None
        # set lazily (every operator result is built here, so the hot path stays short):
        # _grad (see .grad), _grad_acc (a leaf's accumulator, autograd/graph.py) and _version
        # (bumped by every in-place op, so backward can refuse values changed after saving)

    # --- metadata -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype:
        return self._spec.dtype

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    @property
    def size(self) -> int:
        """The element count (NumPy's attribute); ``numel()`` is torch's name for it."""
        return prod(self._spec.shape)

    def numel(self) -> int:
        return prod(self._spec.shape)

    def dim(self) -> int:
        """torch's name for ``ndim``."""
        return len(self._spec.shape)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def spec(self) -> DTensorSpec:
        return self._spec

    # --- autograd (dtorch_mpi.autograd records and replays; see docs/autograd.md) ---------
    @property
    def requires_grad(self) -> bool:
        """True for a leaf that asked for gradients and for every result computed from one."""
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    def requires_grad_(self, requires_grad: bool = True) -> "DTensor":
        """Mark this leaf as needing gradients (in place); returns self."""
        if self._grad_fn is not None and not requires_grad:
            raise RuntimeError("requires_grad can only be cleared on a leaf; use detach() instead")
        if requires_grad and self.dtype.kind not in "fc":
            raise TypeError(
                f"only floating or complex tensors can require gradients, this one is {self.dtype}; "
                f"cast it first (x.astype(np.float32))"
            )
        self._requires_grad = bool(requires_grad)
        if requires_grad:
            note_requires_grad()
        return self

    @property
    def grad(self) -> "DTensor | None":
        """The accumulated gradient (a DTensor on the same mesh), None before the first backward."""
        return getattr(self, "_grad", None)

    @grad.setter
    def grad(self, value: "DTensor | None") -> None:
        if value is not None:
            check_assigned_grad(self, value)
        self._grad = value

    @property
    def is_leaf(self) -> bool:
        """True unless this tensor was computed by a recorded operation."""
        return self._grad_fn is None

    @property
    def grad_fn(self) -> Any:
        """The recorded operation that produced this tensor (None for a leaf)."""
        return self._grad_fn

    def detach(self) -> "DTensor":
        """The same piece and spec, outside the autograd graph (no copy)."""
        return DTensor(self.to_local(), self._spec)

    def backward(self, gradient: "DTensor | None" = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into ``leaf.grad`` for every leaf that requires grad.

        Collective over the mesh (backward runs the adjoints of the forward's redistributes).
        ``gradient=None`` needs a one-element tensor (a scalar loss gets gradient one whatever
        its placements); otherwise ``gradient`` is d loss/d self, placed as the tensor allows:
        as its Shard on a Shard dim, Replicate on a Partial dim, Replicate or Partial on a
        Replicate dim.
        """
        if gradient is not None:
            check_gradient_argument(self, gradient)
        if gradient is None:
            if self.size != 1:
                raise RuntimeError(
                    f"backward() without a gradient needs a one-element tensor (a scalar loss); this "
                    f"one has shape {self.shape}: reduce it (e.g. loss.sum()) or pass gradient="
                )
            seed = tuple(Replicate() if p.is_partial() else p for p in self.placements)
            spec = self._spec.with_placements(seed)
            xp = array_namespace(self.device_mesh.device_type)
            gradient = DTensor(xp.ones(spec.local_shape, dtype=self.dtype), spec)
        WIRING.check_grad_layout("backward", self._spec, gradient)
        WIRING.run_backward(self, gradient, retain_graph)

    def register_hook(self, hook: Any) -> Any:
        """``hook(grad)`` each backward once the gradient with respect to this tensor is complete,
        before it flows on; it may return a replacement. Returns a handle (``.remove()``)."""
        return WIRING.register_hook(self, hook)

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:
        """``hook(self)`` each backward once this leaf's ``.grad`` holds all of that backward's
        contributions. Returns a handle (``.remove()``)."""
        return WIRING.register_post_accumulate_grad_hook(self, hook)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DTensor")
        return self.shape[0]

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={self.shape}, dtype={self.dtype}, placements={list(self.placements)}, "
            f"mesh={self.device_mesh.shape}, local_shape={self._spec.local_shape})"
        )

    # --- Python and NumPy protocols (docs/concepts.md "Python and NumPy protocols") -------
    # None of them communicates: each decision is a function of metadata every rank shares,
    # so every rank returns the same value or raises the same error.
    def item(self) -> Any:
        """The value of a one-element tensor as a Python scalar, where this rank holds it
        (every mesh dim ``Replicate``); otherwise a clear error naming the redistribute."""
        if self.size != 1:
            raise ValueError(
                f"only a one-element DTensor converts to a Python scalar; this one has shape {self.shape}"
            )
        if any(not isinstance(p, Replicate) for p in self.placements):
            full = ", ".join(["Replicate()"] * self.device_mesh.ndim)
            raise PlacementError(
                f"the value of this one-element DTensor is not local (placements {list(self.placements)}): "
                f"make it so explicitly with x = x.redistribute(placements=[{full}]) (one small "
                f"collective, every rank calls it), or read x.to_torch()"
            )
        if self.device_mesh.get_coordinate() is None:
            raise MeshMismatchError("this rank is outside the tensor's mesh and holds no value")
        return self.to_local().item()

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError(
                "The truth value of a DTensor with more than one element is ambiguous. Use a.any() or a.all()"
                if self.size else
                "The truth value of an empty DTensor is ambiguous. Use `a.size > 0` to check that it is not empty."
            )
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __iter__(self) -> Any:
        raise TypeError(
            "a DTensor is not iterable element by element (its rows may live on other ranks); "
            "index it (x[i]) or iterate x.to_torch() (the complete value) or x.to_local() (this rank's piece)"
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise TypeError(
            "a DTensor does not convert to a NumPy array implicitly (that would gather it without "
            "saying so): x.to_torch() is the complete value on every rank, x.to_local() this rank's piece"
        )

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """A NumPy ufunc called as a function runs the dtorch operator of the same name (same
        placement rules, no hidden communication): ``np.exp(x)`` is ``dt.exp(x)`` and
        ``np.float64(2) * x`` is ``dt.multiply``; a plain array operand is refused as it is in
        ``x + array``. Other ufuncs, ufunc methods and ``out=``/``where=`` raise TypeError."""
        fn = WIRING.exported().get(_UFUNC_NAMES.get(ufunc.__name__, ufunc.__name__))
        if fn is None or method != "__call__" or kwargs:
            call = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
            extra = f" with {sorted(kwargs)}" if kwargs and fn is not None and method == "__call__" else ""
            raise TypeError(
                f"{call}{extra} does not run on a DTensor"
                + (f"; use dt.{fn.__name__}(...)" if fn is not None else "")
                + "; for NumPy, x.to_torch() is the complete value on every rank, x.to_local() this rank's piece"
            )
        # NumPy hands a scalar operand (np.float64(2) * x) over as a 0-d array: a scalar again
        return fn(*(a[()] if isinstance(a, np.ndarray) and a.ndim == 0 else a for a in inputs))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        name = getattr(func, "__name__", str(func))
        hint = f"use dt.{name}(...) (see dt.signature({name!r})); " if name in WIRING.exported() else ""
        raise TypeError(
            f"numpy.{name} does not run on a DTensor: {hint}for NumPy, x.to_torch() is the complete "
            f"value on every rank, x.to_local() this rank's piece"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a DTensor cannot be pickled (its pieces live on several ranks and its mesh holds an MPI "
            "communicator): save it with dt.save({'x': x}, path) (HDF5, every rank calls it), or "
            "pickle x.to_torch() (the complete value) or x.to_local() (this rank's piece); x.clone() copies it"
        )

    if TYPE_CHECKING:  # operators and methods installed by dtorch_mpi.ops (see signature())
        T: DTensor

        def __add__(self, other: Any) -> DTensor: ...
        def __radd__(self, other: Any) -> DTensor: ...
        def __sub__(self, other: Any) -> DTensor: ...
        def __rsub__(self, other: Any) -> DTensor: ...
        def __mul__(self, other: Any) -> DTensor: ...
        def __rmul__(self, other: Any) -> DTensor: ...
        def __truediv__(self, other: Any) -> DTensor: ...
        def __rtruediv__(self, other: Any) -> DTensor: ...
        def __floordiv__(self, other: Any) -> DTensor: ...
        def __mod__(self, other: Any) -> DTensor: ...
        def __pow__(self, other: Any) -> DTensor: ...
        def __matmul__(self, other: Any) -> DTensor: ...
        def __neg__(self) -> DTensor: ...
        def __abs__(self) -> DTensor: ...
        def __invert__(self) -> DTensor: ...
        def __lt__(self, other: Any) -> DTensor: ...
        def __le__(self, other: Any) -> DTensor: ...
        def __gt__(self, other: Any) -> DTensor: ...
        def __ge__(self, other: Any) -> DTensor: ...
        def __and__(self, other: Any) -> DTensor: ...
        def __or__(self, other: Any) -> DTensor: ...
        def __getitem__(self, key: Any) -> DTensor: ...
        def __iadd__(self, other: Any) -> DTensor: ...
        def __isub__(self, other: Any) -> DTensor: ...
        def __imul__(self, other: Any) -> DTensor: ...
        def __itruediv__(self, other: Any) -> DTensor: ...
        def __getattr__(self, name: str) -> Any: ...

    # --- local piece ----------------------------------------------------------------------
    def wait(self) -> "DTensor":
        """Finish a pending ``redistribute(async_op=True)``; returns self."""
        if self._pending is not None:
            self._local = self._pending.wait()
            self._pending = None
        return self

    def to_local(self) -> Any:
        """This rank's piece (a NumPy or CuPy array), without copying."""
        self.wait()
        return self._local

    # --- communication --------------------------------------------------------------------
    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> "DTensor":
        """The same global value with new placements on the same mesh.

        With ``async_op=True`` the collectives are nonblocking: a DTensor is returned at once
        and its piece materialises when first used (``to_local()``, any operator) or on
        ``.wait()``.
        """
        if device_mesh is not None:
            self._check_target_mesh(device_mesh)
        plan = self._plan_to(placements)
        if async_op:
            out = DTensor(None, plan.out_spec, _pending=CompiledHandle(self.to_local(), plan))
        else:
            out = DTensor(run_compiled(self.to_local(), plan), plan.out_spec)
        if self._requires_grad and _GradMode.enabled:
            WIRING.record_redistribute(self, out)
        return out

    def _check_target_mesh(self, device_mesh: Any) -> None:
        mesh = self.device_mesh
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(
                f"redistribute(device_mesh=None, placements=None): the first positional argument is "
                f"device_mesh, got {device_mesh!r}; pass the placements by keyword: "
                f"x.redistribute(placements={device_mesh!r})"
            )
        if device_mesh != mesh:
            raise MeshMismatchError(
                f"redistribute to another mesh is not supported: the tensor lives on {mesh!r}, "
                f"the target is {device_mesh!r}; gather with to_torch() and distribute_tensor() "
                f"onto the new mesh instead"
            )

    def _plan_to(self, placements: Sequence[Placement] | Placement | None) -> CompiledPlan:
        """The compiled plan to ``placements``, memoised on the spec by the placements as
        given (``DTensorSpec.plans``), so a repeated redistribute skips normalising them and
        hashing the spec. Invalid placements are never memoised: they raise every time."""
        spec = self._spec
        key: Any = placements
        if placements is not None and not isinstance(placements, Placement):
            try:  # (not `with suppress`: its context manager costs ~0.2 us per call)
                key = tuple(placements)  # a list or a generator: one hashable spelling
            except TypeError:  # not iterable: normalized_placements raises the error
                key = placements
        try:
            plan: CompiledPlan | None = spec.plans.get(key)
        except TypeError:  # unhashable entries: normalized_placements names them
            plan, key = None, _UNCACHEABLE
        if plan is not None:
            if not plan.steps:
                spec.mesh._check_alive()  # run_compiled checks it for plans that move data
            return plan
        mesh = spec.mesh
        target = spec.placements if key is None else normalized_placements(key, mesh.ndim, len(spec.shape))
        plan = compile_plan(spec, target)
        if key is not _UNCACHEABLE:
            spec.plans[key] = plan
        return plan

    def to_torch(self) -> Any:
        """The complete value on every rank of the mesh (NumPy for "cpu", CuPy for "cuda").

        ``Shard`` pieces are concatenated, ``Replicate`` contributes one copy and ``Partial``
        pieces are reduced. Already fully replicated: the local piece itself (no copy).
        On a rank outside the mesh: None.
        """
        return self.to_torch_async().wait()

    full_tensor = to_torch

    def to_torch_async(self) -> "GatherHandle":
        """Start gathering the complete value on nonblocking collectives; see GatherHandle."""
        mesh = self.device_mesh
        plan = compile_plan(self._spec, (Replicate(),) * mesh.ndim)
        return GatherHandle(CompiledHandle(self.to_local(), plan), mesh.get_coordinate() is not None)

    # --- construction ---------------------------------------------------------------------
    @staticmethod
    def from_local(
        local: Any,
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        shape: Sequence[int] | None = None,
        run_check: bool = False,
        requires_grad: bool = False,
    ) -> "DTensor":
        """Wrap this rank's piece; every rank of the mesh calls it with its own piece.

        ``shape=None``: the global shape is derived from every rank's piece (one fixed-size
        Allreduce of the pieces' extents, O(1) per rank whatever the rank count), and the pieces
        are checked against the split rule. ``run_check=True``
        checks the pieces (shapes, dtype, ndim) against ``shape`` the same way. A failed check
        raises the same ``ShapeMismatchError``/``DTypeMismatchError`` on every rank.
        ``shape`` given and ``run_check=False``: no communication. This rank's piece is still
        checked against the split rule (locally, for free); a wrong piece raises
        ``ShapeMismatchError`` on the ranks that hold one only (no collective has started, so
        none is left waiting here; the abort-on-exception hook ends the job if it goes
        uncaught). ``run_check=True`` makes the same check an agreed error on every rank.
        ``DTORCH_SPMD_DEBUG=1`` checks every call, and checks first that every world rank
        makes it on the same mesh. ``requires_grad=True`` makes the result a leaf that collects
        a gradient; the piece itself records nothing (docs/autograd.md).
        """
        piece, spec = local_and_spec(local, device_mesh, placements, shape, run_check)
        return DTensor(piece, spec).requires_grad_(requires_grad)


def check_assigned_grad(t: DTensor, g: Any) -> None:
    """``t.grad = g`` as PyTorch checks it (type, device, shape, dtype): the gradient must be a
    DTensor on ``t``'s mesh with ``t``'s global shape and dtype, in any placements (a Partial
    gradient awaiting ``reduce_gradients`` is fine). Metadata only: every rank decides alike,
    so a wrong gradient is refused on every rank instead of mis-broadcasting on some."""
    what = f"assigning .grad of a DTensor of shape {t.shape} ({t.dtype})"
    if not isinstance(g, DTensor):
        raise TypeError(
            f"{what}: the gradient must be a DTensor or None, got {type(g).__module__}.{type(g).__name__}; "
            f"a complete array becomes one with dt.distribute_tensor(g, t.device_mesh, t.placements)"
        )
    if g.device_mesh != t.device_mesh:
        raise MeshMismatchError(f"{what}: the gradient lives on another mesh ({g.device_mesh!r})")
    if g.shape != t.shape:
        raise ShapeMismatchError(f"{what}: the gradient has shape {g.shape}; it must have the tensor's shape")
    if g.dtype != t.dtype:
        raise DTypeMismatchError(f"{what}: the gradient is {g.dtype}; cast it with g.astype(np.{t.dtype})")


def check_gradient_argument(t: DTensor, g: Any) -> None:
    """``t.backward(gradient=g)``: ``g`` is a DTensor of ``t``'s dtype (its shape and
    placements are checked by ``check_grad_layout``); as PyTorch refuses a dtype mismatch."""
    if not isinstance(g, DTensor):
        raise TypeError(
            f"backward(gradient=...) takes a DTensor (d loss / d self, shape {t.shape}), got "
            f"{type(g).__module__}.{type(g).__name__}; a complete array becomes one with "
            f"dt.distribute_tensor(g, t.device_mesh, placements), placed as backward() documents"
        )
    if g.dtype != t.dtype:
        raise DTypeMismatchError(
            f"backward(gradient=...): the gradient is {g.dtype}, the tensor {t.dtype}; cast the gradient"
        )


class GatherHandle:
    """Handle of ``to_torch_async()``: ``done()`` polls, ``wait()`` returns the complete value."""

    def __init__(self, plan: CompiledHandle, member: bool) -> None:
        self._plan = plan
        self._member = member

    def done(self) -> bool:
        return self._plan.done()

    def wait(self) -> Any:
        value = self._plan.wait()
        return value if self._member else None
