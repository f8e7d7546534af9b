"""The ``eagle-jax`` command line: ``generate``, ``serve``, ``import-gguf``, ``doctor``, ``draft-data``
and ``train-draft``.

Errors that are the user's to fix (bad input, bad checkpoint) print one ``error:`` line
and exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from eagle_jax.errors import EagleJaxError, InputError

from eagle_jax.defaults import (  # noqa: F401  (re-exported for scripts written against cli)
    DEFAULT_DRAFT_NAME,
    DEFAULT_MODEL_NAME,
    default_draft_dir,
    default_model_dir,
    enable_compilation_cache,
    positive_int,
    pow2_at_least as _pow2_at_least,
)

_positive_int = positive_int


log = logging.getLogger("eagle_jax.cli")

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-jax", description="EAGLE-3 speculative decoding in JAX.")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log at INFO level; -vv also eagle-jax's DEBUG lines (every graph's trace, lower and compile "
                        "seconds at start-up)")
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
    g.add_argument("--output", type=Path, default=None, help="write one JSON object per prompt to this JSONL file")
    add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="serve the model over HTTP with the OpenAI API",
                       description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming or "
                                   "not; /v1/models, /health, /metrics) on the engine. docs/serving.md says more.")
    v.add_argument("--model", type=Path, default=None, help=f"model directory (default: checkpoints/{DEFAULT_MODEL_NAME})")
    add_engine_arguments(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    v.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients pass and /v1/models lists (default: the model directory's name)")
    v.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait for a slot; one more gets a 429 (default 256)")
    v.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may run before they are cancelled (default 10)")
    v.set_defaults(func=cmd_serve)

    i = sub.add_parser("import-gguf", help="convert a GGUF file into a Hugging Face model directory")
    i.add_argument("gguf", type=Path, help="input .gguf file")
    i.add_argument("outdir", type=Path, help="output directory (config.json, model.safetensors, tokenizer files)")
    i.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    i.set_defaults(func=cmd_import_gguf)

    from eagle_jax import doctor
    from eagle_jax.experiments import ablate, bench, evaluate
    from eagle_jax.train import commands as train_commands

    doctor.add_parser(sub)
    evaluate.add_parser(sub)
    ablate.add_parser(sub)
    bench.add_parser(sub)
    train_commands.add_parsers(sub)
    return p


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (policy, shapes, batch size, max_seq_len, dtype, mesh): the same for
    every command that builds an engine from them (``generate``, ``serve``)."""
    g = parser
    g.add_argument("--batch-size", type=_positive_int, default=8, help="requests decoded together (more are queued)")
    g.add_argument("--draft", type=Path, default=None, help=f"EAGLE-3 draft directory (default: checkpoints/{DEFAULT_DRAFT_NAME} when it exists)")
    g.add_argument("--spec-policy", choices=("auto", "threshold", "fixed"), default=None,
                   help="auto (default with a draft): time every candidate step per batch bucket at start-up and run "
                        "the one predicted fastest, plain included; fixed: always the --steps/--topk/--draft-tokens "
                        "shape; threshold: that shape, off above --spec-disable-batch-threshold (default: fixed when "
                        "a shape flag is given, threshold when the threshold is, else auto)")
    g.add_argument("--spec-shapes", default=None, metavar="LIST",
                   help="auto's candidates, comma-separated, e.g. 'chain S=1, chain S=3, tree S=3 k=4 T=8' (default: "
                        "chains S=1..5 and trees S=2 k=4 T=6, S=3 k=4 T=8, S=4 k=4 T=12); fewer compile faster")
    g.add_argument("--no-prune-buckets", dest="prune_buckets", action="store_false",
                   help="compile auto's default candidates at every batch bucket (default: at each bucket, only those "
                        "whose least step cost, from plain steps timed at start-up, the draft's prior could pay for)")
    g.add_argument("--spec-calibration-s", type=float, default=20.0, metavar="SECONDS",
                   help="auto's start-up timing budget (default 20)")
    g.add_argument("--recalibrate", action="store_true",
                   help="time auto's steps again although this machine's calibration cache holds them (and replace them)")
    g.add_argument("--draft-sync", choices=("auto", "eager", "deferred"), default="auto",
                   help="how the draft follows plain steps and prefill: eager (runs the draft on every one), deferred "
                        "(stores its inputs; the next speculative step runs the draft over them), auto (default: "
                        "deferred where the policy runs plain and speculates, on one device)")
    # Fixed shape defaults: tied fastest (with chain S=2) for the released SmolLM2 draft on a 2-core CPU.
    g.add_argument("--steps", type=_positive_int, default=None, help="fixed shape: draft steps S (tree depth; default 3)")
    g.add_argument("--topk", type=_positive_int, default=None, help="fixed shape: draft branching k (1 = chain; default 4)")
    g.add_argument("--draft-tokens", type=_positive_int, default=None,
                   help="fixed shape: tokens verified per step T (default: 8 for a tree, or all its nodes if fewer; "
                        "S+1 for a chain)")
    g.add_argument("--no-speculation", action="store_true", help="plain decoding even when a draft is available")
    g.add_argument("--spec-disable-batch-threshold", type=int, default=None, metavar="N",
                   help="threshold policy: switch speculation off while the padded batch is larger than N")
    g.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="start serving with plain steps once they are compiled, and compile the speculative steps "
                        "in a background thread; the policy calibrates and speculation starts when they are ready "
                        "(auto and threshold policies; the output is the same). Default: on for serve under auto or "
                        "threshold (a server answers at once), off for generate")
    g.add_argument("--time-phases", action="store_true",
                   help="run each speculative step as its draft and verify graphs, timed apart (slower: a measuring "
                        "mode), and print draft/verify ms per step")
    g.add_argument("--max-seq-len", type=_positive_int, default=None, help="context limit (default: the model's)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="default: float32 on CPU, bfloat16 on GPU; bfloat16 on a CPU with the packed kernel streams bfloat16 weights with float32 arithmetic (activations and cache float32)")
    add_mesh_argument(g)


def add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    """``--mesh``, for every command that builds an engine (``EngineConfig.mesh``)."""
    parser.add_argument(
        "--mesh", default="data=1,model=1", metavar="data=D,model=M",
        help="device mesh: D engine batch shards times M tensor-parallel shards of the target (heads, MLP, "
             "vocabulary; the draft is replicated); a mixture-of-experts target also takes expert=E (its routed "
             "experts split E ways: data=D,expert=E,model=M); 'auto' puts every device (of every process) on model "
             "(default data=1,model=1)")
    parser.add_argument("--draft-sharding", choices=("replicated", "model"), default="replicated",
                        help="the draft on a mesh: whole on every device (default) or split over model like the target")
    # Several hosts: every process runs the same command (same prompts, same flags); the
    # mesh spans the devices of all of them; process 0 writes the output.
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="multi-process run: address of process 0's coordinator (or 'auto': detect a SLURM / "
                             "Open MPI cluster); default JAX_COORDINATOR_ADDRESS, else a single process")
    parser.add_argument("--num-processes", type=int, default=None, metavar="N",
                        help="multi-process run: number of processes (default JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None, metavar="I",
                        help="multi-process run: this process's index, 0..N-1 (default JAX_PROCESS_ID)")


