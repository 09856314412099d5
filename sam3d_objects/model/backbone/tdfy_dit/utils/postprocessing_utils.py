"""Mesh post-processing and texture baking for GLB export, on any device PyTorch runs on.

Upstream's names and parameters (``postprocess_mesh``, ``parametrize_mesh``, ``bake_texture``, ``to_glb``,
``simplify_gs``); the CUDA-only pieces are replaced by permissively licensed, device-agnostic ones:

- simplification: ``fast-simplification`` (MIT, quadric decimation), ``simplify_ratio`` = fraction of faces removed;
- interior faces / holes: visibility from Hammersley views through ``backends.rasterize``; the s-t min cut is
  SciPy's ``maximum_flow`` (BSD) instead of igraph; small holes are closed by a fan around each boundary loop's
  centroid instead of pymeshfix (GPL);
- UV unwrap: ``xatlas`` (MIT);
- multi-view Gaussian renders: ``sam3d_objects.render`` (pure PyTorch);
- texture baking ("opt"): the views are first projected onto the texels (the rasteriser's depth test picks the
  front surface; per-texel average), then refined by Adam on L1 + lambda_tv * TV as upstream, starting from that
  projection instead of black; uncovered texels are filled from the nearest covered texel (SciPy EDT) instead of
  OpenCV's Telea inpainting.

Colour: the Gaussian renders are display (sRGB-encoded) values, the texture stores those same values and glTF
reads baseColorTexture as sRGB, so no transfer function is applied anywhere (this is what keeps the colours from
washing out). Differences from upstream are listed in the functions' docstrings.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tqdm import tqdm

import backends
from backends import rasterize as R

__all__ = ["postprocess_mesh", "parametrize_mesh", "bake_texture", "to_glb", "simplify_gs",
           "sphere_hammersley_cameras", "camera_clip_matrix", "rasterize_view", "render_textured_mesh",
           "write_preview", "refine_glb", "export_mesh_extras"]

# z-up object frame -> y-up glTF frame: (x, y, z) -> (x, z, -y) for row vectors.
_ZUP_TO_YUP = np.array([[1, 0, 0], [0, 0, -1], [0, 1, 0]])


# ------------------------------------------------------------------------------------------------- cameras
def _radical_inverse_base2(i: int) -> float:
    return int(format(i, "032b")[::-1], 2) / 2.0 ** 32


def sphere_hammersley_cameras(num_views: int, resolution: int, radius: float = 2.0, fov_deg: float = 40.0):
    """Upstream's Hammersley view sequence (r = 2, fov 40 deg, looking at the origin, +z up) as ``Camera``s."""
    from sam3d_objects.render import Camera, intrinsics_from_fov, look_at

    fx, fy, cx, cy = intrinsics_from_fov(fov_deg, resolution, resolution)
    cams = []
    for i in range(num_views):
        u, v = i / num_views, _radical_inverse_base2(i)
        pitch, yaw = math.acos(1 - 2 * u) - math.pi / 2, 2 * math.pi * v
        eye = radius * torch.tensor([math.sin(yaw) * math.cos(pitch), math.cos(yaw) * math.cos(pitch),
                                     math.sin(pitch)])
        try:
            w2c = look_at(eye, (0.0, 0.0, 0.0), (0.0, 0.0, 1.0))
        except ValueError:  # the poles: +z is along the view direction, any horizontal up will do
            w2c = look_at(eye, (0.0, 0.0, 0.0), (0.0, 1.0, 0.0))
        cams.append(Camera(w2c, fx, fy, cx, cy, resolution, resolution))
    return cams


def camera_clip_matrix(camera, near: float, far: float) -> torch.Tensor:
    """[4, 4] world -> OpenGL clip space for an OpenCV ``Camera``; the rasteriser's row 0 is then image row H-1."""
    w, h = camera.width, camera.height
    proj = torch.zeros(4, 4, dtype=torch.float64)
    proj[0, 0], proj[0, 2] = 2 * camera.fx / w, 2 * camera.cx / w - 1
    proj[1, 1], proj[1, 2] = -2 * camera.fy / h, 1 - 2 * camera.cy / h  # OpenCV y down -> NDC y up
    proj[2, 2], proj[2, 3] = (far + near) / (far - near), -2 * far * near / (far - near)
    proj[3, 2] = 1.0
    return proj @ camera.world_to_camera.double()


