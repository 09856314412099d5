"""Upstream's ``tdfy_dit.utils`` package: rendering, post-processing and random-sequence helpers."""
