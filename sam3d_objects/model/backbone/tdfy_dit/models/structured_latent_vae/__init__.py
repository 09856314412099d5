"""Structured-latent VAE: encoder and the Gaussian / radiance-field / mesh decoders."""
from .decoder_gs import SLatGaussianDecoder
from .decoder_rf import SLatRadianceFieldDecoder
from .encoder import SLatEncoder

__all__ = ["SLatEncoder", "SLatGaussianDecoder", "SLatRadianceFieldDecoder"]
