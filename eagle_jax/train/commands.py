"""``eagle-jax draft-data`` and ``eagle-jax train-draft``: make a draft for a target.

    eagle-jax draft-data --model DIR --out DATA [--synthetic 1024 | --prompt-file F.jsonl]
    eagle-jax train-draft --model DIR --data DATA --out DRAFT

``draft-data`` has the target answer the prompts (conversations.jsonl,
eval_conversations.jsonl) and stores the target's features (train/, eval/) with a
manifest.json. ``train-draft`` trains an EAGLE-3 draft on them and writes it in the
released format, with training_log.jsonl and training.json beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

from eagle_jax.cli import _positive_int
from eagle_jax.errors import InputError

log = logging.getLogger(__name__)


def add_parsers(sub) -> None:
    d = sub.add_parser(
        "draft-data", help="regenerate draft training data with the target",
        description="Have the target answer chat prompts and store its features for draft training.",
    )
    d.add_argument("--model", type=Path, default=None, help="target model directory (default: the default model)")
    d.add_argument("--out", type=Path, required=True, help="data directory to write")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--synthetic", type=_positive_int, default=None, metavar="N",
                     help="N built-in template prompts (default 1024 when no --prompt-file)")
    src.add_argument("--prompt-file", type=Path, default=None, help="JSONL prompts, as for `generate`")
    d.add_argument("--eval-prompts", type=int, default=64, metavar="N",
                   help="held-out prompts: built-in ones on unseen topics, or the last N of --prompt-file (default 64)")
    d.add_argument("--max-new-tokens", type=_positive_int, default=256)
    d.add_argument("--max-seq-len", type=_positive_int, default=320, help="prompt + response are cut to this (default 320)")
    d.add_argument("--batch-size", type=_positive_int, default=64, help="requests answered together (default 64)")
    d.add_argument("--sampled-fraction", type=float, default=0.25, help="share of prompts answered by sampling (default 0.25)")
    d.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled answers (default 0.7)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--reuse-conversations", action="store_true",
                   help="keep conversations already in --out and only (re)compute what is missing")
    d.set_defaults(func=cmd_draft_data)

    t = sub.add_parser(
        "train-draft", help="train an EAGLE-3 draft on `draft-data` output",
        description="Train an EAGLE-3 draft (training-time test) and write it in the released format.",
    )
    t.add_argument("--model", type=Path, default=None, help="target model directory (default: the default model)")
    t.add_argument("--data", type=Path, required=True, help="directory written by `eagle-jax draft-data`")
    t.add_argument("--out", type=Path, required=True, help="draft directory to write")
    t.add_argument("--overwrite", action="store_true", help="replace an existing draft directory")
    t.add_argument("--draft-vocab", type=_positive_int, default=8192, help="draft vocabulary size (default 8192)")
    t.add_argument("--ttt-length", type=_positive_int, default=7, help="unrolled draft steps (default 7)")
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    t.add_argument("--warmup-steps", type=int, default=20)
    t.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step (default 8)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init-draft", type=Path, default=None,
                   help="continue training this draft (its vocabulary is kept; --draft-vocab is ignored)")
    t.add_argument("--save-epochs", action="store_true", help="also write the draft after every epoch to OUT/epoch-N")
    t.add_argument("--save-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="dtype of the written tensors (default float32; 16-bit halves the file)")
    t.set_defaults(func=cmd_train_draft)


def _model_dir(args) -> Path:
    from eagle_jax.cli import default_model_dir

    path = args.model or default_model_dir()
    if not (path / "config.json").is_file():
        raise InputError(f"model directory {path} not found or has no config.json (run `make model`, or pass --model DIR)")
    return path


def _fingerprint(model_dir: Path) -> str:
    """sha256 of the target's config.json: data and drafts name the target they came from."""
    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]


