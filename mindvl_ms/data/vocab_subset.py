"""A model vocabulary that is a subset of the tokenizer's: only the token ids some data uses.

A tokenizer directory may hold, next to its tokenizer files, `vocab_subset.json`:
    {"base_vocab_size": 151669, "ids": [198, 271, ..., 151653, 151655, 151656]}
`load_tokenizer(dir)` then returns a `SubsetTokenizer`: text is tokenized exactly as by the full
tokenizer, and id `ids[k]` becomes model id `k` (decoding maps back). A model trained over it has
`len(ids)` embedding rows, which is what the subset is for: the tiny demo model's LM head and
embedding over Qwen3's 151,936 rows cost ~40% of its CPU train step while its data uses ~100 ids.
Training over the subset is training with every other token's logit masked out; `restrict_model_config`
sets the model's vocab size and special token ids to match. The subset file travels with the tokenizer
files into every checkpoint (`data.processor_files`), so `mindvl generate/eval` on such a
checkpoint map ids the same way.

Text that needs a token outside the subset is an error naming the token, not a silent substitute.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterable, List, Sequence, Tuple

import numpy as np

from mindvl_ms.data.tokenizer import TextTokenizer

SUBSET_FILE = "vocab_subset.json"


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


def subset_ids(processor, samples: Iterable, prompts: Iterable = ()) -> List[int]:
    """Sorted base-tokenizer ids of `samples` (data.schema.Sample) as `processor` renders them (chat
    template, generation prompt, vision tags), of `prompts` (message lists ending with the user turn, as an
    evaluation feeds them: `eval.benchmark.EvalItem.messages`, never their answers) as generation renders
    them, plus the processor's special tokens."""
    from mindvl_ms.data.processor import IM_END, IM_START, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, render

    tok = processor.tokenizer
    if isinstance(tok, SubsetTokenizer):
        raise ValueError("subset_ids needs a processor over the full tokenizer")
    ids = {tok.token_to_id(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END, IM_START, IM_END)}
    sp = processor.config.system_prompt
    for s in samples:
        ids.update(tok.encode(render(s.messages, sp, add_generation_prompt=False)[0]))
        ids.update(tok.encode(render(s.messages[:-1], sp, add_generation_prompt=True)[0]))
    for msgs in prompts:
        ids.update(tok.encode(render(msgs, sp, add_generation_prompt=True)[0]))
    return sorted(ids)


def write_subset(out_dir: str, base: TextTokenizer, ids: Sequence[int]) -> str:
    """A tokenizer directory: `base`'s tokenizer files plus vocab_subset.json; returns it."""
    from mindvl_ms.data.processor_files import tokenizer_source_files

    os.makedirs(out_dir, exist_ok=True)
    for src in tokenizer_source_files(base.source):
        shutil.copyfile(src, os.path.join(out_dir, os.path.basename(src)))
    with open(os.path.join(out_dir, SUBSET_FILE), "w", encoding="utf-8") as f:
        json.dump({"base_vocab_size": base.vocab_size, "ids": [int(i) for i in sorted(set(ids))]}, f)
    return out_dir


def restrict_model_config(model_cfg, tokenizer: TextTokenizer) -> None:
    """Model vocab size and special token ids as `tokenizer` numbers them (in place)."""
    from mindvl_ms.data.processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

    model_cfg.text.vocab_size = tokenizer.vocab_size
    for field, token in (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
                         ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END)):
        setattr(model_cfg, field, tokenizer.token_to_id(token))
    model_cfg.validate()
