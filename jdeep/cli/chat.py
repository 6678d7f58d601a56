"""`jdeep chat`: an interactive chat on stdin/stdout in the model's own chat format (io/chat); replies stream
as they are generated, the reasoning of thinking mode shown apart from the answer and kept out of the history
as DeepSeek's encoder drops it."""

from __future__ import annotations

import argparse
import sys

from .. import generate, load
from ..io.chat import ReplyParser, chat_format_for
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
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
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

        generate(model, [tok.chat(messages, thinking=args.thinking, fmt=fmt)], sampling=sampling_params(args),
                       stream=lambda new: show(parser.push(detok.push(new[0]))), stream_every=4,
                       speculative=args.speculative_config)
        show(parser.push(detok.flush()) + parser.finish())
        print(flush=True)
        messages.append({"role": "assistant", "content": reply["content"], "reasoning_content": reply["reasoning"]})
