"""Upstream's data helpers (data.utils tree/batch helpers, img_and_mask_transforms small names) against the spec."""
import numpy as np
import pytest
import torch
from PIL import Image

from sam3d_objects.data import utils as du
from sam3d_objects.data.dataset.tdfy import img_and_mask_transforms as t


def test_tree_helpers():
    assert du.tree_transpose_level_one([{"a": 1, "b": None}, {"a": 3, "b": None}]) == {"a": [1, 3], "b": [None, None]}
    assert du.tree_transpose_level_one({"x": (1, 2), "y": (3, 4)}, map_fn=lambda d: d["x"] * d["y"]) == (3, 8)
    with pytest.raises(AssertionError):
        du.tree_transpose_level_one([{"a": 1}, {"b": 2}], check_children=True)
    tree = {"a": torch.ones(2), "b": [torch.zeros(1), None]}
    out = du.tree_tensor_map(lambda x, y: x + y, tree, tree)
    assert torch.equal(out["a"], torch.full((2,), 2.0)) and out["b"][1] is None
    assert du.to_device(tree, "cpu")["a"].device.type == "cpu"
    e = du.expand_right(torch.arange(6.0).reshape(2, 3), (2, 3, 4, 5))
    assert e.shape == (2, 3, 4, 5) and e[1, 2, 3, 4] == 5 and e.data_ptr() == e[..., 0, 0].data_ptr()
    assert du.right_broadcasting(torch.zeros(2), torch.zeros(2, 3, 4)).shape == (2, 1, 1)
    assert du.as_keys(None) == () and du.as_keys("ab") == ("ab",) and du.as_keys(["a", 0]) == ("a", 0)
    batch = {"img": [10, 20], "meta": {"k": 5}}
    assert du.get_child(batch, "img", 1) == 20
    assert du.set_child(batch, 7, "meta", "k") == 5 and batch["meta"]["k"] == 7
    assert du.build_batch_extractor(None)(batch) == ((batch,), {})
    assert du.build_batch_extractor(du.empty_mapping)(batch) == ((), {})
    assert du.build_batch_extractor(du.kwargs_identity_mapping)(batch) == ((), batch)
    assert du.build_batch_extractor([("img", 0), "meta"])(batch) == ((10, {"k": 7}), {})
    assert du.build_batch_extractor(([["img", 1]], {"m": ["meta", "k"]}))(batch) == ((20,), {"m": 7})
    assert du.build_batch_extractor({"m": ["meta", "k"]})(batch) == ((), {"m": 7})
    assert du.tree_reduce_unique(lambda x: x.dtype, {"a": torch.zeros(1), "b": torch.ones(2)}) == torch.float32
    with pytest.raises(RuntimeError, match="should be the same"):
        du.tree_reduce_unique(lambda x: x.dtype, [torch.zeros(1), torch.zeros(1, dtype=torch.int64)])
    stats = du.get_stats(torch.tensor([1.0, 2.0, 4.0]))
    assert stats["shape"] == (3,) and stats["median"] == 2.0 and stats["mean"] == pytest.approx(7 / 3)