def _load_records(args):
    from eagle_jax.serving.prompts import PromptRecord, read_prompt_file

    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    if args.chat or args.system is not None:
        msgs = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        msgs.append({"role": "user", "content": args.prompt})
        return [PromptRecord(0, messages=tuple(msgs))]
    return [PromptRecord(0, prompt=args.prompt)]


def _phase_figures(summary: dict) -> str:
    """Draft and verify time per speculative step, from ``EngineMetrics.summary()``."""
    d, v = summary["draft_ms_per_step"], summary["verify_ms_per_step"]
    if d is None:
        return "no speculative step timed"
    return (f"draft {d:.2f} ms + verify {v:.2f} ms per speculative step "
            f"({100 * summary['draft_share']:.0f}% drafting, {summary['spec_steps']} steps)")


def _spec_policy(args) -> str:
    """The policy the flags ask for (see --spec-policy), or a clear error for flags that
    contradict it."""
    shape_flags = [f for f, v in (("--steps", args.steps), ("--topk", args.topk), ("--draft-tokens", args.draft_tokens)) if v is not None]
    policy = args.spec_policy
    if policy is None:
        policy = "threshold" if args.spec_disable_batch_threshold is not None else "fixed" if shape_flags else "auto"
    if policy == "auto" and shape_flags:
        raise InputError(f"{', '.join(shape_flags)} set the fixed shape; with --spec-policy auto list candidates in --spec-shapes")
    if policy != "auto" and args.spec_shapes is not None:
        raise InputError(f"--spec-shapes are auto's candidates; --spec-policy {policy} runs the --steps/--topk shape")
    if policy != "threshold" and args.spec_disable_batch_threshold is not None:
        raise InputError(f"--spec-disable-batch-threshold goes with --spec-policy threshold, not {policy}")
    if policy == "threshold" and args.spec_disable_batch_threshold is None:
        raise InputError("--spec-policy threshold needs --spec-disable-batch-threshold N")
    if not args.spec_calibration_s > 0:
        raise InputError(f"--spec-calibration-s {args.spec_calibration_s} must be > 0")
    # The shapes themselves, before anything loads: a typo is a start-up error.
    from eagle_jax.serving.policy import parse_shapes
    from eagle_jax.spec.config import default_shape

    if args.spec_shapes is not None:
        parse_shapes(args.spec_shapes)
    if policy != "auto":
        default_shape(args.steps, args.topk, args.draft_tokens)
    return policy


