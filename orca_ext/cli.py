"""``orca-generate``: offline generation from the command line (the ``LLM.generate`` API).

    orca-generate [--model smollm2-135m-instruct] [--prompt TEXT ...] [--max-tokens 64]
                  [--temperature 0] [--top-p 1] [--seed N] [--policy orca] [--dtype auto]
                  [--chat | --no-chat] [--chat-template FILE_OR_TEXT] [--json]

Prompts come from ``--prompt`` (repeatable) or, without it, one per line of standard input. A
model with a chat template (or one given with ``--chat-template``, as orca-serve's) gets each
prompt as a user message (``--no-chat``: as raw text).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .llm import LLM
from .model.builtin import DEFAULT_MODEL
from .sampling_params import SamplingParams
from .chat import load_chat_template


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orca-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a built-in name (smollm2-135m-instruct, orca-tiny), a Hugging Face "
                             f"model folder or a GGUF file (default: {DEFAULT_MODEL})")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default stdin)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--policy", default="orca", choices=["orca", "paged", "request"])
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 where the CPU has AMX or AVX512-BF16, else float32")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="send each prompt as a user message through the chat template "
                             "(default: when the model has one or --chat-template gives one)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                        help="a Jinja chat template, a file or its text (as orca-serve's); "
                             "replaces the model's own")
    parser.add_argument("--json", action="store_true", help="one JSON object per output line")
    args = parser.parse_args(argv)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        parser.error("no prompts: pass --prompt or lines on standard input")
    try:
        template = load_chat_template(args.chat_template)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype, policy=args.policy)
        chat = args.chat if args.chat is not None else \
            template is not None or llm.engine.info.chat_template is not None
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                               use_tqdm=len(prompts) > 1, chat_template=template)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"orca-generate: error: {exc}\n")
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text,
                              "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
