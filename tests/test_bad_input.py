"""Image / mask loading for every Pillow mode and the input checks of sam3d_objects.validation (no model runs)."""
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from sam3d_objects.inference import load_image, load_mask
from sam3d_objects.utils.images import UnsupportedImageModeError
from sam3d_objects import validation

RNG = np.random.default_rng(0)


def _png(path, width, height, bit_depth, colour_type, raw_rows: bytes):
    """A PNG written by hand (not by Pillow), so 16-bit colour files are an independent reference."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw_rows))
                     + chunk(b"IEND", b""))


def _rows16(arr):  # arr uint16 [H, W, C]: big-endian samples, filter byte 0 per row
    return b"".join(b"\x00" + row.astype(">u2").tobytes() for row in arr)


# ---------------------------------------------------------------------------------------------------------------
# 8-bit RGB / RGBA: exactly upstream's np.array(Image.open(path)).astype(np.uint8)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,channels", [("RGB", 3), ("RGBA", 4)])
def test_8bit_rgb_rgba_exact(tmp_path, mode, channels):
    arr = RNG.integers(0, 256, (5, 7, channels), dtype=np.uint8)
    Image.fromarray(arr, mode).save(tmp_path / "x.png")
    got = load_image(tmp_path / "x.png")
    assert got.dtype == np.uint8 and got.shape == (5, 7, channels)
    np.testing.assert_array_equal(got, arr)
    np.testing.assert_array_equal(got, np.array(Image.open(tmp_path / "x.png")).astype(np.uint8))


def test_16bit_grey_is_scaled_not_saturated(tmp_path):
    arr = np.array([[0, 257, 32768, 65535], [1000, 20000, 40000, 60000]], np.uint16)
    Image.fromarray(arr).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    got = load_image(tmp_path / "g16.png")
    want = np.round(arr / 257.0).astype(np.uint8)
    assert got.shape == (2, 4, 3)
    for c in range(3):
        np.testing.assert_array_equal(got[..., c], want)
    assert not (got == 255).all()  # the reported bug: every pixel 255


def test_16bit_rgb_png(tmp_path):
    arr = RNG.integers(0, 65536, (3, 4, 3), dtype=np.uint16)
    _png(tmp_path / "rgb16.png", 4, 3, 16, 2, _rows16(arr))
    got = load_image(tmp_path / "rgb16.png")
    assert got.shape == (3, 4, 3)
    # 16 -> 8 bits: either the high byte or the rounded /257 scaling; both within 1 of value/257
    assert np.abs(got.astype(int) - arr / 257.0).max() <= 1.0


def test_grey_and_bilevel(tmp_path):
    arr = RNG.integers(0, 256, (4, 6), dtype=np.uint8)
    Image.fromarray(arr, "L").save(tmp_path / "l.png")
    np.testing.assert_array_equal(load_image(tmp_path / "l.png"), np.repeat(arr[..., None], 3, -1))
    bits = arr > 127
    Image.fromarray(bits).convert("1").save(tmp_path / "b.png")
    np.testing.assert_array_equal(load_image(tmp_path / "b.png")[..., 0], bits.astype(np.uint8) * 255)


def test_palette_with_and_without_transparency(tmp_path):
    palette = [255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 9)
    idx = np.array([[0, 1, 2], [2, 1, 0]], np.uint8)
    img = Image.fromarray(idx, "P")
    img.putpalette(palette)
    img.save(tmp_path / "p.png")
    colours = np.array(palette[:9], np.uint8).reshape(3, 3)
    np.testing.assert_array_equal(load_image(tmp_path / "p.png"), colours[idx])
    img.save(tmp_path / "pt.png", transparency=1)
    got = load_image(tmp_path / "pt.png")
    assert got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got[..., 3], np.where(idx == 1, 0, 255))
    np.testing.assert_array_equal(load_mask(tmp_path / "pt.png"), idx != 1)


def test_grey_alpha(tmp_path):
    arr = RNG.integers(0, 256, (3, 5, 2), dtype=np.uint8)
    Image.fromarray(arr, "LA").save(tmp_path / "la.png")
    got = load_image(tmp_path / "la.png")
    np.testing.assert_array_equal(got[..., :3], np.repeat(arr[..., :1], 3, -1))
    np.testing.assert_array_equal(got[..., 3], arr[..., 1])
    with pytest.warns(UserWarning, match="soft mask"):  # random alpha is a soft mask: thresholded at 50%
        np.testing.assert_array_equal(load_mask(tmp_path / "la.png"), arr[..., 1] >= 128)


def test_cmyk(tmp_path):
    cmy = RNG.integers(0, 256, (3, 4, 3), dtype=np.uint8)
    cmyk = np.concatenate([cmy, np.zeros((3, 4, 1), np.uint8)], -1)  # K = 0: RGB = 255 - CMY
    Image.fromarray(cmyk, "CMYK").save(tmp_path / "c.tiff")
    np.testing.assert_array_equal(load_image(tmp_path / "c.tiff"), 255 - cmy)


def test_exif_orientation_applied(tmp_path):
    arr = RNG.integers(0, 256, (2, 3, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: display = the stored pixels turned 90 degrees clockwise
    Image.fromarray(arr).save(tmp_path / "o.png", exif=exif)
    got = load_image(tmp_path / "o.png")
    np.testing.assert_array_equal(got, np.rot90(arr, k=-1))


@pytest.mark.parametrize("mode,make", [
    ("F", lambda: Image.fromarray(np.full((2, 2), 7.5, np.float32), "F")),
    ("LAB", lambda: Image.new("LAB", (2, 2))),
])
def test_unusable_modes_are_refused_by_name(tmp_path, mode, make):
    make().save(tmp_path / "x.tiff")
    with pytest.raises(UnsupportedImageModeError, match=repr(mode)):
        load_image(tmp_path / "x.tiff")


def test_float_in_unit_range_is_accepted(tmp_path):
    arr = np.array([[0.0, 0.5], [1.0, 0.25]], np.float32)
    Image.fromarray(arr, "F").save(tmp_path / "f.tiff")
    np.testing.assert_array_equal(load_image(tmp_path / "f.tiff")[..., 0], np.round(arr * 255).astype(np.uint8))


def test_truncated_and_non_image_files(tmp_path):
    Image.fromarray(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.png.*truncated"):
        load_image(tmp_path / "cut.png")
    with pytest.raises(FileNotFoundError, match="nope.png"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(ValueError, match="not a file"):
        load_image(tmp_path)


def test_16bit_mask(tmp_path):
    arr = np.zeros((4, 4), np.uint16)
    arr[1:3, 1:3] = 65535
    Image.fromarray(arr).save(tmp_path / "m16.png")
    np.testing.assert_array_equal(load_mask(tmp_path / "m16.png"), arr > 0)


# ---------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------
def test_mask_checks():
    image = np.zeros((40, 50, 3), np.uint8)
    with pytest.raises(ValueError, match="same height and width"):
        validation.check_run_inputs(image, np.ones((40, 49), bool))
    with pytest.raises(ValueError, match="empty"):
        validation.check_run_inputs(image, np.zeros((40, 50), np.uint8))
    with pytest.raises(ValueError, match="alpha channel"):  # RGBA image, alpha as the mask, all zero
        validation.check_run_inputs(np.zeros((40, 50, 4), np.uint8), None)
    tiny = np.zeros((40, 50), bool)
    tiny[3, 4] = True
    with pytest.warns(validation.InputWarning, match=r"only 1 pixel"):
        validation.check_run_inputs(image, tiny)
    big = np.ones((40, 50), bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validation.check_run_inputs(image, big)  # no warning for a normal mask


def test_pointmap_checks():
    image, mask = np.zeros((20, 30, 3), np.uint8), np.ones((20, 30), bool)
    with pytest.raises(ValueError, match="30x20"):
        validation.check_run_inputs(image, mask, np.zeros((10, 15, 3), np.float32))
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        validation.check_run_inputs(image, mask, np.zeros((20, 30, 2), np.float32))
    with pytest.raises(ValueError, match="no finite point"):
        validation.check_run_inputs(image, mask, np.full((20, 30, 3), np.nan, np.float32))


def test_large_image_warning_and_downscale():
    with pytest.warns(validation.InputWarning, match=r"8000x6000.*downscaled.*about 48 s"):
        validation.check_image(np.broadcast_to(np.uint8(0), (6000, 8000, 3)))
    image = RNG.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    mask = np.zeros((300, 400), bool)
    mask[100:200, 100:300] = True
    dot = np.zeros((300, 400), bool)
    dot[5, 7] = True  # a single pixel nearest sampling would miss
    pm = np.arange(300 * 400 * 3, dtype=np.float32).reshape(300, 400, 3)
    small, (m, d), spm = validation.downscale_inputs(image, [mask, dot], pm, max_side=200)
    assert small.shape == (150, 200, 3) and m.shape == d.shape == spm.shape[:2] == (150, 200)
    assert abs(m.mean() - mask.mean()) < 1e-3 and d.sum() >= 1
    assert np.isin(spm, pm).all()  # nearest: no invented depths
    same = validation.downscale_inputs(image, [mask], pm, max_side=400)
    assert same[0] is image and same[2] is pm


def test_output_dir_checks(tmp_path):
    validation.check_output_dir(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()  # checking creates nothing
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        validation.check_output_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="is a file"):
        validation.check_output_dir(tmp_path / "file" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no probe file left


def test_device_checks():
    import torch
    with pytest.raises(ValueError, match="not a torch device"):
        validation.check_device("gpu0")
    validation.check_device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(validation.DeviceUnavailableError, match="CUDA is not available"):
            validation.check_device("cuda")
    if not torch.backends.mps.is_available():
        with pytest.raises(validation.DeviceUnavailableError, match="MPS is not available"):
            validation.check_device("mps")
    from sam3d_objects.inference import DeviceUnavailableError
    assert DeviceUnavailableError is validation.DeviceUnavailableError and issubclass(DeviceUnavailableError,
                                                                                      RuntimeError)


def test_verify_checkpoint_structures(tmp_path):
    import zipfile

    import torch
    from safetensors.torch import save_file

    from sam3d_objects.pipeline.checkpoint import CheckpointError, verify_checkpoint
    save_file({"a": torch.zeros(1000), "b": torch.ones(10)}, str(tmp_path / "ok.safetensors"))
    verify_checkpoint(tmp_path / "ok.safetensors", prefixes=("a",))
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors.*download it again"):
        verify_checkpoint(tmp_path / "cut.safetensors")
    with pytest.raises(CheckpointError, match=r"ok\.safetensors has no key starting with 'z\.'"):
        verify_checkpoint(tmp_path / "ok.safetensors", prefixes=("z.",))
    with zipfile.ZipFile(tmp_path / "other.ckpt", "w") as z:
        z.writestr("readme.txt", "not a torch file")
    with pytest.raises(CheckpointError, match=r"other\.ckpt.*no data\.pkl"):
        verify_checkpoint(tmp_path / "other.ckpt")
    torch.save({"state_dict": {"_base_models.generator.w": torch.zeros(2)}}, tmp_path / "gen.ckpt")
    verify_checkpoint(tmp_path / "gen.ckpt", prefixes=("_base_models.generator.",))
    with pytest.raises(CheckpointError, match=r"gen\.ckpt has no key starting with '_base_models\.condition"):
        verify_checkpoint(tmp_path / "gen.ckpt", prefixes=("_base_models.condition_embedder.",))