def rasterize_view(vertices: torch.Tensor, faces: torch.Tensor, camera, near: float = 0.1,
                   far: float = 10.0) -> torch.Tensor:
    """rast [H, W, 4] of a mesh seen by ``camera``, in image row order (row 0 = top)."""
    m = camera_clip_matrix(camera, near, far).to(vertices.device, torch.float32)
    homo = torch.cat([vertices.float(), torch.ones_like(vertices[:, :1], dtype=torch.float32)], -1)
    rast = R.rasterize(homo @ m.T, faces, (camera.height, camera.width))[0]
    return rast.flip(0)


def _camera_from_matrices(extrinsics, intrinsics, width: int, height: int):
    from sam3d_objects.render import Camera

    k = torch.as_tensor(np.asarray(intrinsics), dtype=torch.float64)
    return Camera(torch.as_tensor(np.asarray(extrinsics), dtype=torch.float32), float(k[0, 0]) * width,
                  float(k[1, 1]) * height, float(k[0, 2]) * width, float(k[1, 2]) * height, width, height)


def _normalized_intrinsics(camera) -> np.ndarray:
    return np.array([[camera.fx / camera.width, 0, camera.cx / camera.width],
                     [0, camera.fy / camera.height, camera.cy / camera.height], [0, 0, 1]], dtype=np.float32)


# ------------------------------------------------------------------------------------------------- topology
def _boundary_edges(faces: np.ndarray) -> np.ndarray:
    """Directed edges (a, b) [E, 2] used by exactly one face (in that face's winding)."""
    directed = np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
    key = np.sort(directed, 1)
    _, inverse, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    return directed[counts[inverse.reshape(-1)] == 1]


def _edge_loops(edges: np.ndarray, num_vertices: int) -> Tuple[int, np.ndarray]:
    """Connected components of boundary edges (vertex graph): (count, label per edge)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    if len(edges) == 0:
        return 0, np.zeros(0, dtype=np.int64)
    graph = coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(num_vertices, num_vertices))
    n, labels = connected_components(graph, directed=False)
    return n, labels[edges[:, 0]]


def _loop_areas(vertices: np.ndarray, edges: np.ndarray, labels: np.ndarray, n: int) -> np.ndarray:
    """Upstream's hole area: 0.5 * sum |(a - c) x (b - c)| with c = mean edge midpoint of the loop."""
    mid = 0.5 * (vertices[edges[:, 0]] + vertices[edges[:, 1]])
    cnt = np.bincount(labels, minlength=n).astype(np.float64)
    centre = np.stack([np.bincount(labels, mid[:, d], minlength=n) for d in range(3)], 1) / np.maximum(cnt, 1)[:, None]
    c = centre[labels]
    cross = np.linalg.norm(np.cross(vertices[edges[:, 0]] - c, vertices[edges[:, 1]] - c), axis=1)
    return 0.5 * np.bincount(labels, cross, minlength=n)


def _fill_small_holes(vertices: np.ndarray, faces: np.ndarray, max_hole_nbe: int) -> Tuple[np.ndarray, np.ndarray]:
    """Close every boundary loop with at most ``max_hole_nbe`` edges by a fan around its centroid (pymeshfix's
    job upstream, without its refinement). The new faces follow the surrounding winding."""
    edges = _boundary_edges(faces)
    n, labels = _edge_loops(edges, len(vertices))
    if n == 0:
        return vertices, faces
    sizes = np.bincount(labels, minlength=n)
    small = np.nonzero(sizes <= max_hole_nbe)[0]
    small = small[sizes[small] >= 3]
    if len(small) == 0:
        return vertices, faces
    keep = np.isin(labels, small)
    edges, labels = edges[keep], labels[keep]
    remap = -np.ones(n, dtype=np.int64)
    remap[small] = np.arange(len(small))
    labels = remap[labels]
    cnt = np.bincount(labels, minlength=len(small)).astype(np.float64)
    # Centroid of the loop's vertices (each vertex appears once as an edge start in a simple loop).
    centre = np.stack([np.bincount(labels, vertices[edges[:, 0], d], minlength=len(small)) for d in range(3)], 1)
    centre = centre / cnt[:, None]
    new_ids = len(vertices) + labels
    fan = np.stack([edges[:, 1], edges[:, 0], new_ids], 1)  # reversed edge: consistent orientation
    return (np.concatenate([vertices, centre.astype(vertices.dtype)]),
            np.concatenate([faces, fan.astype(faces.dtype)]))


