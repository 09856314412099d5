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


# inputs above this are refused before decoding (a 10^5 x 10^5 PNG of a few KB would need 30 GB); the model sees a
# 518 px crop, and preprocessing costs about 1 s per megapixel on a CPU
MAX_INPUT_PIXELS = 100_000_000


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
        img = Image.open(path)  # reads the header only: the size is known before any pixel is decoded
        width, height = img.size
        if width * height > MAX_INPUT_PIXELS:
            raise ValueError(f"{path} is {width}x{height} ({width * height / 1e6:.0f} megapixels), over the "
                             f"{MAX_INPUT_PIXELS / 1e6:.0f} megapixel limit of an input: downscale it first (the "
                             f"model sees a {518} px crop)")
        img.load()
    except Image.DecompressionBombError as e:
        raise ValueError(f"{path}: refused as a decompression bomb ({e}); downscale it first") from None
    except ValueError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
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


def mask_from_array(arr: np.ndarray, name: str = "the mask", lossy: bool = False) -> np.ndarray:
    """bool [H, W] of mask data, interpreted explicitly:

    * the alpha channel of RGBA / grey+alpha data, only when it carries information (not one constant value: a
      fully opaque RGBA mask is read by its colour like any other);
    * binary data (0 and one other value: 0/255, 0/1, 0/65535, bool): the non-zero pixels;
    * anything else is a soft mask: thresholded at half the range (>= 0.5), with an ``InputWarning`` (a soft mask
      with background 1 and object 255 would otherwise select the whole image);
    * ``lossy`` (a JPEG file): an ``InputWarning`` that compression blurs the edges.
    """
    import warnings

    from sam3d_objects.errors import InputWarning
    arr = np.asarray(arr)
    if arr.dtype == bool:
        return arr.any(axis=-1) if arr.ndim == 3 else arr
    if arr.dtype.kind not in "uif" or arr.ndim not in (2, 3):
        raise ValueError(f"{name}: mask data must be numbers [H, W] or [H, W, C], got {arr.dtype} {arr.shape}")
    if arr.ndim == 3:
        channels = arr.shape[-1]
        alpha = arr[..., -1] if channels in (2, 4) else None
        if alpha is not None and alpha.size and alpha.min() != alpha.max():
            arr = alpha
        else:
            arr = (arr[..., :-1] if alpha is not None else arr).max(axis=-1)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError(f"{name}: the mask holds NaN/infinite values")
    full = 1.0 if arr.dtype.kind == "f" else (255.0 if arr.dtype == np.uint8 else
                                              65535.0 if arr.max(initial=0) > 255 else 255.0)
    if lossy:
        warnings.warn(f"{name} is a JPEG: compression blurs mask edges (a halo around the object); it is "
                      f"thresholded at 50%. Save masks as PNG", InputWarning, stacklevel=3)
    values = np.unique(arr) if arr.size <= 4_000_000 else np.unique(arr[::7, ::7])
    if len(values) <= 2 and (values[0] == 0 or len(values) == 1):
        return arr > 0
    if not lossy:
        warnings.warn(f"{name} is a soft mask ({len(values)} distinct values): object = values >= 50% of the "
                      f"range. Pass a binary mask (0/255 or 0/1) to choose yourself", InputWarning, stacklevel=3)
    return arr.astype(np.float64) >= 0.5 * full


def load_mask_file(path: PathLike) -> np.ndarray:
    """bool [H, W] of a mask file (``mask_from_array``: alpha when it carries information, binary values as they
    are, soft and JPEG masks thresholded at 50% with a warning; 16-bit too)."""
    img = open_image(path)
    lossy = (img.format or "").upper() in ("JPEG", "MPO") or Path(path).suffix.lower() in (".jpg", ".jpeg")
    if img.mode in _SIXTEEN_BIT or img.mode in ("I", "F", "1", "L", "LA", "RGBA", "RGB"):
        arr = np.array(img)
    else:
        arr = image_to_array(img, name=str(path))
    return mask_from_array(arr, name=f"mask {path}", lossy=lossy)
