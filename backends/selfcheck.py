"""``python -m backends.selfcheck``: the device self-check, kept at this documented path.

The self-check itself is ``sam3d_objects.selfcheck``: it runs the renderer, the tiny pipeline and the CLI's tiny
checkpoint, so it is a client of the whole package, and ``backends`` (the ground floor) imports nothing of
``sam3d_objects``. This alias runs that module by name when executed and imports nothing when imported.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("sam3d_objects.selfcheck", run_name="__main__", alter_sys=True)