def _face_adjacency(faces: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Pairs of faces sharing an edge [P, 2] and the shared edge's vertex ids [P, 2] (manifold edges only)."""
    edges = np.sort(np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]]), 1)
    face_of = np.tile(np.arange(len(faces)), 3)
    order = np.lexsort((edges[:, 1], edges[:, 0]))
    edges, face_of = edges[order], face_of[order]
    same = (edges[1:] == edges[:-1]).all(1)
    return np.stack([face_of[:-1][same], face_of[1:][same]], 1), edges[:-1][same]


def _face_components(faces: np.ndarray) -> Tuple[int, np.ndarray]:
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    pairs, _ = _face_adjacency(faces)
    f = len(faces)
    graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(f, f))
    return connected_components(graph, directed=False)


# ------------------------------------------------------------------------------------------------- hole filling
def _face_visibility(vertices: torch.Tensor, faces: torch.Tensor, resolution: int, num_views: int,
                     verbose: bool) -> torch.Tensor:
    """Fraction of views in which some pixel shows the face as front-most (upstream's step 2)."""
    counts = torch.zeros(len(faces), dtype=torch.float32, device=vertices.device)
    cams = sphere_hammersley_cameras(num_views, resolution)
    for cam in tqdm(cams, desc="visibility", disable=not verbose):
        rast = rasterize_view(vertices, faces, cam, near=1.0, far=3.0)
        ids = rast[..., 3].reshape(-1).long()
        seen = torch.unique(ids[ids > 0]) - 1
        counts[seen] += 1
    return counts / num_views


def _min_cut_source_side(num_faces: int, pairs: np.ndarray, weights: np.ndarray, inner: np.ndarray,
                         outer: np.ndarray) -> np.ndarray:
    """Faces on the source side of the s-t min cut (source linked to inner faces, sink to outer ones)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    s, t = num_faces, num_faces + 1
    # Upstream: dual edges weigh their mesh edge's length, terminal links weigh 1. SciPy wants integer
    # capacities, so both are scaled by 1e6 (edge lengths of 1e-6 still count as 1).
    unit = 1_000_000
    dual = np.maximum(np.round(weights * unit), 1).astype(np.int64)
    rows = np.concatenate([pairs[:, 0], pairs[:, 1], np.full(len(inner), s), outer])
    cols = np.concatenate([pairs[:, 1], pairs[:, 0], inner, np.full(len(outer), t)])
    caps = np.concatenate([dual, dual, np.full(len(inner), unit), np.full(len(outer), unit)])
    n = num_faces + 2
    graph = csr_matrix((caps.astype(np.int32), (rows, cols)), shape=(n, n))
    graph.sum_duplicates()
    flow = maximum_flow(graph, s, t).flow
    residual = (graph - flow).tocsr()
    residual.data = np.where(residual.data > 0, residual.data, 0)
    residual.eliminate_zeros()
    reach = breadth_first_order(residual, s, directed=True, return_predecessors=False)
    reach = reach[reach < num_faces]
    return np.sort(reach)


def _fill_holes(verts: torch.Tensor, faces: torch.Tensor, max_hole_size: float = 0.04, max_hole_nbe: int = 32,
                resolution: int = 128, num_views: int = 500, debug: bool = False,
                verbose: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Remove invisible interior faces (min cut on the dual graph) and close small holes.

    Difference from upstream: small holes are filled even when no face is fully invisible (upstream skips its
    pymeshfix step then, which leaves punched holes open)."""
    device = verts.device
    with torch.no_grad():
        vis = _face_visibility(verts, faces, resolution, num_views, verbose).cpu().numpy()
    v = verts.detach().cpu().double().numpy()
    f = faces.detach().cpu().long().numpy()
    inner = np.nonzero(vis == 0)[0]
    if len(inner):
        n_comp, comp = _face_components(f)
        outer_mask = np.zeros(len(f), dtype=bool)
        for c in range(n_comp):
            members = comp == c
            tau = min(max(float(np.quantile(vis[members], 0.75)), 0.25), 0.5)
            outer_mask |= members & (vis > tau)
        pairs, shared = _face_adjacency(f)
        weights = np.linalg.norm(v[shared[:, 0]] - v[shared[:, 1]], axis=1)
        candidates = _min_cut_source_side(len(f), pairs, weights, inner, np.nonzero(outer_mask)[0])
        remove = _accepted_removals(v, f, candidates, vis, max_hole_size)
        if remove.any():
            f = f[~remove]
            used = np.unique(f)
            remap = -np.ones(len(v), dtype=np.int64)
            remap[used] = np.arange(len(used))
            v, f = v[used], remap[f]
        if verbose:
            print(f"fill_holes: removed {int(remove.sum())} interior faces")
    v, f = _fill_small_holes(v, f, max_hole_nbe)
    return torch.tensor(v, dtype=torch.float32, device=device), torch.tensor(f, dtype=torch.int32, device=device)


