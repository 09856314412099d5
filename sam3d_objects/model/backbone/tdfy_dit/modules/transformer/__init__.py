"""Dense transformer blocks."""
from .blocks import AbsolutePositionEmbedder, FeedForwardNet, TransformerBlock, TransformerCrossBlock
from .modulated import ModulatedTransformerBlock, ModulatedTransformerCrossBlock, modulate

__all__ = ["AbsolutePositionEmbedder", "FeedForwardNet", "TransformerBlock", "TransformerCrossBlock",
           "ModulatedTransformerBlock", "ModulatedTransformerCrossBlock", "modulate"]
