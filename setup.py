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
    "omegaconf>=2.3.0",
    "hydra-core>=1.3.2",  # the oldest the hostile-checkpoint suite runs against (make test-hydra-oldest)
    "pillow",
    "trimesh",
    "safetensors",
    "tqdm",
    "plyfile",
    "scipy",  # automatic foreground masks (ndimage), vertex colours kept through decimation (cKDTree)
]

# Packages installed with --no-deps by `make extras` (their declared requirements would pull a second torch,
# torchvision, gradio and a GUI OpenCV; the code paths used here need only what the matching extra lists).
NO_DEPS = {
    "moge": ["dlr-moge==2.0.0", "dlr-utils3d==1.3"],
    # sam3 pins numpy<2.4 / tqdm<4.68 / typing_extensions<4.16 it does not need; timm and open-clip-torch pull
    # torch: their imported requirements are in the sam3 extra.
    "sam3": ["sam3==0.1.4", "timm", "open-clip-torch"],
    # Meta's own package run through patches.apply(): dlr-moge declares gradio/torchvision/GUI OpenCV, timm torch.
    "upstream": ["dlr-moge==2.0.0", "dlr-utils3d==1.3", "timm"],
}

EXTRAS = {
    # Optional packages: the code uses each one only when it imports. Install them with `make extras
    # EXTRAS=a,b`, which pins the torch already installed (and adds the NO_DEPS packages above).
    "torchvision": ["torchvision"],
    "open3d": ["open3d"],
    "spconv": ["spconv"],
    # Weights by name (--checkpoints facebook/sam-3d-objects): snapshot_download into the standard cache.
    "hub": ["huggingface_hub>=0.23"],
    # MoGe depth: the runtime needs of dlr-moge / dlr-utils3d (installed with --no-deps, see NO_DEPS).
    "moge": ["opencv-python-headless", "scipy", "huggingface_hub>=0.23"],
    # Mesh post-processing / texture baking (postprocessing_utils, downsample --faces): all MIT/BSD, CUDA-free.
    "post": ["xatlas", "fast-simplification", "scipy"],
    # Turntables as MP4 (--turntable-format mp4): imageio's ffmpeg plugin ships its own ffmpeg binary.
    "video": ["imageio", "imageio-ffmpeg"],
    # `sam3d-objects app`: the Gradio web app (gradio needs no torch); weights by name come with it.
    "app": ["gradio>=5,<7", "huggingface_hub>=0.23", "imageio", "imageio-ffmpeg"],
    # upstream's notebook helpers: display_image (matplotlib), GIFs (imageio), interactive_visualizer (gradio),
    # SceneVisualizer / plot_tdfy_scene (plotly); JupyterLab to open the notebooks
    "notebook": ["matplotlib", "imageio", "gradio>=5,<7", "plotly", "jupyterlab"],
    "test": ["pytest", "pytest-xdist", "nbclient", "nbformat", "ipykernel", "scipy", "xatlas", "fast-simplification",
             "imageio", "gradio>=5,<7", "huggingface_hub>=0.23", "pycocotools"],
    # Browser test of the app (make test-browser): selenium drives Debian's chromium + chromium-driver.
    "browser": ["selenium"],
    # Meta's unmodified package through `patches.apply()` (README "Running Meta's code unchanged"): the CUDA-free
    # packages its modules import at module level, at versions checked against its golden cases on the CPU
    # (spconv's CPU build is the real sparse conv; open3d needs libusb-1.0 on Linux). `make extras
    # EXTRAS=upstream` adds dlr-moge, dlr-utils3d and timm with --no-deps (NO_DEPS).
    "upstream": ["loguru>=0.7", "optree>=0.13", "astor>=0.8", "easydict>=1.10", "lightning>=2.2", "hydra-core>=1.3",
                 "omegaconf>=2.3", "opencv-python-headless", "scipy", "matplotlib", "seaborn", "plotly", "gradio>=5,<7",
                 "imageio", "xatlas", "pyvista", "pymeshfix", "igraph", "plyfile", "trimesh", "huggingface_hub>=0.23",
                 "spconv==2.3.8; sys_platform == 'linux'", "open3d-cpu>=0.18; sys_platform == 'linux'",
                 "open3d>=0.18; sys_platform != 'linux'", "moderngl"],
    # `sam3d-objects segment` (SAM 3 masks, CUDA-era code run through patches.apply()): `make extras EXTRAS=sam3`
    # (sam3, timm and open-clip-torch come --no-deps, see NO_DEPS; below: what they import). psutil is imported
    # by sam3 but not declared; open-clip-torch ships the BPE vocabulary sam3's wheel lacks; scipy is imported by
    # its video tracker (and labels its masks' components on the CPU, patches.sam3_video); imageio(-ffmpeg) reads
    # video files for `segment VIDEO`. torchvision is resolved against the pinned torch (a CUDA build whose
    # extension does not load is repaired by the torchvision shim).
    "sam3": ["torchvision", "psutil", "scipy", "imageio", "imageio-ffmpeg", "einops", "ftfy", "regex", "iopath",
             "pycocotools", "huggingface_hub>=0.30,<2", "pyyaml", "safetensors"],
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
    package_data={"backends": ["metal/*.metal", "metal/*.h", "**/*.metal", "**/*.h", "sparse_conv/triton_tilings.json"],
                  "patches": ["hub/*/hubconf.py"],
                  "sam3d_objects": ["assets/*.md", "assets/example/*.png", "assets/tiny_configs/*.yaml"]},
    include_package_data=True,
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["sam3d-objects=sam3d_objects.cli:main"]},
    license="MIT",
)
