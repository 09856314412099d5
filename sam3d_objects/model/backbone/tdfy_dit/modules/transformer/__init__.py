"""Dense transformer blocks."""
from .blocks import AbsolutePositionEmbedder, FeedForwardNet, TransformerBlock, TransformerCrossBlock
from .modulated import ModulatedTransformerBlock, ModulatedTransformerCrossBlock, modulate

__all__ = ["AbsolutePositionEmbedder", "FeedForwardNet", "TransformerBlock", "TransformerCrossBlock",
           "ModulatedTransformerBlock", "ModulatedTransformerCrossBlock", "modulate"]


def __getattr__(name: str):
    # upstream's package re-exports everything of .modulated, including the mixture-of-transformers block, which
    # lives with the MoT flow model here (that model imports this package): resolved on first use
    if name == "MOTModulatedTransformerCrossBlock":
        from . import modulated
        return modulated.MOTModulatedTransformerCrossBlock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
