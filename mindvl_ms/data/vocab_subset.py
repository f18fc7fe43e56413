"""A model vocabulary that is a subset of the tokenizer's: only the token ids some data uses.

A tokenizer directory may hold, next to its tokenizer files, `vocab_subset.json`:
    {"base_vocab_size": 151669, "ids": [198, 271, ..., 151653, 151655, 151656]}
`load_tokenizer(dir)` then returns a `data.tokenizer.SubsetTokenizer`: text is tokenized exactly as by the
full tokenizer, and id `ids[k]` becomes model id `k` (decoding maps back). A model trained over it has
`len(ids)` embedding rows, which is what the subset is for: for a tiny model whose data uses a small fraction
of the vocabulary (the demo), the LM head and embedding over Qwen3's full vocabulary are a large share of
a CPU train step (figures in docs/PERFORMANCE.md, `## data`). Training over the subset is training with every other token's logit masked
out. This module writes such a directory (`subset_ids`, `write_subset`) and makes a model config match
it: `restrict_model_config` sets the model's vocab size and special token ids, `follow_vocab_subset`
does so for a run config whose `data.tokenizer` holds a subset (called where a run is prepared: the
trainer and the demo). The subset file travels with the tokenizer files into every checkpoint
(`data.processor_files`), so `mindvl generate/eval` on such a checkpoint map ids the same way.

Text that needs a token outside the subset is an error naming the token, not a silent substitute.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterable, List, Sequence

from mindvl_ms.data.processor import render
from mindvl_ms.data.processor_files import tokenizer_source_files
from mindvl_ms.data.tokenizer import SUBSET_FILE, SubsetTokenizer, TextTokenizer, load_tokenizer
from mindvl_ms.data.tokens import CHAT_TOKENS, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START


def subset_ids(processor, samples: Iterable, prompts: Iterable = ()) -> List[int]:
    """Sorted base-tokenizer ids of `samples` (data.schema.Sample) as `processor` renders them (chat
    template, generation prompt, vision tags), of `prompts` (message lists ending with the user turn, as an
    evaluation feeds them: `eval.items.EvalItem.messages`, never their answers) as generation renders
    them, plus the processor's special tokens."""
    tok = processor.tokenizer
    if isinstance(tok, SubsetTokenizer):
        raise ValueError("subset_ids needs a processor over the full tokenizer")
    ids = {tok.token_to_id(t) for t in CHAT_TOKENS}
    sp = processor.config.system_prompt
    for s in samples:
        ids.update(tok.encode(render(s.messages, sp, add_generation_prompt=False)[0]))
        ids.update(tok.encode(render(s.messages[:-1], sp, add_generation_prompt=True)[0]))
    for msgs in prompts:
        ids.update(tok.encode(render(msgs, sp, add_generation_prompt=True)[0]))
    return sorted(ids)


def write_subset(out_dir: str, base: TextTokenizer, ids: Sequence[int]) -> str:
    """A tokenizer directory: `base`'s tokenizer files plus vocab_subset.json; returns it."""
    os.makedirs(out_dir, exist_ok=True)
    for src in tokenizer_source_files(base.source):
        shutil.copyfile(src, os.path.join(out_dir, os.path.basename(src)))
    with open(os.path.join(out_dir, SUBSET_FILE), "w", encoding="utf-8") as f:
        json.dump({"base_vocab_size": base.vocab_size, "ids": [int(i) for i in sorted(set(ids))]}, f)
    return out_dir


def restrict_model_config(model_cfg, tokenizer: TextTokenizer) -> None:
    """Model vocab size and special token ids as `tokenizer` numbers them (in place)."""
    model_cfg.text.vocab_size = tokenizer.vocab_size
    for field, token in (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
                         ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END)):
        setattr(model_cfg, field, tokenizer.token_to_id(token))
    model_cfg.validate()


def follow_vocab_subset(run_cfg) -> None:
    """A run config's `data.tokenizer` directory holding vocab_subset.json numbers its tokens 0..V-1: the
    model's vocab size and special token ids are set from it (in place), since a YAML cannot know them (the
    subset is written per dataset, e.g. by `mindvl demo`). Nothing changes without a subset."""
    tok = run_cfg.data.tokenizer
    if tok and os.path.isfile(os.path.join(tok, SUBSET_FILE)):
        restrict_model_config(run_cfg.model, load_tokenizer(tok))
