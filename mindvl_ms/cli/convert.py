"""`mindvl convert hf2ms|ms2hf SRC DST` and `mindvl init --vision-from --llm-from --out`.

Both write the processor next to the weights (data/processor_files.py), inside the output's atomic
directory so that its checksums.json covers them: convert carries the source's (tokenizer, pixel limits,
system prompt; the defaults when it has none); init takes the LLM's tokenizer and the vision
checkpoint's pixel limits. A text-only LLM conversion copies the tokenizer files only. Both verify their
inputs' checksums first (`--no-verify` skips that).
"""
import os
import shutil


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert checkpoints between Hugging Face and native layouts",
        description="Convert a checkpoint directory. hf2ms: a Hugging Face Qwen2.5-VL directory "
                    "(config.json + safetensors, sharded index too) -> native mindvl-ms checkpoint; "
                    "ms2hf: native -> Hugging Face layout loadable by transformers. Tensors are "
                    "copied bit-exactly (the Conv3d patch embedding is reshaped).")
    p.add_argument("direction", choices=["hf2ms", "ms2hf"], help="conversion direction")
    p.add_argument("src", help="source checkpoint directory")
    p.add_argument("dst", help="output directory (written atomically)")
    p.add_argument("--max-shard-mb", type=float, default=2048,
                   help="write the weights in shards of at most this many MiB with a Hugging Face index "
                        "(default 2048; 0: one file). Tensors are streamed one at a time, so memory stays "
                        "far below one shard")
    p.add_argument("--no-verify", action="store_true",
                   help="do not verify the checkpoints' checksums.json (trusted fast paths; the "
                        "safetensors headers are still checked)")
    p.set_defaults(func=_run_convert)

    q = subparsers.add_parser(
        "init", help="build the MindVL initialisation from a ViT and an LLM checkpoint",
        description="MindVL initialisation (paper section 5.1): vision encoder from a Qwen2.5-VL "
                    "checkpoint, language model from a Qwen3 (or Qwen2 / DeepSeek-V3) checkpoint, "
                    "MLP projector initialised randomly. Writes a native checkpoint.")
    q.add_argument("--vision-from", required=True, help="Qwen2.5-VL checkpoint directory (HF or native)")
    q.add_argument("--llm-from", required=True, help="language model checkpoint directory (HF Qwen3/Qwen2/DeepSeek-V3)")
    q.add_argument("--out", required=True, help="output native checkpoint directory")
    q.add_argument("--seed", type=int, default=0, help="seed of the projector's random init (default 0)")
    q.add_argument("--no-verify", action="store_true",
                   help="do not verify the checkpoints' checksums.json (trusted fast paths; the "
                        "safetensors headers are still checked)")
    q.set_defaults(func=_run_init)


def _run_convert(args) -> int:
    from mindvl_ms.checkpoint.hf import convert
    from mindvl_ms.checkpoint.integrity import skip_verification

    if args.direction == "ms2hf" and os.path.isfile(os.path.join(args.src, "vocab_subset.json")):
        raise SystemExit(f"{args.src}: the model's vocabulary is a subset of its tokenizer's (vocab_subset.json, "
                         f"data/vocab_subset.py); transformers would read the full tokenizer's ids, so there is "
                         f"no Hugging Face layout for it (train with the full vocabulary to export)")
    files = []
    with skip_verification(args.no_verify):
        stats = convert(args.src, args.dst, to="native" if args.direction == "hf2ms" else "hf",
                        max_shard_bytes=int(args.max_shard_mb * 2 ** 20) or None,
                        extra=lambda tmp: files.extend(write_processor(tmp, args.src)))
    print(f"wrote {args.dst}: {stats['tensors']} tensors, {stats['parameters']:,} parameters"
          + (f"; processor files {', '.join(files)}" if files else ""))
    return 0


def _run_init(args) -> int:
    from mindvl_ms.checkpoint.integrity import skip_verification
    from mindvl_ms.checkpoint.pretrained import init_from_pretrained
    from mindvl_ms.models.mindvl import MindVLModel

    files = []
    with skip_verification(args.no_verify):
        cfg = init_from_pretrained(MindVLModel, args.vision_from, args.llm_from, args.out, seed=args.seed,
                                   extra=lambda tmp: files.extend(_init_processor(tmp, args.vision_from,
                                                                                  args.llm_from)))
    print(f"wrote {args.out}: vision depth {cfg.vision.depth} (from {args.vision_from}), "
          f"{cfg.text.model_type} LLM with {cfg.text.num_hidden_layers} layers (from {args.llm_from}), "
          f"projector randomly initialised (seed {args.seed}); processor files {', '.join(files)}")
    return 0


def write_processor(dst: str, *sources: str):
    """The processor files of a converted/initialised checkpoint (see the module docstring)."""
    from mindvl_ms.checkpoint.hf import is_text_only, read_config_json
    from mindvl_ms.data.processor import carry_processor
    from mindvl_ms.data.processor_files import tokenizer_source_files

    if is_text_only(read_config_json(dst)):
        copied = []
        for src in sources:
            for f in tokenizer_source_files(src):
                shutil.copyfile(f, os.path.join(dst, os.path.basename(f)))
                copied.append(os.path.basename(f))
        return copied
    return carry_processor(dst, *sources)


def _init_processor(out: str, vision_from: str, llm_from: str):
    """init: the LLM's tokenizer (the model's vocabulary), the vision checkpoint's pixel limits; the vision
    checkpoint's whole processor when the LLM's tokenizer lacks the chat/vision special tokens."""
    from mindvl_ms.data.processor import processor_of, save_processor
    from mindvl_ms.data.processor_files import has_tokenizer, read_image_config

    try:
        proc = processor_of(llm_from if has_tokenizer(llm_from) else None)
    except ValueError as e:
        print(f"note: {llm_from}'s tokenizer cannot serve MindVL ({e}); using {vision_from}'s processor")
        proc = processor_of(vision_from)
    proc.config.image = read_image_config(vision_from)
    return save_processor(out, proc)
