"""Modules with DTensor parameters, tensor-parallel styles, and state_dict loading."""

from .layers import LayerNorm, Linear, ReLU, Sequential, default_mesh, linear
from .module import Module, Parameter
from .parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from .state import load_into

__all__ = ["ColwiseParallel", "LayerNorm", "Linear", "Module", "ParallelStyle", "Parameter",
           "ReLU", "RowwiseParallel", "Sequential", "default_mesh", "linear", "load_into",
           "parallelize_module"]
