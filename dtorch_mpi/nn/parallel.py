"""Tensor-parallel styles and parallelize_module.

A style shards a Linear's or an Embedding's parameters (zero bytes move: replicated weights are sliced) and
wraps its forward so the module boundary declares its layouts: the input is taken as
``input_layouts`` (a local array is wrapped, a DTensor in another layout is redistributed
explicitly), and the output is redistributed to ``output_layouts``. That is the only
communication a style does; ``CommCounter`` shows it (Colwise then Rowwise: one all-reduce).

What a style returns is a DTensor by default (``use_local_output=False``): it supports every
operator and autograd follows it, so the plan a PyTorch user writes trains (docs/training.md,
"Tensor-parallel styles and autograd"). ``use_local_output=True`` returns this rank's piece as a
plain array, which autograd cannot follow: it is refused (on every rank: the verdict is
metadata) where the output requires grad, so no plan cuts the graph silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from ..dtensor import DTensor
from ..errors import MeshMismatchError, ShapeMismatchError
from ..grad_mode import is_grad_enabled
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard, normalize_placements
from ..spec import DTensorSpec
from ..split import local_shape_and_offset
from ..spmd import agreed
from . import functional as F
from .deferred import is_deferred, materialize, materialize_as
from .layers import Embedding, Linear
from .module import Module, Parameter


class ParallelStyle:
    input_layouts: Placement
    output_layouts: Placement
    use_local_output: bool

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts!r}, "
                f"output_layouts={self.output_layouts!r}, use_local_output={self.use_local_output})")


def _shard_param(param: Parameter | None, placement: Placement, mesh: DeviceMesh, style: str) -> None:
    """Put ``param`` in ``placement`` on the style's ``mesh``, its piece in an allocation of its
    own: a deferred parameter makes only its shard (no complete value on any rank), one with
    values is sliced and copied (nn/deferred.py).

    A deferred parameter made for another mesh (a layer built without ``device_mesh`` has the
    default CPU world mesh) is made on ``mesh`` instead, as PyTorch's ``parallelize_module``
    moves a module's tensors onto its mesh (a ``"cuda"`` mesh: CuPy pieces). One whose values
    already live on another mesh is refused, on every rank of ``mesh``: moving them is a
    collective over both meshes, which a style does not do implicitly."""
    if param is None:
        return
    if param.device_mesh == mesh:
        materialize(param, [placement])
        return
    with agreed(mesh.get_comm()):
        if not is_deferred(param):
            raise MeshMismatchError(
                f"{style}: a parameter of shape {tuple(param.shape)} already has its values on "
                f"{param.device_mesh!r}, not on the style's {mesh!r}; build the layer with "
                f"device_mesh= that mesh (or load its values after parallelize_module), or move it "
                f"explicitly with to_torch() + distribute_tensor()")
    target = normalize_placements([placement], mesh.ndim, len(param.shape))
    materialize_as(param, DTensorSpec(mesh, target, tuple(param.shape), param.dtype))


def _as_input(x: Any, layout: Placement, mesh: DeviceMesh, in_features: int, style: str) -> DTensor:
    """A style's input as a DTensor: a plain array is this rank's piece in ``layout``."""
    if isinstance(x, DTensor):
        return x
    if isinstance(layout, Replicate):
        return DTensor.from_local(x, mesh, [layout], shape=x.shape)
    if isinstance(layout, Shard) and layout.dim in (-1, x.ndim - 1):
        return _feature_piece(x, mesh, in_features, style)
    return DTensor.from_local(x, mesh, [layout])


def _feature_piece(x: Any, mesh: DeviceMesh, in_features: int, style: str) -> DTensor:
    """A plain array taken as this rank's ``Shard(-1)`` piece of ``in_features`` columns.

    Each rank can check only its own piece, so the outcome is agreed (one 4-byte all-reduce
    of a flag): a wrong piece on any rank raises ``ShapeMismatchError`` on every rank, naming
    each failing rank's expected local shape (a full-width array is the usual mistake).
    """
    shape, coord = tuple(x.shape[:-1]) + (in_features,), mesh.get_coordinate()
    with agreed(mesh.get_comm()):
        if coord is not None:
            want, offset = local_shape_and_offset(shape, mesh.shape, (Shard(x.ndim - 1),), coord)
            if tuple(x.shape) != want:
                raise ShapeMismatchError(
                    f"{style} takes a plain input as this rank's Shard(-1) piece of {in_features} features: "
                    f"coordinate {coord} expects local shape {want} (columns {offset[-1]}:"
                    f"{offset[-1] + want[-1]}), got {tuple(x.shape)}; pass that slice, a DTensor, or "
                    f"input_layouts=Replicate() for a complete input"
                )
    return DTensor.from_local(x, mesh, [Shard(x.ndim - 1)], shape=shape)


def _embedding_style(module: Embedding, mesh: DeviceMesh, weight: Placement, style: ParallelStyle) -> Module:
    """An Embedding under a style: the weight takes ``weight`` (rows: vocab-parallel, the
    lookup ``Partial("sum")``; columns: ``Shard(-1)``), the index is taken ``Replicate``, and
    the lookup is redistributed to the style's ``output_layouts`` (the only communication)."""
    if mesh.ndim != 1:
        raise ValueError(f"{type(style).__name__} needs a 1-D mesh; pass a sub-mesh such as mesh['tp']")
    _shard_param(module.weight, weight, mesh, type(style).__name__)

    def forward(index: Any) -> Any:
        if isinstance(index, DTensor) and index.placements != (Replicate(),):
            index = index.redistribute(placements=[Replicate()])
        return _to_output(style, F.embedding(index, module.weight))

    object.__setattr__(module, "forward", forward)
    return module


