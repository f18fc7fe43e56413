"""`mindvl generate`, `mindvl chat` and `mindvl export`.

    mindvl generate --ckpt DIR --image cat.png --prompt "What is in the picture?"
    mindvl chat --ckpt DIR          # /image PATH attaches an image to your next message; /reset; /exit
    mindvl export --ckpt DIR --out DIR [--fp16]

The checkpoint's processor files (tokenizer, preprocessor_config.json with the pixel limits,
chat_template.json with the training system prompt) format the prompt as in training; --min-pixels and
--max-pixels override the limits. Answers stream to the terminal token by token, grounding tags
included (--show-special-tokens prints every special token). Errors a user can fix (missing checkpoint, unreadable
image, prompt longer than the context) are one clear line; in `chat` they do not end the session.
MindSpore is imported inside the handlers so `mindvl --help` stays fast.
"""
import argparse
import sys


HELP_SAMPLING = "greedy decoding unless --do-sample"


def register(subparsers) -> None:
    g = subparsers.add_parser(
        "generate", help="answer one prompt (optionally about images and videos)",
        description="Generate one answer with the KV-cache graphs. Images are resized with "
                    "smart_resize and enter the vision graph as uint8; videos are decoded with "
                    "PyAV and sampled as in training (the checkpoint's data.video settings: fps, "
                    "frame budget). " + HELP_SAMPLING + ".",
        epilog="examples:\n  mindvl generate --ckpt ckpt/sft --image cat.png --prompt 'Describe it.'"
               "\n  mindvl generate --ckpt ckpt/sft --video clip.mp4 --prompt 'What happens?'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_sampling(g)
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="image file (repeatable); an <image> placeholder is added per image unless the "
                        "prompt already holds them")
    g.add_argument("--video", action="append", default=[], metavar="FILE",
                   help="video file (repeatable); a <video> placeholder is added per video unless the prompt "
                        "already holds them")
    g.add_argument("--prompt", required=True, help="the user message")
    g.set_defaults(func=_run_generate)

    c = subparsers.add_parser(
        "chat", help="interactive multi-turn chat with images",
        description="Interactive chat. Type a message and press Enter. Commands: /image PATH "
                    "(attach an image to the next message), /reset (forget the history), /exit. "
                    "Image features are computed once per image and reused in later turns. "
                    + HELP_SAMPLING + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_sampling(c)
    c.set_defaults(func=_run_chat)

    e = subparsers.add_parser(
        "export", help="export MindIR graphs (vision, prefill, decode) for deployment",
        description="Write OUT/vision.mindir, prefill.mindir, decode.mindir (dynamic shapes; the "
                    "decode graph takes and returns the KV cache) and OUT/export.json with shapes, "
                    "dtypes, token ids and preprocessing. Run them with "
                    "mindvl_ms.infer.mindir_runner.ExportedRunner (MindSpore Lite when installed, else "
                    "mindspore GraphCell).")
    e.add_argument("--ckpt", required=True, help="checkpoint directory (native or Hugging Face layout)")
    e.add_argument("--out", required=True, help="output directory (written atomically)")
    e.add_argument("--fp16", action="store_true", help="export float16 weights and KV cache (logits stay float32)")
    e.add_argument("--no-verify", action="store_true",
                   help="do not verify the checkpoints' checksums.json (trusted fast paths; the "
                        "safetensors headers are still checked)")
    e.set_defaults(func=_run_export)


def _run_generate(args) -> int:
    from mindvl_ms.infer.generate import open_image

    from mindvl_ms.data.video import probe_video

    images = [open_image(p) for p in args.image]  # fail on a bad image or video before loading the model
    for v in args.video:
        probe_video(v)
    session = _Session(args)
    session.answer([{"role": "user", "content": _with_placeholders(args.prompt, len(images), len(args.video))}],
                   images, args.video)
    return 0


def _run_chat(args) -> int:
    from mindvl_ms.infer.generate import open_image

    session = _Session(args)
    messages, images, pending = [], [], []
    print("mindvl chat: /image PATH attaches an image, /reset clears the history, /exit quits.")
    while True:
        try:
            line = input(">>> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages, images, pending = [], [], []
            print("(history cleared)")
            continue
        try:
            if line.startswith("/image"):
                path = line[len("/image"):].strip()
                pending.append(open_image(path))
                print(f"(image attached: {path})")
                continue
            msg = {"role": "user", "content": _with_placeholders(line, len(pending))}
            reply = session.answer(messages + [msg], images + pending)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        messages += [msg, {"role": "assistant", "content": reply}]
        images += pending
        pending = []


def _run_export(args) -> int:
    from mindvl_ms.checkpoint.integrity import skip_verification
    from mindvl_ms.infer.export import export
    from mindvl_ms.infer.generate import use_graph_mode
    from mindvl_ms.ops.process import freeze_imported_objects

    freeze_imported_objects()
    use_graph_mode()
    with skip_verification(args.no_verify):
        meta = export(args.ckpt, args.out, fp16=args.fp16)
    for name, g in meta["graphs"].items():
        print(f"{args.out}/{g['file']}: {g['bytes'] / 2 ** 20:.2f} MiB")
    print(f"{args.out}/export.json ({meta['dtype']}, total {meta['total_bytes'] / 2 ** 20:.2f} MiB)")
    return 0


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="checkpoint directory (native or Hugging Face Qwen2.5-VL layout)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated at most (default 128)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1.0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalise tokens already present (1.0: off; 1.1 is a common choice)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop once the answer contains TEXT (repeatable); <|im_end|> always stops")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--fp16", action="store_true", help="run with float16 weights")
    p.add_argument("--no-verify", action="store_true",
                   help="do not verify the checkpoints' checksums.json (trusted fast paths; the "
                        "safetensors headers are still checked)")
    p.add_argument("--min-pixels", type=int, default=None,
                   help="smallest resized image area (default: the checkpoint's preprocessor_config.json, else 3136)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="largest resized image area (default: the checkpoint's preprocessor_config.json, else 1003520)")
    p.add_argument("--show-special-tokens", action="store_true",
                   help="print every special token (by default only the grounding tags such as "
                        "<|box_start|>...<|box_end|> are printed)")


class _Session:
    """Model, processor and sampling options shared by generate and chat."""

    def __init__(self, args):
        from mindvl_ms.checkpoint.integrity import skip_verification
        from mindvl_ms.infer.generate import load_model, load_processor, use_graph_mode
        from mindvl_ms.ops.process import freeze_imported_objects

        freeze_imported_objects()
        use_graph_mode()
        with skip_verification(args.no_verify):
            self.model = load_model(args.ckpt, args.fp16)
        self.proc = load_processor(args.ckpt, self.model.config)
        if args.min_pixels is not None:
            self.proc.image_config.min_pixels = args.min_pixels
        if args.max_pixels is not None:
            self.proc.image_config.max_pixels = args.max_pixels
        self.proc.image_config.validate()
        self.args = args

    def answer(self, messages, images, videos=()) -> str:
        from mindvl_ms.infer.generate import decode_answer, encode_chat, generate, stop_token_ids

        a = self.args
        show = getattr(a, "show_special_tokens", False)
        sample = encode_chat(self.proc, messages, images, videos=videos)
        shown, ids = "", []

        def on_token(_row, tok):
            nonlocal shown
            ids.append(tok)
            text = decode_answer(self.proc, ids, show)
            if text.startswith(shown):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
            shown = text

        generate(self.model, [sample], a.max_new_tokens, decode=self.proc.decode, on_token=on_token,
                 do_sample=a.do_sample, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                 repetition_penalty=a.repetition_penalty, eos_token_ids=stop_token_ids(self.proc),
                 stop_strings=tuple(a.stop), seed=a.seed)
        sys.stdout.write("\n")
        text = decode_answer(self.proc, ids, show)
        for s in a.stop:
            text = text.split(s)[0]
        return text.strip()


def _with_placeholders(prompt: str, n_images: int, n_videos: int = 0) -> str:
    for tag, n in (("<image>", n_images), ("<video>", n_videos)):
        have = prompt.count(tag)
        if have not in (0, n):
            raise ValueError(f"the prompt has {have} {tag} placeholders but {n} {tag[1:-1]}s were given")
        if not have:
            prompt = f"{tag}\n" * n + prompt
    return prompt
