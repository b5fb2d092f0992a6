"""SGD with momentum, dampening, weight decay and Nesterov momentum (PyTorch's algorithm)."""

from __future__ import annotations

from typing import Any

from .checks import ANY_FINITE, NON_NEGATIVE, check_hyperparameters
from .optimizer import Optimizer, ParamsArg

_REALS = {"lr": NON_NEGATIVE, "momentum": NON_NEGATIVE, "dampening": ANY_FINITE, "weight_decay": NON_NEGATIVE}


class SGD(Optimizer):
    """``g = grad + wd * p``; with momentum ``b = g`` on the first step, else
    ``b = momentum * b + (1 - dampening) * g``; ``g = g + momentum * b`` (Nesterov) or
    ``g = b``; then ``p -= lr * g``. State: ``momentum_buffer`` (when momentum is used)."""

    def __init__(self, params: ParamsArg, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov})

    def _validate(self, group: dict[str, Any]) -> None:
        check_hyperparameters("SGD", group, _REALS, ("nesterov",))
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("SGD: Nesterov momentum requires momentum > 0 and dampening = 0")

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _update(self, group: dict[str, Any], param: Any, grad: Any, state: dict[str, Any], xp: Any) -> None:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        g = grad + wd * param if wd != 0 else grad
        if momentum != 0:
            buf = state["momentum_buffer"].to_local()
            if state["step"] == 0:
                buf[...] = g
            else:
                buf *= momentum
                buf += (1 - group["dampening"]) * g
            g = g + momentum * buf if group["nesterov"] else buf
        state["step"] += 1
        param -= lr * g
