"""Reading image and mask files into the arrays the pipeline expects, for every Pillow mode.

``load_image`` returns uint8 [H, W, 3] (RGB) or [H, W, 4] (RGBA, alpha kept) - for 8-bit RGB/RGBA files exactly the
file's pixels, as upstream's ``load_image`` (``np.array(Image.open(path))``). Other modes are converted so that
nothing is silently wrong: 16-bit grey/colour values are scaled to 8 bits (upstream's ``astype(np.uint8)`` keeps
only the low byte, e.g. a 16-bit grey PNG becomes noise or all-255), palette and grey images become RGB (RGBA when
they carry transparency), CMYK / YCbCr become RGB, and the EXIF orientation is applied (phone photos). Modes with
no defined 8-bit meaning (32-bit float or int beyond 16 bits, LAB, HSV ...) are refused with a message naming the
mode.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import numpy as np

PathLike = Union[str, Path]

# Pillow modes that convert to RGB without losing meaning
_TO_RGB = {"1", "L", "CMYK", "YCbCr", "RGBX"}
_TO_RGBA = {"LA", "La", "PA", "RGBa"}
_SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N"}


class UnsupportedImageModeError(ValueError):
    """The file decodes, but its pixel format has no defined conversion to 8-bit RGB."""


def open_image(path: PathLike):
    """The decoded ``PIL.Image`` with its EXIF orientation applied; FileNotFoundError / ValueError name the file."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"image file {str(path)!r} not found")
    if not path.is_file():
        raise ValueError(f"{path} is not a file (give an image file such as .png or .jpg)")
    try:
        img = Image.open(path)
        img.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        # truncated downloads, text files renamed .png, formats Pillow has no plugin for
        raise ValueError(f"{path} is not an image file Pillow can read, or it is truncated ({e})") from e
    try:
        oriented = ImageOps.exif_transpose(img)
    except (OSError, ValueError, SyntaxError, KeyError, TypeError):  # a broken EXIF block: keep the pixels as stored
        oriented = None
    return oriented if oriented is not None else img


def _scale_16bit(arr: np.ndarray) -> np.ndarray:
    """0..65535 -> 0..255 with rounding (65535 -> 255, 32768 -> 128)."""
    return np.clip(np.round(arr.astype(np.float64) / 257.0), 0, 255).astype(np.uint8)


def _grey_to_rgb(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[..., None], 3, axis=-1)


def image_to_array(img, name: str = "image") -> np.ndarray:
    """uint8 [H, W, 3|4] of a decoded ``PIL.Image`` (see the module docstring for the per-mode rules)."""
    mode = img.mode
    if mode in ("RGB", "RGBA"):
        return np.array(img, dtype=np.uint8)
    if mode in _SIXTEEN_BIT:
        return _grey_to_rgb(_scale_16bit(np.array(img)))
    if mode == "I":
        arr = np.array(img)
        # Pillow decodes 16-bit PNGs as "I" too: values within 0..65535 are 16-bit samples
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise UnsupportedImageModeError(
                f"{name}: 32-bit integer image (Pillow mode 'I') with values {arr.min()}..{arr.max()} outside "
                f"16-bit range: convert it to an 8-bit RGB PNG or JPEG first")
        return _grey_to_rgb(_scale_16bit(arr))
    if mode == "P":
        has_alpha = "transparency" in img.info or (img.palette is not None and img.palette.mode == "RGBA")
        return np.array(img.convert("RGBA" if has_alpha else "RGB"), dtype=np.uint8)
    if mode in _TO_RGBA:
        return np.array(img.convert("RGBA"), dtype=np.uint8)
    if mode in _TO_RGB:
        return np.array(img.convert("RGB"), dtype=np.uint8)
    if mode == "F":
        arr = np.array(img)
        if arr.size and np.isfinite(arr).all() and arr.min() >= 0.0 and arr.max() <= 1.0:
            return _grey_to_rgb(np.round(arr * 255.0).astype(np.uint8))
        raise UnsupportedImageModeError(
            f"{name}: 32-bit float image (Pillow mode 'F') with values outside 0..1: convert it to an 8-bit RGB "
            f"PNG or JPEG first")
    raise UnsupportedImageModeError(
        f"{name}: unsupported pixel format (Pillow mode {mode!r}); convert it to an 8-bit RGB or RGBA PNG/JPEG "
        f"first")


def load_image_file(path: PathLike) -> np.ndarray:
    """uint8 [H, W, 3|4] of an image file (RGB, or RGBA when the file has alpha)."""
    return image_to_array(open_image(path), name=str(path))


def mask_from_array(arr: np.ndarray) -> np.ndarray:
    """bool [H, W]: the alpha channel of RGBA / grey+alpha data, else any non-zero channel."""
    if arr.ndim == 3:
        arr = arr[..., -1] if arr.shape[-1] in (2, 4) else arr.max(axis=-1)
    return arr > 0


def load_mask_file(path: PathLike) -> np.ndarray:
    """bool [H, W] of a mask file: the alpha channel when it has one, else any non-zero pixel (16-bit too)."""
    img = open_image(path)
    if img.mode in _SIXTEEN_BIT or img.mode in ("I", "F", "1", "L"):
        return mask_from_array(np.array(img))
    return mask_from_array(image_to_array(img, name=str(path)))
