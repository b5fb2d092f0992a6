"""Module and Parameter: torch-like containers whose parameters are DTensors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from ..dtensor import DTensor
from ..grad_mode import note_requires_grad
from ..stateful import InPlaceLoad, check_fill
from .state import load_into


class Parameter(DTensor):
    """A DTensor registered as a module parameter; used exactly as a DTensor."""

    __slots__ = ()

    def __init__(self, data: DTensor, requires_grad: bool = True) -> None:
        if not isinstance(data, DTensor):
            raise TypeError(f"Parameter wraps a DTensor, got {type(data).__name__}")
        if requires_grad and data.dtype.kind not in "fc":
            raise TypeError(
                f"a Parameter that requires grad must be floating or complex (as in PyTorch); this DTensor "
                f"is {data.dtype}: cast it (x.astype(np.float32)) or pass requires_grad=False"
            )
        super().__init__(data.to_local(), data.spec)
        self._requires_grad = bool(requires_grad)
        if requires_grad:
            note_requires_grad()

    def _replace(self, local: Any, spec: Any) -> None:
        """Point this parameter at a new piece and spec (used by parallel styles)."""
        self._local = local
        self._spec = spec
        self._pending = None

    def __repr__(self) -> str:
        return "Parameter" + super().__repr__()[len("DTensor"):]


class Module:
    """Base class: attributes that are Parameters or Modules are registered by assignment."""

    _parameters: "OrderedDict[str, Parameter]"
    _modules: "OrderedDict[str, Module]"
    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def train(self, mode: bool = True) -> "Module":
        """Set training mode (``Dropout`` drops) on this module and every submodule."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        """Evaluation mode: ``train(False)``."""
        return self.train(False)

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        if params is None:
            raise AttributeError("call Module.__init__() before assigning attributes")
        if isinstance(value, Parameter):
            params[name] = value
            self._modules.pop(name, None)
        elif isinstance(value, Module):
            self._modules[name] = value
            params.pop(name, None)
        else:
            params.pop(name, None)
            self._modules.pop(name, None)
        object.__setattr__(self, name, value)

    def register_parameter(self, name: str, value: Parameter | None) -> None:
        if value is None:
            object.__setattr__(self, name, None)
            return
        setattr(self, name, value)

    # --- traversal ------------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for mod_name, mod in self.named_modules(prefix):
            for name, p in mod._parameters.items():
                yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def get_submodule(self, target: str) -> "Module":
        mod = self
        for part in target.split(".") if target else []:
            if part not in mod._modules:
                raise AttributeError(f"{type(mod).__name__} has no submodule {part!r} (in {target!r})")
            mod = mod._modules[part]
        return mod

    # --- state ----------------------------------------------------------------------------
    def state_dict(self) -> "OrderedDict[str, Parameter]":
        """Parameter name -> the parameter itself (a DTensor; ``to_torch()`` gathers it)."""
        return OrderedDict(self.named_parameters())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> "Module":
        """Load complete values (or DTensors); each rank keeps only its piece. See
        ``dtorch_mpi.nn.state.load_into``."""
        load_into(self.state_dict(), state_dict, strict=strict)
        return self

    def prepare_load(self, state_dict: Mapping[str, Any], strict: bool = True) -> InPlaceLoad:
        """The ``Stateful`` checked load: check ``state_dict`` against the parameters (keys,
        meshes, shapes, dtypes) and return them as the targets to fill in place (this rank's
        check only: callers agree it, as ``load_state_dict`` and ``dtorch.load`` do)."""
        params = self.state_dict()
        keys = check_fill(params, state_dict, strict)
        return InPlaceLoad({k: params[k] for k in keys}, {k: state_dict[k] for k in keys})

    # --- calling --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            body = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        if len(lines) == 1:
            return lines[0] + ")"
        return "\n".join(lines) + "\n)"
