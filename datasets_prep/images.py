"""Images in rows: ``data.image_key`` values checked and turned into references, and prompts given their image parts.

A row's images (``data.image_key``, OpenRLHF's ``--data.image_key``) may be a file path (absolute, or relative to
the data file's folder, then the working directory), a list of them, PNG/JPEG bytes, base64 text (or a ``data:``
URI), a ``datasets`` Image value (``{"bytes", "path"}`` or a decoded PIL image), or a list of any of these. Each
becomes a *reference*: an absolute path, or a ``data:image/png;base64,...`` URI for in-memory images, so the rows
travel to the ranks as JSON. Every image is opened when the rows are checked: a missing file, an unreadable one or
more than ``data.max_images_per_prompt`` fail naming the file, row and field before any training.

Prompts: a text prompt becomes one user message whose content is the images' ``{"type": "image"}`` parts, then the
text (TRL's and OpenRLHF's layout); chat messages keep their image parts, or get them at the start of the first
user message when they have none. The chat template renders each part as the processor's image token.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

from datasets_prep.loading import DataError

DATA_URI = "data:image/png;base64,"
EXPECTED = ("a file path, a list of them, image bytes, base64 text, a data: URI, or a datasets Image value "
            "({'bytes', 'path'} or a PIL image)")


def open_image(ref: str):
    """The RGB PIL image of a reference (:func:`image_refs`)."""
    from PIL import Image

    if ref.startswith("data:"):
        return Image.open(io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))).convert("RGB")
    return Image.open(ref).convert("RGB")


def encode_png(image) -> str:
    """A PIL image as a PNG data URI reference."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return DATA_URI + base64.b64encode(buf.getvalue()).decode()


def _from_bytes(data: bytes, where: str) -> str:
    from PIL import Image, UnidentifiedImageError

    try:
        Image.open(io.BytesIO(data)).verify()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: {len(data)} bytes that are not an image ({type(e).__name__}: {e})") from None
    return DATA_URI + base64.b64encode(data).decode()


def _from_path(value: str, where: str, base: Path | None) -> str:
    from PIL import Image, UnidentifiedImageError

    path = _existing(value, base) or Path(value).expanduser()
    if not path.is_file():
        tried = f" (looked in {base} and {Path.cwd()})" if base else ""
        raise DataError(f"{where}: image file {value!r} does not exist{tried}")
    try:
        with Image.open(path) as im:
            im.verify()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: image file {path} is not a readable image ({type(e).__name__}: {e})") from None
    return str(path.resolve())


_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")


def _existing(value: str, base: Path | None) -> Path | None:
    """The file a path names (relative: against ``base``, then the working directory), or None."""
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else ([base / path] if base else []) + [Path.cwd() / path]
    try:
        return next((p for p in candidates if p.is_file()), None)
    except OSError:  # a name too long to be a path
        return None


def _from_base64(value: str, where: str) -> str:
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise DataError(f"{where}: base64 text that does not decode ({e})") from None
    return _from_bytes(data, where)


def _one(value, where: str, base: Path | None) -> str:
    if isinstance(value, dict):  # a datasets Image value not decoded
        if value.get("bytes"):
            return _from_bytes(value["bytes"], where)
        if value.get("path"):
            return _from_path(value["path"], where, base)
    elif isinstance(value, (bytes, bytearray)):
        return _from_bytes(bytes(value), where)
    elif isinstance(value, str):
        if value.startswith("data:"):
            head, _, body = value.partition(",")
            if ";base64" not in head:
                raise DataError(f"{where}: a data: URI without base64 ({head!r}); expected data:image/...;base64,...")
            return _from_base64(body, where)
        if _existing(value, base) is None and len(value) >= 64 and _BASE64.fullmatch(value):
            return _from_base64(value, where)  # not a file: base64 text
        return _from_path(value, where, base)
    elif hasattr(value, "save") and hasattr(value, "size"):  # a PIL image (a decoded datasets Image)
        return encode_png(value.convert("RGB"))
    raise DataError(f"{where}: an image value of type {type(value).__name__} ({value!r:.60}); expected {EXPECTED}")


def image_refs(row: dict, key: str, where: str, base: Path | None = None, max_images: int | None = None) -> list[str]:
    """The references of ``row[key]``'s images, each opened and checked; ``[]`` when the field is missing or null."""
    value = row.get(key)
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if max_images is not None and len(values) > max_images:
        raise DataError(f"{where}: field '{key}' has {len(values)} images; data.max_images_per_prompt is {max_images}")
    return [_one(v, f"{where}: field '{key}'" + (f" image {i + 1}" if len(values) > 1 else ""), base)
            for i, v in enumerate(values)]


def image_parts(content) -> int:
    """How many ``{"type": "image"}`` parts a message's content has."""
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image") if isinstance(content, list) else 0


def with_images(prompt, n: int, where: str):
    """``prompt`` (text or chat messages) as messages carrying ``n`` image parts (see the module's docstring)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": prompt}]}]
    have = sum(image_parts(m.get("content")) for m in prompt)
    if have == n:
        return prompt
    if have:
        raise DataError(f"{where}: the messages have {have} image parts but the row has {n} images")
    first = next((i for i, m in enumerate(prompt) if m.get("role") == "user"), None)
    if first is None:
        raise DataError(f"{where}: no user message to put the row's {n} images in")
    out = [dict(m) for m in prompt]
    text = out[first].get("content") or ""
    parts = text if isinstance(text, list) else [{"type": "text", "text": text}]
    out[first]["content"] = [{"type": "image"}] * n + parts
    return out
