"""``eagle-jax draft-data`` and ``eagle-jax train-draft``: make a draft for a target.

    eagle-jax draft-data --model DIR --out DATA [--synthetic 1024 | --prompt-file F.jsonl [--eval-prompt-file H.jsonl]]
    eagle-jax draft-data --model DIR --answers data/draft-answers/MODEL --prompt-file F.jsonl.gz [--out DATA]
    eagle-jax train-draft --model DIR --data DATA --out DRAFT

``draft-data`` has the target answer the prompts (conversations.jsonl,
eval_conversations.jsonl) and stores the target's features (train/, eval/) with a
manifest.json; run again with the same arguments, it resumes a killed run
(``DRAFT_DATA_DESCRIPTION`` says how). ``train-draft`` trains an EAGLE-3 draft on them and writes it in the
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

from eagle_jax.defaults import positive_int as _positive_int
from eagle_jax.errors import InputError

log = logging.getLogger(__name__)

# draft-data defaults. Batch: of 8/16/32/64, 64 decoded the most tokens per CPU-second
# with SmolLM2-135M on the shared 2-core CPU (29/35/37/38 in a 1024-token context,
# 48/52/57/66 in a 512-token one): a step re-reads the weights whatever the batch, so
# fuller batches spread that cost. Context: 1024 tokens keep all but 0.5% of the bundled
# chat prompts with room for a 256-token answer.
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_SEQ_LEN = 1024

DRAFT_DATA_DESCRIPTION = """\
Have the target answer chat prompts and store its features for draft training:
OUT/conversations.jsonl and OUT/eval_conversations.jsonl (the answers), OUT/train/ and
OUT/eval/ (the features), OUT/manifest.json.