def _policy_lines(summary: dict) -> list[str]:
    """Which step ran in each batch bucket, measured and predicted tokens/s (--verbose)."""
    lines = [f"steps by bucket: {summary['steps_by_bucket']}"]
    meas, pred = summary["measured_tokens_per_second_by_bucket"], summary["predicted_tokens_per_second_by_bucket"]
    for key in meas:
        lines.append(f"  bucket {key}: measured {meas[key]:.1f} tok/s"
                     + (f", predicted {pred[key]:.1f} tok/s (full bucket)" if key in pred else ""))
    return lines


def engine_config(args, *, draft: bool, batch: int, max_seq_len: int, longest: int, sampled: bool | None = None,
                  background_default: bool = False):
    """The ``EngineConfig`` the engine flags mean, for a run with or without a draft.
    ``EngineConfig``'s own defaults are the flags' defaults (tests/cli/test_cli.py checks
    both give the same policy and shapes), so this only passes on what the flags set.
    ``sampled``: compile the sampling steps (default: when ``--temperature`` > 0)."""
    from eagle_jax.runtime.plan import prompt_buckets_for
    from eagle_jax.serving.engine import EngineConfig
    from eagle_jax.serving.policy import parse_shapes
    from eagle_jax.spec.config import default_shape

    policy = _spec_policy(args) if draft else "plain"
    return EngineConfig(
        max_batch=batch,
        max_seq_len=max_seq_len,
        batch_buckets=tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b < batch) + (batch,),
        prompt_buckets=prompt_buckets_for(longest, max_seq_len),
        dtype=args.dtype,
        spec_policy=policy,
        speculative=default_shape(args.steps, args.topk, args.draft_tokens) if policy in ("fixed", "threshold") else None,
        spec_disable_batch_threshold=args.spec_disable_batch_threshold if policy == "threshold" else None,
        spec_shapes=parse_shapes(args.spec_shapes) if policy == "auto" and args.spec_shapes is not None else None,
        spec_calibration_s=args.spec_calibration_s,
        spec_prune_buckets=args.prune_buckets,
        recalibrate=args.recalibrate,
        # Sampled steps only when some request samples (halves the graphs otherwise).
        sampled_steps=args.temperature > 0 if sampled is None else sampled,
        time_phases=args.time_phases and draft,
        mesh=args.mesh,
        draft_sharding=args.draft_sharding,
        draft_sync=args.draft_sync,
        # Unset: on where the command asks for it (serve) and the policy runs plain steps to
        # serve meanwhile; a fixed shape never does, so there the flag alone turns it on.
        background_compile=(args.background_compile if args.background_compile is not None
                            else background_default and policy in ("auto", "threshold")),
    )


