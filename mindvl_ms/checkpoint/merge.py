"""Weight merging of checkpoints: linear average, task arithmetic, TIES; streamed tensor by tensor.

    mindvl merge RUN_2K RUN_4K RUN_8K --out merged                     # uniform average (MindVL 5.3)
    mindvl merge A B C --out merged --weights 2 1 1                      # weighted average (normalised)
    mindvl merge SFT_4K --base DSV3 --method task_arithmetic --only model.layers --out merged
    mindvl merge A B --base BASE --method ties --density 0.2 --out merged

Methods (theta_i: input i, theta_b: base, tau_i = theta_i - theta_b, w_i: --weights, lam: --scale):
- linear:            sum_i w_i theta_i / sum_i w_i                 (weights default 1, always normalised)
- task_arithmetic:   theta_b + lam * sum_i w_i tau_i               (weights default 1/N, used as given)
- ties:              trim each tau_i to its top `density` fraction by magnitude (per tensor, values >= the
                     k-th largest magnitude are kept), elect the sign of sum_i w_i tau_i per element, then
                     theta_b + lam * (sum of w_i tau_i over inputs agreeing with the sign) / (sum of their w_i)
`--only PREFIX` merges the keys starting with a prefix; all other tensors are copied from the first input,
and the other inputs need only hold the selected keys (e.g. the LLM of a VLM merged with its base LLM).

Design:
- Headers are checked before anything is written: every input (and the base) must hold the same keys with
  the same shapes and dtypes; the error lists every difference per input.
- Memory stays about a few chunks, not N checkpoints: each input file's header is read once and tensor
  bytes are fetched with positional reads in chunks of `CHUNK` elements (small enough that the widening,
  the float64 sum and the rounding of a chunk run in the CPU's cache, large enough that the threads below
  seldom wait for the GIL: the arithmetic, not the disk, bounds a merge; rate in docs/PERFORMANCE.md,
  ## checkpoint). The main thread reads (and checks) the chunks in
  order; their arithmetic runs on `WORKERS` threads (`ChunkPipe`: numpy releases the GIL, so a second core
  does arithmetic too), at most `AHEAD` bytes of chunks in flight, and the results are written in order.
  The output is written as a stream (header first, then tensor bytes in order, by a writer thread) and
  each written shard is checked by opening it with `safetensors.safe_open`. Reading the inputs through
  `safe_open` instead keeps the memory-mapped pages of all N inputs resident, and its numpy frontend
  cannot hold bf16 (peak memory of both ways: docs/PERFORMANCE.md, ## checkpoint).
- Floating tensors are read as float32 (float64 stays float64); linear and task-arithmetic merges add them
  up in float64, so an average is the exact mean rounded once to the output dtype (bf16 with
  round-to-nearest-even; float32 sums would be off by an ulp of the sum). Integer/bool tensors must be identical across inputs and are copied.
- The output mirrors the first input: same shard files, same index, same `__metadata__`
  (transformers needs `format: pt`); a first input with a file over `max_shard_bytes` (2 GiB by default,
  as convert writes) is regrouped into Hugging Face-named shards with an index, plus config.json and the other non-weight files (not the
  optimizer/trainer state), and a `merge_record.json` with inputs and weights. The processor files
  (tokenizer, preprocessor_config.json, chat_template.json) come with them; when the first input has
  none, a MindVL merge writes them from the first input (or base) that has them, else the defaults
  (`processor_from` in the record). It is written through
  `integrity.atomic_dir`: a failed merge leaves no directory behind, and the output carries its checksums.
- Every input (and the base) is verified against its checksums, read once: the index and side files
  before anything is read (`integrity.verify_except_tensors`), each tensor from the chunks the merge reads
  (`SafetensorsFile`), compared when its last chunk arrives, before the output is renamed into place
  (a directory without checksums is merged as it is). A tensor the merge does not read (an unselected
  key of a second input under `--only`) is not verified: its bytes do not reach the output.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import crc32c
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from mindvl_ms.checkpoint.hf import is_text_only, read_config_json
from mindvl_ms.checkpoint.integrity import MANIFEST, atomic_dir, tensor_checksums, verify_except_tensors
from mindvl_ms.checkpoint.io import DEFAULT_SHARD_BYTES, INDEX, CheckpointError, TensorSpec, plan_shards, \
    record_written, shard_name, weight_files
from mindvl_ms.data.processor import carry_processor
from mindvl_ms.data.processor_files import CHAT_TEMPLATE, PREPROCESSOR, PROCESSOR_FILES, has_tokenizer

CHUNK = 1 << 18  # elements per streamed chunk: few numpy calls (each hands the GIL between threads) per element,
# while a chunk's float64 sum (2 MiB) and temporaries stay in the CPU's cache (docs/PERFORMANCE.md, ## checkpoint)
WORKERS = 2  # threads merging chunks (ChunkPipe) while the main thread reads and checks the inputs
AHEAD = 4 << 20  # bytes of input chunks in flight (read, being merged, or waiting to be written in order)
METHODS = ("linear", "task_arithmetic", "ties")
NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
         "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
         "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}
FLOATS = ("F64", "F32", "F16", "BF16")
SKIP_FILES = ("trainer_state.json", "merge_record.json", MANIFEST)  # not carried over from the first input
SKIP_PREFIXES = ("optimizer", "rng_state", "scheduler")


class MergeError(ValueError):
    """Inputs that cannot be merged; the message lists what differs."""


class SafetensorsFile:
    """Header of one .safetensors file plus chunked positional reads of its tensors. `checksums` (tensor ->
    CRC32C hex, from the directory's manifest) are checked as the bytes are read: a tensor read front to
    back, whole or in consecutive chunks, is compared with its checksum when its last chunk arrives, so a
    merge reads its inputs once (no separate verifying pass)."""

    def __init__(self, path: str, checksums: Optional[Dict[str, str]] = None):
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MergeError(f"{path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None)
        self.tensors = header  # key -> {dtype, shape, data_offsets}
        self.data_start = 8 + n
        self.checksums = checksums or {}
        self._running: Dict[str, Tuple[int, int]] = {}  # key -> (bytes checksummed so far, their CRC32C)
        self._layouts: Dict[str, Tuple[np.dtype, int, int]] = {}  # key -> (dtype, numel, file offset)
        self._fd = os.open(path, os.O_RDONLY)

    def _layout(self, key: str) -> Tuple[np.dtype, int, int]:
        """Storage dtype, element count and file offset of `key`, worked out once per tensor (a read per
        chunk would otherwise redo them tens of thousands of times in a merge)."""
        got = self._layouts.get(key)
        if got is None:
            info = self.tensors[key]
            got = self._layouts[key] = (np.dtype(NUMPY[info["dtype"]]), int(np.prod(info["shape"], dtype=np.int64)),
                                        self.data_start + info["data_offsets"][0])
        return got

    def read(self, key: str, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Flat elements [start, stop) of `key` in their storage dtype (bf16 as uint16)."""
        dt, numel, at = self._layout(key)
        stop = numel if stop is None else stop
        nbytes = (stop - start) * dt.itemsize
        buf = np.empty(stop - start, dtype=dt)
        raw = memoryview(buf).cast("B")
        got = os.preadv(self._fd, [raw], at + start * dt.itemsize) if nbytes else 0
        if got != nbytes:
            raise MergeError(f"{self.path}: tensor '{key}' is truncated")
        if key in self.checksums:
            self._check(key, start * dt.itemsize, raw, stop == numel)
        return buf

    def _check(self, key: str, offset: int, raw: memoryview, last: bool) -> None:
        """Carry `key`'s running CRC32C over a chunk read at byte `offset`; compare it at the tensor's end.
        A read that does not continue the previous one restarts the count (at 0) or leaves it unverified."""
        done, crc = self._running.pop(key, (0, 0)) if offset else (0, 0)
        if done != offset:
            return
        crc = crc32c.crc32c(raw, crc)
        if not last:
            self._running[key] = (offset + len(raw), crc)
        elif f"{crc:08x}" != self.checksums[key]:
            raise CheckpointError(f"{self.path}: tensor '{key}' fails its checksum (crc32c {crc:08x}, {MANIFEST} "
                                  f"records {self.checksums[key]}): the bytes changed after it was written (disk "
                                  f"or copy corruption); re-copy or re-save the checkpoint, or pass --no-verify "
                                  f"to load it anyway")

    def close(self) -> None:
        os.close(self._fd)


class Checkpoint:
    """A checkpoint directory (model.safetensors, or shards + index; found by io.weight_files, so an
    optimizer.safetensors next to the weights is not mistaken for weights) or one .safetensors file."""

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint not found: {path}")
        manifest = verify_except_tensors(path)  # index and side files; tensors as they are read
        sums = tensor_checksums(path, manifest) if os.path.isdir(path) else {}
        self.path = path
        try:
            files = weight_files(path)  # tensor name -> file
        except (FileNotFoundError, OSError, ValueError, KeyError) as e:
            raise MergeError(f"{path}: no readable safetensors weights ({e})") from None
        self.root = path if os.path.isdir(path) else os.path.dirname(path)
        self.index_name = INDEX if os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX)) else None
        self.files = {os.path.basename(f): SafetensorsFile(f, sums.get(os.path.abspath(f)))
                      for f in sorted(set(files.values()))}
        self.where: Dict[str, str] = {}
        for k, f in files.items():
            shard = os.path.basename(f)
            if k not in self.files[shard].tensors:
                raise MergeError(f"{path}: the index puts '{k}' in {shard}, which does not hold it")
            self.where[k] = shard

    def info(self, key: str) -> Tuple[str, List[int]]:
        t = self.files[self.where[key]].tensors[key]
        return t["dtype"], list(t["shape"])

    def read(self, key: str, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        return self.files[self.where[key]].read(key, start, stop)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def to_float(x: np.ndarray, dtype: str) -> np.ndarray:
    """Storage array -> float32 (float64 for F64); bf16 is widened in place of its one uint32 copy."""
    if dtype == "BF16":
        wide = x.astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32)
    return x.astype(np.float64 if dtype == "F64" else np.float32, copy=False)  # reads are fresh arrays