Prompt files: JSON Lines, one record a line, with a unique "id":
  {"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}
      rendered with the model's chat template and its generation prompt; the target
      answers the last user turn, and earlier turns (earlier assistant replies included)
      are context only: the loss covers the new answer alone.
  {"id": ..., "prompt": "text"}   plain text, no chat template.
Bad input is handled in two ways:
  error, naming FILE:LINE: a line that is not JSON, not such a record (e.g. a role or
      content that is not a string), or that repeats an id; an id in both files.
  skipped, with the count per reason printed and kept in manifest.json: a well-formed
      record that cannot be answered (last turn not from the user, a role other than
      system/user/assistant, empty content), or whose prompt is longer than
      MAX_SEQ_LEN - MAX_NEW_TOKENS tokens.

Growing: --train-prompts N answers the first N usable training prompts; a later run
into the same --out with a larger N keeps every answer made and asks only for the new
ones (the features are then recomputed). A smaller N than the answers on file is refused.

Committed answers (--answers DIR): the answers are kept in DIR/<prompt file name>/ as
compressed shards of token ids (uint16 .npz, about 25,000 response tokens each; no
text, no features), each prompt named by its record's index in the prompt file, with a
manifest.json naming the model's and the prompt file's sha256, the settings, and every
shard's counts and sha256. Commit DIR: a later run, on any machine, with the same model,
prompt file and settings, asks only for the prompts not answered there. A shard whose
sha256 does not match the manifest is refused by name, as is a store made with another
model, prompt file or settings. Without --out, draft-data stops after answering.
Prompt files may be gzipped (.jsonl.gz); their sha256 is that of the decompressed text.

Resuming: answers are appended to the conversations files as they finish, and features
are written shard by shard. Run the same command again with the same --out to continue
a killed run: prompts already answered are not asked again (a line torn by the kill is
dropped), finished feature shards are kept. Whether an answer is sampled, and its seed,
are hashed from the prompt's id, so the result equals an uninterrupted run's (with the
same --batch-size: another one is allowed, but changes float rounding, so a rare answer
may come out differently).
manifest.json records the model (sha256 of its files), the prompt files (sha256) and
the settings; rerunning with other ones into the same --out is refused.
"""


def add_parsers(sub) -> None:
    import argparse

    d = sub.add_parser(
        "draft-data", help="regenerate draft training data with the target",
        description=DRAFT_DATA_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("--model", type=Path, default=None, help="target model directory (default: the default model)")
    d.add_argument("--out", type=Path, default=None,
                   help="data directory to write (or to resume): answers and features; optional with --answers")
    d.add_argument("--answers", type=Path, default=None, metavar="DIR",
                   help="keep the answers as committed shards in DIR/<prompt file name>/ (e.g. "
                        "data/draft-answers/smollm2-135m-instruct): resumed from there, by any later run on any machine; "
                        "without --out, only answer (no features)")
    d.add_argument("--shard-tokens", type=_positive_int, default=None, metavar="N",
                   help="with --answers: response tokens per shard (default 25000; a kill loses at most the shard in progress)")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--synthetic", type=_positive_int, default=None, metavar="N",
                     help="N built-in template prompts (default 1024 when no --prompt-file)")
    src.add_argument("--prompt-file", type=Path, default=None, metavar="FILE", help="training prompts, JSONL (see below)")
    d.add_argument("--eval-prompt-file", type=Path, default=None, metavar="FILE",
                   help="held-out prompts for eval/, JSONL (with --prompt-file; default: the last --eval-prompts of it)")
    d.add_argument("--eval-prompts", type=int, default=None, metavar="N",
                   help="held-out prompts: N built-in ones on unseen topics (default 64), or the last N of --prompt-file "
                        "(default 64), or the first N of --eval-prompt-file (default all); 0: no eval/")
    d.add_argument("--train-prompts", type=_positive_int, default=None, metavar="N",
                   help="answer only the first N usable training prompts (a shuffled prompt file makes them a fair "
                        "sample); a later run into the same --out may raise N to grow the data (default: all)")
    d.add_argument("--skip-train-prompts", type=int, default=0, metavar="K",
                   help="leave out the first K usable training prompts (those an earlier draft trained on), so a "
                        "continued draft (--init-from) learns from new ones; --train-prompts N then takes the N after "
                        "them (default 0)")
    d.add_argument("--answered-only", action="store_true",
                   help="with --answers and --out: features for the prompts the store has answered among those "
                        "selected, and generate none (a run whose answering was cut off by a time limit, e.g. "
                        "scripts/device/draft_pipeline.sh)")
    d.add_argument("--max-new-tokens", type=_positive_int, default=256, help="longest answer (default 256)")
    d.add_argument("--max-seq-len", type=_positive_int, default=DEFAULT_MAX_SEQ_LEN,
                   help=f"context of prompt + answer (default {DEFAULT_MAX_SEQ_LEN}); prompts longer than "
                        f"MAX_SEQ_LEN - MAX_NEW_TOKENS are skipped and counted")
    d.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                   help=f"requests answered together (default {DEFAULT_BATCH_SIZE}, the fastest measured on a 2-core CPU); "
                        f"may change between a run and its resumption")
    d.add_argument("--sampled-fraction", type=float, default=0.25, help="share of prompts answered by sampling (default 0.25)")
    d.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled answers (default 0.7)")
    d.add_argument("--seed", type=int, default=0, help="picks the sampled prompts and their seeds (hashed with each prompt's id)")
    d.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                   help="when stderr is not a terminal, print a progress line this often (default 30)")
    d.set_defaults(func=cmd_draft_data)

    t = sub.add_parser(
        "train-draft", help="train an EAGLE-3 draft on `draft-data` output",
        description="Train an EAGLE-3 draft (training-time test) and write it in the released format.",
    )
    t.add_argument("--model", type=Path, default=None, help="target model directory (default: the default model)")
    t.add_argument("--data", type=Path, default=None, help="directory written by `eagle-jax draft-data` (required unless --resume)")
    t.add_argument("--out", type=Path, default=None, help="draft directory to write (required unless --resume)")
    t.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="continue the interrupted run whose --out was DIR, from its newest readable checkpoint, with "
                        "the settings it recorded in DIR/run.json (give no other training flags)")
    t.add_argument("--log-every", type=_positive_int, default=10, metavar="STEPS",
                   help="write a training record (loss, acc, lr) every STEPS steps (default 10)")
    t.add_argument("--checkpoint-every", type=int, default=200, metavar="STEPS",
                   help="save the training state (orbax) to OUT/checkpoints every STEPS steps (default 200; 0: only "
                        "at the end and on SIGINT/SIGTERM); the newest 3 are kept")
    t.add_argument("--eval-every", type=int, default=0, metavar="STEPS",
                   help="also evaluate on the held-out set every STEPS steps (default 0: at each epoch's end only); "
                        "the eval records, with the response tokens seen, are the learning curve")
    t.add_argument("--overwrite", action="store_true", help="replace an existing draft directory")
    t.add_argument("--draft-vocab", type=_positive_int, default=8192, help="draft vocabulary size (default 8192)")
    t.add_argument("--ttt-length", type=_positive_int, default=7, help="unrolled draft steps (default 7)")
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    t.add_argument("--warmup-steps", type=int, default=20)
    t.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step (default 8)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init-draft", "--init-from", dest="init_draft", type=Path, default=None, metavar="DIR",
                   help="continue training this draft (its vocabulary is kept and --draft-vocab ignored, unless "
                        "--new-vocab); the model card then counts its tokens, steps and runs before this one")
    t.add_argument("--new-vocab", action="store_true",
                   help="with --init-draft: choose the draft vocabulary (--draft-vocab ids) from this data; the "
                        "draft's head keeps its columns for the ids both vocabularies share")
    t.add_argument("--finished-shards", action="store_true",
                   help="train on the finished shards of a `draft-data` run still in progress (or stopped): its "
                        "first sequences, whose features are written; the held-out split must be complete")
    t.add_argument("--time-budget", type=_duration, default=None, metavar="TIME",
                   help="end training (steps, evaluations, checkpoints) within TIME: 90m, 2h, 600s or seconds. The "
                        "planned steps follow the measured step time, so the learning rate decays where the "
                        "budget ends; --epochs stays an upper bound")
    t.add_argument("--save-epochs", action="store_true", help="also write the draft after every epoch to OUT/epoch-N")
    t.add_argument("--save-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="dtype of the written tensors (default float32; 16-bit halves the file)")
    t.set_defaults(func=cmd_train_draft)


def _duration(text: str) -> float:
    """Seconds from '90m', '2h', '600s', '1.5h' or a plain number of seconds."""
    import argparse

    t = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(t[-1:], None)
    num = t[:-1] if scale else t
    try:
        v = float(num) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90m, 2h, 600s)") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive duration")
    return v


def _model_dir(args) -> Path:
    from eagle_jax.defaults import default_model_dir

    path = args.model or default_model_dir()
    if not (path / "config.json").is_file():
        raise InputError(f"model directory {path} not found or has no config.json (run `make model`, or pass --model DIR)")
    return path


def _fingerprint(model_dir: Path) -> str:
    """sha256 of the target's config.json: data and drafts name the target they came from."""
    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]


