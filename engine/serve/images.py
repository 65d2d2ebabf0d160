"""Images in chat requests: ``image_url`` parts with a ``data:`` URL (base64 PNG, JPEG or WebP), decoded with
Pillow. The server fetches nothing: an ``http(s)`` URL is refused, and so is anything that is not a whole image of
those formats or is larger than the limit. Every refusal is a 400 naming the message and part."""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from engine.serve.protocol import APIError

DEFAULT_MAX_IMAGE_BYTES = 8 * 2**20  # one image's encoded bytes
MAX_IMAGE_PIXELS = 40_000_000  # a decoded image's width x height (Pillow's decompression-bomb guard is above this)
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
_DATA_URL = re.compile(r"data:image/([a-zA-Z]+);base64,", re.ASCII)


def decode_image(url: str, where: str, max_bytes: int) -> Any:
    """The RGB ``PIL.Image`` of a ``data:image/<png|jpeg|webp>;base64,...`` URL; APIError 400 naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    if url.startswith(("http://", "https://")):
        raise APIError(400, f"{where}: image URLs are not fetched; send the image as a data: URL (base64)", param=where)
    m = _DATA_URL.match(url)
    if m is None or m.group(1).lower() not in FORMATS:
        raise APIError(400, f"{where}: expected data:image/png|jpeg|webp;base64,... ", param=where)
    payload = url[m.end() :]
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise APIError(400, f"{where}: the image is larger than this server's limit of {max_bytes} bytes", param=where)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the data URL is not valid base64", param=where) from None
    if len(raw) > max_bytes:
        raise APIError(400, f"{where}: the image is larger than this server's limit of {max_bytes} bytes", param=where)
    want = FORMATS[m.group(1).lower()]
    try:
        with Image.open(io.BytesIO(raw)) as probe:
            if probe.format != want:
                raise APIError(400, f"{where}: the data is {probe.format}, not the {want} its URL names", param=where)
            if probe.width * probe.height > MAX_IMAGE_PIXELS:
                raise APIError(400, f"{where}: {probe.width}x{probe.height} pixels is too large", param=where)
            probe.verify()
        img = Image.open(io.BytesIO(raw))
        img.load()
        return img.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise APIError(400, f"{where}: not a decodable {want} image ({exc})", param=where) from None
