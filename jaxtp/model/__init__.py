"""The model as pure math over logical axes, handed a `Layout`: layers, attention
and its kernels, the MLP, the vocab-parallel embedding and loss, the Transformer."""

from .block import REMAT_POLICIES, Block
from .transformer import Transformer, reorder_layers, stack_layers, unstack_layers

__all__ = ["REMAT_POLICIES", "Block", "Transformer", "reorder_layers", "stack_layers",
           "unstack_layers"]
