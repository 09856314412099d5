"""Sparse voxel octree over the unit cube (upstream's DfsOctree): the structure array holds, per non-leaf node,
(leaf-children count, first non-leaf child row, first leaf child data row); children are stored contiguously,
blocks in parent-row order (so pointers are prefix sums of the counts); per-leaf data arrays are separate."""
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import backends

DEFAULT_TRIVEC_CONFIG = {"dim": 8, "rank": 8}
DEFAULT_VOXEL_CONFIG = {"solid": False}
DEFAULT_DECOPOLY_CONFIG = {"degree": 8, "rank": 16}


def _octant_offsets(device: Any) -> torch.Tensor:
    """(8, 3) offsets in {0, 1}: bit 0 -> x, bit 1 -> y, bit 2 -> z (x fastest)."""
    i = torch.arange(8, device=device)
    return torch.stack([i & 1, (i >> 1) & 1, (i >> 2) & 1], dim=-1).float()


class DfsOctree:
    # per-primitive data arrays (set in __init__ for the configured primitive only, as upstream): voxel ->
    # features_dc, features_ac (+ density unless solid); gaussian -> + opacity; trivec -> trivec, density, ...;
    # decoupoly -> decoupoly_V, decoupoly_g, density, features_dc, features_ac
    features_dc: torch.Tensor
    features_ac: torch.Tensor
    density: torch.Tensor
    opacity: torch.Tensor
    decoupoly_V: torch.Tensor  # noqa: N815  upstream's name
    decoupoly_g: torch.Tensor
    # what the last structure_control did (upstream keeps it for re-arranging optimiser state): subdivide_mask /
    # merge_mask over the old leaves, new_data {name: array} and new_data_length. Upstream's slot bookkeeping
    # (data_valid, new_data_idx) has no counterpart: the leaves here are stored densely, in DFS order.
    data_rearrange_buffer: Dict[str, Any]

    def __init__(self, depth: int, aabb: Sequence[float] = [0, 0, 0, 1, 1, 1], sh_degree: int = 2,  # noqa: B006
                 primitive: str = "voxel", primitive_config: Dict[str, Any] = {},  # noqa: B006 (copied)
                 device: Optional[Any] = None):
        device = backends.device.as_device(device)  # upstream: "cuda"; here the default device
        config = dict(primitive_config or {})
        self.max_depth = depth
        self.aabb = torch.tensor(list(aabb), dtype=torch.float32, device=device)
        self.device = device
        self.sh_degree = self.active_sh_degree = sh_degree
        self.primitive = primitive
        self.primitive_config = config
        self.structure = torch.tensor([[8, 1, 0]], dtype=torch.int32, device=device)
        self.position = (_octant_offsets(device) * 0.5 + 0.25)
        self.depth = torch.ones(8, 1, dtype=torch.uint8, device=device)
        self.data: List[str] = ["position", "depth"]
        self.param_names: List[str] = []
        n_ac = (sh_degree + 1) ** 2 - 1
        fields: Dict[str, tuple] = {}
        if primitive == "voxel":
            fields = {"features_dc": (8, 1, 3), "features_ac": (8, n_ac, 3)}
            if not config.get("solid", False):
                fields["density"] = (8, 1)
        elif primitive == "gaussian":
            fields = {"features_dc": (8, 1, 3), "features_ac": (8, n_ac, 3), "opacity": (8, 1)}
        elif primitive == "trivec":
            rank, dim = config["rank"], config["dim"]
            fields = {"trivec": (8, rank, 3, dim), "density": (8, rank), "features_dc": (8, rank, 1, 3),
                      "features_ac": (8, rank, n_ac, 3)}
            self.density_shift = 0
        elif primitive == "decoupoly":
            rank, degree = config["rank"], config["degree"]
            fields = {"decoupoly_V": (8, rank, 3), "decoupoly_g": (8, rank, degree), "density": (8, rank),
                      "features_dc": (8, rank, 1, 3), "features_ac": (8, rank, n_ac, 3)}
            self.density_shift = 0
        for name, shape in fields.items():
            setattr(self, name, torch.zeros(shape, dtype=torch.float32, device=device))
            self.data.append(name)
            self.param_names.append(name)
        self.setup_functions()

    def setup_functions(self) -> None:
        self.density_activation = (lambda x: x) if self.primitive == "trivec" else (lambda x: torch.exp(x - 2))
        self.opacity_activation = lambda x: torch.sigmoid(x - 6)
        self.inverse_opacity_activation = lambda x: torch.logit(x) + 6
        self.color_activation = torch.sigmoid

    @property
    def num_non_leaf_nodes(self) -> int:
        return self.structure.shape[0]

    @property
    def num_leaf_nodes(self) -> int:
        return self.depth.shape[0]

    @property
    def cur_depth(self) -> int:
        return int(self.depth.max())

    @property
    def occupancy(self) -> float:
        return self.num_leaf_nodes / 8 ** self.cur_depth

    @property
    def get_xyz(self) -> torch.Tensor:
        return self.position

    @property
    def get_depth(self) -> torch.Tensor:
        return self.depth

    @property
    def get_density(self) -> torch.Tensor:
        # upstream reads a never-set voxel_config for voxels and fails; the evident intent: a solid voxel is opaque
        if self.primitive == "voxel" and self.primitive_config.get("solid", False):
            return torch.full((self.num_leaf_nodes, 1), 1000.0, device=self.position.device)
        return self.density_activation(self.density)

    @property
    def get_opacity(self) -> torch.Tensor:
        # upstream applies the opacity activation to `density` (kept)
        return self.opacity_activation(self.density)

    @property
    def get_trivec(self) -> torch.Tensor:
        return self.trivec

    @property
    def get_decoupoly(self):
        return F.normalize(self.decoupoly_V, dim=-1), self.decoupoly_g

    @property
    def get_color(self) -> torch.Tensor:
        # upstream reads a never-set `colors`; the evident intent: the activated DC colour
        return self.color_activation(self.features_dc)

    @property
    def get_features(self) -> torch.Tensor:
        if self.sh_degree == 0:
            return self.features_dc
        return torch.cat([self.features_dc, self.features_ac], dim=-2)

    def state_dict(self) -> Dict[str, Any]:
        out = {"structure": self.structure, "position": self.position, "depth": self.depth,
               "sh_degree": self.sh_degree, "active_sh_degree": self.active_sh_degree,
               "trivec_config": self.primitive_config if self.primitive == "trivec" else DEFAULT_TRIVEC_CONFIG,
               "voxel_config": self.primitive_config if self.primitive == "voxel" else DEFAULT_VOXEL_CONFIG,
               "primitive": self.primitive}
        if hasattr(self, "density_shift"):
            out["density_shift"] = self.density_shift
        for name in self.data + self.param_names:
            value = getattr(self, name)
            out[name] = value.state_dict() if isinstance(value, nn.Module) else value
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        for key in set(self.data + self.param_names + list(state_dict) + ["structure", "position", "depth"]):
            if key not in state_dict:
                print(f"Warning: key {key} not found in the state_dict.")
                continue
            try:
                current = getattr(self, key, None)
                if isinstance(current, nn.Module):
                    current.load_state_dict(state_dict[key])
                else:
                    setattr(self, key, state_dict[key])
            except Exception as e:  # noqa: BLE001 - reported per key, as upstream
                print(e)
                raise ValueError(f"Error loading key {key}.") from e

    def gather_from_leaf_children(self, data: torch.Tensor) -> torch.Tensor:
        """Per non-leaf node: the sum of `data` over its leaf children."""
        counts = self.structure[:, 0].long()
        owner = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        rows = torch.repeat_interleave(self.structure[:, 2].long(), counts) + (
            torch.arange(int(counts.sum()), device=counts.device)
            - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts))
        out = torch.zeros((len(counts),) + tuple(data.shape[1:]), dtype=data.dtype, device=data.device)
        return out.index_add_(0, owner, data[rows])

    def gather_from_non_leaf_children(self, data: torch.Tensor) -> torch.Tensor:
        """Per non-leaf node: the sum of `data` (indexed by structure row) over its non-leaf children."""
        counts = 8 - self.structure[:, 0].long()
        owner = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        rows = torch.repeat_interleave(self.structure[:, 1].long(), counts) + (
            torch.arange(int(counts.sum()), device=counts.device)
            - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts))
        return torch.zeros_like(data).index_add_(0, owner, data[rows])

    # ---- subdivision / merging (training-time structure control)
    def _leaf_cells(self) -> torch.Tensor:
        """Integer cell (x, y, z) of every leaf at the max depth's scale."""
        size = 2.0 ** -self.depth.float()
        return torch.floor((self.position - size / 2) * 2 ** self.max_depth + 0.5).long()

    def structure_control(self, mask: torch.Tensor) -> None:
        """Subdivide leaves with mask 1 (not at max depth), merge complete sibling groups marked -1 (not at depth
        1), keep 0. The octree (structure and every data array) is rebuilt from the resulting leaf set; new
        children copy the parent's fields (trivecs resampled over the child's half-range, opacity re-encoded as
        inv(sqrt(act(opacity)))), a merged parent takes its first child's fields."""
        depth = self.depth[:, 0].long()
        mask = mask.clone().long()
        mask[(depth >= self.max_depth) & (mask > 0)] = 0
        mask[(depth <= 1) & (mask < 0)] = 0
        fields = [n for n in self.data if n not in ("position", "depth")]
        positions, depths, parts = [], [], {n: [] for n in fields}
        size = 2.0 ** -depth.float()
        parent_key = torch.floor(self.position / (2 * size[:, None])).long()
        merged_done = set()
        for i in range(self.num_leaf_nodes):
            if mask[i] < 0:
                key = (int(depth[i]), *parent_key[i].tolist())
                if key in merged_done:
                    continue
                merged_done.add(key)
                centre = (parent_key[i].float() + 0.5) * 2 * size[i]
                positions.append(centre[None])
                depths.append(depth[i:i + 1] - 1)
                for n in fields:
                    parts[n].append(getattr(self, n)[i:i + 1])
            elif mask[i] > 0:
                offsets = _octant_offsets(self.position.device)
                positions.append(self.position[i] + (offsets - 0.5) * 2.0 ** (-1 - int(depth[i])))
                depths.append(depth[i].repeat(8) + 1)
                for n in fields:
                    parts[n].append(self._child_values(n, getattr(self, n)[i], offsets))
            else:
                positions.append(self.position[i:i + 1])
                depths.append(depth[i:i + 1])
                for n in fields:
                    parts[n].append(getattr(self, n)[i:i + 1])
        position, depth = torch.cat(positions), torch.cat(depths)
        order = self._rebuild_structure(position, depth)
        self.position = position[order]
        self.depth = depth[order].to(torch.uint8)[:, None]
        for n in fields:
            setattr(self, n, torch.cat(parts[n])[order])
        self.data_rearrange_buffer = {"subdivide_mask": mask > 0, "merge_mask": mask < 0,
                                      "new_data_length": int(self.position.shape[0]),
                                      "new_data": {n: getattr(self, n) for n in self.data}}

    def _child_values(self, name: str, value: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if name == "opacity":
            value = self.inverse_opacity_activation(torch.sqrt(self.opacity_activation(value)))
        if name == "trivec":  # (rank, 3, dim): each axis line resampled over the child's half of it
            rank, _, dim = value.shape
            children = []
            for off in offsets:
                axes = []
                for a in range(3):
                    lo = -1 + float(off[a])  # half range [-1, 0] or [0, 1] in grid_sample coordinates
                    grid = torch.stack([torch.linspace(lo, lo + 1, dim, device=value.device),
                                        torch.zeros(dim, device=value.device)], -1)[None, None]
                    line = value[:, a][:, None, None, :]  # (rank, 1, 1, dim)
                    axes.append(F.grid_sample(line, grid.expand(rank, -1, -1, -1), align_corners=True)[:, 0, 0])
                children.append(torch.stack(axes, dim=1))
            return torch.stack(children)
        return value[None].expand(8, *value.shape).clone()

    def _rebuild_structure(self, position: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Structure rows (parent-row order) for the leaf set; returns the data order of the leaves."""
        cells = torch.floor(position * (2.0 ** depth.float())[:, None]).long()
        paths = []
        for c, d in zip(cells.tolist(), depth.tolist()):
            path = tuple(((c[0] >> (d - 1 - k)) & 1) | (((c[1] >> (d - 1 - k)) & 1) << 1)
                         | (((c[2] >> (d - 1 - k)) & 1) << 2) for k in range(d))
            paths.append(path)
        leaf_of = {p: i for i, p in enumerate(paths)}
        inner = {p[:k] for p in paths for k in range(len(p))}
        queue, structure, leaf_order = [()], [], []
        while queue:
            node = queue.pop(0)
            kids_inner = [node + (o,) for o in range(8) if node + (o,) in inner]
            kids_leaf = [leaf_of[node + (o,)] for o in range(8) if node + (o,) in leaf_of]
            structure.append([len(kids_leaf), 0, len(leaf_order)])
            leaf_order += kids_leaf
            queue += kids_inner
        counts = torch.tensor([8 - s[0] for s in structure])
        child_ptr = 1 + torch.cumsum(counts, 0) - counts
        for s, ptr in zip(structure, child_ptr.tolist()):
            s[1] = ptr
        self.structure = torch.tensor(structure, dtype=torch.int32, device=position.device)
        return torch.tensor(leaf_order, dtype=torch.long, device=position.device)