def _to_output(style: Any, y: DTensor) -> Any:
    """``y`` redistributed to the style's ``output_layouts`` (explicitly: the boundary's one
    communication), as a local array when the style says ``use_local_output``."""
    out = _normalise(style.output_layouts, y.ndim)
    if y.placements != (out,):
        y = y.redistribute(placements=[out])
    return _local_or_dtensor(style, y)


def _local_or_dtensor(style: Any, y: DTensor) -> Any:
    """The style's result: ``y`` itself, or (``use_local_output=True``) its local piece where
    that cuts no graph. A plain array records nothing, so a ``y`` that requires grad (a
    parameter or an input upstream requires it, grad mode on) would silently stop training
    those parameters: refused instead, the same on every rank (every rank's ``y`` requires grad
    or none does)."""
    if not style.use_local_output:
        return y
    if y.requires_grad and is_grad_enabled():
        name = type(style).__name__
        raise RuntimeError(
            f"{name}(use_local_output=True) would return this rank's piece as a plain array, which "
            f"autograd cannot follow: the parameters before it (this layer's included) would get no "
            f"gradient. Use {name}() (use_local_output=False, the default: a DTensor that trains and "
            f"supports every operator; .to_local() is the piece), or run the forward under "
            f"dt.no_grad() for inference"
        )
    return y.to_local()


def _check_linear(module: Module, style: str, mesh: DeviceMesh) -> Linear:
    if not isinstance(module, Linear):
        raise TypeError(f"{style} applies to Linear and Embedding modules, got {type(module).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{style} needs a 1-D mesh; pass a sub-mesh such as mesh['tp']")
    return module


