"""Real spherical harmonics up to degree 4 (upstream's ``renderers.sh_utils``): normalisation constants, evaluation
of coefficient sets along view directions and the degree-0 colour <-> coefficient conversions.

Works on torch tensors and numpy arrays alike (only arithmetic and slicing)."""
from __future__ import annotations

from typing import Any

__all__ = ["C0", "C1", "C2", "C3", "C4", "eval_sh", "RGB2SH", "SH2RGB"]

# normalisation constants of the real SH basis, band by band (sqrt((2l+1)/(4 pi) * (l-|m|)!/(l+|m|)!) times the
# polynomial's integer factor), in the order the evaluation below uses them
C0 = 0.28209479177387814
C1 = 0.4886025119029199
C2 = [1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396]
C3 = [-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154, -0.4570457994644658,
      1.445305721320277, -0.5900435899266435]
C4 = [2.5033429417967046, -1.7701307697799304, 0.9461746957575601, -0.6690465435572892, 0.10578554691520431,
      -0.6690465435572892, 0.47308734787878004, -1.7701307697799304, 0.6258357354491761]


def _band_terms(deg: int, x, y, z) -> list:
    """Basis functions (without the coefficient) of all bands up to ``deg``, flat index order."""
    terms = [C0 + 0 * x]
    if deg >= 1:
        terms += [-C1 * y, C1 * z, -C1 * x]
    if deg >= 2:
        xx, yy, zz, xy, yz, xz = x * x, y * y, z * z, x * y, y * z, x * z
        terms += [C2[0] * xy, C2[1] * yz, C2[2] * (2 * zz - xx - yy), C2[3] * xz, C2[4] * (xx - yy)]
    if deg >= 3:
        terms += [C3[0] * y * (3 * xx - yy), C3[1] * xy * z, C3[2] * y * (4 * zz - xx - yy),
                  C3[3] * z * (2 * zz - 3 * xx - 3 * yy), C3[4] * x * (4 * zz - xx - yy), C3[5] * z * (xx - yy),
                  C3[6] * x * (xx - 3 * yy)]
    if deg >= 4:
        terms += [C4[0] * xy * (xx - yy), C4[1] * yz * (3 * xx - yy), C4[2] * xy * (7 * zz - 1),
                  C4[3] * yz * (7 * zz - 3), C4[4] * (zz * (35 * zz - 30) + 3), C4[5] * xz * (7 * zz - 3),
                  C4[6] * (xx - yy) * (7 * zz - 1), C4[7] * xz * (xx - 3 * yy),
                  C4[8] * (xx * (xx - 3 * yy) - yy * (3 * xx - yy))]
    return terms


def eval_sh(deg: int, sh: Any, dirs: Any) -> Any:
    """Value of the SH expansion ``sh`` [..., C, (deg+1)^2 or more] along unit directions ``dirs`` [..., 3]
    (not normalised here) -> [..., C]."""
    assert 0 <= deg <= 4, f"eval_sh supports degrees 0..4, got {deg}"
    coeff = (deg + 1) ** 2
    assert sh.shape[-1] >= coeff, f"sh has {sh.shape[-1]} coefficients, degree {deg} needs {coeff}"
    x, y, z = dirs[..., 0:1], dirs[..., 1:2], dirs[..., 2:3]
    result = 0
    for i, basis in enumerate(_band_terms(deg, x, y, z)):
        result = result + basis * sh[..., i]
    return result


def RGB2SH(rgb: Any) -> Any:  # noqa: N802  upstream's name
    """Degree-0 coefficient of a colour in [0, 1]."""
    return (rgb - 0.5) / C0


def SH2RGB(sh: Any) -> Any:  # noqa: N802  upstream's name
    """Colour of a degree-0 coefficient."""
    return sh * C0 + 0.5