def from_float(x: np.ndarray, dtype: str, reuse: bool = False) -> np.ndarray:
    """float32/64 -> storage array of `dtype` (bf16: round to nearest even, NaN kept NaN). `reuse`: `x` is
    a scratch array the bf16 rounding may overwrite (no temporaries of its size beyond one)."""
    if dtype != "BF16":
        return x.astype(NUMPY[dtype])
    x = np.ascontiguousarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # a sum of large values may overflow: then look
        nan = np.isnan(x) if not np.isfinite(x.sum()) else None  # a NaN makes the sum NaN: one cheap pass
    u = x.view(np.uint32) if reuse and x.flags.writeable else x.view(np.uint32).copy()
    odd = u >> 16
    odd &= 1
    odd += 0x7FFF
    u += odd
    u >>= 16  # the upper half of each word: the rounded bf16 bits
    out = u.astype(np.uint16)
    if nan is not None:
        out[nan] = 0x7FC0
    return out


def _diff_listing(name: str, ref: Checkpoint, other: Checkpoint, keys: Sequence[str], exact: bool) -> List[str]:
    """Human-readable differences of `other` against `ref` on `keys` (and extra keys when `exact`)."""
    lines, show = [], 10
    missing = [k for k in keys if k not in other.where]
    extra = sorted(set(other.where) - set(ref.where)) if exact else []
    bad = []
    for k in keys:
        if k in other.where and other.info(k) != ref.info(k):
            (d1, s1), (d2, s2) = ref.info(k), other.info(k)
            bad.append(f"    {k}: {d1}{s1} in {ref.path} vs {d2}{s2}")
    if missing:
        lines.append(f"  {name} {other.path}: {len(missing)} key(s) missing, e.g. " + ", ".join(missing[:show]))
    if extra:
        lines.append(f"  {name} {other.path}: {len(extra)} extra key(s), e.g. " + ", ".join(extra[:show]))
    if bad:
        lines.append(f"  {name} {other.path}: {len(bad)} shape/dtype mismatch(es):")
        lines.extend(bad[:show] + ([f"    ... and {len(bad) - show} more"] if len(bad) > show else []))
    return lines


