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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Union

import crc32c
import numpy as np

class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as written; the message names the file and the tensor."""


_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_, "U16": np.uint16,
       "U32": np.uint32, "U64": np.uint64}
_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
       np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
       np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 << 30  # convert, merge and save_pretrained shard above this (as Hugging Face shards)
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


class TensorFile:
    """One safetensors file opened for tensor-by-tensor reads: the verified header once, then each tensor
    (or a flat element range of it) read with a positional read into a fresh array of its storage dtype.
    Nothing is memory-mapped, so a streamed load or conversion holds one tensor, not the file (mapped
    pages of a read file would count in the process's resident memory until unmapped)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            with os.fdopen(os.dup(self._fd), "rb") as f:
                self.header, self.data_start = verified_header(path, f)
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, name: str, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Flat elements [start, stop) of `name` in storage dtype (bf16 as uint16); the whole tensor,
        in its shape, without a range."""
        info = self.header[name]
        dt = np.dtype(_NP[info["dtype"]])
        numel = int(np.prod(info["shape"], dtype=np.int64))
        whole = start == 0 and stop is None
        stop = numel if stop is None else stop
        buf = np.empty(stop - start, dtype=dt)
        view = memoryview(buf).cast("B")
        pos, done = self.data_start + info["data_offsets"][0] + start * dt.itemsize, 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], pos + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: tensor '{name}' ends early (the file changed while read)")
            done += got
        return buf.reshape(info["shape"]) if whole else buf

    def raw(self, name: str) -> RawTensor:
        return RawTensor(self.read(name), self.header[name]["dtype"])

    def span(self, name: str) -> "FileSpan":
        """Where `name`'s bytes are in the file, for a writer that copies them unchanged."""
        a, b = self.header[name]["data_offsets"]
        return FileSpan(self._fd, self.data_start + a, b - a)

    def close(self) -> None:
        os.close(self._fd)


def read_file(path: str) -> Dict[str, RawTensor]:
    with TensorFile(path) as tf:
        return {name: tf.raw(name) for name in tf.header}


@dataclass
class FileSpan:
    """Bytes of an open file (`fd`, `offset`, `nbytes`): a tensor copied as it is stored. `crc32c`, when
    known (the source's checksum manifest), is what the bytes must checksum to: the copy verifies the
    source on the way, so a streamed conversion reads its input once (`where` names it in an error)."""

    fd: int
    offset: int
    nbytes: int
    crc32c: Optional[str] = None
    where: str = ""


COPY_CHUNK = 8 << 20  # bytes per read of a copied span; two such buffers alternate (`Copier`)
_READ_AHEAD = hasattr(os, "posix_fadvise")  # not on every platform


class Copier:
    """Appends bytes to an open file from a background thread, in the order given, while the caller reads
    and checksums the next chunk: a streamed copy reads its source and writes its output at the same time
    instead of one after the other (both wait on the disk; file writes, `preadv` and CRC32C of large
    buffers release the GIL). Copied spans go through two `COPY_CHUNK` buffers used in turn, a buffer
    being refilled only once its previous write finished; memory stays two buffers. An array (`write`) is
    written after the queued chunks, before `write` returns, so the caller may drop or reuse it."""

    def __init__(self, out):
        self.out = out
        self._pool = ThreadPoolExecutor(max_workers=1)  # one worker: writes land in submission order
        self._bufs: List[memoryview] = []  # allocated by the first copied span
        self._busy: List[Optional[Future]] = [None, None]
        self._turn = 0

    def write(self, data) -> None:
        """Write `data` after everything queued before, and return once it is written."""
        self._drain()
        self.out.write(data)

    def _drain(self) -> None:
        for i, f in enumerate(self._busy):
            if f is not None:
                self._busy[i] = None
                f.result()

    def copy(self, span: FileSpan, file_crc: int) -> tuple:
        """Append `span`'s bytes, checksumming them as they pass; returns (the file's CRC32C so far, the
        span's CRC32C). A span whose CRC32C differs from the one it carries is a CheckpointError naming
        the source."""
        pos, left, crc = span.offset, span.nbytes, 0
        if not self._bufs:
            self._bufs = [memoryview(bytearray(COPY_CHUNK)) for _ in range(2)]
        while left > 0:
            self._turn ^= 1
            if self._busy[self._turn] is not None:
                self._busy[self._turn].result()  # this buffer's previous write is done (or raises)
            buf = self._bufs[self._turn]
            n = os.preadv(span.fd, [buf[:min(left, len(buf))]], pos)
            if n <= 0:
                raise CheckpointError(f"{span.where}: data ends early at byte {pos:,} (the file changed while "
                                      f"copied)")
            if _READ_AHEAD and left > n:  # the disk reads the next chunk while this one is checksummed
                os.posix_fadvise(span.fd, pos + n, min(left - n, len(buf)), os.POSIX_FADV_WILLNEED)
            chunk = buf[:n]
            crc = crc32c.crc32c(chunk, crc)
            file_crc = crc32c.crc32c(chunk, file_crc)
            self._busy[self._turn] = self._pool.submit(self.out.write, chunk)
            pos, left = pos + n, left - n
        if span.crc32c is not None and f"{crc:08x}" != span.crc32c:
            raise CheckpointError(f"{span.where} fails its checksum (crc32c {crc:08x}, checksums.json records "
                                  f"{span.crc32c}): the bytes changed after it was written (disk or copy "
                                  f"corruption); re-copy or re-save the checkpoint, or pass --no-verify to load "
                                  f"it anyway")
        return file_crc, crc

    def close(self) -> None:
        """Wait for every queued write (re-raising a failed one) and stop the thread."""
        try:
            self._drain()
        finally:
            self._pool.shutdown(wait=True)


_WRITTEN: Dict[str, tuple] = {}  # abspath -> (bytes, mtime_ns, manifest entry) of files write_stream wrote


def written_entry(path: str) -> Optional[dict]:
    """The checksum-manifest entry (`integrity.file_entry`'s format) of a safetensors file this process
    wrote with `write_stream` and has not changed since, computed from the bytes as they were written:
    the manifest of a streamed checkpoint needs no second read of its files. None otherwise."""
    known = _WRITTEN.get(os.path.abspath(path))
    if known is None:
        return None
    st = os.stat(path)
    return known[2] if (st.st_size, st.st_mtime_ns) == known[:2] else None


@dataclass
class TensorSpec:
    """What a writer needs of a tensor before its bytes: name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(_NP[self.dtype]).itemsize


def write_stream(path: str, specs: List[TensorSpec], fetch: Callable[[str], Union[np.ndarray, FileSpan]],
                 metadata: Optional[Dict[str, str]] = None) -> None:
    """Write one safetensors file as a stream: the header from `specs`, then each tensor's bytes from
    `fetch(name)` in header order, so at most one tensor is in memory (no second copy of the file); a
    `FileSpan` is copied through two small buffers, reads overlapping writes (`Copier`; verified,
    `FileSpan.crc32c`). The CRC32C of the file
    and of each tensor are computed on the way (`written_entry`). A fetched tensor of another byte size (or
    array of another shape) than its spec is a ValueError."""
    header, offset = {}, 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": [int(x) for x in s.shape],
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    head = struct.pack("<Q", len(hb)) + hb
    file_crc, tensors = crc32c.crc32c(head), {}
    with open(path, "wb") as f:
        f.write(head)
        copier = Copier(f)
        try:
            for s in specs:
                got = fetch(s.name)
                if isinstance(got, FileSpan):
                    if got.nbytes != s.nbytes:
                        raise ValueError(f"{path}: tensor '{s.name}' has {got.nbytes} bytes, its header says "
                                         f"{s.nbytes}")
                    file_crc, tensors[s.name] = copier.copy(got, file_crc)
                    continue
                arr = np.asarray(got)
                arr = arr if arr.flags.c_contiguous else np.array(arr, order="C")  # keeps 0-d arrays 0-d
                if arr.nbytes != s.nbytes or tuple(arr.shape) != tuple(s.shape):
                    raise ValueError(f"{path}: tensor '{s.name}' is {list(arr.shape)} ({arr.nbytes} bytes), its "
                                     f"header says {list(s.shape)} {s.dtype}")
                raw = memoryview(arr.reshape(-1)).cast("B")
                tensors[s.name] = crc32c.crc32c(raw)
                file_crc = crc32c.crc32c(raw, file_crc)
                copier.write(raw)
                del arr, raw
        finally:
            copier.close()
    record_written(path, file_crc, tensors)


def record_written(path: str, file_crc: int, tensors: Dict[str, int]) -> None:
    """Keep the checksums of a safetensors file just written and closed, computed from its bytes on the way
    out, for its manifest entry (`written_entry`)."""
    st = os.stat(path)
    _WRITTEN[os.path.abspath(path)] = (st.st_size, st.st_mtime_ns, {
        "bytes": st.st_size, "checksum": f"{file_crc:08x}", "tensors": {k: f"{v:08x}" for k, v in tensors.items()}})


def write_file(path: str, tensors: Dict[str, RawTensor], metadata: Optional[Dict[str, str]] = None) -> None:
    specs = [TensorSpec(n, tensors[n].dtype, tuple(tensors[n].data.shape)) for n in sorted(tensors)]
    write_stream(path, specs, lambda n: tensors[n].data, metadata)


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
    """(name, RawTensor) for every tensor of a checkpoint, read one tensor at a time (`TensorFile`)."""
    by_file: Dict[str, list] = {}
    for name, fn in weight_files(path).items():
        by_file.setdefault(fn, []).append(name)
    for fn, names in by_file.items():
        with TensorFile(fn) as tf:
            for name in names:
                yield name, tf.raw(name)


def read_tensors(path: str) -> Dict[str, RawTensor]:
    return dict(iter_tensors(path))


def plan_shards(specs: List[TensorSpec], max_shard_bytes: Optional[int]) -> List[List[TensorSpec]]:
    """Consecutive groups of `specs` of at most `max_shard_bytes` each (a larger tensor alone); one group
    when no limit is given or everything fits."""
    if not max_shard_bytes or sum(s.nbytes for s in specs) <= max_shard_bytes:
        return [list(specs)]
    shards, cur, size = [], [], 0
    for s in specs:
        if cur and size + s.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    shards.append(cur)
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_sharded(path: str, specs: List[TensorSpec], fetch: Callable[[str], Union[np.ndarray, FileSpan]],
                  max_shard_bytes: Optional[int] = None) -> List[str]:
    """Stream tensors (`write_stream`, sorted by name) into `model.safetensors`, or into shards
    `model-0000i-of-0000n.safetensors` of at most `max_shard_bytes` + `model.safetensors.index.json`
    (Hugging Face's naming) when they do not fit in one. Returns the file names written."""
    os.makedirs(path, exist_ok=True)
    specs = sorted(specs, key=lambda s: s.name)
    shards = plan_shards(specs, max_shard_bytes)
    if len(shards) == 1:
        write_stream(os.path.join(path, SINGLE), shards[0], fetch, {"format": "pt"})
        return [SINGLE]
    weight_map, names = {}, []
    for i, group in enumerate(shards):
        fn = shard_name(i, len(shards))
        write_stream(os.path.join(path, fn), group, fetch, {"format": "pt"})
        weight_map.update({s.name: fn for s in group})
        names.append(fn)
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}, f, indent=2)
    return names + [INDEX]


def write_tensors(path: str, tensors: Dict[str, RawTensor], max_shard_bytes: Optional[int] = None) -> None:
    """Write `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` + index when too big."""
    specs = [TensorSpec(n, t.dtype, tuple(t.data.shape)) for n, t in tensors.items()]
    write_sharded(path, specs, lambda n: tensors[n].data, max_shard_bytes)


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
