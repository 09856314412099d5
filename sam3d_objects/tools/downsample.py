"""Shrink generated outputs: Gaussian splat PLYs and meshes (GLB/PLY/OBJ).

    sam3d-objects downsample IN -o OUT (--voxel SIZE | --uniform K | --random FRACTION [--seed S] | --faces N)

Splat PLY (a ``vertex`` element with 3DGS attributes, no faces): the kept Gaussians keep every attribute
unchanged (position, colour/SH, opacity, scale, rotation, anything else), so OUT is a valid 3DGS PLY.

- ``--voxel SIZE``: one representative per cubic voxel of edge SIZE (world units): the Gaussian of highest
  opacity in the voxel (ties: the first). Representatives are kept rather than merged: averaging rotations,
  log-scales or logit opacities does not give a Gaussian that renders like the group, and a kept one stays exact.
- ``--uniform K``: every K-th Gaussian in file order (open3d's ``uniform_down_sample`` semantics).
- ``--random FRACTION``: a random subset of round(FRACTION * N) Gaussians, reproducible with ``--seed``.

Mesh (GLB, OBJ, or PLY with faces): ``--faces N`` decimates to about N faces (quadric decimation,
fast-simplification) and writes a mesh; ``--voxel``/``--uniform``/``--random`` treat its vertices as a point
cloud (colours kept when present) and write a PLY point cloud. All of it is numpy; open3d is not needed.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["voxel_indices", "uniform_indices", "random_indices", "downsample_splat_ply", "downsample_mesh",
           "downsample", "add_downsample_parser", "run_downsample"]


# ------------------------------------------------------------------------------------------------- selection
def voxel_indices(points: np.ndarray, voxel: float, weight: Optional[np.ndarray] = None) -> np.ndarray:
    """Sorted indices of one point per occupied voxel: the one of largest ``weight`` (default: the first)."""
    if not np.isfinite(voxel) or voxel <= 0:
        raise ValueError(f"--voxel must be a finite size > 0, got {voxel}")
    keys = np.floor(np.asarray(points, np.float64) / voxel).astype(np.int64)
    _, cell = np.unique(keys, axis=0, return_inverse=True)
    cell = cell.reshape(-1)
    w = np.zeros(len(points)) if weight is None else np.asarray(weight, np.float64).reshape(-1)
    # Sort by cell, then by descending weight, then by index: the first entry of each cell is its representative.
    order = np.lexsort((np.arange(len(points)), -w, cell))
    first = np.ones(len(order), dtype=bool)
    first[1:] = cell[order[1:]] != cell[order[:-1]]
    return np.sort(order[first])


def uniform_indices(n: int, every_k: int) -> np.ndarray:
    if every_k < 1:
        raise ValueError(f"--uniform must be >= 1, got {every_k}")
    return np.arange(0, n, every_k)


def random_indices(n: int, fraction: float, seed: Optional[int] = None) -> np.ndarray:
    if not 0 < fraction <= 1:  # also refuses NaN
        raise ValueError(f"--random must be in (0, 1], got {fraction}")
    keep = max(1, int(round(fraction * n))) if n else 0
    return np.sort(np.random.default_rng(seed).choice(n, size=keep, replace=False))


def _select(points: np.ndarray, voxel: Optional[float], uniform: Optional[int], fraction: Optional[float],
            seed: Optional[int], weight: Optional[np.ndarray] = None) -> np.ndarray:
    if voxel is not None:
        return voxel_indices(points, voxel, weight)
    if uniform is not None:
        return uniform_indices(len(points), uniform)
    if fraction is not None:
        return random_indices(len(points), fraction, seed)
    raise ValueError("choose one of --voxel, --uniform, --random (or --faces for meshes)")


# ------------------------------------------------------------------------------------------------- files
def _is_splat_ply(path: Path) -> bool:
    from plyfile import PlyData

    ply = PlyData.read(str(path))
    names = [e.name for e in ply.elements]
    return "face" not in names and "vertex" in names


def downsample_splat_ply(src: Path, dst: Path, voxel: Optional[float] = None, uniform: Optional[int] = None,
                         fraction: Optional[float] = None, seed: Optional[int] = None) -> int:
    """Write the kept rows of the PLY's vertex element, all properties and the file's format kept. Returns N kept."""
    from plyfile import PlyData, PlyElement

    ply = PlyData.read(str(src))
    vertex = ply["vertex"].data
    xyz = np.stack([vertex["x"], vertex["y"], vertex["z"]], 1)
    opacity = vertex["opacity"] if "opacity" in vertex.dtype.names else None
    keep = _select(xyz, voxel, uniform, fraction, seed, opacity)
    element = PlyElement.describe(vertex[keep], "vertex")
    others = [e for e in ply.elements if e.name != "vertex"]
    PlyData([element] + others, text=ply.text, byte_order=ply.byte_order,
            comments=list(ply.comments)).write(str(dst))
    return len(keep)


def _vertex_colours(mesh) -> Optional[np.ndarray]:
    """RGBA uint8 per vertex: vertex colours as they are, a texture sampled at the vertices' UVs; None without
    colour."""
    kind = getattr(mesh.visual, "kind", None)
    if kind == "vertex":
        return np.asarray(mesh.visual.vertex_colors)
    if kind == "texture":
        try:
            return np.asarray(mesh.visual.to_color().vertex_colors)
        except Exception:  # noqa: BLE001  a material without an image: no colour to keep
            return None
    return None


def downsample_mesh(src: Path, dst: Path, faces: Optional[int] = None, voxel: Optional[float] = None,
                    uniform: Optional[int] = None, fraction: Optional[float] = None,
                    seed: Optional[int] = None) -> int:
    """Decimate to ~``faces`` faces (returns the face count) or keep a vertex subset as a point cloud (count)."""
    import trimesh

    mesh = trimesh.load(str(src), force="mesh", process=False)
    if faces is not None:
        from sam3d_objects.model.backbone.tdfy_dit.utils.postprocessing_utils import _decimate

        if faces < 4:
            raise ValueError(f"--faces must be >= 4, got {faces}")
        ratio = max(0.0, 1.0 - faces / max(len(mesh.faces), 1))
        v, f = _decimate(np.asarray(mesh.vertices, np.float32), np.asarray(mesh.faces), ratio)
        colours = _vertex_colours(mesh)
        if colours is not None:  # decimation moves vertices: each new one takes its nearest original's colour
            from scipy.spatial import cKDTree
            colours = colours[cKDTree(np.asarray(mesh.vertices)).query(v)[1]]
        trimesh.Trimesh(v, f, vertex_colors=colours, process=False).export(str(dst))
        return len(f)
    keep = _select(np.asarray(mesh.vertices), voxel, uniform, fraction, seed)
    colours = None
    if getattr(mesh.visual, "kind", None) == "vertex":
        colours = np.asarray(mesh.visual.vertex_colors)[keep]
    trimesh.PointCloud(np.asarray(mesh.vertices)[keep], colors=colours).export(str(dst))
    return len(keep)


MESH_SUFFIXES = (".ply", ".glb", ".gltf", ".obj", ".stl", ".off")
PLY_TYPE_BYTES = {"char": 1, "uchar": 1, "int8": 1, "uint8": 1, "short": 2, "ushort": 2, "int16": 2, "uint16": 2,
                  "int": 4, "uint": 4, "int32": 4, "uint32": 4, "float": 4, "float32": 4, "double": 8,
                  "float64": 8}
MAX_PLY_HEADER = 1 << 16


def check_ply_header(path: Path) -> None:
    """ValueError when a PLY's header is unreadable or claims more rows than the file can hold (a 1 KB file
    claiming 10^12 vertices would otherwise make the reader allocate for them)."""
    with open(path, "rb") as f:
        head = f.read(MAX_PLY_HEADER)
    end = head.find(b"end_header")
    if not head.startswith(b"ply") or end < 0:
        raise ValueError(f"{path}: not a PLY file (no 'ply ... end_header' header in its first "
                         f"{MAX_PLY_HEADER // 1024} KB)")
    body = path.stat().st_size - (head.index(b"\n", end) + 1 if b"\n" in head[end:] else end + 10)
    binary, need, count, row = False, 0, 0, 0
    for line in head[:end].decode("ascii", "replace").splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "format":
            binary = len(words) > 1 and words[1].startswith("binary")
        elif words[0] == "element" and len(words) >= 3:
            need += count * row
            try:
                count = int(words[2])
            except ValueError:
                raise ValueError(f"{path}: bad PLY element line {line!r}") from None
            if count < 0:
                raise ValueError(f"{path}: bad PLY element line {line!r}")
            row = 0
        elif words[0] == "property" and len(words) >= 3:
            # a list property costs at least its count; an ascii value at least 2 bytes (digit + separator)
            row += (PLY_TYPE_BYTES.get(words[2], 1) if words[1] == "list" else PLY_TYPE_BYTES.get(words[1], 1)) \
                if binary else 2
    need += count * row
    if need > max(body, 0):
        raise ValueError(f"{path}: its header claims elements of at least {need} bytes but the file holds {body}: "
                         f"a truncated or damaged PLY")


def downsample(src, dst, faces: Optional[int] = None, voxel: Optional[float] = None, uniform: Optional[int] = None,
               fraction: Optional[float] = None, seed: Optional[int] = None) -> int:
    """Dispatch on the input: splat PLY (no faces) or mesh. Writes ``dst`` only after the result is complete,
    through a temporary file of its own (a file of the user's is never removed), and never over ``src``."""
    import os
    import tempfile
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such file")
    if src.suffix.lower() not in MESH_SUFFIXES:
        raise ValueError(f"{src}: not a splat or mesh file ({', '.join(MESH_SUFFIXES)})")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"-o {dst} is the input file: choose another output name (the input is never "
                         f"overwritten)")
    if dst.is_dir():
        raise ValueError(f"-o {dst} is a folder: give an output file name")
    if src.suffix.lower() == ".ply":
        check_ply_header(src)
    try:
        splat = src.suffix.lower() == ".ply" and _is_splat_ply(src)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"{src}: cannot read it as PLY ({type(e).__name__}: {e})") from e
    if splat and faces is not None:
        raise ValueError("--faces applies to meshes; this PLY holds gaussians (use --voxel/--uniform/--random)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dst.stem}.", suffix=".partial" + dst.suffix, dir=dst.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        try:
            if splat:
                n = downsample_splat_ply(src, tmp, voxel, uniform, fraction, seed)
            else:
                n = downsample_mesh(src, tmp, faces, voxel, uniform, fraction, seed)
        except (ValueError, FileNotFoundError, ImportError):
            raise
        except Exception as e:  # noqa: BLE001  readers raise anything for a damaged file
            raise ValueError(f"{src}: cannot downsample it ({type(e).__name__}: {e})") from e
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return n


# ------------------------------------------------------------------------------------------------- CLI
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not np.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a finite size > 0 (world units)")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: give a fraction in (0, 1]")
    return value


