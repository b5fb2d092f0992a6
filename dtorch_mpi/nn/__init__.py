"""Modules with DTensor parameters, tensor-parallel styles, state_dict loading, layer
functions (``functional``) and gradient utilities (``utils``)."""

from . import functional, utils
from .fsdp import fully_shard
from .layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, RMSNorm, Sequential, SiLU, default_mesh, linear
from .module import Module, Parameter
from .parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from .replicate import replicate
from .state import load_into

__all__ = ["GELU", "ColwiseParallel", "Dropout", "Embedding", "LayerNorm", "Linear", "Module", "ParallelStyle",
           "Parameter", "RMSNorm", "ReLU", "RowwiseParallel", "Sequential", "SiLU", "default_mesh", "functional",
           "fully_shard", "linear", "load_into", "parallelize_module", "replicate", "utils"]
