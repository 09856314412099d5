"""How sensitive is the golden ``slat_decoder_mesh`` face-normal check? (a developer tool, not a test)

Feeds upstream's OWN recorded decoder output (``stage.out_layer.feats``) to our mesh extractor, once as
recorded and then with every entry moved by +-k float32 ulps (random signs, seeded), and runs the harness's
``check_mesh`` on the result. Our extraction reproduces upstream's mesh bit for bit from the recorded output, so
any failure here is the conditioning of the check itself: near-degenerate triangles (edges ~1e-4) turn vertex
moves of ~1e-7 into face-normal changes of ~1e-4.

    python tests/tools/mesh_normal_conditioning.py [--golden ../shared/golden] [--ulps 0 1 2] [--seeds 5]
"""
import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor  # noqa: E402
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import SparseFeatures2Mesh  # noqa: E402


def nudge(values: torch.Tensor, ulps: int, seed: int) -> torch.Tensor:
    """Move each entry by `ulps` representable float32 steps, up or down at random."""
    up = torch.rand(values.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    target = torch.where(up, torch.tensor(float("inf")), torch.tensor(float("-inf")))
    for _ in range(ulps):
        values = torch.nextafter(values, target)
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=pathlib.Path, default=ROOT.parent / "shared" / "golden")
    parser.add_argument("--ulps", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(args.golden))
    import check_cases

    check_cases._import_libraries()
    case = check_cases.Case(args.golden / "slat_decoder_mesh")
    out = case.outputs
    extractor = SparseFeatures2Mesh(res=4 * case.config.resolution, use_color=True)
    keys = {k: k for k in ("vertices", "faces", "vertex_attrs", "face_normal")}
    for ulps in args.ulps:
        for seed in range(args.seeds if ulps else 1):
            feats = nudge(out["stage.out_layer.feats"].clone(), ulps, seed)
            mesh = extractor(SparseTensor(feats=feats, coords=out["stage.out_layer.coords"]))
            chk = check_cases.Checker(case)
            check_cases.check_mesh(chk, mesh, keys)
            verdict = "; ".join(f"{k}: {d}" for k, d in chk.failures) or "all mesh checks pass"
            print(f"+-{ulps} ulp, seed {seed}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
