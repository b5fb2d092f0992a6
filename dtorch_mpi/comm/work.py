"""Handles of nonblocking collectives: they keep every buffer alive until completion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI


class Work:
    """A started collective. ``wait()`` returns its result; ``done()`` polls without blocking.

    The handle holds references to every buffer and derived datatype the operation uses
    (mpi4py does not for every nonblocking collective) and runs the finishing step (copying
    out of padded buffers, dividing an average, narrowing a widened dtype) exactly once.
    """

    __slots__ = ("_request", "_finish", "_keep", "_result", "_finished")

    def __init__(
        self,
        request: MPI.Request | None,
        finish: Callable[[], Any],
        keep: tuple[Any, ...] = (),
    ) -> None:
        self._request = request
        self._finish = finish
        self._keep = keep
        self._result: Any = None
        self._finished = False
        if request is None:
            self._complete()

    def _complete(self) -> None:
        self._result = self._finish()
        self._finished = True
        self._keep = ()
        self._request = None

    def done(self) -> bool:
        if not self._finished and self._request is not None and self._request.Test():
            self._complete()
        return self._finished

    def wait(self) -> Any:
        if not self._finished:
            assert self._request is not None
            self._request.Wait()
            self._complete()
        return self._result


def completed(result: Any) -> Work:
    return Work(None, lambda: result)


def moves_nothing(group_size: int, send: Any, out: Any, empty: bool = False) -> Work | None:
    """The finished collective when no data has to move (a group of one rank copies ``send``
    into ``out``; ``empty`` means every rank's buffers are empty), else None."""
    if group_size == 1:
        if send is not out:
            out[...] = send
        return completed(out)
    return completed(out) if empty else None
