"""Every operator, by family: each family module declares its ops in one place (rule table,
kernel, NumPy reference, backward, public functions, DTensor methods); this module gathers
them.

=================  ============================================================================
elementwise.py     unary math and broadcasting binary ops that are NumPy's own functions,
                   ``where``, ``clone``, ``astype``
activations.py     sigmoid, relu, silu, softplus, gelu (and its erf), clip/clamp
reductions.py      sum, mean, max, min, prod, all, any, std, var, argmax, argmin
along_dim.py       softmax, log_softmax, cumsum
layout.py          permute/transpose, reshape/view/flatten/squeeze/unsqueeze, indexing, cat, stack
linalg.py          matmul
=================  ============================================================================

Each public name is a real module-level binding with a precise type (what mypy and IDEs see
as ``dtorch_mpi.<name>``); ``dtorch_mpi/__init__.py`` re-exports this module's ``__all__``,
the union of the families' (tests/test_ops.py checks it against the declarations). To add an
operator: one declaration in its family's module (its name in that module's ``__all__``), then
``make docs``; rules, docs, methods and the generated tests follow from the declaration.
"""

from __future__ import annotations

from . import activations, along_dim, elementwise, layout, linalg, reductions
from .activations import *  # noqa: F403
from .along_dim import *  # noqa: F403
from .elementwise import *  # noqa: F403
from .layout import *  # noqa: F403
from .linalg import *  # noqa: F403
from .reductions import *  # noqa: F403

__all__: list[str] = []
__all__ += elementwise.__all__
__all__ += activations.__all__
__all__ += reductions.__all__
__all__ += along_dim.__all__
__all__ += layout.__all__
__all__ += linalg.__all__