def _display_path(path: Path) -> str:
    """A path for files that are kept or shared (manifests, training.json): relative to
    the working directory when inside it, else the directory's name alone, so no machine's
    absolute paths are recorded."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.name


# The files of a model directory that decide what the target answers: weights, config,
# tokenizer and chat template, generation settings (end-of-sequence ids).
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _model_sha256(model_dir: Path) -> str:
    """sha256 over the model's weights, config and tokenizer files: a resumed run must
    talk to the same target as the run it continues."""
    from eagle_jax.train.data import file_sha256

    h = hashlib.sha256()
    files = [model_dir / n for n in _MODEL_FILES if (model_dir / n).is_file()] + sorted(model_dir.glob("*.safetensors"))
    for f in files:
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\n")
    return h.hexdigest()


@dataclasses.dataclass
class _Split:
    """The prompts of one split: (id, prompt ids) in file order, what was skipped and
    why, and where they came from (compared when resuming)."""

    requests: list
    skipped: dict
    source: dict
    file: str | None = None
    path: Path | None = None  # the prompt file (None: built-in prompts)
    indexes: list | None = None  # each request's record index in that file (0-based, blank lines not counted)


def _encode_records(records, path: Path, tok, budget: int, start: int = 0) -> tuple[list, dict, list]:
    """(requests, skipped counts, record indexes of the requests); ``records`` begin at
    record ``start`` of ``path``."""
    from eagle_jax.serving.prompts import chat_problem

    requests, skipped, indexes = [], {}, []
    for k, r in enumerate(records, start):
        problem = chat_problem(r)
        if problem is None:
            try:
                if r.messages is not None:
                    ids = tok.encode(tok.apply_chat_template(list(r.messages), add_generation_prompt=True))
                else:
                    ids = tok.encode(r.prompt, add_special_tokens=True)
            except InputError as e:
                raise InputError(f"{path}:{r.line}: {e}") from e
            if len(ids) > budget:
                problem = f"prompt over {budget} tokens"
        if problem is not None:
            skipped[problem] = skipped.get(problem, 0) + 1
            continue
        requests.append((r.id, ids))
        indexes.append(k)
    return requests, skipped, indexes


def _prompts(args, tok, budget: int) -> dict[str, _Split]:
    """The train and eval prompts, encoded; prompts over ``budget`` tokens and records
    that cannot be answered are skipped and counted (see DRAFT_DATA_DESCRIPTION)."""
    from eagle_jax.serving.prompts import check_unique_ids, prompt_file_sha256, read_prompt_file
    from eagle_jax.train.data import id_key
    from eagle_jax.train.synthetic_prompts import synthetic_prompts

    if args.prompt_file is None:
        if args.eval_prompt_file is not None:
            raise InputError("--eval-prompt-file needs --prompt-file")
        if args.train_prompts is not None:
            raise InputError("--train-prompts needs --prompt-file (use --synthetic N for built-in prompts)")
        if args.skip_train_prompts:
            raise InputError("--skip-train-prompts needs --prompt-file")
        n, n_eval = args.synthetic or 1024, 64 if args.eval_prompts is None else args.eval_prompts
        splits = {}
        for split, count in (("train", n), ("eval", n_eval)):
            if count == 0:
                continue
            texts = synthetic_prompts(count, split=split, seed=args.seed)
            ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)) for q in texts]
            requests = [(f"synthetic-{split}-{i}", p) for i, p in enumerate(ids) if len(p) <= budget]
            skipped = {f"prompt over {budget} tokens": len(ids) - len(requests)} if len(requests) < len(ids) else {}
            splits[split] = _Split(requests, skipped, {"synthetic": count, "seed": args.seed})
        return _check_train(splits, "the built-in prompts")

    records = read_prompt_file(args.prompt_file)
    check_unique_ids(records, args.prompt_file)
    sha = prompt_file_sha256(args.prompt_file)
    if args.eval_prompt_file is None:
        n_eval = 64 if args.eval_prompts is None else args.eval_prompts
        if n_eval >= len(records):
            raise InputError(f"--eval-prompts {n_eval} leaves no training prompts of the {len(records)} in {args.prompt_file}")
        cut = len(records) - n_eval
        parts = {
            "train": (records[:cut], args.prompt_file, {"sha256": sha, "records": f"all but the last {n_eval}"}, 0),
            "eval": (records[cut:], args.prompt_file, {"sha256": sha, "records": f"the last {n_eval}"}, cut),
        }
    else:
        held = read_prompt_file(args.eval_prompt_file)
        check_unique_ids(held, args.eval_prompt_file)
        train_lines = {id_key(r.id): r.line for r in records}
        for r in held:
            if id_key(r.id) in train_lines:
                raise InputError(
                    f"{args.eval_prompt_file}:{r.line}: id {r.id!r} is also in {args.prompt_file}:{train_lines[id_key(r.id)]} "
                    f"(held-out prompts must not be trained on)"
                )
        n_eval = len(held) if args.eval_prompts is None else min(args.eval_prompts, len(held))
        parts = {
            "train": (records, args.prompt_file, {"sha256": sha, "records": "all"}, 0),
            "eval": (held[:n_eval], args.eval_prompt_file,
                     {"sha256": prompt_file_sha256(args.eval_prompt_file), "records": f"the first {n_eval}"}, 0),
        }
    splits = {}
    for split, (recs, path, source, start) in parts.items():
        if recs:
            requests, skipped, indexes = _encode_records(recs, path, tok, budget, start)
            splits[split] = _Split(requests, skipped, source, path.name, path, indexes)
    if args.skip_train_prompts < 0:
        raise InputError(f"--skip-train-prompts {args.skip_train_prompts}: give 0 or more")
    if "train" in splits and (args.train_prompts is not None or args.skip_train_prompts):
        # The first N in file order (after the K skipped), so N prompts of a shuffled file
        # are a fair sample of it and a larger N later extends the set instead of replacing it.
        tr = splits["train"]
        lo = args.skip_train_prompts
        hi = None if args.train_prompts is None else lo + args.train_prompts
        if lo >= len(tr.requests):
            raise InputError(f"--skip-train-prompts {lo} leaves none of the {len(tr.requests)} usable training prompts")
        tr.requests, tr.indexes = tr.requests[lo:hi], tr.indexes[lo:hi]
        if lo:
            # Part of the data's identity: a resumed run with another K is refused.
            tr.source = {**tr.source, "skipped_first": lo}
    return _check_train(splits, str(args.prompt_file))


def _check_train(splits: dict[str, _Split], where: str) -> dict[str, _Split]:
    if not splits["train"].requests:
        raise InputError(f"{where}: no usable training prompts (skipped: {splits['train'].skipped})")
    return splits


class _Progress:
    """Progress of a long stage on stderr: a rich bar with ETA on a terminal; elsewhere
    (a log file, nohup) a plain line every ``every_s`` seconds, since bar redraws would
    fill the file. Rates and the ETA count only this run's work, so a resumed run's ETA
    is not flattered by what an earlier run did."""

    def __init__(self, label: str, total: int, done: int, unit: str, every_s: float):
        self.label, self.total, self.unit, self.every = label, total, unit, every_s
        self.done0 = self.done = done
        self.printed = None
        self.tokens = 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                TextColumn("{task.fields[info]}"), console=Console(stderr=True), transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task(label, total=total, completed=done, info="")

    def _figures(self) -> str:
        dt = time.perf_counter() - self.t0
        rate = self.tokens / dt if dt > 0 else 0.0
        new = self.done - self.done0
        eta = (self.total - self.done) * dt / new if new else None
        left = "?" if eta is None else _hms(eta)
        return f"{self.tokens:,} tokens, {rate:.0f} tok/s, elapsed {_hms(dt)}, ETA {left}"

    def update(self, done: int, tokens: int) -> None:
        """``done`` of ``total`` finished; ``tokens`` made in this run so far."""
        self.done, self.tokens = done, tokens
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=self._figures())
        elif time.perf_counter() - self.last >= self.every:
            self._line()

    def _line(self) -> None:
        self.last = time.perf_counter()
        self.printed = self.done
        print(f"{self.label}: {self.done}/{self.total} {self.unit}, {self._figures()}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the bar; the final figures are printed once either way."""
        if self.bar is not None:
            self.bar.stop()
        if self.printed != self.done:
            self._line()


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _check_out_dir(out: Path, identity: dict) -> dict | None:
    """The manifest of an earlier run into ``out`` made with the same inputs and
    settings (to resume), or None for a fresh directory; anything else is refused."""
    path = out / "manifest.json"
    if not path.is_file():
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InputError(f"{out} exists and has no manifest.json, so it is not `draft-data` output; pass another --out")
        return None
    from eagle_jax.train.data import read_json_object

    old = read_json_object(path, "a draft-data manifest")
    diffs = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in identity.items() if old.get(k) != v]
    if diffs:
        raise InputError(
            f"{out} holds draft data made from other inputs or settings, so it cannot be resumed ("
            + "; ".join(diffs) + f"). Pass another --out, or delete {out} to start over."
        )
    return old


