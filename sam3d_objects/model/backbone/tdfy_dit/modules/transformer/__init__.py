"""Dense transformer blocks."""
from .blocks import AbsolutePositionEmbedder, FeedForwardNet, TransformerBlock, TransformerCrossBlock
from .modulated import (  # noqa: F401  upstream's package re-exports .modulated's MoT block too
    MOTModulatedTransformerCrossBlock, ModulatedTransformerBlock, ModulatedTransformerCrossBlock, modulate)

__all__ = ["AbsolutePositionEmbedder", "FeedForwardNet", "TransformerBlock", "TransformerCrossBlock",
           "ModulatedTransformerBlock", "ModulatedTransformerCrossBlock", "modulate"]