def check_compatible(inputs: List[Checkpoint], base: Optional[Checkpoint], selected: List[str],
                     only: Optional[Sequence[str]]) -> None:
    """Raise MergeError listing every key/shape/dtype difference of inputs[1:] and base vs inputs[0]."""
    ref, lines = inputs[0], []
    for i, ck in enumerate(inputs[1:], 2):
        lines += _diff_listing(f"input {i}", ref, ck, selected, exact=not only)
    if base is not None:
        lines += _diff_listing("base", ref, base, selected, exact=False)
    if lines:
        raise MergeError("checkpoints do not match (reference: first input " + ref.path + "):\n" + "\n".join(lines))


class StreamWriter:
    """Write one .safetensors file as a stream: the header first, then tensor bytes in header order, their
    CRC32C (file and per tensor) computed on the way for the output's manifest (`io.record_written`).
    The bytes are written by a background thread while the next chunks are merged (file writes release the
    GIL), handed over in batches of about `BATCH` bytes (one wake-up of the thread per batch, not per
    chunk), at most `QUEUED` batches behind."""

    BATCH = 4 << 20
    QUEUED = 2

    def __init__(self, path: str, entries: List[Tuple[str, str, List[int]]], metadata: Optional[dict]):
        header, off = {}, 0
        if metadata is not None:
            header["__metadata__"] = metadata
        for key, dtype, shape in entries:
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(NUMPY[dtype]).itemsize
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        head = struct.pack("<Q", len(raw)) + raw
        self.path = path
        self.f = open(path, "wb")
        self.f.write(head)
        self.total = off
        self.crc = crc32c.crc32c(head)
        self.tensors: Dict[str, int] = {key: 0 for key, _, _ in entries}
        self._pool = ThreadPoolExecutor(max_workers=1)  # one worker: batches land in the order given
        self._queued: deque = deque()
        self._batch: List[np.ndarray] = []
        self._batched = 0

    def write(self, arr: np.ndarray, key: str) -> None:
        """Append the next bytes of tensor `key` (an array nobody changes afterwards)."""
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        self.crc = crc32c.crc32c(raw, self.crc)
        self.tensors[key] = crc32c.crc32c(raw, self.tensors[key])
        self._batch.append(raw)
        self._batched += raw.nbytes
        if self._batched >= self.BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        batch, self._batch, self._batched = self._batch, [], 0
        self._queued.append(self._pool.submit(self.f.writelines, batch))
        while len(self._queued) > self.QUEUED:
            self._queued.popleft().result()

    def close(self) -> None:
        try:
            self._hand_over()
            while self._queued:
                self._queued.popleft().result()
        finally:
            self._pool.shutdown(wait=True)
            self.f.close()
        record_written(self.path, self.crc, self.tensors)

    def abort(self) -> None:
        """Stop writing after an error (the partial file is removed with the output's temporary directory)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.f.close()


def _combine(method: str, read, n: int, w: np.ndarray, base: Optional[np.ndarray],
             thresholds: Optional[List[float]], scale: float) -> np.ndarray:
    """Merge one chunk; `read(i)` returns input i's chunk as a fresh float32/64 array.

    linear and task arithmetic accumulate input by input into a float64 chunk; TIES needs all N at once.
    """
    if method in ("linear", "task_arithmetic"):
        acc = None
        for i in range(n):
            x = read(i)
            if base is not None:
                x -= base  # task vector
            if w[i] != 1:  # x * 1 is x: skipped, the same values
                x *= w[i]
            acc = x.astype(np.float64) if acc is None else np.add(acc, x, out=acc)
        if method == "linear":  # the float64 mean, then rounded once to float32 (float64 stays)
            return np.divide(acc, w.sum(), out=acc).astype(x.dtype, copy=False)
        acc *= scale
        return np.add(acc, base, out=acc)
    trimmed = []
    for i in range(n):
        t = read(i) - base
        t[np.abs(t) < thresholds[i]] = 0
        trimmed.append(t)
    sign = np.sign(sum(wi * t for wi, t in zip(w, trimmed)))  # elected sign per element
    num, den = np.zeros_like(base), np.zeros_like(base)
    for wi, t in zip(w, trimmed):
        agree = (np.sign(t) == sign) & (t != 0)
        num += np.where(agree, wi * t, 0)
        den += np.where(agree, wi, 0)
    return base + scale * num / np.maximum(den, np.finfo(den.dtype).tiny)


def _ties_threshold(ck: Checkpoint, base: Checkpoint, key: str, dtype: str, density: float) -> float:
    """Magnitude of the k-th largest |tau| of one tensor, k = ceil(density * numel)."""
    tau = np.abs(to_float(ck.read(key), dtype) - to_float(base.read(key), dtype))
    k = max(1, int(np.ceil(density * tau.size)))
    return float(np.partition(tau, tau.size - k)[tau.size - k]) if tau.size else 0.0


def _copy_side_files(src: str, dst: str, skip: set) -> List[str]:
    copied = []
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if (name in skip or name in SKIP_FILES or name.endswith(".safetensors") or os.path.isdir(p)
                or name.startswith(SKIP_PREFIXES)):
            continue
        shutil.copy2(p, os.path.join(dst, name))
        copied.append(name)
    return copied


def _ensure_processor(tmp: str, inputs: Sequence[str]) -> str:
    """Make sure a merged MindVL directory carries processor files; returns where they came from (None for
    LLM-only or config-less merges, whose side files are only copied)."""
    if not os.path.isfile(os.path.join(tmp, "config.json")) or is_text_only(read_config_json(tmp)):
        return None
    if has_tokenizer(tmp) and all(os.path.isfile(os.path.join(tmp, f)) for f in (PREPROCESSOR, CHAT_TEMPLATE)):
        return os.path.abspath(inputs[0])
    dirs = [p for p in inputs if os.path.isdir(p)]
    src = next((d for d in dirs if any(os.path.isfile(os.path.join(d, f)) for f in PROCESSOR_FILES)), None)
    carry_processor(tmp, src)
    return os.path.abspath(src) if src else "defaults"


def plan_output(ref: Checkpoint, max_shard_bytes: Optional[int]) -> List[Tuple[str, List[str], Optional[dict]]]:
    """(file name, tensor names, __metadata__) of each output file: the first input's shards when none is
    larger than `max_shard_bytes` (None: always), else the tensors regrouped into HF-named shards of at
    most that size (a merge of one large file is written sharded, as convert writes)."""
    mirror = [(shard, [k for k in f.tensors if ref.where.get(k) == shard], f.metadata)
              for shard, f in ref.files.items()]
    specs = {k: TensorSpec(k, *ref.info(k)) for k in ref.where}
    if not max_shard_bytes or all(sum(specs[k].nbytes for k in keys) <= max_shard_bytes for _, keys, _ in mirror):
        return mirror
    groups = plan_shards([specs[k] for _, keys, _ in mirror for k in keys], max_shard_bytes)
    meta = mirror[0][2] if mirror[0][2] is not None else {"format": "pt"}
    return [(shard_name(i, len(groups)), [s.name for s in g], meta) for i, g in enumerate(groups)]


def _merge_chunk(method: str, dtype: str, raws: List[np.ndarray], braw: Optional[np.ndarray], w: np.ndarray,
                 thresholds: Optional[List[float]], scale: float) -> np.ndarray:
    """One merged chunk in storage dtype from the inputs' (and base's) storage chunks; runs on a pool thread."""
    bx = to_float(braw, dtype) if braw is not None else None
    read = lambda i: to_float(raws[i], dtype)  # noqa: E731
    return from_float(_combine(method, read, len(raws), w, bx, thresholds, scale), dtype, reuse=True)


class ChunkPipe:
    """Merges chunks on `workers` threads while the caller reads the next ones, and writes the results in
    the order they were put. The chunks in flight hold at most `ahead` bytes of input (or one chunk per
    worker, when chunks are larger), so memory stays a few chunks whatever N and `CHUNK` are.

    The reads stay on the caller's thread, in order, so each input's running CRC32C sees its tensor front
    to back (`SafetensorsFile._check`); the widening, sum and rounding of a chunk run on a pool thread,
    where numpy releases the GIL, so a second core does arithmetic while the first reads and writes
    (rates in docs/PERFORMANCE.md, ## checkpoint)."""

    def __init__(self, workers: int, ahead: int):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="merge")
        self._workers, self._ahead = workers, ahead
        self._pending: deque = deque()  # (writer, tensor name, Future or ready array, input bytes), in order
        self._bytes = 0  # input bytes of the pending chunks

    def submit(self, wr: StreamWriter, key: str, nbytes: int, fn, *args) -> None:
        """Queue `fn(*args)` (an array nobody changes afterwards; its inputs hold `nbytes`) as the next bytes
        of `key` in `wr`."""
        self._put(wr, key, self._pool.submit(fn, *args), nbytes)

    def put(self, wr: StreamWriter, key: str, arr: np.ndarray) -> None:
        """Queue `arr` as the next bytes of `key` in `wr` (written after the chunks before it)."""
        if self._pending:
            self._put(wr, key, arr, arr.nbytes)
        else:
            wr.write(arr, key)

    def _put(self, wr: StreamWriter, key: str, job, nbytes: int) -> None:
        self._pending.append((wr, key, job, nbytes))
        self._bytes += nbytes
        while len(self._pending) > self._workers and self._bytes > self._ahead:
            self._write_next()

    def _write_next(self) -> None:
        wr, key, job, nbytes = self._pending.popleft()
        self._bytes -= nbytes
        wr.write(job.result() if isinstance(job, Future) else job, key)

    def flush(self) -> None:
        """Write every queued chunk."""
        while self._pending:
            self._write_next()

    def close(self) -> None:
        """Stop the threads; chunks still queued (after an error) are dropped."""
        self._pending.clear()
        self._bytes = 0
        self._pool.shutdown(wait=True, cancel_futures=True)


