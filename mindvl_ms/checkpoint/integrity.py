"""A checkpoint directory's integrity: written atomically with a manifest of checksums, verified on load.

- `atomic_dir(path)`: write a directory under a temporary name and rename it into place, so a crash never
  leaves a directory that looks complete but is not. Just before the rename it writes `checksums.json`,
  the manifest of every file in the directory (subdirectories too):

      {"format": "mindvl-checksums", "version": 1, "algorithm": "crc32c",
       "files": {"config.json": {"bytes": 2113, "checksum": "5f1d0c2a"},
                 "model.safetensors": {"bytes": 4711, "checksum": "9ae0f3b1",
                                       "tensors": {"lm_head.weight": "03c4e1d7", ...}}}}

  `checksum` is the CRC32C of the whole file (8 hex digits); a `.safetensors` file also lists the CRC32C of
  each tensor's data span. Every writer goes through `atomic_dir` (training checkpoints, save_pretrained,
  merge, convert, init, MindIR export), so every checkpoint they write carries the manifest.
- `verify_checkpoint(path)`: what a load calls once before reading (resume, load_pretrained behind
  generate/eval/export, merge, convert, init, the MindIR runner). Each listed file is streamed once in
  `CHUNK`-sized reads into one reused buffer and its CRC32C compared with the manifest's; only when a file
  fails is it read a second time, span by span, to name the first tensor whose bytes changed. The
  per-file checksum keeps the normal path to one pass with no per-tensor bookkeeping, and it is the
  standard CRC32C of the file that other tools can check; the per-tensor values cost nothing on a load
  that passes and name the tensor on one that does not. A file listed but missing, or of another size,
  is named too. Files not in the manifest are ignored: side files may be added to a checkpoint later
  (`mindvl search-resolution --save` writes inference_config.json into it).
- A directory without a manifest (Hugging Face downloads, checkpoints written before checksums) loads
  as before, with one info line per directory; the safetensors headers are still checked against the
  file sizes (`io.verified_header`).
- `skip_verification()`: the `--no-verify` of the commands that load checkpoints, for trusted fast paths.

CRC32C rather than SHA-256: the manifest guards against bytes that rot on disk or in a copy, not against
a deliberate forgery, and CRC32C with the CPU's instruction runs several times faster than SHA-256 and
faster than zlib's CRC-32 (bench/bench_checksum.py; figures in docs/PERFORMANCE.md, ## checkpoint), so a
verified load stays bound by reading the files. The `crc32c` package accepts any buffer, so the
per-tensor spans are checksummed as slices of the read buffer without copies.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

import crc32c

from mindvl_ms.checkpoint.io import OPTIM, STATE, CheckpointError, verified_header, written_entry

log = logging.getLogger(__name__)

MANIFEST = "checksums.json"
FORMAT = "mindvl-checksums"
ALGORITHM = "crc32c"
CHUNK = 8 << 20  # bytes per streamed read
_READ_AHEAD = hasattr(os, "posix_fadvise")  # not on every platform
TRAINING_STATE = (OPTIM, STATE)  # what only resume reads: a model load verifies the rest
_state = {"verify": True}
_unverified_logged = set()  # directories without a manifest already reported


@contextlib.contextmanager
def skip_verification(skip: bool = True) -> Iterator[None]:
    """Within the block, loads do not verify checksums (`--no-verify`); headers are still checked."""
    before = _state["verify"]
    _state["verify"] = not skip and before
    try:
        yield
    finally:
        _state["verify"] = before


def _hex(value: int) -> str:
    return f"{value:08x}"


def _stream(path: str) -> Iterator[Tuple[int, memoryview]]:
    """(offset, chunk) over a file, read into one reused buffer: memory stays one CHUNK. The next chunk is
    requested from the kernel (WILLNEED) before this one is checksummed, so the disk reads it meanwhile."""
    buf = memoryview(bytearray(CHUNK))
    pos = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return
            if _READ_AHEAD:
                os.posix_fadvise(f.fileno(), pos + n, CHUNK, os.POSIX_FADV_WILLNEED)
            yield pos, buf[:n]
            pos += n


def file_checksum(path: str) -> Tuple[int, int]:
    """(CRC32C, bytes) of a whole file, streamed."""
    value, size = 0, 0
    for _, chunk in _stream(path):
        value = crc32c.crc32c(chunk, value)
        size += len(chunk)
    return value, size


def safetensors_checksums(path: str) -> Tuple[int, int, Dict[str, int]]:
    """(CRC32C of the file, bytes, {tensor: CRC32C of its data span}) in one streamed pass."""
    with open(path, "rb") as f:
        header, start = verified_header(path, f)
    spans = sorted((start + info["data_offsets"][0], start + info["data_offsets"][1], name)
                   for name, info in header.items())
    tensors = {name: 0 for _, _, name in spans}
    value, size, i = 0, 0, 0
    for pos, chunk in _stream(path):
        value = crc32c.crc32c(chunk, value)
        end = pos + len(chunk)
        size = end
        while i < len(spans) and spans[i][0] < end:
            a, b, name = spans[i]
            lo, hi = max(a, pos), min(b, end)
            if hi > lo:
                tensors[name] = crc32c.crc32c(chunk[lo - pos:hi - pos], tensors[name])
            if b > end:
                break
            i += 1
    return value, size, tensors


def file_entry(path: str) -> dict:
    """The manifest entry of one file (see the module doc); a safetensors file streamed by this process
    (`io.write_stream`) comes with the checksums computed while it was written, so it is not read again."""
    if path.endswith(".safetensors"):
        known = written_entry(path)
        if known is not None:
            return known
        value, size, tensors = safetensors_checksums(path)
        return {"bytes": size, "checksum": _hex(value), "tensors": {k: _hex(v) for k, v in tensors.items()}}
    value, size = file_checksum(path)
    return {"bytes": size, "checksum": _hex(value)}


def _listing(directory: str) -> List[str]:
    """Every file under `directory` but the manifest, as sorted '/'-separated relative paths."""
    out = []
    for root, _, files in os.walk(directory):
        for fn in files:
            rel = os.path.relpath(os.path.join(root, fn), directory).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(directory: str) -> dict:
    """Write `directory`/checksums.json covering every file in it; returns the manifest."""
    manifest = {"format": FORMAT, "version": 1, "algorithm": ALGORITHM,
                "files": {rel: file_entry(os.path.join(directory, rel)) for rel in _listing(directory)}}
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def read_manifest(directory: str) -> Optional[dict]:
    """The directory's manifest, None when it has none; an unreadable one is a CheckpointError."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        algorithm = manifest["algorithm"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable checksum manifest ({type(e).__name__}: {e}); re-copy the "
                              f"checkpoint, or pass --no-verify to load it unverified") from None
    if algorithm != ALGORITHM or not isinstance(files, dict):
        raise CheckpointError(f"{path}: checksum algorithm {algorithm!r}, this version verifies {ALGORITHM!r}")
    return manifest