def _int_from(lo: int, hi: int = 2 ** 62):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value}: give an integer >= {lo}")
        return value
    parse.__name__ = "integer"
    return parse


def add_downsample_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``downsample`` on an argparse sub-parser collection; the handler is ``run_downsample``."""
    p = subparsers.add_parser("downsample", help="shrink a splat PLY or a mesh (voxel / uniform / random / faces)",
                              description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="splat .ply, or a mesh (.glb/.ply/.obj)")
    p.add_argument("-o", "--out", required=True, help="output file (.ply for splats and point clouds)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--voxel", type=_positive_float, metavar="SIZE",
                     help="keep the most opaque gaussian per voxel of SIZE")
    how.add_argument("--uniform", type=_int_from(1), metavar="K", help="keep every K-th element")
    how.add_argument("--random", type=_fraction, metavar="FRACTION", help="keep a random FRACTION (see --seed)")
    how.add_argument("--faces", type=_int_from(4), metavar="N", help="meshes: decimate to about N faces")
    p.add_argument("--seed", type=_int_from(0), default=None, help="seed for --random (same seed, same subset)")
    p.set_defaults(handler=run_downsample)
    return p


def run_downsample(args) -> int:
    n = downsample(args.input, args.out, faces=args.faces, voxel=args.voxel, uniform=args.uniform,
                   fraction=args.random, seed=args.seed)
    what = "faces" if args.faces is not None else "elements"
    print(f"{args.out}: {n} {what}")
    return 0