def test_image_helpers(tmp_path):
    img = torch.rand(3, 5, 6)
    torch.testing.assert_close(t.IMAGENET_UNNORMALIZATION(t.IMAGENET_NORMALIZATION(img)), img)
    torch.testing.assert_close(t.IMAGENET_NORMALIZATION(img)[0], (img[0] - 0.485) / 0.229)
    mask = (torch.rand(5, 6) > 0.5).float()
    rgba = t.concat_rgba(img, mask)
    assert rgba.shape == (4, 5, 6)
    rgb, m = t.split_rgba(rgba)
    assert torch.equal(rgb, img) and torch.equal(m, mask)
    assert torch.equal(t.get_mask(rgba, None, "ALPHA_CHANNEL"), mask[None])
    assert t.get_mask(rgba[None], None, "ALPHA_CHANNEL").shape == (1, 1, 5, 6)
    with pytest.raises(ValueError):
        t.get_mask(rgba, None, "nope")
    with pytest.raises(t.BoundingBoxError, match="at least 2x2"):
        t.check_bounding_box(1, 5)
    cropped = t.crop_and_pad(torch.ones(1, 4, 4), (-1, -1, 2, 2))
    assert cropped.shape == (1, 3, 3) and cropped.sum() == 4 and cropped[0, 0].sum() == 0
    arr = np.random.default_rng(0).integers(0, 256, (4, 3, 4), dtype=np.uint8)
    Image.fromarray(arr, "RGBA").save(tmp_path / "x.png")
    loaded = t.load_rgb(tmp_path / "x.png")
    assert loaded.shape == (4, 4, 3)
    torch.testing.assert_close(loaded, torch.from_numpy(arr).permute(2, 0, 1).float() / 255)
    img_c, mask_c = t.crop_around_mask_with_random_box_size_factor(img, mask.clamp(0, 1) * 0 + 1,
                                                                   random_box_size_factor=0.5)
    assert img_c.shape[-1] == img_c.shape[-2]
    out = t.rembg(img, mask, pointmap=torch.ones(3, 5, 6))
    assert torch.isnan(out[2][:, mask == 0]).all() and torch.equal(out[0], img * mask)


def test_transforms_3d_round_trip():
    from sam3d_objects.data.dataset.tdfy import transforms_3d as t3
    from sam3d_objects.utils.rotation import quaternion_to_matrix
    q = torch.nn.functional.normalize(torch.tensor([[0.8, 0.1, -0.4, 0.3]]), dim=-1)
    rot, s, tr = quaternion_to_matrix(q), torch.tensor([[2.0, 2.0, 2.0]]), torch.tensor([[0.1, -1.0, 3.0]])
    tf = t3.compose_transform(s, rot, tr)
    p = torch.randn(1, 5, 3)
    torch.testing.assert_close(tf.transform_points(p), (p * 2.0) @ rot + tr)
    dec = t3.decompose_transform(tf)
    torch.testing.assert_close(dec.scale, s)
    torch.testing.assert_close(dec.rotation, rot)
    torch.testing.assert_close(dec.translation, tr)
    qx = t3.get_rotation_about_x_axis()
    torch.testing.assert_close(quaternion_to_matrix(qx) @ torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 0, 1]),
                               atol=1e-6, rtol=0)


def test_img_processing_helpers():
    from sam3d_objects.data.dataset.tdfy import img_processing as ip
    img = torch.ones(1, 3, 4, 6)
    sq = ip.pad_to_square(img, value=0.5)
    assert sq.shape == (1, 3, 6, 6) and sq[0, 0, 4:].eq(0.5).all() and sq[0, 0, :4].eq(1).all()  # bottom only
    c_img, c_pm = ip.pad_to_square_centered(torch.ones(3, 4, 6), value=2.0, pointmap=torch.zeros(3, 4, 6))
    assert c_img[0, 0].eq(2).all() and c_img[0, 5].eq(2).all() and torch.isnan(c_pm[:, 0]).all()
    x, m = ip.preprocess_img(torch.rand(2, 3, 10, 20), torch.ones(2, 1, 10, 20), 8, 12, normalize=True)
    assert x.shape == (2, 3, 8, 8) and m.shape == (2, 1, 12, 12) and m[:, :, -1].eq(0).all()
    y = torch.rand(3, 5, 5)
    torch.testing.assert_close(ip.resnet_img_normalization(y), t.IMAGENET_NORMALIZATION(y))
    mask = torch.zeros(20, 20)
    mask[5:10, 8:12] = 1
    assert [int(v) for v in ip.crop_img_to_obj(mask, 0.5)] == [7, 12, 3, 11]  # box 3 x 4 (max - min) grown by half
    assert ip.crop_img_to_obj(torch.zeros(4, 4), 0.5) == (None, None, None, None)
    a, b, c = ip.random_pad(torch.ones(3, 4, 4), torch.ones(1, 4, 4), max_ratio=0.5, pointmap=torch.zeros(3, 4, 4))
    assert a.shape[-2:] == b.shape[-2:] == c.shape[-2:] and a.shape[-1] <= 4 + 2 * 2
    assert int(torch.isnan(c[0]).sum()) == a.shape[-1] * a.shape[-2] - 16
