"""Inference pipeline (stage 1, pose, stage 2, decoders, exports) with upstream's module paths."""
