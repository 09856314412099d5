"""Developer benchmarks and device checks (not installed with the package; run from a checkout):

    python -m benchmarks.bench_ops            # `make bench`: sparse conv / attention per backend and device
    python -m benchmarks.cuda_check           # CUDA fast paths: parity vs float64 and timings
    python -m benchmarks.bench_mesh_decoder   # mesh decoder memory/time, sparse vs dense extraction
    python -m benchmarks.ab_mesh_decoder --tree old=DIR:child --tree new=.:blocked   # source trees, interleaved
    python -m benchmarks.bench_pipeline --config DIR/pipeline.yaml

All share the input generators of ``benchmarks/shapes.py``.
"""
