"""The ``eagle-jax`` command line: ``generate`` and ``import-gguf``.

Errors that are the user's to fix (bad input, bad checkpoint) print one ``error:`` line
and exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from eagle_jax.errors import EagleJaxError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def default_model_dir() -> Path:
    """$EAGLE_JAX_MODEL, else checkpoints/<default> in the working directory, else beside the package."""
    env = os.environ.get("EAGLE_JAX_MODEL")
    if env:
        return Path(env)
    here = Path.cwd() / "checkpoints" / DEFAULT_MODEL_NAME
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[1] / "checkpoints" / DEFAULT_MODEL_NAME


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s} must be >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-jax", description="EAGLE-3 speculative decoding in JAX.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from prompts", description="Generate text with the target model.")
    g.add_argument("--model", type=Path, default=None, help=f"model directory (default: checkpoints/{DEFAULT_MODEL_NAME}, made by `make model`)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a prompt (raw text; add --chat to wrap it as a user message)")
    src.add_argument("--prompt-file", type=Path, help='JSONL: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} per line')
    g.add_argument("--chat", action="store_true", help="render --prompt through the model's chat template as one user message")
    g.add_argument("--system", default=None, help="system message to put before --prompt (implies --chat)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0, help="per-request seed (request i of a file uses seed + i)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--batch-size", type=_positive_int, default=8, help="requests decoded together")
    g.add_argument("--max-seq-len", type=_positive_int, default=None, help="context limit (default: the model's)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="default: float32 on CPU, bfloat16 on GPU")
    g.add_argument("--output", type=Path, default=None, help="write one JSON object per prompt to this JSONL file")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("import-gguf", help="convert a GGUF file into a Hugging Face model directory")
    i.add_argument("gguf", type=Path, help="input .gguf file")
    i.add_argument("outdir", type=Path, help="output directory (config.json, model.safetensors, tokenizer files)")
    i.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    i.set_defaults(func=cmd_import_gguf)
    return p


def _load_records(args):
    from eagle_jax.prompts import PromptRecord, read_prompt_file

    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    if args.chat or args.system is not None:
        msgs = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        msgs.append({"role": "user", "content": args.prompt})
        return [PromptRecord(0, messages=tuple(msgs))]
    return [PromptRecord(0, prompt=args.prompt)]


def cmd_generate(args) -> int:
    import numpy as np  # noqa: F401  (heavy imports stay out of --help)

    from eagle_jax.checkpoint.hf import load_model
    from eagle_jax.errors import InputError
    from eagle_jax.generate import Buckets, Generator
    from eagle_jax.sampling import SamplingParams
    from eagle_jax.tokenizer import Tokenizer

    model_dir = args.model or default_model_dir()
    if not model_dir.is_dir():
        raise InputError(f"model directory {model_dir} not found (run `make model`, or pass --model DIR)")
    records = _load_records(args)
    base = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop_strings=tuple(args.stop),
    )
    tok = Tokenizer.from_dir(model_dir)
    prompts = []
    for r in records:
        if r.messages is not None:
            text = tok.apply_chat_template(list(r.messages), add_generation_prompt=True)
        else:
            text = r.prompt
        # The chat template already holds BOS where the model wants it.
        prompts.append(tok.encode(text, add_special_tokens=r.messages is None))
    model = load_model(model_dir, dtype=args.dtype)
    batches = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b < args.batch_size) + (args.batch_size,)
    gen = Generator(model, tok, buckets=Buckets(batch=batches), max_seq_len=args.max_seq_len)
    params = [
        SamplingParams(**{**base.__dict__, "seed": (base.seed + i) % 2**32}) for i in range(len(records))
    ]
    stream = args.output is None
    on_text = None
    if stream:
        multi = len(records) > 1

        def on_text(index, delta):
            if not multi:
                sys.stdout.write(delta)
                sys.stdout.flush()

    completions = gen.generate(prompts, params, on_text=on_text)
    if stream:
        if len(records) > 1:
            for r, c in zip(records, completions):
                print(f"--- {r.id} ({c.finish_reason}, {c.tokens_per_second:.1f} tok/s)\n{c.text}")
        else:
            print()
            c = completions[0]
            print(f"[{len(c.token_ids)} tokens, {c.finish_reason}, {c.tokens_per_second:.1f} tok/s]", file=sys.stderr)
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as f:
        for r, p, c in zip(records, prompts, completions):
            f.write(
                json.dumps(
                    {
                        "id": r.id,
                        "prompt_token_ids": p,
                        "token_ids": c.token_ids,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "tokens_per_second": round(c.tokens_per_second, 3),
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
    print(f"wrote {len(completions)} completions to {args.output}", file=sys.stderr)
    return 0


def cmd_import_gguf(args) -> int:
    from eagle_jax.checkpoint.gguf_import import import_gguf

    out = import_gguf(args.gguf, args.outdir, overwrite=args.overwrite)
    print(f"imported {args.gguf} -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except EagleJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
