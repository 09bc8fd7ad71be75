"""Images a client sends in: an untrusted ``data:`` URL → an RGB ``uint8`` array. Used by
chat's ``image_url`` parts (docs/protocol.md §7.1); the same limit and error style as
:mod:`omnirelay.serving.media.audio_in`.

* :func:`decode_image_url` ``(url, *, limits, param)`` — OpenAI's ``image_url.url`` as a
  ``data:image/<type>;base64,<data>`` URL: checks the URL, its type and the base64 text,
  then :func:`decode_image`.
* :func:`decode_image` ``(raw, mime, *, limits, param)`` — encoded bytes of one of
  :data:`INPUT_IMAGE_TYPES` → ``numpy.uint8`` ``[height, width, 3]`` (RGB; transparency
  composited on white, as Qwen's processor does; a JPEG's EXIF orientation applied; the
  first frame of an animated image).
* :class:`ImageLimits` — the largest encoded size and the most pixels of the decoded image.
* :class:`ImageInputError` — what is wrong, in a sentence a client can act on (an
  :class:`~omnirelay.errors.InvalidRequestError`: 400 ``invalid_request_error``).

Remote ``http(s)`` URLs are refused: the server fetches nothing a client names (it would
let any client make the server reach any address). Each type is opened with its own Pillow
decoder only — bytes are never probed as another format — and the pixel limit is checked
on the header's size before any pixel is decoded, so a small file that claims a huge
image costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from omnirelay.errors import InvalidRequestError

__all__ = [
    "DEFAULT_IMAGE_LIMITS",
    "INPUT_IMAGE_TYPES",
    "ImageInputError",
    "ImageLimits",
    "decode_image",
    "decode_image_url",
]

#: The media types a client may send, and the one Pillow decoder each is opened with.
INPUT_IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
#: common spellings of the same types
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}


class ImageInputError(InvalidRequestError):
    """An input image that cannot be used; the message says why and what the limit is."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """The most input image one request may carry."""

    #: encoded bytes (after base64 decoding)
    max_bytes: int = 2 * 1024 * 1024
    #: pixels (width × height) of a decoded image; the model's processor then scales it
    #: down to its own maximum
    max_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ImageLimits.{name} must be an int > 0, got {value!r}")


DEFAULT_IMAGE_LIMITS = ImageLimits()


def decode_image_url(
    url: object, *, limits: ImageLimits = DEFAULT_IMAGE_LIMITS, param: str | None = None
) -> np.ndarray:
    """The image of a ``data:`` URL (see the module docstring); ``param``
    (``messages[0].content[1].image_url``) prefixes the field names of errors."""
    where = f"{param}.url" if param else "url"
    if not isinstance(url, str) or not url:
        raise ImageInputError(f"{where} must be a non-empty string (a data: URL)", param=where)
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https"):
        raise ImageInputError(
            f"{where} is a remote URL; this server does not fetch images. Send the image inline as "
            "'data:image/png;base64,...' (png, jpeg or webp)",
            param=where,
        )
    if scheme != "data":
        raise ImageInputError(
            f"{where} must be a data: URL ('data:image/png;base64,...'), got {_shown(url)}", param=where
        )
    header, comma, data = url[5:].partition(",")
    if not comma:
        raise ImageInputError(f"{where} is a data: URL without a ',' before its data", param=where)
    mime, *params = [p.strip().lower() for p in header.split(";")]
    mime = _ALIASES.get(mime, mime)
    if mime not in INPUT_IMAGE_TYPES:
        raise ImageInputError(
            f"{where} has media type {mime or 'none'!r}; supported image types: {list(INPUT_IMAGE_TYPES)}",
            param=where,
        )
    if "base64" not in params:
        raise ImageInputError(f"{where} must be base64-encoded ('data:{mime};base64,...')", param=where)
    # Checked on the text first: a too-large image is refused before it is decoded.
    if len(data) > 4 * ((limits.max_bytes + 2) // 3):
        raise ImageInputError(
            f"{where} holds about {len(data) * 3 // 4} bytes of image; the limit is {limits.max_bytes} "
            "bytes (max_image_input_bytes)",
            param=where,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(
            f"{where} is not valid base64 ({exc}); send the file's bytes base64-encoded", param=where
        ) from exc
    return decode_image(raw, mime, limits=limits, param=where)


def decode_image(
    raw: bytes, mime: str, *, limits: ImageLimits = DEFAULT_IMAGE_LIMITS, param: str | None = None
) -> np.ndarray:
    """Encoded ``raw`` bytes of type ``mime`` → RGB ``uint8`` ``[height, width, 3]``.
    Raises :class:`ImageInputError` (type, size, pixels, undecodable bytes)."""
    where = param or "image"
    fmt = INPUT_IMAGE_TYPES.get(mime)
    if fmt is None:
        raise ImageInputError(
            f"{where} has media type {mime!r}; supported image types: {list(INPUT_IMAGE_TYPES)}", param=where
        )
    if not raw:
        raise ImageInputError(f"{where} holds no image bytes", param=where)
    if len(raw) > limits.max_bytes:
        raise ImageInputError(
            f"{where} is {len(raw)} bytes of image; the limit is {limits.max_bytes} bytes "
            "(max_image_input_bytes)",
            param=where,
        )
    kind = mime.split("/")[1]
    try:
        with warnings.catch_warnings():
            # Pillow warns about large images; the pixel limit below is the one that counts.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw), formats=[fmt]) as img:
                width, height = img.size
                if width * height > limits.max_pixels:
                    raise ImageInputError(
                        f"{where} is a {width}x{height} image ({width * height} pixels); the limit is "
                        f"{limits.max_pixels} pixels (max_image_input_pixels)",
                        param=where,
                    )
                img.seek(0)
                return _rgb(img)
    except ImageInputError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, EOFError) as exc:
        raise ImageInputError(f"{where} is not a readable {kind} image: {_reason(exc)}", param=where) from exc


def _rgb(img: Image.Image) -> np.ndarray:
    img.load()
    if img.format == "JPEG":
        img = ImageOps.exif_transpose(img)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()


def _shown(url: str) -> str:
    return repr(url[:40] + ("..." if len(url) > 40 else ""))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:200]