def _store_name(path: Path) -> str:
    """The answer-store subdirectory for a prompt file: its name without .gz / .jsonl."""
    name = path.name
    for suffix in (".gz", ".jsonl"):
        name = name.removesuffix(suffix)
    return name


class _StoreWriter:
    """Hands a split's finished answers to its prompt file's ``AnswerStore`` by record index."""

    def __init__(self, store, index_of: dict, batch_size: int):
        self.store, self.index_of, self.batch_size = store, index_of, batch_size

    def add(self, conv) -> None:
        from eagle_jax.train.data import id_key

        self.store.add(self.index_of[id_key(conv.id)], conv, batch_size=self.batch_size)


def _open_stores(args, splits: dict, model_dir: Path, model_sha: str, vocab_size: int) -> dict:
    """split -> (the ``AnswerStore`` of its prompt file under --answers, {id key: record
    index}); splits drawn from one file share its store."""
    from eagle_jax.train.data import AnswerStore, id_key

    by_file: dict = {}
    out = {}
    try:
        for split, sp in splits.items():
            name = _store_name(sp.path)
            if name not in by_file:
                identity = {
                    "model_sha256": model_sha, "prompt_file_sha256": sp.source["sha256"],
                    "settings": {"max_new_tokens": args.max_new_tokens, "max_seq_len": args.max_seq_len,
                                 "sampled_fraction": args.sampled_fraction, "temperature": args.temperature, "seed": args.seed},
                }
                describe = {"model": model_dir.resolve().name, "prompt_file": sp.path.name}
                by_file[name] = AnswerStore(args.answers / name, identity, vocab_size=vocab_size,
                                            shard_tokens=args.shard_tokens, describe=describe)
            elif by_file[name].identity["prompt_file_sha256"] != sp.source["sha256"]:
                raise InputError(f"{sp.path} and another prompt file would share {args.answers / name}: rename one")
            out[split] = (by_file[name], {id_key(rid): i for (rid, _), i in zip(sp.requests, sp.indexes)})
    except BaseException:
        for st in by_file.values():
            st._unlock()
        raise
    return out