def _write_shards(tmp: str, cks: List[Checkpoint], bck: Optional[Checkpoint], sel: set, method: str,
                  w: np.ndarray, density: float, scale: float, progress: bool,
                  plan: List[Tuple[str, List[str], Optional[dict]]]) -> None:
    """Stream every tensor of the first input into the files of `plan` in `tmp`, merged when selected,
    else copied."""
    ref = cks[0]
    total = sum(int(np.prod(ref.info(k)[1], dtype=np.int64)) for k in ref.where)
    bar = tqdm(total=total, unit="param", unit_scale=True, desc=f"merge ({method})", disable=not progress)
    pipe = ChunkPipe(WORKERS, AHEAD)
    try:
        for shard, order, metadata in plan:
            wr = StreamWriter(os.path.join(tmp, shard), [(k, *ref.info(k)) for k in order], metadata)
            try:
                for key in order:
                    bar.update(_write_tensor(pipe, wr, key, cks, bck, sel, method, w, density, scale))
                pipe.flush()
            except BaseException:
                wr.abort()
                raise
            wr.close()
            with safe_open(os.path.join(tmp, shard), "np") as check:  # the reference reader accepts the file
                if sorted(check.keys()) != sorted(order):
                    raise MergeError(f"written shard {shard} does not list the expected tensors")
    finally:
        pipe.close()
    bar.close()


