"""Conversions between an object's metric pose and the network's pose targets ("pose target conventions").

An object pose is local-to-camera ("l2c"): x_cam = R(q) (s * x_local) + t, quaternions (w, x, y, z). The scene
scale/shift of a scale-and-shift-invariant (SSI) point map relate metric and SSI space: metric = ssi * scale +
shift. Written from the project spec (models_generators_data.md section 29) with plain torch matrices instead of
pytorch3d's Transform3d.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import torch

from sam3d_objects.utils.rotation import matrix_to_quaternion, quaternion_to_matrix

logger = logging.getLogger(__name__)


@dataclass
class InstancePose:
    instance_scale_l2c: torch.Tensor
    instance_position_l2c: torch.Tensor
    instance_quaternion_l2c: torch.Tensor
    scene_scale: torch.Tensor
    scene_shift: torch.Tensor

    @classmethod
    def _broadcast_postcompose(cls, scale: torch.Tensor, rotation: torch.Tensor, translation: torch.Tensor,
                               transform_to_postcompose: torch.Tensor):
        """Compose the object transform (scale, then rotate by quaternion, then translate) with a following
        affine map given as a (B, 4, 4) column-convention matrix (or (4, 4)); returns (scale, quat, translation)
        shaped like the inputs. Inputs may be (B, K, C), (B, C) or (C,)."""
        shape_s, shape_q, shape_t = scale.shape, rotation.shape, translation.shape
        s = scale.reshape(-1, scale.shape[-1])
        q = rotation.reshape(-1, 4)
        t = translation.reshape(-1, 3)
        n = t.shape[0]
        s3 = s.expand(n, 3) if s.shape[-1] == 1 else s
        post = transform_to_postcompose
        post = post[None] if post.dim() == 2 else post
        # upstream repeats the (B, 4, 4) matrices K times (whole-batch tiling): same here
        post = post.repeat(n // post.shape[0], 1, 1).to(t)
        obj = torch.zeros(n, 4, 4, dtype=t.dtype, device=t.device)
        obj[:, :3, :3] = quaternion_to_matrix(q).to(t) * s3[:, None, :]
        obj[:, :3, 3] = t
        obj[:, 3, 3] = 1
        full = post @ obj
        linear = full[:, :3, :3]
        new_s = linear.norm(dim=-2)  # column norms: per-axis scale of the local frame
        new_q = matrix_to_quaternion(linear / new_s[:, None, :])
        new_t = full[:, :3, 3]
        if shape_s[-1] == 1:
            new_s = new_s[:, :1]
        return new_s.reshape(shape_s), new_q.reshape(shape_q), new_t.reshape(shape_t)


@dataclass
class PoseTarget:
    x_instance_scale: torch.Tensor
    x_instance_rotation: torch.Tensor
    x_instance_translation: torch.Tensor
    x_scene_scale: torch.Tensor
    x_scene_center: torch.Tensor
    x_translation_scale: torch.Tensor
    pose_target_convention: str = "unknown"


@dataclass
class InvariantPoseTarget:
    """T(x) = s_scene * |t_rel| * (s_tilde R(q) x + t_unit), t_rel = t / s_scene, s_rel = s / s_scene,
    s_tilde = s_rel / |t_rel|, t_unit = t_rel / |t_rel|."""
    q: torch.Tensor
    t_unit: torch.Tensor
    s_scene: torch.Tensor
    t_scene_center: Optional[torch.Tensor] = None
    t_rel_norm: Optional[torch.Tensor] = None
    s_tilde: Optional[torch.Tensor] = None
    s_rel: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.q is None or self.s_scene is None:
            raise ValueError("InvariantPoseTarget needs q and s_scene")
        if self.s_rel is None:
            if self.s_tilde is None or self.t_rel_norm is None:
                raise ValueError("InvariantPoseTarget needs s_rel, or s_tilde and t_rel_norm")
            self.s_rel = self.s_tilde * self.t_rel_norm
        if self.t_unit is None:
            raise ValueError("InvariantPoseTarget needs t_unit")
        if self.t_scene_center is None:
            self.t_scene_center = torch.zeros_like(self.t_unit)
        if self.s_tilde is None and self.t_rel_norm is not None:
            self.s_tilde = self.s_rel / self.t_rel_norm
        elif self.t_rel_norm is None and self.s_tilde is not None:
            self.t_rel_norm = self.s_rel / self.s_tilde
        elif self.s_tilde is not None and not torch.allclose(self.s_tilde, self.s_rel / self.t_rel_norm, atol=1e-6):
            logger.warning("s_tilde disagrees with s_rel / t_rel_norm: recomputing it")
            self.s_tilde = self.s_rel / self.t_rel_norm
        self._validate_fields()

    def _validate_fields(self) -> None:
        """Every field set (upstream's check, run at the end of construction)."""
        missing = [k for k, v in asdict(self).items() if v is None]
        if missing:
            raise ValueError(f"InvariantPoseTarget fields still unset: {missing}")

    @staticmethod
    def from_instance_pose(instance_pose: InstancePose) -> "InvariantPoseTarget":
        s_scene = instance_pose.scene_scale
        s, t = instance_pose.instance_scale_l2c, instance_pose.instance_position_l2c
        if s.dim() != s_scene.dim() + 1 or t.dim() != s_scene.dim() + 1:
            raise ValueError("instance scale/position need one more (object) dimension than scene_scale")
        s_scene_k = s_scene.unsqueeze(-2)
        s_rel, t_rel = s / s_scene_k, t / s_scene_k
        t_rel_norm = t_rel.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        return InvariantPoseTarget(q=instance_pose.instance_quaternion_l2c, t_unit=t_rel / t_rel_norm,
                                   s_scene=s_scene, t_scene_center=instance_pose.scene_shift,
                                   t_rel_norm=t_rel_norm, s_tilde=s_rel / t_rel_norm, s_rel=s_rel)

    @staticmethod
    def to_instance_pose(invariant_targets: "InvariantPoseTarget") -> InstancePose:
        inv = invariant_targets
        if inv.s_scene.dim() != inv.t_rel_norm.dim() - 1:
            raise ValueError("s_scene must have one dimension less than t_rel_norm")
        k = inv.s_scene.unsqueeze(-2) * inv.t_rel_norm
        return InstancePose(instance_scale_l2c=inv.s_tilde * k, instance_position_l2c=inv.t_unit * k,
                            instance_quaternion_l2c=inv.q, scene_scale=inv.s_scene, scene_shift=inv.t_scene_center)


class PoseTargetConvention:
    pose_target_convention: str = "base"

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget) -> PoseTarget:
        raise NotImplementedError(f"{cls.__name__} does not define from_invariant")

    @classmethod
    def to_invariant(cls, instance_pose) -> InvariantPoseTarget:
        raise NotImplementedError(f"{cls.__name__} does not define to_invariant")

    @classmethod
    def from_instance_pose(cls, instance_pose: InstancePose) -> PoseTarget:
        return cls.from_invariant(InvariantPoseTarget.from_instance_pose(instance_pose))

    @classmethod
    def to_instance_pose(cls, pose_target: PoseTarget) -> InstancePose:
        return InvariantPoseTarget.to_instance_pose(cls.to_invariant(pose_target))


