"""Input preprocessing (image / mask / point map) with upstream's module paths."""