def _write_tensor(pipe: ChunkPipe, wr: StreamWriter, key: str, cks: List[Checkpoint], bck: Optional[Checkpoint],
                  sel: set, method: str, w: np.ndarray, density: float, scale: float) -> int:
    """Read one tensor chunk by chunk and queue its merged (or copied) chunks for `wr`; returns its element
    count."""
    ref = cks[0]
    dtype, shape = ref.info(key)
    numel = int(np.prod(shape, dtype=np.int64))
    ths = None
    if key in sel and method == "ties" and dtype in FLOATS:
        ths = [_ties_threshold(c, bck, key, dtype, density) for c in cks]
    for a in range(0, max(numel, 1), CHUNK):
        b = min(numel, a + CHUNK)
        if key not in sel:
            pipe.put(wr, key, ref.read(key, a, b))
        elif dtype not in FLOATS:
            x0 = ref.read(key, a, b)
            for c in cks[1:]:
                if not np.array_equal(c.read(key, a, b), x0):
                    raise MergeError(f"tensor '{key}' has dtype {dtype} (not averageable) and differs "
                                     f"between {ref.path} and {c.path}")
            pipe.put(wr, key, x0)
        else:
            braw = bck.read(key, a, b) if bck is not None else None
            raws = [c.read(key, a, b) for c in cks]
            nbytes = sum(r.nbytes for r in raws) + (braw.nbytes if braw is not None else 0)
            pipe.submit(wr, key, nbytes, _merge_chunk, method, dtype, raws, braw, w, ths, scale)
    return numel