def _accepted_removals(v: np.ndarray, f: np.ndarray, candidates: np.ndarray, vis: np.ndarray,
                       max_hole_size: float) -> np.ndarray:
    """Upstream's step 7: per connected candidate component, accept unless mostly visible or it opens a big hole."""
    remove = np.zeros(len(f), dtype=bool)
    if len(candidates) == 0:
        return remove
    original_boundary = {tuple(sorted(e)) for e in _boundary_edges(f).tolist()}
    sub = f[candidates]
    n_comp, comp = _face_components(sub)
    for c in range(n_comp):
        members = candidates[comp == c]
        if np.median(vis[members]) > 0.25:
            continue
        edges = _boundary_edges(f[members])
        new = np.array([not (tuple(sorted(e)) in original_boundary) for e in edges.tolist()], dtype=bool)
        edges = edges[new] if len(edges) else edges
        if len(edges):
            n_loops, labels = _edge_loops(edges, len(v))
            loops = np.unique(labels)
            areas = _loop_areas(v, edges, np.searchsorted(loops, labels), len(loops))
            if (areas > max_hole_size).any():
                continue
        remove[members] = True
    return remove


# ------------------------------------------------------------------------------------------------- public API
def postprocess_mesh(vertices: np.ndarray, faces: np.ndarray, simplify: bool = True, simplify_ratio: float = 0.9,
                     fill_holes: bool = True, fill_holes_max_hole_size: float = 0.04,
                     fill_holes_max_hole_nbe: int = 32, fill_holes_resolution: int = 1024,
                     fill_holes_num_views: int = 1000, debug: bool = False,
                     verbose: bool = False, device: Union[str, torch.device] = "cpu") -> Tuple[np.ndarray, np.ndarray]:
    """Quadric decimation (``simplify_ratio`` = fraction of faces removed), then interior-face removal and hole
    filling by visibility. numpy in, numpy out (float32 vertices, int32 faces). ``device`` (our addition) runs the
    visibility renders there (default CPU; any device works)."""
    vertices = np.asarray(vertices, dtype=np.float32)
    faces = np.asarray(faces)
    if simplify and simplify_ratio > 0:
        vertices, faces = _decimate(vertices, faces, simplify_ratio)
        if verbose:
            print(f"simplify: {len(faces)} faces left")
    if fill_holes:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        v_t, f_t = _fill_holes(torch.tensor(vertices, device=dev), torch.tensor(faces.astype(np.int64), device=dev),
                               max_hole_size=fill_holes_max_hole_size, max_hole_nbe=fill_holes_max_hole_nbe,
                               resolution=fill_holes_resolution, num_views=fill_holes_num_views, debug=debug,
                               verbose=verbose)
        vertices, faces = v_t.cpu().numpy(), f_t.cpu().numpy()
    return vertices.astype(np.float32), faces.astype(np.int32)


def _decimate(vertices: np.ndarray, faces: np.ndarray, ratio: float) -> Tuple[np.ndarray, np.ndarray]:
    try:
        import fast_simplification
    except ImportError as exc:
        raise ImportError("mesh simplification needs fast-simplification: `make extras EXTRAS=post` in the "
                          "clone (or pip install fast-simplification)") from exc
    points, tris = fast_simplification.simplify(np.ascontiguousarray(vertices, dtype=np.float32),
                                                np.ascontiguousarray(faces, dtype=np.int32), target_reduction=ratio)
    return np.asarray(points, dtype=np.float32), np.asarray(tris, dtype=np.int32)


