"""AdamW: Adam with decoupled weight decay (PyTorch's algorithm, amsgrad included)."""

from __future__ import annotations

import math
from typing import Any

from .checks import NON_NEGATIVE, check_betas, check_hyperparameters
from .optimizer import Optimizer, ParamsArg

_REALS = {"lr": NON_NEGATIVE, "eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE}


class AdamW(Optimizer):
    """``p *= 1 - lr * wd``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
    ``p -= lr / (1 - b1^t) * m / (sqrt(v') / sqrt(1 - b2^t) + eps)`` with ``v' = v``, or the
    running maximum of ``v`` with ``amsgrad``. State: ``step``, ``exp_avg``, ``exp_avg_sq``
    (and ``max_exp_avg_sq``)."""

    def __init__(self, params: ParamsArg, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, amsgrad: bool = False) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "amsgrad": amsgrad})

    def _validate(self, group: dict[str, Any]) -> None:
        check_hyperparameters("AdamW", group, _REALS, ("amsgrad",))
        if "betas" not in group:
            raise ValueError("AdamW: the parameter group lacks 'betas'")
        check_betas("AdamW", group)

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        base = ("exp_avg", "exp_avg_sq")
        return base + ("max_exp_avg_sq",) if group["amsgrad"] else base

    def _update(self, group: dict[str, Any], param: Any, grad: Any, state: dict[str, Any], xp: Any) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        state["step"] += 1
        t = state["step"]
        param *= 1 - lr * group["weight_decay"]
        m, v = state["exp_avg"].to_local(), state["exp_avg_sq"].to_local()
        # PyTorch's formulas, in place with one scratch buffer (a step is memory-bound)
        scratch = xp.subtract(grad, m)
        scratch *= 1 - beta1
        m += scratch  # m.lerp_(grad, 1 - beta1)
        xp.multiply(grad, grad, out=scratch)
        scratch *= 1 - beta2
        v *= beta2
        v += scratch
        if group["amsgrad"]:
            vmax = state["max_exp_avg_sq"].to_local()
            xp.maximum(vmax, v, out=vmax)
            v = vmax
        step_size = lr / (1 - beta1 ** t)
        denom = xp.sqrt(v, out=scratch)
        denom /= math.sqrt(1 - beta2 ** t)
        denom += eps
        xp.divide(m, denom, out=denom)
        denom *= step_size
        param -= denom