def verify_checkpoint(path: str, model_only: bool = True) -> Optional[dict]:
    """Verify a checkpoint directory (or one file of one) against its manifest; raise a CheckpointError
    naming the file and tensor that fail. `model_only` skips the training state (optimizer,
    trainer_state.json), which only resume reads. Returns the manifest, None when there is none or
    verification is skipped."""
    if not _state["verify"]:
        return None
    directory, only = (path, None) if os.path.isdir(path) else os.path.split(os.path.abspath(path))
    manifest = read_manifest(directory)
    if manifest is None:
        key = os.path.abspath(directory)
        if key not in _unverified_logged:
            _unverified_logged.add(key)
            log.info("%s: no %s (written by another tool or before checksums); loading it unverified",
                     directory, MANIFEST)
        return None
    for rel, entry in manifest["files"].items():
        if only is not None and rel != only:
            continue
        if model_only and rel in TRAINING_STATE:
            continue
        check_file(os.path.join(directory, *rel.split("/")), entry)
    return manifest


def verify_except_tensors(path: str) -> Optional[dict]:
    """What a streamed copy (`hf.convert`) verifies before it starts: every listed file but the
    safetensors files' tensor bytes, which the copy checks against the manifest's per-tensor CRC32C as it
    reads them (`io.FileSpan.crc32c`), so the input is read once. The safetensors files must exist with
    their recorded size. Returns the manifest (None: none, or verification skipped)."""
    if not _state["verify"] or not os.path.isdir(path):
        return verify_checkpoint(path)
    manifest = read_manifest(path)
    if manifest is None:
        return verify_checkpoint(path)  # logs the unverified directory once
    for rel, entry in manifest["files"].items():
        if rel in TRAINING_STATE:
            continue
        full = os.path.join(path, *rel.split("/"))
        if rel.endswith(".safetensors") and "tensors" in entry:
            if not os.path.isfile(full) or os.path.getsize(full) != entry["bytes"]:
                check_file(full, entry)  # names the missing or truncated file
            continue
        check_file(full, entry)
    return manifest


