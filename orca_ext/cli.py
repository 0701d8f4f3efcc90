"""``orca-generate``: offline generation from the command line (the ``LLM.generate`` API).

    orca-generate [--model orca-tiny] [--prompt TEXT ...] [--max-tokens 32] [--temperature 0]
                  [--top-p 1] [--seed N] [--policy orca] [--dtype float32] [--json]

Prompts come from ``--prompt`` (repeatable) or, without it, one per line of standard input.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .llm import LLM
from .sampling_params import SamplingParams


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orca-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="orca-tiny",
                        help="built-in name or Hugging Face model folder")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default stdin)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--policy", default="orca", choices=["orca", "paged", "request"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", action="store_true", help="one JSON object per output line")
    args = parser.parse_args(argv)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        parser.error("no prompts: pass --prompt or lines on standard input")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype, policy=args.policy)
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"orca-generate: error: {exc}\n")
    for output in outputs:
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": output.prompt, "text": completion.text,
                              "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
