"""Dense transformer blocks."""
from .blocks import AbsolutePositionEmbedder, FeedForwardNet, TransformerBlock, TransformerCrossBlock
from .modulated import (MOTModulatedTransformerCrossBlock, ModulatedTransformerBlock,  # noqa: F401
                        ModulatedTransformerCrossBlock, modulate)  # (upstream re-exports the MoT block too)

__all__ = ["AbsolutePositionEmbedder", "FeedForwardNet", "TransformerBlock", "TransformerCrossBlock",
           "ModulatedTransformerBlock", "ModulatedTransformerCrossBlock", "modulate"]
