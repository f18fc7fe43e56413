"""`mindvl convert hf2ms|ms2hf SRC DST` and `mindvl init --vision-from --llm-from --out`."""
import argparse


def _convert(args) -> int:
    from .hf import convert

    stats = convert(args.src, args.dst, to="native" if args.direction == "hf2ms" else "hf",
                    max_shard_bytes=int(args.max_shard_mb * 2 ** 20) if args.max_shard_mb else None)
    print(f"wrote {args.dst}: {stats['tensors']} tensors, {stats['parameters']:,} parameters")
    return 0


def _init(args) -> int:
    from .hf import init_from_pretrained

    cfg = init_from_pretrained(args.vision_from, args.llm_from, args.out, seed=args.seed)
    print(f"wrote {args.out}: vision depth {cfg.vision.depth} (from {args.vision_from}), "
          f"{cfg.text.model_type} LLM with {cfg.text.num_hidden_layers} layers (from {args.llm_from}), "
          f"projector randomly initialised (seed {args.seed})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert checkpoints between Hugging Face and native layouts",
                       description="Convert a checkpoint directory. hf2ms: a Hugging Face Qwen2.5-VL directory "
                                   "(config.json + safetensors, sharded index too) -> native mindvl-ms checkpoint; "
                                   "ms2hf: native -> Hugging Face layout loadable by transformers. Tensors are "
                                   "copied bit-exactly (the Conv3d patch embedding is reshaped).")
    p.add_argument("direction", choices=["hf2ms", "ms2hf"], help="conversion direction")
    p.add_argument("src", help="source checkpoint directory")
    p.add_argument("dst", help="output directory (written atomically)")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="split the weights into shards of at most this many MiB (with an index file)")
    p.set_defaults(func=_convert)

    q = sub.add_parser("init", help="build the MindVL initialisation from a ViT and an LLM checkpoint",
                       description="MindVL initialisation (paper section 5.1): vision encoder from a Qwen2.5-VL "
                                   "checkpoint, language model from a Qwen3 (or Qwen2 / DeepSeek-V3) checkpoint, "
                                   "MLP projector initialised randomly. Writes a native checkpoint.")
    q.add_argument("--vision-from", required=True, help="Qwen2.5-VL checkpoint directory (HF or native)")
    q.add_argument("--llm-from", required=True, help="language model checkpoint directory (HF Qwen3/Qwen2/DeepSeek-V3)")
    q.add_argument("--out", required=True, help="output native checkpoint directory")
    q.add_argument("--seed", type=int, default=0, help="seed of the projector's random init (default 0)")
    q.set_defaults(func=_init)