def _prompts(args, tok) -> tuple[list[list[int]], list[list[int]], str]:
    from eagle_jax.prompts import read_prompt_file
    from eagle_jax.train.synthetic_prompts import synthetic_prompts

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))

    if args.prompt_file is None:
        n = args.synthetic or 1024
        train = [chat(q) for q in synthetic_prompts(n, split="train", seed=args.seed)]
        ev = [chat(q) for q in synthetic_prompts(args.eval_prompts, split="eval", seed=args.seed)]
        return train, ev, f"synthetic:{n}"
    encoded = []
    for r in read_prompt_file(args.prompt_file):
        if r.messages is not None:
            encoded.append(tok.encode(tok.apply_chat_template(list(r.messages), add_generation_prompt=True)))
        else:
            encoded.append(tok.encode(r.prompt, add_special_tokens=True))
    if args.eval_prompts >= len(encoded):
        raise InputError(f"--eval-prompts {args.eval_prompts} leaves no training prompts of the {len(encoded)} in {args.prompt_file}")
    cut = len(encoded) - args.eval_prompts
    return encoded[:cut], encoded[cut:], str(args.prompt_file)


def cmd_draft_data(args) -> int:
    from eagle_jax.checkpoint.hf import load_model
    from eagle_jax.engine import Engine, EngineConfig
    from eagle_jax.tokenizer import Tokenizer
    from eagle_jax.train.data import extract_features, read_conversations, regenerate, write_conversations

    if not 0 <= args.sampled_fraction <= 1:
        raise InputError(f"--sampled-fraction {args.sampled_fraction} must be in [0, 1]")
    if args.eval_prompts < 0:
        raise InputError(f"--eval-prompts {args.eval_prompts} must be >= 0")
    model_dir = _model_dir(args)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_dir(model_dir)
    train_prompts, eval_prompts, source = _prompts(args, tok)
    longest = max(len(p) for p in train_prompts + eval_prompts)
    if longest >= args.max_seq_len:
        raise InputError(f"a prompt has {longest} tokens; --max-seq-len {args.max_seq_len} leaves no room for a response")
    target = load_model(model_dir)
    engine = None
    splits = {"train": ("conversations.jsonl", train_prompts), "eval": ("eval_conversations.jsonl", eval_prompts)}
    manifest = {
        "model": str(model_dir), "model_config_sha256": _fingerprint(model_dir), "prompts": source,
        "max_new_tokens": args.max_new_tokens, "max_seq_len": args.max_seq_len,
        "sampled_fraction": args.sampled_fraction, "temperature": args.temperature, "seed": args.seed,
        "feature_layer_ids": list(target.config.feature_layer_ids), "hidden_size": target.config.hidden_size,
        "splits": {},
    }
    for split, (name, prompts) in splits.items():
        if not prompts:
            continue
        path = out / name
        if args.reuse_conversations and path.is_file():
            convs = read_conversations(path, target.config.vocab_size)
            print(f"{split}: reusing {len(convs)} conversations from {path}", file=sys.stderr)
        else:
            if engine is None:
                engine = Engine(
                    target, None,
                    EngineConfig(
                        max_batch=args.batch_size, max_seq_len=args.max_seq_len, speculative=None,
                        batch_buckets=tuple(sorted({min(16, args.batch_size), args.batch_size})),
                        prompt_buckets=tuple(sorted({min(64, args.max_seq_len), args.max_seq_len})),
                    ),
                    tok, progress=sys.stderr.isatty(),
                )

            def progress(done, total, ntok, dt, split=split):
                print(f"{split}: {done}/{total} answered, {ntok} tokens, {dt:.0f} s ({ntok / max(dt, 1e-9):.0f} tok/s)", file=sys.stderr)

            convs = regenerate(
                engine, prompts, max_new_tokens=min(args.max_new_tokens, args.max_seq_len - longest),
                sampled_fraction=args.sampled_fraction, temperature=args.temperature,
                seed=args.seed + (0 if split == "train" else 1), chunk=4 * args.batch_size, on_progress=progress,
            )
            write_conversations(path, convs)
        t0 = time.perf_counter()

        def feat_progress(done, total, dt, split=split):
            if done == total or done % (8 * 16) == 0:
                print(f"{split}: features of {done}/{total} sequences, {dt:.0f} s", file=sys.stderr)

        feats = extract_features(target, convs, max_len=args.max_seq_len, on_progress=feat_progress)
        feats.save(out / split)
        n_resp = int(sum(int(n - p) for n, p in zip(feats.lengths, feats.prompt_lengths)))
        manifest["splits"][split] = {"conversations": len(convs), "response_tokens": n_resp}
        print(f"{split}: features of {len(convs)} sequences ({n_resp} response tokens) in {time.perf_counter() - t0:.0f} s -> {out / split}", file=sys.stderr)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def cmd_train_draft(args) -> int:
    from eagle_jax.checkpoint.draft_io import load_draft, save_draft
    from eagle_jax.checkpoint.hf import load_model
    from eagle_jax.train.data import FeatureSet
    from eagle_jax.train.ttt import TrainConfig, train_draft

    model_dir = _model_dir(args)
    manifest_path = args.data / "manifest.json"
    if not manifest_path.is_file():
        raise InputError(f"{args.data} has no manifest.json (make it with `eagle-jax draft-data`)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{manifest_path}: not valid JSON ({e})") from e
    if manifest.get("model_config_sha256") != _fingerprint(model_dir):
        raise InputError(
            f"{args.data} was made with the target {manifest.get('model')!r} (config sha256 "
            f"{manifest.get('model_config_sha256')}), not {model_dir} ({_fingerprint(model_dir)})"
        )
    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        raise InputError(f"{args.out} exists and is not empty (pass --overwrite to replace it)")
    cfg = TrainConfig(
        draft_vocab_size=args.draft_vocab, ttt_length=args.ttt_length, epochs=args.epochs,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, batch_size=args.batch_size, seed=args.seed,
    )
    target = load_model(model_dir)
    data = FeatureSet.load(args.data / "train", mmap=False)
    eval_data = FeatureSet.load(args.data / "eval", mmap=False) if (args.data / "eval").is_dir() else None
    for name, fs in (("train", data), ("eval", eval_data)):
        if fs is not None and fs.features.shape[-1] != len(target.config.feature_layer_ids) * target.config.hidden_size:
            raise InputError(f"{args.data / name} features have width {fs.features.shape[-1]}, not what {model_dir} yields")
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "training_log.jsonl"
    log_file = log_path.open("w")

    def on_log(rec):
        log_file.write(json.dumps(rec, default=float) + "\n")
        log_file.flush()
        if rec["event"] == "train":
            print(f"step {rec['step']} epoch {rec['epoch']:.2f} loss {rec['loss']:.4f} acc {rec['acc']} lr {rec['lr']:.2e} ({rec['elapsed_s']:.0f} s)", file=sys.stderr)
        elif rec["event"] == "eval":
            print(f"eval at step {rec['step']}: acc by step {rec['acc']}, expected chain accept length {rec['expected_accept_length']:.2f}", file=sys.stderr)
        else:
            print(f"draft vocabulary {rec['draft_vocab_size']} covers {100 * rec['coverage']:.2f}% of response tokens", file=sys.stderr)

    init = load_draft(args.init_draft, target=target, dtype="float32") if args.init_draft is not None else None

    def on_epoch(epoch, draft):
        if args.save_epochs:
            save_draft(draft, args.out / f"epoch-{epoch}", dtype=args.save_dtype)

    t0 = time.perf_counter()
    try:
        draft, history = train_draft(target, data, cfg, eval_data=eval_data, on_log=on_log, init=init, on_epoch=on_epoch)
    finally:
        log_file.close()
    save_draft(draft, args.out, dtype=args.save_dtype)
    load_draft(args.out, target=target)  # what was written loads and fits the target
    evals = [h for h in history if h["event"] == "eval"]
    summary = {
        "target": str(model_dir), "target_config_sha256": _fingerprint(model_dir), "data": str(args.data),
        "data_manifest": manifest, "train_config": dataclasses.asdict(cfg),
        "init_draft": str(args.init_draft) if args.init_draft is not None else None,
        "train_sequences": len(data), "coverage": history[0]["coverage"],
        "final_eval": evals[-1] if evals else None, "train_seconds": time.perf_counter() - t0,
    }
    (args.out / "training.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    print(f"wrote draft to {args.out} ({summary['train_seconds']:.0f} s)")
    return 0
