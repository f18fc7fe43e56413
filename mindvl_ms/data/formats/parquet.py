"""Hugging Face `datasets` parquet files: one record a row, images stored in the file.

The image column is `images` (a list) or `image` (one), each cell a `datasets.Image` struct
`{"bytes": ..., "path": ...}` (raw bytes or a path string also work). Bytes are written once to
`Target.image_dir` under the first 16 hex digits of their SHA-256 with the extension of their format
(`3f2a...c1.jpg`): the same image in many rows is one file, a second conversion rewrites nothing, and the
names do not depend on the order rows are read in. A cell with no bytes falls back to its path, relative
to `Target.base`. The other columns are read as a ShareGPT or LLaVA record (`messages` or
`conversations`, `system`, `id`; null columns count as absent).
"""
from __future__ import annotations

import hashlib
import io
import os
from typing import Any, Callable, Dict, Iterator, Optional

import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from mindvl_ms.data.formats.common import ConvertError, Record, Target, as_list
from mindvl_ms.data.formats.sharegpt import sharegpt_record

IMAGE_COLUMNS = ("images", "image")
EXTENSIONS = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tif"}
BATCH_ROWS = 64  # rows decoded at a time: bounds the image bytes held in memory


def num_rows(path: str) -> int:
    return pq.ParquetFile(path).metadata.num_rows


def iter_parquet(path: str, keep: Optional[Callable[[int], bool]] = None) -> Iterator[Record]:
    """Records of the rows `keep` accepts (by 1-based record number), in file order."""
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
        for obj in batch.to_pylist():
            row += 1
            if keep is None or keep(row):
                yield Record(row, f"row {row - 1}", obj)


def write_image(data: bytes, field: str, target: Target) -> str:
    """Path of the image file holding `data` (written unless it is there already; see module doc)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            kind = im.format or "img"
    except UnidentifiedImageError:
        raise ConvertError("unreadable image", f"field {field}: the stored bytes are not an image PIL reads "
                                               f"({len(data)} bytes starting {data[:8]!r})") from None
    except Exception as e:  # PIL raises many types for broken data
        raise ConvertError("unreadable image", f"field {field}: the stored bytes: {e}") from None
    name = hashlib.sha256(data).hexdigest()[:16] + EXTENSIONS.get(kind, "." + kind.lower())
    path = os.path.join(target.image_dir, name)
    if not os.path.isfile(path):
        part = f"{path}.{os.getpid()}.part"  # another process may write the same image: replace atomically
        try:
            os.makedirs(target.image_dir, exist_ok=True)
            with open(part, "wb") as f:
                f.write(data)
            os.replace(part, path)
        except OSError as e:
            raise ConvertError("unwritable image", f"field {field}: {path}: {e}") from None
        target.written += 1
    return path


def stored_image(cell: Any, field: str, target: Target) -> str:
    """The path of one image cell: its bytes written out (absolute), or the cell's path as written."""
    if isinstance(cell, dict):
        if cell.get("bytes"):
            return write_image(cell["bytes"], field, target)
        if cell.get("path"):
            return cell["path"]
        raise ConvertError("missing image", f"field {field}: neither bytes nor a path")
    if isinstance(cell, (bytes, bytearray)):
        return write_image(bytes(cell), field, target)
    if isinstance(cell, str):
        return cell
    raise ConvertError("schema", f"field {field}: expected {{bytes, path}}, bytes or a path, got "
                                 f"{type(cell).__name__}")


def parquet_record(row: Any, target: Target) -> Dict[str, Any]:
    """One parquet row -> one record of this project's JSONL (raises ConvertError)."""
    if not isinstance(row, dict):
        raise ConvertError("schema", f"expected a row of columns, got {type(row).__name__}")
    obj = {k: v for k, v in row.items() if v is not None}
    name = next((c for c in IMAGE_COLUMNS if c in obj), None)
    if name is not None:
        cells = obj[name]
        if isinstance(cells, list):
            obj[name] = [stored_image(c, f"{name}[{k}]", target) for k, c in enumerate(cells)]
        else:
            obj[name] = stored_image(cells, name, target)
        if not as_list(obj[name]):
            del obj[name]
    return sharegpt_record(obj, target)