class _LinearStyle(ParallelStyle):
    """What ColwiseParallel and RowwiseParallel share: PyTorch's keyword constructor (each
    style's defaults in ``_layouts``) and ``apply``'s dispatch: an Embedding goes to
    ``_embedding_style``; a Linear gets its weight (and bias) placed as in ``_placed``, then the
    style's ``_forward``."""

    _layouts: tuple[Placement, Placement]  # default (input_layouts, output_layouts)
    _placed: tuple[Placement, Placement | None, Placement]  # Linear weight, Linear bias (None: kept), Embedding weight

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = input_layouts or self._layouts[0]
        self.output_layouts = output_layouts or self._layouts[1]
        self.use_local_output = use_local_output

    def apply(self, module: Module, mesh: DeviceMesh) -> Module:
        weight, bias, embedding = self._placed
        if isinstance(module, Embedding):
            return _embedding_style(module, mesh, embedding, self)
        lin = _check_linear(module, type(self).__name__, mesh)
        _shard_param(lin.weight, weight, mesh, type(self).__name__)
        if bias is not None or (lin.bias is not None and lin.bias.device_mesh != mesh):  # a kept bias moves Replicate
            _shard_param(lin.bias, bias or Replicate(), mesh, type(self).__name__)
        object.__setattr__(lin, "forward", self._forward(lin, mesh))
        return lin

    def _forward(self, lin: Linear, mesh: DeviceMesh) -> Any:
        raise NotImplementedError


class ColwiseParallel(_LinearStyle):
    """Shard a Linear's output features: weight ``Shard(0)``, bias ``Shard(0)``. Input
    ``Replicate`` by default; output ``Shard(-1)`` (no communication), a DTensor unless
    ``use_local_output=True`` (then a plain piece, refused where it requires grad). On an
    Embedding: weight ``Shard(1)`` (embedding columns), output ``Shard(-1)``."""

    _layouts = (Replicate(), Shard(-1))
    _placed = (Shard(0), Shard(0), Shard(1))

    def _forward(self, lin: Linear, mesh: DeviceMesh) -> Any:
        def forward(x: Any) -> Any:
            x = _as_input(x, self.input_layouts, mesh, lin.in_features, "ColwiseParallel")
            if x.placements != (Replicate(),):
                x = x.redistribute(placements=[Replicate()])
            y = x @ lin.weight.T
            if lin.bias is not None:
                y = y + lin.bias
            return _to_output(self, y)

        return forward


class RowwiseParallel(_LinearStyle):
    """Shard a Linear's input features: weight ``Shard(1)``, bias ``Replicate``. Input
    ``Shard(-1)`` by default; the partial sums are reduced to ``output_layouts`` (default
    ``Replicate``: one all-reduce; ``Shard(0)``: one reduce-scatter), then the bias is added.
    On an Embedding (vocab-parallel): weight ``Shard(0)``, index ``Replicate``; each rank looks
    up the rows it owns and the ``Partial("sum")`` lookup is reduced to ``output_layouts``."""

    _layouts = (Shard(-1), Replicate())
    _placed = (Shard(1), None, Shard(0))

    def _forward(self, lin: Linear, mesh: DeviceMesh) -> Any:
        def forward(x: Any) -> Any:
            x = _as_input(x, self.input_layouts, mesh, lin.in_features, "RowwiseParallel")
            want = Shard(x.ndim - 1)
            if x.placements != (want,):
                x = x.redistribute(placements=[want])
            y = (x @ lin.weight.T).redistribute(placements=[_normalise(self.output_layouts, x.ndim)])
            if lin.bias is not None:
                y = y + lin.bias
            return _local_or_dtensor(self, y)

        return forward


def _normalise(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim % ndim) if isinstance(p, Shard) else p


def parallelize_module(module: Module, device_mesh: DeviceMesh,
                       parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle]) -> Module:
    """Apply styles to submodules named by dotted paths (``*`` wildcards allowed); returns module."""
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan.apply(module, device_mesh)
    names = [name for name, _ in module.named_modules() if name]
    for pattern, style in parallelize_plan.items():
        matched = [n for n in names if fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(f"plan key {pattern!r} matches no submodule; submodules are {names}")
        for name in matched:
            style.apply(module.get_submodule(name), device_mesh)
    return module
