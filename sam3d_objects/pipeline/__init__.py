"""Inference pipeline (stage 1, pose, stage 2, decoders, exports) with upstream's module paths."""
try:  # makes torchvision.transforms.{Compose,Resize} resolvable for hydra when torchvision does not import
    from patches.torchvision_shim import install as _install_torchvision_shim
except ImportError:  # the patches package is not on the path: hydra then needs a working torchvision
    _install_torchvision_shim = None
if _install_torchvision_shim is not None:
    _install_torchvision_shim()