def _draft_dir(args) -> Path | None:
    """The draft the engine flags ask for: --draft, else the default draft when the model
    is the default one; None with --no-speculation or when there is none (with a note)."""
    if args.no_speculation:
        return None
    draft_dir = args.draft or (default_draft_dir() if args.model is None else None)
    if draft_dir is not None and not draft_dir.is_dir():
        if args.draft is not None:
            raise InputError(f"draft directory {draft_dir} not found")
        draft_dir = None
    if draft_dir is None:
        print("note: no draft (pass --draft DIR); decoding without speculation", file=sys.stderr)
    else:
        _spec_policy(args)  # contradicting flags are an error before anything loads
    return draft_dir


def serve_engine(args):
    """The engine ``serve`` runs for its parsed flags (also the offline reference the
    server's tests compare against: the same config, the same graphs)."""
    from eagle_jax.checkpoint.tokenizer import Tokenizer
    from eagle_jax.models.registry import read_target_config
    from eagle_jax.serving.engine import Engine

    model_dir = args.model or default_model_dir()
    if not model_dir.is_dir():
        raise InputError(f"model directory {model_dir} not found (run `make model`, or pass --model DIR)")
    draft_dir = _draft_dir(args)
    max_seq_len = args.max_seq_len or read_target_config(model_dir).max_position_embeddings
    # Any prompt that leaves room for a token may arrive: prefill chunks up to the largest
    # default chunk (longer prompts go in several); requests choose their own
    # temperature, so the sampling steps are compiled too.
    config = engine_config(args, draft=draft_dir is not None, batch=args.batch_size, max_seq_len=max_seq_len,
                           longest=max_seq_len, sampled=True, background_default=True)
    enable_compilation_cache()
    tok = Tokenizer.from_dir(model_dir)
    return Engine(str(model_dir), str(draft_dir) if draft_dir else None, config, tok, progress=sys.stderr.isatty())


def cmd_serve(args) -> int:
    from eagle_jax.server.app import serve

    if args.coordinator is not None or args.num_processes is not None or args.process_id is not None:
        raise InputError("serve runs in one process (its mesh may still span this host's devices): "
                         "--coordinator, --num-processes and --process-id are for generate")
    if not 0 <= args.port < 65536:
        raise InputError(f"--port {args.port} is not a port (0..65535)")
    if args.max_queue < 0:
        raise InputError(f"--max-queue {args.max_queue} must be >= 0")
    if not args.shutdown_timeout > 0:
        raise InputError(f"--shutdown-timeout {args.shutdown_timeout} must be > 0")
    engine = serve_engine(args)
    name = args.served_model_name or (args.model or default_model_dir()).name
    return serve(engine, host=args.host, port=args.port, model_name=name, max_queue=args.max_queue,
                 shutdown_timeout=args.shutdown_timeout)


def _note_background(engine) -> None:
    """A run that ended before its background compile did says so: it decoded plainly
    throughout, and what was compiled and calibrated is kept for the next start."""
    left = engine.background_progress()
    if left is not None:
        log.info("the run ended before speculation was ready (%s): %d steps ran plain; the graphs compiled and the "
                 "calibration measured so far are kept, so the next start-up of this command continues from them",
                 left, engine.metrics.plain_steps)


