"""Optimizers over DTensor parameters: every update is local on each rank's piece.

Per-parameter state (momentum buffers, Adam moments) has its parameter's mesh, placements
and shape, so no rank holds more than its piece and ``step()`` moves no data. Gradients must
already have their parameters' placements (``dtorch_mpi.nn.utils.reduce_gradients``).
"""

from .adamw import AdamW
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["AdamW", "Optimizer", "SGD"]
