"""Upstream's standalone timestep embedder: the flow models' TimestepEmbedder plus a `freeze` switch."""
from .sparse_structure_flow import TimestepEmbedder as _FlowTimestepEmbedder, timestep_embedding  # noqa: F401


class TimestepEmbedder(_FlowTimestepEmbedder):
    """Sinusoid features of t (cos | sin) -> Linear -> SiLU -> Linear; `freeze` makes it a fixed, eval-mode module."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256, freeze: bool = False):
        super().__init__(hidden_size, frequency_embedding_size)
        self.freeze = freeze
        if freeze:
            self.requires_grad_(False)
            self.eval()

    @staticmethod
    def timestep_embedding(t, dim: int, max_period: float = 10000.0):
        """Sinusoidal features [N, dim] (cos | sin) of the N timesteps t."""
        return timestep_embedding(t, dim, max_period)