def parametrize_mesh(vertices: np.ndarray, faces: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """xatlas UV unwrap: (vertices split along seams, faces, uvs in [0, 1])."""
    try:
        import xatlas
    except ImportError as exc:
        raise ImportError("UV unwrapping needs xatlas: `make extras EXTRAS=post` in the clone (or pip install xatlas)") \
            from exc
    vmapping, indices, uvs = xatlas.parametrize(np.asarray(vertices, dtype=np.float32), np.asarray(faces, np.uint32))
    return np.asarray(vertices)[vmapping], indices, uvs


def _nearest_fill(image: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Copy into every unknown pixel the value of the nearest known one (stand-in for Telea inpainting)."""
    from scipy.ndimage import distance_transform_edt

    if known.all() or not known.any():
        return image
    _, (ii, jj) = distance_transform_edt(~known, return_indices=True)
    return image[ii, jj]


def bake_texture(vertices, faces, uvs, observations: Sequence[np.ndarray], masks: Sequence[np.ndarray],
                 extrinsics: Sequence[np.ndarray], intrinsics: Sequence[np.ndarray], texture_size: int = 2048,
                 near: float = 0.1, far: float = 10.0, mode: str = "opt", lambda_tv: float = 1e-2,
                 verbose: bool = False, rendering_engine: str = "nvdiffrast", device="auto",
                 num_steps: int = 2500, seed: int = 0) -> np.ndarray:
    """Bake observations (uint8 [H, W, 3], image order) into a [T, T, 3] uint8 texture (row 0 = v close to 1).

    ``device`` "auto" (upstream: "cuda") is the project's default device (cuda > mps > cpu); an explicit "cuda"
    without CUDA falls back to it. Differences from upstream:
    the optimisation starts from the projected average (not black) and fits only pixels that the mesh covers too;
    views are drawn from a seeded generator (``seed``), ``num_steps`` is exposed (upstream: 2500); mode "fast"
    uses each view's own mask (upstream: the first view's for all). Both rendering engines sample through
    ``backends.rasterize.texture`` (bilinear, no mip-mapping). ``debug`` files of upstream are not written."""
    if mode not in ("fast", "opt"):
        raise ValueError(f"Unknown mode: {mode}")
    if rendering_engine not in ("nvdiffrast", "pytorch3d"):
        raise ValueError(f"rendering_engine must be 'nvdiffrast' or 'pytorch3d', got {rendering_engine!r}")
    dev = backends.device.as_device(None if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        dev = backends.device.default_device()
    t = int(texture_size)
    v = torch.as_tensor(np.asarray(vertices), dtype=torch.float32, device=dev)
    f = torch.as_tensor(np.asarray(faces).astype(np.int64), device=dev)
    uv = torch.as_tensor(np.asarray(uvs), dtype=torch.float32, device=dev)
    pix_uv, pix_rgb = _observed_texels(v, f, uv, observations, masks, extrinsics, intrinsics, near, far, verbose)
    tex, weight = _project(pix_uv, pix_rgb, t)
    seen = (weight > 0).cpu().numpy()
    tex = torch.as_tensor(_nearest_fill(tex.cpu().numpy(), seen), device=dev)
    if mode == "opt" and num_steps > 0:
        tex = _optimise(tex, pix_uv, pix_rgb, lambda_tv, num_steps, seed, verbose)
    # Texels outside every chart: nearest chart texel, so bilinear lookups at chart borders do not bleed black.
    chart = R.rasterize(torch.cat([uv * 2 - 1, torch.zeros_like(uv[:, :1]), torch.ones_like(uv[:, :1])], -1),
                        f, (t, t))[0, ..., 3] > 0
    out = _nearest_fill(tex.detach().cpu().numpy(), chart.cpu().numpy())
    return (np.clip(out[::-1], 0, 1) * 255 + 0.5).astype(np.uint8)


def _observed_texels(v, f, uv, observations, masks, extrinsics, intrinsics, near, far, verbose):
    """Per view: the uv and colour of pixels that are both in the mask and covered by the mesh."""
    pix_uv, pix_rgb = [], []
    for obs, mask, ext, intr in tqdm(list(zip(observations, masks, extrinsics, intrinsics)), desc="bake: views",
                                     disable=not verbose):
        h, w = obs.shape[:2]
        cam = _camera_from_matrices(ext, intr, w, h)
        rast = rasterize_view(v, f, cam, near, far)
        valid = (rast[..., 3] > 0) & torch.as_tensor(np.asarray(mask) > 0, device=v.device)
        tex_uv = R.interpolate(uv, rast.unsqueeze(0), f)[0]
        pix_uv.append(tex_uv[valid])
        pix_rgb.append(torch.as_tensor(np.asarray(obs)[..., :3], device=v.device)[valid].float() / 255.0)
    return pix_uv, pix_rgb


def _project(pix_uv: List[torch.Tensor], pix_rgb: List[torch.Tensor], t: int):
    """Average observed colour per texel (the "fast" bake); texel row 0 is v = 0."""
    device = pix_uv[0].device if pix_uv else torch.device("cpu")
    acc = torch.zeros(t * t, 3, device=device)
    weight = torch.zeros(t * t, device=device)
    for uv, rgb in zip(pix_uv, pix_rgb):
        col = (uv[:, 0] * t).long().clamp(0, t - 1)
        row = (uv[:, 1] * t).long().clamp(0, t - 1)
        idx = row * t + col
        acc.index_add_(0, idx, rgb)
        weight.index_add_(0, idx, torch.ones_like(rgb[:, 0]))
    tex = acc / weight.clamp(min=1).unsqueeze(-1)
    return tex.view(t, t, 3), weight.view(t, t)


def _optimise(init: torch.Tensor, pix_uv, pix_rgb, lambda_tv: float, steps: int, seed: int, verbose: bool):
    """Adam on L1(texture sampled at observed pixels, colours) + lambda_tv * TV, cosine-annealed lr (upstream)."""
    views = [i for i, p in enumerate(pix_uv) if len(p)]
    if not views:
        return init
    tex = torch.nn.Parameter(init.clone().unsqueeze(0))
    opt = torch.optim.Adam([tex], lr=1e-2, betas=(0.5, 0.9))
    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for step in tqdm(range(steps), desc="bake: optimise", disable=not verbose):
            i = views[int(torch.randint(len(views), (1,), generator=gen))]
            render = R.texture(tex, pix_uv[i].view(1, 1, -1, 2), boundary_mode="clamp")[0, 0]
            loss = (render - pix_rgb[i]).abs().mean()
            if lambda_tv > 0:
                tv = (tex[:, 1:] - tex[:, :-1]).abs().mean() + (tex[:, :, 1:] - tex[:, :, :-1]).abs().mean()
                loss = loss + lambda_tv * tv
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            for group in opt.param_groups:
                group["lr"] = 1e-5 + 0.5 * (1e-2 - 1e-5) * (1 + math.cos(math.pi * (step + 1) / steps))
    return tex.detach()[0]


def _render_gaussian_views(app_rep, cams, verbose: bool) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """Gaussian renders on black with their coverage: (uint8 colours un-premultiplied by alpha, masks alpha > 0.5).

    Dividing by alpha keeps silhouette pixels from baking in the black background (darkened borders). The
    gaussians' render inputs (covariances, colours) are formed once for all views; on the CPU several views render
    at once (``sam3d_objects.render.frame_workers``), the same images as one by one."""
    from sam3d_objects.render import frame_workers, gaussian_render_inputs, map_frames, render_gaussians

    cams = list(cams)
    means, covs, colors, opacities = gaussian_render_inputs(app_rep)

    def view(cam) -> Tuple[np.ndarray, np.ndarray]:
        res = render_gaussians(means, covs, colors, opacities, cam, background=(0.0, 0.0, 0.0))
        alpha = res.alpha.clamp(min=1e-6).unsqueeze(-1)
        colour = (res.color / alpha).clamp(0, 1)
        return (colour * 255 + 0.5).to(torch.uint8).cpu().numpy(), (res.alpha > 0.5).cpu().numpy()
    workers = frame_workers(means.device, len(cams), int(means.shape[0]))
    obs, masks = [], []
    for colour, mask in tqdm(map_frames(view, cams, workers), desc="render views", total=len(cams),
                             disable=not verbose):
        obs.append(colour)
        masks.append(mask)
    return obs, masks


def to_glb(app_rep, mesh, simplify: float = 0.95, fill_holes: bool = True, fill_holes_max_size: float = 0.04,
           texture_size: int = 1024, debug: bool = False, verbose: bool = True, with_mesh_postprocess: bool = True,
           with_texture_baking: bool = True, use_vertex_color: bool = False, rendering_engine: str = "nvdiffrast",
           *, fill_holes_resolution: int = 1024, fill_holes_num_views: int = 1000, bake_views: int = 100,
           bake_resolution: int = 1024, bake_steps: int = 2500):
    """Gaussians + mesh (z-up) -> ``trimesh.Trimesh`` (y-up), simplified / hole-filled / textured as upstream.

    The keyword-only arguments (ours) expose upstream's hard-coded view counts and resolutions so a CPU run can
    trade quality for time. Work runs on the mesh's device."""
    import trimesh
    from PIL import Image

    device = mesh.vertices.device
    vertices = mesh.vertices.detach().float().cpu().numpy()
    faces = mesh.faces.detach().cpu().numpy()
    colours = None
    if mesh.vertex_attrs is not None:
        colours = mesh.vertex_attrs[:, :3].detach().float().cpu().numpy()
    if with_mesh_postprocess:
        vertices, faces = postprocess_mesh(vertices, faces, simplify=simplify > 0, simplify_ratio=simplify,
                                           fill_holes=fill_holes, fill_holes_max_hole_size=fill_holes_max_size,
                                           fill_holes_max_hole_nbe=int(250 * math.sqrt(1 - simplify)),
                                           fill_holes_resolution=fill_holes_resolution,
                                           fill_holes_num_views=fill_holes_num_views, debug=debug, verbose=verbose,
                                           device=device)
        if len(faces) == 0:  # nothing to unwrap or bake: say so instead of failing deep in the rasteriser
            raise ValueError("mesh post-processing removed every face (simplification and interior-face removal "
                             "left nothing: the mesh is noise or seen by too few views); try a lower --simplify "
                             "or more visibility views")
    visual = None
    if with_texture_baking:
        vertices, faces, uvs = parametrize_mesh(vertices, faces)
        cams = sphere_hammersley_cameras(bake_views, bake_resolution)
        obs, masks = _render_gaussian_views(app_rep, cams, verbose)
        texture = bake_texture(vertices, faces, uvs, obs, masks, [c.world_to_camera.numpy() for c in cams],
                               [_normalized_intrinsics(c) for c in cams], texture_size=texture_size, mode="opt",
                               lambda_tv=0.01, verbose=verbose, rendering_engine=rendering_engine, device=device,
                               num_steps=bake_steps)
        material = trimesh.visual.material.PBRMaterial(roughnessFactor=1.0, metallicFactor=0.0,
                                                       baseColorTexture=Image.fromarray(texture),
                                                       baseColorFactor=np.array([255, 255, 255, 255], np.uint8))
        visual = trimesh.visual.TextureVisuals(uv=uvs, material=material)
    vertices = np.asarray(vertices, dtype=np.float64) @ _ZUP_TO_YUP
    if not with_mesh_postprocess and not with_texture_baking and use_vertex_color and colours is not None:
        out = trimesh.Trimesh(vertices, faces, process=False)
        out.visual.vertex_colors = (np.clip(colours, 0, 1) * 255 + 0.5).astype(np.uint8)
        return out
    return trimesh.Trimesh(vertices, faces, visual=visual)


def render_textured_mesh(mesh, camera, near: float = 0.1, far: float = 10.0, y_up: bool = True,
                         background: Sequence[float] = (0.0, 0.0, 0.0)) -> Tuple[np.ndarray, np.ndarray]:
    """Render a textured ``trimesh.Trimesh`` (as ``to_glb`` returns) with an OpenCV ``Camera`` of the z-up object
    frame: (float [H, W, 3] colours in [0, 1], bool coverage). Texture lookups are bilinear in display values."""
    vertices = np.asarray(mesh.vertices, dtype=np.float64)
    if y_up:
        vertices = vertices @ _ZUP_TO_YUP.T  # undo (x, y, z) -> (x, z, -y)
    v = torch.tensor(vertices, dtype=torch.float32)
    f = torch.tensor(np.asarray(mesh.faces, dtype=np.int64))
    rast = rasterize_view(v, f, camera, near, far)
    hit = rast[..., 3] > 0
    image = torch.tensor(background, dtype=torch.float32).expand(camera.height, camera.width, 3).clone()
    material = getattr(mesh.visual, "material", None)
    tex_img = getattr(material, "baseColorTexture", None) if material is not None else None
    if tex_img is None and material is not None:
        tex_img = getattr(material, "image", None)
    if tex_img is not None and getattr(mesh.visual, "uv", None) is not None:
        uv = torch.tensor(np.asarray(mesh.visual.uv), dtype=torch.float32)
        tex = torch.tensor(np.ascontiguousarray(np.asarray(tex_img.convert("RGB"))[::-1]), dtype=torch.float32) / 255.0
        pix_uv = R.interpolate(uv, rast.unsqueeze(0), f)
        colour = R.texture(tex, pix_uv, boundary_mode="clamp")[0]
    else:
        rgba = torch.tensor(np.asarray(mesh.visual.vertex_colors)[:, :3], dtype=torch.float32) / 255.0
        colour = R.interpolate(rgba, rast.unsqueeze(0), f)[0]
    image[hit] = colour[hit]
    return image.numpy(), hit.numpy()


def write_preview(mesh, path, resolution: int = 512, views: Sequence[Tuple[float, float]] = ((30, 20), (150, 20),
                  (270, 20)), radius: float = 2.0, fov_deg: float = 40.0) -> str:
    """Save a PNG strip of the textured mesh from a few orbit views (z-up object frame) next to a GLB."""
    from PIL import Image

    from sam3d_objects.render import orbit_camera

    tiles = []
    for yaw, pitch in views:
        cam = orbit_camera(yaw, pitch, radius, fov_deg=fov_deg, width=resolution)
        img, _ = render_textured_mesh(mesh, cam, background=(1.0, 1.0, 1.0))
        tiles.append((np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8))
    Image.fromarray(np.concatenate(tiles, 1)).save(str(path))
    return str(path)


def simplify_gs(gs, simplify: float = 0.95, verbose: bool = True):
    """Keep the ``(1 - simplify)`` most significant Gaussians (opacity x volume), a documented stand-in for
    upstream's ADMM-sparsified re-optimisation (upstream marks it unused). Returns a new Gaussian."""
    import copy

    if simplify <= 0:
        return gs
    n = gs.get_xyz.shape[0]
    keep_n = max(1, int((1 - simplify) * n))
    score = gs.get_opacity.detach().reshape(-1) * gs.get_scaling.detach().prod(-1)
    keep = torch.topk(score, keep_n).indices.sort().values
    out = copy.copy(gs)
    for name in ("_xyz", "_features_dc", "_features_rest", "_scaling", "_rotation", "_opacity"):
        value = getattr(gs, name, None)
        if isinstance(value, torch.Tensor) and value.shape[:1] == (n,):
            setattr(out, name, value.detach()[keep].clone())
    if verbose:
        print(f"simplify_gs: {n} -> {keep_n} gaussians")
    return out


# ------------------------------------------------------------------------------------------------- CLI helpers
def refine_glb(output, texture: bool = False, simplify: Optional[float] = None, verbose: bool = False, **kwargs):
    """The CLI's ``--texture`` / ``--simplify RATIO`` on a pipeline output (``mesh`` and ``gaussian`` lists).

    ``texture``: upstream's full path (simplify, interior removal, hole filling, xatlas, bake; ``simplify``
    defaults to 0.95). ``simplify`` alone: the mesh post-processing only, with each new vertex taking the colour of
    the nearest original vertex (upstream's export would have no colour at all then). kwargs go to ``to_glb``."""
    from scipy.spatial import cKDTree

    mesh = output["mesh"][0]
    ratio = 0.95 if simplify is None else float(simplify)
    if not 0 <= ratio < 1:
        raise ValueError(f"--simplify must be in [0, 1) (fraction of faces removed), got {ratio}")
    if texture:
        gaussians = output.get("gaussian") or [None]
        if gaussians[0] is None:
            raise ValueError("--texture bakes the gaussians' colours: keep 'gaussian' in --formats")
        return to_glb(gaussians[0], mesh, simplify=ratio, verbose=verbose, **kwargs)
    glb = to_glb(None, mesh, simplify=ratio, verbose=verbose, with_texture_baking=False, **kwargs)
    if mesh.vertex_attrs is not None:
        src = mesh.vertices.detach().float().cpu().numpy() @ _ZUP_TO_YUP
        colours = mesh.vertex_attrs[:, :3].detach().float().cpu().clamp(0, 1).numpy()
        nearest = cKDTree(src).query(np.asarray(glb.vertices))[1]
        glb.visual.vertex_colors = (colours[nearest] * 255 + 0.5).astype(np.uint8)
    return glb


def export_mesh_extras(glb, folder, formats: Sequence[str] = (), preview: bool = False) -> List:
    """Write ``mesh.obj`` / ``mesh.stl`` (trimesh exports) and ``mesh_preview.png``; returns the paths."""
    from pathlib import Path

    folder = Path(folder)
    written = []
    for ext in formats:
        if ext not in ("obj", "stl"):
            raise ValueError(f"unknown mesh export format {ext!r} (obj, stl)")
        path = folder / f"mesh.{ext}"
        glb.export(str(path))
        written.append(path)
    if preview:
        written.append(Path(write_preview(glb, folder / "mesh_preview.png")))
    return written