def merge(inputs: Sequence[str], out: str, method: str = "linear", weights: Optional[Sequence[float]] = None,
          base: Optional[str] = None, density: float = 0.2, scale: float = 1.0,
          only: Optional[Sequence[str]] = None, overwrite: bool = False, progress: bool = True,
          max_shard_bytes: Optional[int] = DEFAULT_SHARD_BYTES) -> dict:
    """Merge checkpoints `inputs` into directory `out`; returns the merge record (also written to out).
    The output keeps the first input's shards unless one is over `max_shard_bytes` (`plan_output`)."""
    if method not in METHODS:
        raise MergeError(f"unknown method '{method}': expected one of {', '.join(METHODS)}")
    if not inputs:
        raise MergeError("no input checkpoints given")
    if method != "linear" and base is None:
        raise MergeError(f"method '{method}' needs --base (the checkpoint the task vectors are taken against)")
    if method == "linear" and len(inputs) < 2:
        raise MergeError("a linear merge needs at least two checkpoints")
    if weights is not None and len(weights) != len(inputs):
        raise MergeError(f"{len(weights)} weight(s) given for {len(inputs)} checkpoint(s)")
    if method == "ties" and not 0 < density <= 1:
        raise MergeError(f"--density {density}: expected 0 < density <= 1")
    if weights is None:
        weights = [1.0] * len(inputs) if method != "task_arithmetic" else [1.0 / len(inputs)] * len(inputs)
    w = np.asarray(weights, dtype=np.float64)
    if method == "linear" and (w < 0).any() or (method != "task_arithmetic" and w.sum() <= 0):
        raise MergeError(f"weights {list(weights)}: expected non-negative weights with a positive sum")
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise MergeError(f"output directory {out} exists and is not empty (use --overwrite)")

    cks = [Checkpoint(p) for p in inputs]
    bck = Checkpoint(base) if base is not None else None
    try:
        ref = cks[0]
        keys = list(ref.where)
        selected = [k for k in keys if not only or any(k.startswith(p) for p in only)]
        if only and not selected:
            raise MergeError(f"--only {' '.join(only)} matches no tensor of {ref.path}; keys look like: "
                             + ", ".join(keys[:5]))
        check_compatible(cks, bck, selected, only)
        with atomic_dir(out) as tmp:  # renamed into place only when complete
            plan = plan_output(ref, max_shard_bytes)
            _write_shards(tmp, cks, bck, set(selected), method, w, density, scale, progress, plan)
            if ref.index_name or len(plan) > 1:
                index = {}
                if ref.index_name:
                    with open(os.path.join(ref.root, ref.index_name)) as fh:
                        index = json.load(fh)
                index.setdefault("metadata", {})["total_size"] = sum(TensorSpec(k, *ref.info(k)).nbytes for k in keys)
                index["weight_map"] = {k: shard for shard, order, _ in plan for k in order}
                with open(os.path.join(tmp, INDEX), "w") as fh:
                    json.dump(index, fh, indent=2)
            copied = (_copy_side_files(ref.root, tmp, {ref.index_name} if ref.index_name else set())
                      if os.path.isdir(ref.path) else [])  # a bare .safetensors input has no side files
            processor_from = _ensure_processor(tmp, list(inputs) + ([base] if base else []))
            record = {
                "method": method,
                "inputs": [{"path": os.path.abspath(p), "weight": float(x)} for p, x in zip(inputs, weights)],
                "normalised_weights": (w / w.sum()).tolist() if method == "linear" else None,
                "base": os.path.abspath(base) if base else None,
                "density": density if method == "ties" else None,
                "scale": scale if method != "linear" else None,
                "only": list(only) if only else None,
                "merged_tensors": len(selected), "copied_tensors": len(keys) - len(selected),
                "files_copied_from_first_input": copied,
                "processor_from": processor_from,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            with open(os.path.join(tmp, "merge_record.json"), "w") as fh:
                json.dump(record, fh, indent=2)
    finally:
        for c in cks + ([bck] if bck else []):
            c.close()
    return record
