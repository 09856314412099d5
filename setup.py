"""sam3d-objects-anywhere: SAM 3D Objects on CPU, Apple MPS and CUDA from one codebase.

torch is deliberately installed before this package (see the Makefile): a bare ``torch`` requirement on a
CPU-only Linux machine would resolve to a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

CORE = [
    # macOS runs on MPS: torch 2.7 has the public torch.mps.compile_shader (Metal kernels), max_pool3d/avg_pool3d
    # on MPS and bicubic antialias; backends.metal.require_torch_for_mps says so at startup on older wheels.
    'torch>=2.7; sys_platform == "darwin"',
    'torch>=2.4; sys_platform != "darwin"',
    "numpy",
    "omegaconf>=2.3",
    "hydra-core>=1.3",
    "pillow",
    "trimesh",
    "safetensors",
    "tqdm",
    "plyfile",
]

EXTRAS = {
    # Optional packages: the code uses each one only when it imports.
    "torchvision": ["torchvision"],
    "open3d": ["open3d"],
    "spconv": ["spconv"],
    "moge": ["dlr-moge", "dlr-utils3d", "opencv-python-headless"],
    # Mesh post-processing / texture baking (postprocessing_utils, downsample --faces): all MIT/BSD, CUDA-free.
    "post": ["xatlas", "fast-simplification", "scipy"],
    # upstream's notebook helpers: display_image (matplotlib), GIFs (imageio), interactive_visualizer (gradio),
    # SceneVisualizer / plot_tdfy_scene (plotly)
    "notebook": ["matplotlib", "imageio", "gradio", "plotly"],
    "test": ["pytest", "nbclient", "nbformat", "ipykernel", "scipy", "xatlas", "fast-simplification", "imageio",
             "pycocotools"],
    # `sam3d-objects segment` (SAM 3 masks, CUDA-era code run through patches.apply()): psutil is imported by sam3
    # but not declared; open-clip-torch ships the BPE vocabulary sam3's wheel lacks; scipy is imported by its video
    # tracker (and labels its masks' components on the CPU, patches.sam3_video). On CPU-only Linux install a
    # CPU torch (and, where one exists, a matching torchvision) first; a CUDA torchvision build is repaired by
    # the torchvision shim.
    "sam3": ["sam3", "psutil", "open-clip-torch", "scipy"],
}

setup(
    name="sam3d-objects-anywhere",
    version="0.1.0",
    description="SAM 3D Objects (image + mask -> 3D object) on CPU, MPS and CUDA with the official checkpoints",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["sam3d_objects", "sam3d_objects.*", "backends", "backends.*",
                                    "patches", "patches.*"]),
    package_data={"backends": ["metal/*.metal", "metal/*.h", "**/*.metal", "**/*.h", "triton_tilings.json"],
                  "sam3d_objects": ["assets/*.md", "assets/example/*.png", "assets/tiny_configs/*.yaml"]},
    include_package_data=True,
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["sam3d-objects=sam3d_objects.cli:main"]},
    license="MIT",
)
