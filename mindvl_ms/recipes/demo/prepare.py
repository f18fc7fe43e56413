"""The demo's data phase: write the datasets its `demo:` section asks for (`datasets.write_demo_data`)
and, with `demo.vocab: data`, give the model only the token ids they use (`data.vocab_subset`)."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List

from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import SampleError, iter_jsonl
from mindvl_ms.data.vocab_subset import follow_vocab_subset, subset_ids, write_subset
from mindvl_ms.eval.benchmark import load_benchmark
from mindvl_ms.recipes.demo.datasets import write_demo_data


log = logging.getLogger(__name__)


def write_data(demo: Dict[str, Any], data_dir: str, seed: int, progress: bool = True) -> Dict[str, Any]:
    """The demo's datasets as the `demo:` section sets them: `data_sizes` {task: [train, held-out]} and
    `vqa_mix` {question type: weight} of the easy-VQA train split (null: the package's own mix), and
    `vqa_balance_yes_no` (its yes/no questions equally over negated/plain wording x yes/no answer) and
    `vqa_question_first` (each easy-VQA question before its image instead of after it), and `vqa_describe`
    (each easy-VQA train answer describes the image first: "a blue rectangle. red: absent. yes")."""
    sizes = {k: tuple(v) for k, v in (demo.get("data_sizes") or {}).items()}
    return write_demo_data(data_dir, seed=seed, sizes=sizes, progress=progress, vqa_mix=demo.get("vqa_mix"),
                           vqa_balance_yes_no=bool(demo.get("vqa_balance_yes_no", False)),
                           vqa_question_first=bool(demo.get("vqa_question_first", False)),
                           vqa_describe=bool(demo.get("vqa_describe", False)))


def restrict_vocab(run_cfg, demo: Dict[str, Any], data_dir: str, heldout: List[str]) -> Dict[str, Any]:
    """`demo.vocab`: "full" keeps the tokenizer's whole vocabulary; "data" gives the model only the token
    ids the train sources use, plus those of the `heldout` benchmarks' prompts as `mindvl eval` reads them
    (inputs only, never their answers: an input token no train line has gets an untrained row, as it would
    in the full vocabulary); see `data.vocab_subset`. A tokenizer directory OUT/data/tokenizer with
    vocab_subset.json becomes `data.tokenizer`, and the model's vocab size and special ids follow it."""
    mode = demo.get("vocab", "full")
    if mode not in ("full", "data"):
        raise ValueError(f"demo.vocab {mode!r}: expected 'full' (the tokenizer's vocabulary) or 'data' (the ids the "
                         f"train sources use)")
    full = run_cfg.model.text.vocab_size
    if mode == "full":
        return {"mode": mode, "size": full}
    proc = MindVLProcessor(config=run_cfg.data)
    paths = [s.path for s in run_cfg.data.sources] + [src["path"] for st in run_cfg.stages
                                                      for src in (st.data or {}).get("sources", [])]

    def read(files):
        out = []
        for p in dict.fromkeys(files):
            for _, s in iter_jsonl(p):
                if isinstance(s, SampleError):  # demo data is generated, so a bad line is a bug: stop loudly
                    raise ValueError(str(s))
                out.append(s)
        return out
    # the held-out prompts as `mindvl eval` feeds them (task/metric are benchmark fields there)
    prompts = [it.messages for p in dict.fromkeys(heldout) for it in load_benchmark(p)]
    run_cfg.data.tokenizer = write_subset(os.path.join(data_dir, "tokenizer"), proc.tokenizer,
                                          subset_ids(proc, read(paths), prompts=prompts))
    follow_vocab_subset(run_cfg)
    log.info("demo.vocab data: the model's vocabulary is the %d token ids the train data uses (of %d)",
             run_cfg.model.text.vocab_size, full)
    return {"mode": mode, "size": run_cfg.model.text.vocab_size, "of": full}
