"""`jdeep chat`: an interactive chat on stdin/stdout in the model's own chat format (io/chat); replies stream
as they are generated, the reasoning of thinking mode shown apart from the answer and kept out of the history
as DeepSeek's encoder drops it. Images (`--image PATH`, `/image PATH`) go into the next user message as image
parts (DeepSeek-V4.1 with a vision tower)."""

from __future__ import annotations

import argparse
import sys

from .. import generate, load
from ..io.chat import ReplyParser, chat_format_for, encode_chat
from ..vision.processor import ImageError, open_image
from .args import folder_tokenizer, load_kwargs, sampling_params

__all__ = ["cmd_chat"]


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat on stdin/stdout: each reply streams as it is generated (whole UTF-8 characters)."""
    tok = folder_tokenizer(args.model)
    if tok is None:
        raise SystemExit(f"jdeep chat: {args.model} has no tokenizer.json")
    model = load(args.model, **load_kwargs(args, progress=True, mtp=args.speculative_config is not None))
    fmt = chat_format_for(model.config.model_type, args.chat_format)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.image and model.vision is None:
        raise SystemExit(f"jdeep chat: {args.model} has no vision tower (its config.json has no vision_config)")
    pending = [_image(p) for p in args.image]      # for the next user message
    images: list = []                              # every image of the conversation, in prompt order
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        if line.startswith("/image "):
            try:
                if model.vision is None:
                    raise ImageError("this model has no vision tower")
                pending.append(open_image(line[len("/image "):].strip()))
            except ImageError as e:
                print(f"[image not attached: {e}]", flush=True)
            continue
        text_part = {"type": "text", "text": line.rstrip("\n")}
        parts = [{"type": "image_url", "image_url": {"url": "(attached)"}} for _ in pending]
        messages.append({"role": "user", "content": parts + [text_part] if parts else text_part["text"]})
        images += pending
        pending = []
        detok = tok.detokenizer(skip_special_tokens=False)
        parser = ReplyParser(fmt, args.thinking)
        reply = {"reasoning": "", "content": ""}
        shown = [None]

        def show(events) -> None:
            for ev in events:
                if ev[0] in reply:
                    if shown[0] != ev[0]:
                        print("\n[thinking] " if ev[0] == "reasoning" else ("\n" if shown[0] else ""), end="")
                        shown[0] = ev[0]
                    reply[ev[0]] += ev[1]
                    print(ev[1], end="", flush=True)

        prompt = ({"text": encode_chat(fmt, messages, thinking=args.thinking), "images": images} if images
                  else tok.chat(messages, thinking=args.thinking, fmt=fmt))
        generate(model, [prompt], sampling=sampling_params(args),
                       stream=lambda new: show(parser.push(detok.push(new[0]))), stream_every=4,
                       speculative=args.speculative_config)
        show(parser.push(detok.flush()) + parser.finish())
        print(flush=True)
        messages.append({"role": "assistant", "content": reply["content"], "reasoning_content": reply["reasoning"]})


def _image(path: str):
    """The image at `path`, decoded now (a bad file is reported before the model runs)."""
    try:
        return open_image(path)
    except ImageError as e:
        raise SystemExit(f"jdeep chat: {e}") from None