def cmd_generate(args) -> int:
    import jax

    from eagle_jax.serving.engine import Engine
    from eagle_jax.spec.sampling import SamplingParams
    from eagle_jax.runtime.sharding import initialize_distributed
    from eagle_jax.models.registry import read_target_config
    from eagle_jax.checkpoint.tokenizer import Tokenizer

    model_dir = args.model or default_model_dir()
    if not model_dir.is_dir():
        raise InputError(f"model directory {model_dir} not found (run `make model`, or pass --model DIR)")
    # Before anything touches a device. Every process then runs this same command; only
    # process 0 writes what it generated (the others' copies are the same tokens).
    # (initialize_distributed logs which process this is.)
    distributed = initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    lead = distributed is None or jax.process_index() == 0
    records = _load_records(args)
    base = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop_strings=tuple(args.stop),
    )
    draft_dir = _draft_dir(args)
    tok = Tokenizer.from_dir(model_dir)
    prompts = []
    for r in records:
        if r.messages is not None:
            text = tok.apply_chat_template(list(r.messages), add_generation_prompt=True)
        else:
            text = r.prompt
        # The chat template already holds BOS where the model wants it.
        prompts.append(tok.encode(text, add_special_tokens=r.messages is None))
    # Compile only the shapes this run needs: buckets up to the batch and the longest prompt.
    context = read_target_config(model_dir).max_position_embeddings
    longest = max(len(p) for p in prompts)
    max_seq_len = args.max_seq_len or min(context, _pow2_at_least(longest + args.max_new_tokens))
    if longest >= max_seq_len:
        raise InputError(
            f"a prompt has {longest} tokens; the context holds {max_seq_len} (max_seq_len), leaving no room for a new token"
        )
    if args.time_phases and draft_dir is None:
        print("note: --time-phases has nothing to time without speculation; ignored", file=sys.stderr)
    config = engine_config(args, draft=draft_dir is not None, batch=min(args.batch_size, len(prompts)),
                           max_seq_len=max_seq_len, longest=longest)
    enable_compilation_cache()
    engine = Engine(str(model_dir), str(draft_dir) if draft_dir else None, config, tok, progress=sys.stderr.isatty())
    params = [SamplingParams(**{**base.__dict__, "seed": (base.seed + i) % 2**32}) for i in range(len(records))]
    if args.output is None and len(records) == 1:
        for delta in engine.stream(prompts[0], params[0]):
            if lead:
                sys.stdout.write(delta)
                sys.stdout.flush()
        if not lead:
            return 0
        print()
        _note_background(engine)
        summary = engine.metrics.summary()
        if args.verbose:
            for line in _policy_lines(summary):
                log.info(line)
        print(
            f"[{summary['tokens']} tokens, {summary['tokens_per_second']:.1f} tok/s"
            + (f", mean accept length {summary['mean_accept_length']:.2f}" if engine.draft is not None else "")
            + (f", {_phase_figures(summary)}" if config.time_phases else "") + "]",
            file=sys.stderr,
        )
        return 0
    completions = engine.generate(prompts, params)
    _note_background(engine)
    if args.verbose:
        for line in _policy_lines(engine.metrics.summary()):
            log.info(line)
    if not lead:
        return 0
    if config.time_phases:
        print(f"[{_phase_figures(engine.metrics.summary())}]", file=sys.stderr)
    if args.output is None:
        for r, c in zip(records, completions):
            print(f"--- {r.id} ({c.finish_reason}, {c.tokens_per_second:.1f} tok/s)\n{c.text}")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as f:
        for r, p, c in zip(records, prompts, completions):
            row = {
                "id": r.id,
                "prompt_token_ids": p,
                "token_ids": c.token_ids,
                "text": c.text,
                "finish_reason": c.finish_reason,
                # Timing: queue_s (arrival to admission), ttft_s (arrival to the first token),
                # decode_tokens_per_second (after the first token), tokens_per_second (from arrival).
                **c.timing(),
                "accept_lengths": c.accept_lengths,
                "mean_accept_length": round(c.mean_accept_length, 4),
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
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
    # Start-up lines (what was loaded, what is compiled, what speculation does) always show.
    logging.getLogger("eagle_jax").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    try:
        return args.func(args)
    except EagleJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