def _affine(scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(B, 4, 4) column-convention matrices of p -> p * scale + shift (scale (B, 3) or (B, 1))."""
    b = shift.shape[0]
    m = torch.zeros(b, 4, 4, dtype=shift.dtype, device=shift.device)
    m[:, [0, 1, 2], [0, 1, 2]] = scale.expand(b, 3).to(shift)
    m[:, :3, 3] = shift
    m[:, 3, 3] = 1
    return m


class ScaleShiftInvariant(PoseTargetConvention):
    pose_target_convention = "ScaleShiftInvariant"
    scale_mean = torch.tensor([1.0232692956924438, 1.0232691764831543, 1.0232692956924438])
    scale_std = torch.tensor([1.3773751258850098, 1.3773752450942993, 1.3773750066757202])
    translation_mean = torch.tensor([0.003191213821992278, 0.017236359417438507, 0.9401122331619263])
    translation_std = torch.tensor([1.341888666152954, 0.7665449380874634, 3.175130605697632])

    @staticmethod
    def ssi_to_metric(scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """(B, 4, 4) matrices of metric = ssi * scale + shift (1-D inputs get a batch dim)."""
        scale = scale[None] if scale.dim() == 1 else scale
        shift = shift[None] if shift.dim() == 1 else shift
        return _affine(scale.to(shift.device), shift)

    @classmethod
    def _to_ssi(cls, ip: InstancePose):
        metric_to_ssi = torch.linalg.inv(cls.ssi_to_metric(ip.scene_scale, ip.scene_shift))
        return InstancePose._broadcast_postcompose(ip.instance_scale_l2c, ip.instance_quaternion_l2c,
                                                   ip.instance_position_l2c, metric_to_ssi)

    @classmethod
    def from_instance_pose(cls, instance_pose: InstancePose, normalize: bool = False) -> PoseTarget:
        scale, quat, trans = cls._to_ssi(instance_pose)
        if normalize:
            scale = (scale - cls.scale_mean.to(scale)) / cls.scale_std.to(scale)
            trans = (trans - cls.translation_mean.to(trans)) / cls.translation_std.to(trans)
        return PoseTarget(x_instance_scale=scale, x_instance_rotation=quat, x_instance_translation=trans,
                          x_scene_scale=instance_pose.scene_scale, x_scene_center=instance_pose.scene_shift,
                          x_translation_scale=torch.ones_like(scale[..., :1]),
                          pose_target_convention=cls.pose_target_convention)

    @classmethod
    def to_instance_pose(cls, pose_target: PoseTarget, normalize: bool = False) -> InstancePose:
        pt = pose_target
        if normalize:  # upstream de-normalises the passed PoseTarget in place
            pt.x_instance_scale = pt.x_instance_scale * cls.scale_std.to(pt.x_instance_scale) \
                + cls.scale_mean.to(pt.x_instance_scale)
            pt.x_instance_translation = pt.x_instance_translation * cls.translation_std.to(pt.x_instance_translation) \
                + cls.translation_mean.to(pt.x_instance_translation)
        scale, quat, trans = InstancePose._broadcast_postcompose(
            pt.x_instance_scale, pt.x_instance_rotation, pt.x_instance_translation,
            cls.ssi_to_metric(pt.x_scene_scale, pt.x_scene_center))
        return InstancePose(instance_scale_l2c=scale, instance_position_l2c=trans, instance_quaternion_l2c=quat,
                            scene_scale=pt.x_scene_scale, scene_shift=pt.x_scene_center)

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget, normalize: bool = False) -> InvariantPoseTarget:
        return InvariantPoseTarget.from_instance_pose(cls.to_instance_pose(pose_target, normalize=normalize))

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget, normalize: bool = False) -> PoseTarget:
        return cls.from_instance_pose(InvariantPoseTarget.to_instance_pose(invariant_targets), normalize=normalize)

    @classmethod
    def get_scale_and_shift(cls, pointmap: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """shift = (0, 0, nanmedian z); scale = nanmean |p - shift| over all elements, expanded to 3."""
        pts = pointmap.reshape(-1, 3)
        shift = torch.zeros(3, dtype=pts.dtype, device=pts.device)
        shift[2] = pts[:, 2].nanmedian()
        scale = (pts - shift).abs().nanmean().expand(3).clone()
        return scale, shift


class ScaleShiftInvariantWTranslationScale(PoseTargetConvention):
    pose_target_convention = "ScaleShiftInvariantWTranslationScale"
    scale_mean = ScaleShiftInvariant.scale_mean
    scale_std = ScaleShiftInvariant.scale_std
    translation_mean = ScaleShiftInvariant.translation_mean
    translation_std = ScaleShiftInvariant.translation_std
    ssi_to_metric = ScaleShiftInvariant.__dict__["ssi_to_metric"]

    @classmethod
    def from_instance_pose(cls, instance_pose: InstancePose, normalize: bool = False) -> PoseTarget:
        scale, quat, trans = ScaleShiftInvariant._to_ssi(instance_pose)  # normalize is ignored upstream
        norm = trans.norm(dim=-1, keepdim=True)
        return PoseTarget(x_instance_scale=scale, x_instance_rotation=quat,
                          x_instance_translation=trans / norm.clamp_min(1e-7),
                          x_scene_scale=instance_pose.scene_scale, x_scene_center=instance_pose.scene_shift,
                          x_translation_scale=norm, pose_target_convention=cls.pose_target_convention)

    @classmethod
    def to_instance_pose(cls, pose_target: PoseTarget, normalize: bool = False) -> InstancePose:
        pt = pose_target
        unit = pt.x_instance_translation / pt.x_instance_translation.norm(dim=-1, keepdim=True).clamp_min(1e-7)
        scale, quat, trans = InstancePose._broadcast_postcompose(
            pt.x_instance_scale, pt.x_instance_rotation, unit * pt.x_translation_scale,
            ScaleShiftInvariant.ssi_to_metric(pt.x_scene_scale, pt.x_scene_center))
        return InstancePose(instance_scale_l2c=scale, instance_position_l2c=trans, instance_quaternion_l2c=quat,
                            scene_scale=pt.x_scene_scale, scene_shift=pt.x_scene_center)

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget) -> InvariantPoseTarget:
        return InvariantPoseTarget.from_instance_pose(cls.to_instance_pose(pose_target))

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget) -> PoseTarget:
        return cls.from_instance_pose(InvariantPoseTarget.to_instance_pose(invariant_targets))

    get_scale_and_shift = ScaleShiftInvariant.__dict__["get_scale_and_shift"]


class DisparitySpace(PoseTargetConvention):
    """Translation as (x/z, y/z) offsets from the scene shift plus a log-depth scale; scale relative to depth."""
    pose_target_convention = "DisparitySpace"

    @classmethod
    def from_instance_pose(cls, instance_pose: InstancePose, normalize: bool = False) -> PoseTarget:
        ip = instance_pose
        if not bool((ip.scene_scale == 1).all()):
            raise AssertionError("DisparitySpace expects a scene scale of ones")
        if ip.scene_shift.dim() != ip.instance_position_l2c.dim() - 1:
            raise ValueError("scene_shift must have one dimension less than the instance position")
        shift = ip.scene_shift.unsqueeze(-2)
        t = ip.instance_position_l2c
        z = t[..., 2:3]
        trans = torch.cat([t[..., 0:1] / z - shift[..., 0:1], t[..., 1:2] / z - shift[..., 1:2],
                           torch.zeros_like(z)], dim=-1)
        return PoseTarget(x_instance_scale=torch.exp(torch.log(ip.instance_scale_l2c) - torch.log(z)),
                          x_instance_rotation=ip.instance_quaternion_l2c, x_instance_translation=trans,
                          x_scene_scale=ip.scene_scale, x_scene_center=ip.scene_shift,
                          x_translation_scale=torch.exp(torch.log(z) - shift[..., 2:3]),
                          pose_target_convention=cls.pose_target_convention)

    @classmethod
    def to_instance_pose(cls, pose_target: PoseTarget, normalize: bool = False) -> InstancePose:
        pt = pose_target
        shift = pt.x_scene_center.unsqueeze(-2)
        depth = pt.x_translation_scale * torch.exp(shift[..., 2:3])
        t = pt.x_instance_translation
        xyz = torch.cat([t[..., 0:1] + shift[..., 0:1], t[..., 1:2] + shift[..., 1:2], torch.ones_like(depth)], -1)
        scene_scale = pt.x_scene_scale.unsqueeze(-2)
        return InstancePose(instance_scale_l2c=pt.x_instance_scale * depth * scene_scale,
                            instance_position_l2c=xyz * depth * scene_scale,
                            instance_quaternion_l2c=pt.x_instance_rotation,
                            scene_scale=pt.x_scene_scale, scene_shift=pt.x_scene_center)

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget, normalize: bool = False) -> InvariantPoseTarget:
        return InvariantPoseTarget.from_instance_pose(cls.to_instance_pose(pose_target, normalize=normalize))

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget, normalize: bool = False) -> PoseTarget:
        return cls.from_instance_pose(InvariantPoseTarget.to_instance_pose(invariant_targets), normalize=normalize)


def _target(cls, inv: InvariantPoseTarget, scale, translation, translation_scale) -> PoseTarget:
    return PoseTarget(x_instance_scale=scale, x_instance_rotation=inv.q, x_instance_translation=translation,
                      x_scene_scale=inv.s_scene, x_scene_center=inv.t_scene_center,
                      x_translation_scale=translation_scale, pose_target_convention=cls.pose_target_convention)


def _unit_and_norm(translation: torch.Tensor):
    norm = translation.norm(dim=-1, keepdim=True)
    return translation / norm, norm


class NormalizedSceneScale(PoseTargetConvention):
    pose_target_convention = "NormalizedSceneScale"

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget) -> PoseTarget:
        inv = invariant_targets
        return _target(cls, inv, inv.s_rel, inv.t_unit * inv.t_rel_norm, torch.ones_like(inv.t_rel_norm))

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget) -> InvariantPoseTarget:
        unit, norm = _unit_and_norm(pose_target.x_instance_translation)
        return InvariantPoseTarget(q=pose_target.x_instance_rotation, t_unit=unit, s_scene=pose_target.x_scene_scale,
                                   t_scene_center=pose_target.x_scene_center, t_rel_norm=norm,
                                   s_rel=pose_target.x_instance_scale)


class Naive(PoseTargetConvention):
    pose_target_convention = "Naive"

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget) -> PoseTarget:
        inv = invariant_targets
        return _target(cls, inv, inv.s_rel * inv.s_scene.unsqueeze(-2), inv.t_unit * inv.t_rel_norm,
                       torch.ones_like(inv.t_rel_norm))

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget) -> InvariantPoseTarget:
        unit, norm = _unit_and_norm(pose_target.x_instance_translation)
        return InvariantPoseTarget(q=pose_target.x_instance_rotation, t_unit=unit, s_scene=pose_target.x_scene_scale,
                                   t_scene_center=pose_target.x_scene_center, t_rel_norm=norm,
                                   s_rel=pose_target.x_instance_scale / pose_target.x_scene_scale.unsqueeze(-2))


class NormalizedSceneScaleAndTranslation(PoseTargetConvention):
    pose_target_convention = "NormalizedSceneScaleAndTranslation"

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget) -> PoseTarget:
        inv = invariant_targets
        return _target(cls, inv, inv.s_rel, inv.t_unit, inv.t_rel_norm)

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget) -> InvariantPoseTarget:
        pt = pose_target
        return InvariantPoseTarget(q=pt.x_instance_rotation, t_unit=pt.x_instance_translation,
                                   s_scene=pt.x_scene_scale, t_scene_center=pt.x_scene_center,
                                   t_rel_norm=pt.x_translation_scale, s_rel=pt.x_instance_scale)


class ApparentSize(PoseTargetConvention):
    pose_target_convention = "ApparentSize"

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget) -> PoseTarget:
        inv = invariant_targets
        return _target(cls, inv, inv.s_tilde, inv.t_unit, inv.t_rel_norm)

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget) -> InvariantPoseTarget:
        pt = pose_target
        return InvariantPoseTarget(q=pt.x_instance_rotation, t_unit=pt.x_instance_translation,
                                   s_scene=pt.x_scene_scale, t_scene_center=pt.x_scene_center,
                                   t_rel_norm=pt.x_translation_scale, s_tilde=pt.x_instance_scale)


class Identity(PoseTargetConvention):
    pose_target_convention = "Identity"

    @classmethod
    def from_instance_pose(cls, instance_pose: InstancePose) -> PoseTarget:
        ip = instance_pose
        return PoseTarget(x_instance_scale=ip.instance_scale_l2c, x_instance_rotation=ip.instance_quaternion_l2c,
                          x_instance_translation=ip.instance_position_l2c, x_scene_scale=ip.scene_scale,
                          x_scene_center=ip.scene_shift, x_translation_scale=torch.ones_like(ip.instance_scale_l2c[..., :1]),
                          pose_target_convention=cls.pose_target_convention)

    @classmethod
    def to_instance_pose(cls, pose_target: PoseTarget) -> InstancePose:
        pt = pose_target
        return InstancePose(instance_scale_l2c=pt.x_instance_scale, instance_position_l2c=pt.x_instance_translation,
                            instance_quaternion_l2c=pt.x_instance_rotation, scene_scale=pt.x_scene_scale,
                            scene_shift=pt.x_scene_center)

    @classmethod
    def to_invariant(cls, pose_target: PoseTarget) -> InvariantPoseTarget:
        return InvariantPoseTarget.from_instance_pose(cls.to_instance_pose(pose_target))

    @classmethod
    def from_invariant(cls, invariant_targets: InvariantPoseTarget) -> PoseTarget:
        return cls.from_instance_pose(InvariantPoseTarget.to_instance_pose(invariant_targets))


def _pose_target_class(name: str):
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, PoseTargetConvention)):
        raise ValueError(f"unknown pose target convention {name!r}")
    return cls


class PoseTargetConverter:
    @staticmethod
    def pose_target_to_instance_pose(pose_target: PoseTarget, normalize: bool = False) -> InstancePose:
        cls = _pose_target_class(pose_target.pose_target_convention)
        if cls is ScaleShiftInvariant:
            return cls.to_instance_pose(pose_target, normalize=normalize)
        return cls.to_instance_pose(pose_target)

    @staticmethod
    def instance_pose_to_pose_target(instance_pose: InstancePose, pose_target_convention: str,
                                     normalize: bool = False) -> PoseTarget:
        cls = _pose_target_class(pose_target_convention)
        if cls is ScaleShiftInvariant:
            return cls.from_instance_pose(instance_pose, normalize=normalize)
        return cls.from_instance_pose(instance_pose)

    @staticmethod
    def dicts_instance_pose_to_pose_target(pose_target_convention: str, **kwargs) -> dict:
        return asdict(PoseTargetConverter.instance_pose_to_pose_target(InstancePose(**kwargs),
                                                                       pose_target_convention))

    @staticmethod
    def dicts_pose_target_to_instance_pose(**kwargs) -> dict:
        cls = _pose_target_class(kwargs["pose_target_convention"])
        assert cls.pose_target_convention == kwargs["pose_target_convention"]
        normalize = kwargs.pop("normalize", False)
        return asdict(PoseTargetConverter.pose_target_to_instance_pose(PoseTarget(**kwargs), normalize=normalize))


class LogScaleShiftNormalizer:
    """normalize(v) = log(v) - shift_log / scale_log (upstream's operator precedence, kept on purpose);
    denormalize(v) = exp(v * scale_log + shift_log). Inverses of each other only when scale_log == 1."""

    def __init__(self, shift_log: float = 0.0, scale_log: float = 1.0):
        self.shift_log = shift_log
        self.scale_log = scale_log

    def normalize(self, value: torch.Tensor) -> torch.Tensor:
        return torch.log(value) - self.shift_log / self.scale_log

    def denormalize(self, value: torch.Tensor) -> torch.Tensor:
        return torch.exp(value * self.scale_log + self.shift_log)
