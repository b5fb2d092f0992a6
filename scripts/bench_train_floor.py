"""The NumPy floor of scripts/bench_train.py: the same math by hand (forward, backward, in-place
AdamW) on one rank's pieces, no communication."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_train_setup import BETAS, EPS, LR, WD, Step

C_GELU = math.sqrt(2 / math.pi)


class AdamWFloor:
    """torch's AdamW on plain arrays, in place."""

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        self.params, self.t = params, 0
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        b1, b2 = BETAS
        size, c2 = LR / (1 - b1 ** self.t), 1 / math.sqrt(1 - b2 ** self.t)
        for k, p in self.params.items():
            g, m, v = grads[k], self.m[k], self.v[k]
            p *= 1 - LR * WD
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            denom = np.sqrt(v)
            denom *= c2
            denom += EPS
            p -= size * (m / denom)


def gelu_fwd(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = np.tanh(C_GELU * (a + 0.044715 * a * a * a))
    return 0.5 * a * (1 + t), t


def gelu_bwd(a: np.ndarray, t: np.ndarray, g: np.ndarray) -> np.ndarray:
    return g * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * C_GELU * (1 + 3 * 0.044715 * a * a))


def rms_fwd(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(x.dtype).eps)
    return x * r * w, r


def rms_bwd(x: np.ndarray, r: np.ndarray, w: np.ndarray, gy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of ``x * r * w`` with respect to x and w."""
    gyw = gy * w
    gx = r * gyw - x * (r ** 3) * ((gyw * x).mean(-1, keepdims=True))
    return gx, (gy * x * r).reshape(-1, x.shape[-1]).sum(0)


def mlp_floor(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray], int]:
    """Loss, gradients and saved-activation bytes of one MLP step on these pieces (the
    Rowwise all-reduce is left out: on one rank's pieces the output is that rank's term)."""
    a = x @ p["0.weight"].T + p["0.bias"]
    g, t = gelu_fwd(a)
    out = g @ p["2.weight"].T + p["2.bias"]
    diff = out - y
    loss = float((diff * diff).mean())
    gout = diff * (2 / diff.size)
    ga = gelu_bwd(a, t, gout @ p["2.weight"])
    grads = {"0.weight": ga.T @ x, "0.bias": ga.sum(0), "2.weight": gout.T @ g, "2.bias": gout.sum(0)}
    return loss, grads, a.nbytes + t.nbytes + g.nbytes + diff.nbytes


def block_floor(p: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
                vocab0: int, causal: np.ndarray) -> tuple[float, dict[str, np.ndarray], int]:
    """One transformer-block step on this rank's pieces: vocabulary rows ``vocab0...``, its
    heads and ffn columns (the block's three all-reduces and cross_entropy's two are left out)."""
    n_rows, (vl, d), (hl, _, dh) = tokens.size, p["embed"].shape, p["wq"].shape
    own = (tokens >= vocab0) & (tokens < vocab0 + vl)
    x0 = np.zeros(tokens.shape + (d,), p["embed"].dtype)
    x0[own] = p["embed"][tokens[own] - vocab0]
    h1, r1 = rms_fwd(x0, p["norm1"])
    h1u = h1[:, None]
    q, k, v = h1u @ p["wq"], h1u @ p["wk"], h1u @ p["wv"]  # [B, H, T, Dh]
    s = q @ k.swapaxes(-1, -2) * (1 / math.sqrt(dh)) + causal
    e = np.exp(s - s.max(-1, keepdims=True))
    prob = e / e.sum(-1, keepdims=True)
    o = prob @ v
    x1 = x0 + (o @ p["wo"]).sum(1)
    h2, r2 = rms_fwd(x1, p["norm2"])
    u = h2 @ p["w1"].T
    gu_act, tu = gelu_fwd(u)
    x2 = x1 + gu_act @ p["w2"].T
    h3, r3 = rms_fwd(x2, p["norm3"])
    z = h3 @ p["out"].T  # [B, T, Vl]
    zmax = z.max(-1, keepdims=True)
    ez = np.exp(z - zmax)
    se = ez.sum(-1, keepdims=True)
    mine = (targets >= vocab0) & (targets < vocab0 + vl)
    zt = np.where(mine, np.take_along_axis(z, np.clip(targets - vocab0, 0, vl - 1)[..., None], -1)[..., 0], 0.0)
    loss = float((np.log(se[..., 0]) + zmax[..., 0] - zt).mean())
    # backward
    gz = ez / se
    gz[mine, targets[mine] - vocab0] -= 1
    gz *= 1 / n_rows
    flat = (-1, d)
    gr: dict[str, np.ndarray] = {"out": gz.reshape(-1, vl).T @ h3.reshape(flat)}
    gx2, gr["norm3"] = rms_bwd(x2, r3, p["norm3"], gz @ p["out"])
    gr["w2"] = gx2.reshape(flat).T @ gu_act.reshape(-1, gu_act.shape[-1])
    gu = gelu_bwd(u, tu, gx2 @ p["w2"])
    gr["w1"] = gu.reshape(-1, gu.shape[-1]).T @ h2.reshape(flat)
    gh2, gr["norm2"] = rms_bwd(x1, r2, p["norm2"], gu @ p["w1"])
    gx1 = gx2 + gh2
    ga = gx1[:, None]  # [B, 1, T, d]
    heads_major = (1, 0, 2, 3)
    gr["wo"] = o.transpose(heads_major).reshape(hl, n_rows, dh).swapaxes(1, 2) @ gx1.reshape(flat)
    go = ga @ p["wo"].swapaxes(1, 2)
    gp = go @ v.swapaxes(-1, -2)
    gv = prob.swapaxes(-1, -2) @ go
    gs = prob * (gp - (gp * prob).sum(-1, keepdims=True)) * (1 / math.sqrt(dh))
    gq, gk = gs @ k, gs.swapaxes(-1, -2) @ q
    h1t = h1.reshape(flat).T
    gh1 = np.zeros_like(h1)
    for name, grad in (("wq", gq), ("wk", gk), ("wv", gv)):
        gr[name] = h1t @ grad.transpose(heads_major).reshape(hl, n_rows, dh)
        gh1 += (grad @ p[name].swapaxes(1, 2)).sum(1)
    gh1x, gr["norm1"] = rms_bwd(x0, r1, p["norm1"], gh1)
    gx0 = gx1 + gh1x
    gr["embed"] = np.zeros_like(p["embed"])
    np.add.at(gr["embed"], tokens[own] - vocab0, gx0[own])
    saved = (x0, h1, r1, q, k, v, prob, o, x1, h2, r2, u, tu, gu_act, x2, h3, r3, ez, se)
    return loss, gr, sum(a.nbytes for a in saved)


def floor_step(fn: Callable[..., tuple[float, dict[str, np.ndarray], int]], params: dict[str, np.ndarray],
               *args: Any) -> tuple[Step, Callable[[], int]]:
    """The floor's step closure and a function giving its saved-activation bytes."""
    opt = AdamWFloor(params)
    last = {"saved": 0}

    def step() -> float:
        loss, grads, last["saved"] = fn(params, *args)
        opt.step(grads)
        return loss

    return step, lambda: last["saved"]
