"""Safetensors files and checkpoint directories, read and written without torch.

- `read_tensors(dir_or_file)`: one `model.safetensors`, or shards listed in `model.safetensors.index.json`.
  Tensors come back as `RawTensor` (numpy array + the safetensors dtype), so bfloat16 survives a round trip
  bit-exactly even though numpy has no bfloat16 (it is held as uint16 bits; `.float32()` widens it).
- `write_tensors(dir, tensors, max_shard_bytes)`: one file or shards + index, HF naming.
- Directories are written atomically with a manifest of checksums, verified on load: `checkpoint/integrity.py`.
- Every read checks the header against the file before touching tensor bytes (`verified_header`): the
  header length fits the file, each tensor's dtype is known, its shape's byte length equals its
  `data_offsets` span, and the span ends inside the file. A truncated or corrupt file raises
  `CheckpointError` naming the file and the tensor ("...: tensor 'x' needs 77,791,232 bytes, the file
  ends after 40,199,484"), for every command that loads weights (resume, generate, eval, convert, export).
"""
import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterator, Optional

import numpy as np

class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as written; the message names the file and the tensor."""


_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
       np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
       np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
OPTIM = "optimizer.safetensors"  # training checkpoints only (trainer_state.py)
STATE = "trainer_state.json"


@dataclass
class RawTensor:
    """A tensor as stored: `data` (numpy; uint16 bits for BF16) and the safetensors `dtype` tag."""

    data: np.ndarray
    dtype: str

    @classmethod
    def of(cls, arr: np.ndarray, dtype: Optional[str] = None) -> "RawTensor":
        arr = np.asarray(arr)
        arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d arrays 0-d
        return cls(arr, dtype or _ST[arr.dtype])

    @property
    def shape(self):
        return self.data.shape

    def float32(self) -> np.ndarray:
        if self.dtype == "BF16":
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        return self.data.astype(np.float32)

    def reshape(self, *shape) -> "RawTensor":
        return RawTensor(self.data.reshape(*shape), self.dtype)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def verified_header(path: str, f) -> tuple:
    """(header without __metadata__, byte offset of the data) of an open safetensors file, checked
    against the file size before any tensor is read (see module doc)."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) != 8:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, the header length alone needs 8)")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        raise CheckpointError(f"{path}: the header needs {n:,} bytes, the file ends after {max(size - 8, 0):,} "
                              f"(truncated or not a safetensors file)")
    try:
        header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    start = 8 + n
    for name, info in header.items():
        try:
            dt, shape, (a, b) = info["dtype"], [int(x) for x in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor '{name}': corrupt header entry {info!r}") from None
        if dt not in _NP:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {dt}")
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NP[dt]).itemsize
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b) or b - a != need:
            raise CheckpointError(f"{path}: tensor '{name}' of shape {shape} {dt} needs {need:,} bytes, its "
                                  f"data_offsets are {[a, b]} (corrupt header)")
        if start + b > size:
            raise CheckpointError(f"{path}: tensor '{name}' needs {need:,} bytes, the file ends after "
                                  f"{max(size - start - a, 0):,} (truncated: re-copy or re-save the checkpoint)")
    return header, start


def read_file(path: str) -> Dict[str, RawTensor]:
    with open(path, "rb") as f:
        header, start = verified_header(path, f)
        out = {}
        for name, info in header.items():
            a, b = info["data_offsets"]
            f.seek(start + a)
            arr = np.frombuffer(f.read(b - a), dtype=_NP[info["dtype"]]).reshape(info["shape"])
            out[name] = RawTensor(arr.copy(), info["dtype"])
    return out


def write_file(path: str, tensors: Dict[str, RawTensor], metadata: Optional[Dict[str, str]] = None) -> None:
    header, offset, chunks = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name]
        raw = np.ascontiguousarray(t.data).tobytes()
        header[name] = {"dtype": t.dtype, "shape": list(t.data.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        chunks.append(raw)
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for c in chunks:
            f.write(c)


def weight_files(path: str) -> Dict[str, str]:
    """tensor name -> file for a checkpoint dir (index or single file) or a single .safetensors file."""
    if os.path.isfile(path):
        return {name: path for name in read_header(path)}
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                wm = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return {name: single for name in read_header(single)}
    files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors")) if os.path.isdir(path) else []
    if not files:
        raise FileNotFoundError(f"{path}: no {SINGLE}, {INDEX} or *.safetensors found")
    out = {}
    for fn in files:
        out.update({name: os.path.join(path, fn) for name in read_header(os.path.join(path, fn))})
    return out


def read_header(path: str) -> Dict[str, dict]:
    """Tensor entries of a safetensors file, verified against the file size (see `verified_header`)."""
    with open(path, "rb") as f:
        return verified_header(path, f)[0]


def iter_tensors(path: str) -> Iterator[tuple]:
    """(name, RawTensor) for every tensor of a checkpoint, one file in memory at a time."""
    by_file: Dict[str, list] = {}
    for name, fn in weight_files(path).items():
        by_file.setdefault(fn, []).append(name)
    for fn, names in by_file.items():
        tensors = read_file(fn)
        for name in names:
            yield name, tensors[name]


def read_tensors(path: str) -> Dict[str, RawTensor]:
    return dict(iter_tensors(path))


def write_tensors(path: str, tensors: Dict[str, RawTensor], max_shard_bytes: Optional[int] = None) -> None:
    """Write `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` + index when too big."""
    os.makedirs(path, exist_ok=True)
    names = sorted(tensors)
    total = sum(tensors[n].data.nbytes for n in names)
    if not max_shard_bytes or total <= max_shard_bytes:
        write_file(os.path.join(path, SINGLE), tensors, {"format": "pt"})
        return
    shards, cur, size = [], [], 0
    for n in names:
        nb = tensors[n].data.nbytes
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nb
    shards.append(cur)
    weight_map = {}
    for i, group in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(os.path.join(path, fn), {n: tensors[n] for n in group}, {"format": "pt"})
        weight_map.update({n: fn for n in group})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