def _stored_answers(store, sp, temperature: float) -> dict:
    """The answers ``store`` holds for the split ``sp``'s requests, as Conversations by id key."""
    from eagle_jax.train.data import Conversation, id_key, prompt_crc

    got = {}
    for (rid, ids), i in zip(sp.requests, sp.indexes):
        a = store.answers.get(i)
        if a is None:
            continue
        if a.prompt_crc != prompt_crc(ids):
            raise InputError(
                f"{store.path}: the stored answer to record {i} (id {rid!r}) of {sp.path.name} was made for a prompt "
                f"that tokenizes differently now (another tokenizer or chat template?)"
            )
        got[id_key(rid)] = Conversation(list(ids), a.response_ids, a.finish_reason, temperature if a.sampled else 0.0, rid)
    return got


def cmd_draft_data(args) -> int:
    import signal
    import threading

    from eagle_jax.checkpoint.hf import load_model
    from eagle_jax.checkpoint.tokenizer import Tokenizer
    from eagle_jax.train.data import ConversationWriter, id_key, read_answered, write_conversations, write_features

    if not 0 <= args.sampled_fraction <= 1:
        raise InputError(f"--sampled-fraction {args.sampled_fraction} must be in [0, 1]")
    if args.eval_prompts is not None and args.eval_prompts < 0:
        raise InputError(f"--eval-prompts {args.eval_prompts} must be >= 0")
    if args.max_new_tokens >= args.max_seq_len:
        raise InputError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in --max-seq-len {args.max_seq_len}")
    if not args.progress_every > 0:
        raise InputError(f"--progress-every {args.progress_every} must be > 0")
    if args.out is None and args.answers is None:
        raise InputError("draft-data needs --out DATA (answers and features), --answers DIR (answers only), or both")
    if args.shard_tokens is not None and args.answers is None:
        raise InputError("--shard-tokens needs --answers")
    if args.shard_tokens is None:
        from eagle_jax.train.data import DEFAULT_SHARD_TOKENS

        args.shard_tokens = DEFAULT_SHARD_TOKENS
    if args.answers is not None and args.prompt_file is None:
        raise InputError("--answers stores answers by their record in a prompt file: it needs --prompt-file")
    if args.answered_only and (args.answers is None or args.out is None):
        raise InputError("--answered-only computes features from an answer store: it needs --answers DIR and --out DATA")
    model_dir = _model_dir(args)
    out = args.out
    tok = Tokenizer.from_dir(model_dir)
    budget = args.max_seq_len - args.max_new_tokens
    splits = _prompts(args, tok, budget)
    model_sha = _model_sha256(model_dir)
    # What the answers depend on: a run into an existing --out continues it only when
    # all of these are equal (batch size and progress settings may change).
    identity = {
        "format": 2, "model_sha256": model_sha,
        "prompts": {name: sp.source for name, sp in splits.items()},
        "max_new_tokens": args.max_new_tokens, "max_seq_len": args.max_seq_len,
        "sampled_fraction": args.sampled_fraction, "temperature": args.temperature, "seed": args.seed,
    }
    if args.answered_only:  # which prompts it holds then depends on the store: another data set
        identity["answered_only"] = True
    resumed = out is not None and _check_out_dir(out, identity) is not None
    for name, sp in splits.items():
        if sp.skipped:
            print(f"{name}: skipped {sum(sp.skipped.values())} prompts: "
                  + ", ".join(f"{n} {why}" for why, n in sorted(sp.skipped.items())), file=sys.stderr)
    files = {"train": "conversations.jsonl", "eval": "eval_conversations.jsonl"}
    for name in [name for name, sp in splits.items() if not sp.requests]:
        print(f"{name}: no usable prompts, so no {name}/", file=sys.stderr)
        del splits[name]
    target = load_model(model_dir)
    vocab = target.config.vocab_size
    stores = _open_stores(args, splits, model_dir, model_sha, vocab) if args.answers is not None else {}
    try:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            manifest = {
                **identity, "status": "in progress",
                "model": _display_path(model_dir), "model_config_sha256": _fingerprint(model_dir),
                "prompt_files": {name: sp.file for name, sp in splits.items()},
                "skipped": {name: sp.skipped for name, sp in splits.items()},
                "batch_size": args.batch_size, "train_prompts": args.train_prompts,
                "feature_layer_ids": list(target.config.feature_layer_ids), "hidden_size": target.config.hidden_size,
                "splits": {},
            }
            if stores:
                manifest["answers"] = _display_path(args.answers)
            _write_manifest(out, manifest)
        answered, todo = {}, {}
        for split, sp in splits.items():
            if stores:
                # The store may hold more (another run's --train-prompts): only this run's prompts count.
                answered[split] = _stored_answers(stores[split][0], sp, args.temperature)
                if args.answered_only:
                    keep = [k for k, (rid, _) in enumerate(sp.requests) if id_key(rid) in answered[split]]
                    if not keep:
                        raise InputError(f"--answered-only: {stores[split][0].path} answers none of this run's {split} prompts")
                    print(f"{split}: --answered-only, {len(keep)} of {len(sp.requests)} selected prompts answered",
                          file=sys.stderr)
                    sp.requests, sp.indexes = [sp.requests[k] for k in keep], [sp.indexes[k] for k in keep]
            else:
                path = out / files[split]
                answered[split], torn = read_answered(path, vocab)
                if torn:
                    print(f"{split}: dropped a line of {path} torn by an interrupted run", file=sys.stderr)
                wanted = {id_key(rid) for rid, _ in sp.requests}
                stray = [c.id for k, c in answered[split].items() if k not in wanted]
                if stray:
                    hint = f" (an earlier run used a larger --train-prompts than {args.train_prompts}?)" if args.train_prompts else ""
                    raise InputError(f"{path} answers prompts that are not in this run's {split} prompts (e.g. id {stray[0]!r}){hint}")
            todo[split] = [r for r in sp.requests if id_key(r[0]) not in answered[split]]
            if resumed or answered[split]:
                print(f"{split}: resuming, {len(answered[split])} of {len(sp.requests)} prompts already answered", file=sys.stderr)
        if stores:
            writers = {split: _StoreWriter(st, index_of, args.batch_size) for split, (st, index_of) in stores.items()}
        else:
            writers = {split: ConversationWriter(out / files[split]) for split, reqs in todo.items() if reqs}
        # SIGTERM (a session's end, `kill`) stops like Ctrl-C: the writers are closed below,
        # so the answers finished so far are kept (a store writes its buffered shard).
        main_thread = threading.current_thread() is threading.main_thread()
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
        try:
            _answer(args, target, tok, writers, todo,
                    total=sum(len(sp.requests) for sp in splits.values()), done=sum(len(a) for a in answered.values()))
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, old_term)
            closing = list({id(st): st for st, _ in stores.values()}.values()) if stores else list(writers.values())
            for w in closing:
                w.close()
    except KeyboardInterrupt:
        print("interrupted: the answers finished so far are saved; run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        for st, _ in stores.values():
            st._unlock()
    if stores:
        for split, sp in splits.items():
            st = stores[split][0]
            have = _stored_answers(st, sp, args.temperature)
            answered[split] = have
            print(f"{split}: {len(have)} of {len(sp.requests)} prompts answered in {st.path} "
                  f"({st.manifest['answers']} answers, {st.manifest['response_tokens']:,} response tokens, "
                  f"{sum(e['bytes'] for e in st.manifest['shards']):,} bytes in {len(st.manifest['shards'])} shards)",
                  file=sys.stderr)
        if out is None:
            return 0
    # The held-out split first: it is small, and with it written a run can train on the
    # training split's finished shards (train-draft --finished-shards) while it grows.
    for split, sp in sorted(splits.items(), key=lambda kv: kv[0] != "eval"):
        path = out / files[split]
        if stores:
            answers = answered[split]
        else:
            answers, _ = read_answered(path, vocab)
        # The file in prompt order (it was written in finishing order): the same bytes
        # however often the run was interrupted.
        convs = [answers[id_key(rid)] for rid, _ in sp.requests]
        write_conversations(path, convs)
        n_resp = sum(len(c.response_ids) for c in convs)
        bar = _Progress(f"{split} features", len(convs), 0, "sequences", args.progress_every)
        try:
            write_features(target, convs, out / split, on_progress=lambda done, total, ntok: bar.update(done, ntok))
        finally:
            bar.close()
        manifest["splits"][split] = {"prompts": len(sp.requests), "conversations": len(convs), "response_tokens": n_resp}
        _write_manifest(out, manifest)
    manifest["status"] = "complete"
    _write_manifest(out, manifest)
    print(f"wrote {out}")
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _context_for(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> int:
    """The engine context a prompt is answered in: its length rounded up to a power of
    two (at least 128), plus the answer, capped at --max-seq-len.

    The engine's KV cache is as long as its context for every row, and on a CPU a decode
    step's time grows with that length (2-core CPU, SmolLM2-135M, batch 64: 1.69 CPU-s
    per step at 1024, 0.98 at 512), so short prompts (most of them) are answered by an
    engine with a short context. The group depends only on the prompt's length, so a
    resumed run answers each prompt in the same engine shape as an uninterrupted one.
    """
    p = 128
    while p < prompt_len:
        p *= 2
    return min(max_seq_len, p + max_new_tokens)


def _answer(args, target, tok, writers: dict, todo: dict, *, total: int, done: int) -> None:
    """Answer the ``todo`` requests of every split, handing each answer to its split's
    writer (``.add(conv)``: a ``ConversationWriter`` or an answer store's) as it finishes;
    one engine per context group (``_context_for``), shortest first. The caller closes
    the writers."""
    from eagle_jax.serving.engine import Engine, EngineConfig
    from eagle_jax.train.data import id_key, regenerate

    if not any(todo.values()):
        return
    split_of = {id_key(rid): split for split, reqs in todo.items() for rid, _ in reqs}
    groups: dict[int, list] = {}
    for split, reqs in todo.items():
        for r in reqs:
            groups.setdefault(_context_for(len(r[1]), args.max_new_tokens, args.max_seq_len), []).append(r)
    bar = _Progress("answers", total, done, "prompts", args.progress_every)
    tokens = 0
    try:
        for ctx in sorted(groups):
            reqs = groups[ctx]
            print(f"answers: {len(reqs)} prompts in a context of {ctx} tokens (building the engine)", file=sys.stderr, flush=True)
            prompt_buckets = [64]
            while prompt_buckets[-1] < ctx - args.max_new_tokens:
                prompt_buckets.append(2 * prompt_buckets[-1])
            engine = Engine(
                target, None,
                EngineConfig(
                    max_batch=args.batch_size, max_seq_len=ctx, spec_policy="plain",
                    # Full batches but for the last few answers: two batch sizes are enough.
                    batch_buckets=tuple(sorted({min(16, args.batch_size), args.batch_size})),
                    prompt_buckets=tuple(sorted({min(b, ctx) for b in prompt_buckets} | {ctx})),
                ),
                tok, progress=sys.stderr.isatty(),
            )
            base_done, base_tokens = bar.done, tokens

            def progress(n_done, n_total, n_tok):
                nonlocal tokens
                tokens = base_tokens + n_tok
                bar.update(base_done + n_done, tokens)

            regenerate(
                engine, reqs, max_new_tokens=args.max_new_tokens, sampled_fraction=args.sampled_fraction,
                temperature=args.temperature, seed=args.seed,
                on_answer=lambda conv: writers[split_of[id_key(conv.id)]].add(conv), on_progress=progress,
            )
            del engine  # its caches before the next one's
    finally:
        bar.close()


def _write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out / "manifest.json")


# The train-draft settings a run records in OUT/run.json, so --resume repeats them.
_RUN_FIELDS = ("model", "data", "draft_vocab", "ttt_length", "epochs", "lr", "warmup_steps", "batch_size", "seed",
               "init_draft", "save_epochs", "save_dtype", "checkpoint_every", "log_every", "eval_every",
               "new_vocab", "time_budget", "finished_shards")
# Fields added after run.json existed, with the value an older run had in effect.
_RUN_FIELD_DEFAULTS = {"eval_every": 0, "new_vocab": False, "time_budget": None, "finished_shards": False}


def _resume_args(args):
    """The recorded settings of the run in ``args.resume`` (its OUT/run.json)."""
    from eagle_jax.train.data import read_json_object

    given = [f"--{n.replace('_', '-')}" for n in ("data", "out") if getattr(args, n) is not None]
    if given:
        raise InputError(f"--resume {args.resume} takes the run's settings from its run.json; drop {', '.join(given)}")
    path = args.resume / "run.json"
    if not path.is_file():
        raise InputError(f"{args.resume} has no run.json: not the --out of a train-draft run (or one before resuming existed)")
    run = read_json_object(path, "a train-draft run record")
    missing = [k for k in _RUN_FIELDS if k not in run and k not in _RUN_FIELD_DEFAULTS]
    if missing:
        raise InputError(f"{path}: missing {missing}")
    for k in _RUN_FIELDS:
        v = run.get(k, _RUN_FIELD_DEFAULTS.get(k))
        setattr(args, k, Path(v) if k in ("model", "data", "init_draft") and v is not None else v)
    args.out, args.overwrite = args.resume, True
    return args


def _cumulative(init_dir: Path | None, this_run: dict) -> dict:
    """Training a draft has seen in all, across the runs it continues (``--init-draft``):
    this run's steps, response tokens and seconds added to what the init draft's
    training.json counted (its ``cumulative``, or for a draft that predates it, its own
    run: steps and seconds from its final evaluation, tokens as its epochs over its data)."""
    runs = 1
    total = dict(this_run)
    if init_dir is not None and (init_dir / "training.json").is_file():
        from eagle_jax.train.data import read_json_object

        before = read_json_object(init_dir / "training.json", "a draft's training record")
        prev = before.get("cumulative")
        if prev is None:  # a single run recorded before runs were added up
            fe = before.get("final_eval") or {}
            manifest = before.get("data_manifest") or {}
            per_epoch = int(manifest.get("splits", {}).get("train", {}).get("response_tokens", 0))
            prev = {
                "runs": 1, "steps": int(fe.get("step", 0)), "train_seconds": float(before.get("train_seconds", 0.0)),
                "response_tokens_seen": int(before.get("train_response_tokens", per_epoch) * float(fe.get("epoch", 0.0))),
            }
        runs += int(prev.get("runs", 1))
        for k in total:
            total[k] += prev.get(k, 0)
    return {"runs": runs, **total}


def cmd_train_draft(args) -> int:
    from eagle_jax.checkpoint.draft_io import load_draft, save_draft
    from eagle_jax.checkpoint.hf import load_model
    import numpy as np

    from eagle_jax.train.curve import curve_points, save_learning_curve
    from eagle_jax.train.data import FeatureSet
    from eagle_jax.train.ttt import TrainConfig, TrainingInterrupted, train_draft

    resuming = args.resume is not None
    if resuming:
        args = _resume_args(args)
    elif args.data is None or args.out is None:
        raise InputError("train-draft needs --data and --out (or --resume DIR to continue a run)")
    if args.new_vocab and args.init_draft is None:
        raise InputError("--new-vocab needs --init-draft DIR (a fresh draft always chooses its vocabulary)")
    if args.checkpoint_every < 0:
        raise InputError(f"--checkpoint-every {args.checkpoint_every} must be >= 0")
    if args.eval_every < 0:
        raise InputError(f"--eval-every {args.eval_every} must be >= 0")
    model_dir = _model_dir(args)
    manifest_path = args.data / "manifest.json"
    if not manifest_path.is_file():
        raise InputError(f"{args.data} has no manifest.json (make it with `eagle-jax draft-data`)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{manifest_path}: not valid JSON ({e})") from e
    if manifest.get("status", "complete") != "complete" and not args.finished_shards:
        raise InputError(f"{args.data} is unfinished `draft-data` output: rerun that command to finish it "
                         f"(or train on its finished shards: --finished-shards)")
    if manifest.get("model_config_sha256") != _fingerprint(model_dir):
        raise InputError(
            f"{args.data} was made with the target {manifest.get('model')!r} (config sha256 "
            f"{manifest.get('model_config_sha256')}), not {model_dir} ({_fingerprint(model_dir)})"
        )
    if not resuming and args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        raise InputError(f"{args.out} exists and is not empty (pass --overwrite to replace it, or --resume {args.out})")
    # A resumed run (or the next round on the same data) loads its step graphs instead of
    # compiling them again, inside its time budget.
    from eagle_jax.defaults import enable_compilation_cache

    enable_compilation_cache()
    cfg = TrainConfig(
        draft_vocab_size=args.draft_vocab, ttt_length=args.ttt_length, epochs=args.epochs,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, batch_size=args.batch_size, seed=args.seed,
    )
    target = load_model(model_dir)
    # Memory-mapped: a batch reads its own rows, so memory does not grow with the data
    # (padded to its longest sequence, a large set is far bigger than RAM).
    data = FeatureSet.load(args.data / "train", mmap=True, finished_shards=args.finished_shards)
    # The held-out set is used whole or not at all.
    eval_data = FeatureSet.load(args.data / "eval", mmap=True) if (args.data / "eval").is_dir() else None
    if args.finished_shards:
        print(f"training on {len(data)} sequences of {args.data / 'train'} (its finished shards)", file=sys.stderr)
    for name, fs in (("train", data), ("eval", eval_data)):
        if fs is not None and fs.features.shape[-1] != len(target.config.feature_layer_ids) * target.config.hidden_size:
            raise InputError(f"{args.data / name} features have width {fs.features.shape[-1]}, not what {model_dir} yields")
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = args.out / "checkpoints"
    if not resuming:
        if ckpt_dir.exists():
            import shutil

            shutil.rmtree(ckpt_dir)  # --overwrite: an older run's checkpoints are not this one's
        run = {k: (str(getattr(args, k)) if isinstance(getattr(args, k), Path) else getattr(args, k)) for k in _RUN_FIELDS}
        run["model"] = str(model_dir.resolve())
        run["data"] = str(args.data.resolve())
        if args.init_draft is not None:
            run["init_draft"] = str(args.init_draft.resolve())
        (args.out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    log_path = args.out / "training_log.jsonl"
    log_file = log_path.open("w")

    def on_log(rec):
        if rec["event"] == "resume":
            # The log restarts from the checkpoint's history: steps logged after it are redone.
            for old in rec["history"]:
                log_file.write(json.dumps(old, default=float) + "\n")
            log_file.flush()
            print(f"resumed at step {rec['step']} from {ckpt_dir}", file=sys.stderr)
            return
        log_file.write(json.dumps(rec, default=float) + "\n")
        log_file.flush()
        if rec["event"] == "train":
            print(f"step {rec['step']} epoch {rec['epoch']:.2f} loss {rec['loss']:.4f} acc {rec['acc']} lr {rec['lr']:.2e} ({rec['elapsed_s']:.0f} s)", file=sys.stderr)
        elif rec["event"] == "eval":
            print(f"eval at step {rec['step']} ({rec['response_tokens_seen']:,} response tokens seen): acc by step {rec['acc']}, expected chain accept length {rec['expected_accept_length']:.2f}", file=sys.stderr)
        else:
            print(f"draft vocabulary {rec['draft_vocab_size']} covers {100 * rec['coverage']:.2f}% of response tokens", file=sys.stderr)

    init = load_draft(args.init_draft, target=target, dtype="float32") if args.init_draft is not None else None

    def on_epoch(epoch, draft):
        if args.save_epochs:
            save_draft(draft, args.out / f"epoch-{epoch}", dtype=args.save_dtype)

    t0 = time.perf_counter()
    try:
        draft, history = train_draft(
            target, data, cfg, eval_data=eval_data, on_log=on_log, init=init, on_epoch=on_epoch,
            checkpoint_dir=ckpt_dir, checkpoint_every=args.checkpoint_every, resume=resuming, log_every=args.log_every,
            eval_every=args.eval_every, time_budget_s=args.time_budget, new_vocab=args.new_vocab,
        )
    except TrainingInterrupted as e:
        print(f"interrupted: training state of step {e.step} saved; continue with `eagle-jax train-draft --resume {args.out}`",
              file=sys.stderr)
        return 130
    finally:
        log_file.close()
    save_draft(draft, args.out, dtype=args.save_dtype)
    load_draft(args.out, target=target)  # what was written loads and fits the target
    evals = [h for h in history if h["event"] == "eval"]
    epoch_tokens = int((np.asarray(data.lengths) - np.asarray(data.prompt_lengths)).sum())
    summary = {
        "target": _display_path(model_dir), "target_config_sha256": _fingerprint(model_dir), "data": _display_path(args.data),
        "data_manifest": manifest, "train_config": dataclasses.asdict(cfg),
        "init_draft": _display_path(args.init_draft) if args.init_draft is not None else None,
        "train_sequences": len(data), "coverage": history[0]["coverage"],
        "final_eval": evals[-1] if evals else None,
        # Held-out agreement against response tokens seen (train/curve.py draws it).
        "learning_curve": curve_points(history),
        "train_response_tokens": epoch_tokens,
        # Across resumptions: the training clock the history carries, else this process's.
        "train_seconds": max([h.get("elapsed_s", 0.0) for h in history] + [time.perf_counter() - t0]),
        "time_budget_s": args.time_budget,
    }
    trains = [h for h in history if h["event"] == "train"]
    this_run = {
        "steps": max([h["step"] for h in trains], default=0),
        "response_tokens_seen": max([h.get("response_tokens_seen", 0) for h in history], default=0),
        "train_seconds": summary["train_seconds"],
    }
    summary["cumulative"] = _cumulative(args.init_draft, this_run)
    (args.out / "training.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    if save_learning_curve(history, args.out / "learning_curve.png", title=f"{args.out.name}: held-out learning curve",
                           epoch_tokens=epoch_tokens):
        print(f"wrote {args.out / 'learning_curve.png'}", file=sys.stderr)
    print(f"wrote draft to {args.out} ({summary['train_seconds']:.0f} s)")
    return 0