def tensor_checksums(path: str, manifest: Optional[dict]) -> Dict[str, Dict[str, str]]:
    """{absolute file path: {tensor: CRC32C hex}} of the safetensors files a manifest lists."""
    if manifest is None:
        return {}
    return {os.path.abspath(os.path.join(path, *rel.split("/"))): entry["tensors"]
            for rel, entry in manifest["files"].items() if "tensors" in entry}


def check_file(path: str, entry: dict) -> None:
    """Compare one file with its manifest entry (a CheckpointError naming the file, and the first tensor
    that differs when the file is a safetensors file)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: listed in {MANIFEST} but missing (an incomplete copy?); re-copy the "
                              f"checkpoint")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        if path.endswith(".safetensors") and size < entry["bytes"]:
            with open(path, "rb") as f:
                verified_header(path, f)  # names the tensor a truncation cut
        raise CheckpointError(f"{path}: {size:,} bytes, {MANIFEST} records {entry['bytes']:,} (truncated or "
                              f"changed after it was written); re-copy or re-save the checkpoint")
    value, _ = file_checksum(path)
    if _hex(value) != entry["checksum"]:
        raise CheckpointError(_mismatch(path, entry, value))


def _mismatch(path: str, entry: dict, value: int) -> str:
    """The message for a file whose checksum differs: the first tensor whose span differs, if any."""
    fix = ("the bytes changed after it was written (disk or copy corruption); re-copy or re-save the "
           "checkpoint, or pass --no-verify to load it anyway")
    if "tensors" in entry:
        _, _, tensors = safetensors_checksums(path)  # a header that no longer parses is named here
        for name, want in entry["tensors"].items():
            got = tensors.get(name)
            if got is None:
                return f"{path}: tensor '{name}' listed in {MANIFEST} is no longer in the file's header; {fix}"
            if _hex(got) != want:
                return f"{path}: tensor '{name}' fails its checksum ({ALGORITHM} {_hex(got)}, {MANIFEST} " \
                       f"records {want}): {fix}"
        return f"{path}: fails its checksum outside the tensor data (the header); {fix}"
    return f"{path}: fails its checksum ({ALGORITHM} {_hex(value)}, {MANIFEST} records {entry['checksum']}): {fix}"


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yield a temporary directory next to `path`; on success write its manifest and replace `path` with it
    (rename)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
    try:
        yield tmp
        write_manifest(tmp)
        for root, _, files in os.walk(tmp):  # flush file contents before the rename makes them visible
            for fn in files:
                with open(os.path.join(root, fn), "rb") as f:
                    os.fsync(f.fileno())
        if os.path.isdir(path):
            old = tmp + ".old"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
