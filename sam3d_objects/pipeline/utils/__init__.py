"""Upstream's ``sam3d_objects.pipeline.utils`` package (point-map helpers)."""
