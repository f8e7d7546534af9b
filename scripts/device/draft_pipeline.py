#!/usr/bin/env python
"""The draft pipeline on a lent GPU (issue 26): answers, features and training in one call.

    OUT=/some/dir scripts/device/draft_pipeline.sh --gguf-parts .cache/device/gguf   # on the GPU machine
    OUT=/tmp/dry scripts/device/draft_pipeline.sh --model DIR --prompt-file F ... --dry-run   # a CPU, tiny

Phases, each a subprocess under its own time limit (a phase cut off by its limit stops
cleanly and the next one goes on with what it left), all inside ``--total-s``:

0. ``model``: the target directory (``--model``), or the GGUF brought in parts
   (``--gguf-parts DIR``: ``part-*`` files and their ``SHA256``, written here by
   ``--prepare-gguf``; a device call carries at most 64 MiB with the working tree, so the
   98 MB GGUF travels in three calls) joined, checked and imported.
1. ``answers``: ``draft-data --answers`` fills the committed answer store with the
   prompts it lacks (``--train-prompts N``; the same settings as
   scripts/draft_answers.sh, so the store stays one), at ``--answer-batch`` rows a
   step, until ``--answer-s`` (SIGTERM: the shard in progress is written).
2. ``features``: ``draft-data --answered-only --out DATA`` over the store's answers (the
   held-out prompts first), until ``--features-s``.
3. ``train``: ``train-draft --finished-shards --init-from INIT --time-budget`` with the
   measured step settings; held-out agreement every ``--eval-every`` steps.

What comes back under ``$OUT`` (a device call returns at most 8 files of 16 MiB):
``pipeline.json`` (every phase: command, seconds, exit status, the store's answers and
tokens before and after, the training record's last evaluation), ``pipeline.log`` (all
output), ``answers-new.tar`` (the shards this call added and the store's manifest:
untar into data/draft-answers/<model>/ and commit), and ``draft.tar.part-NN`` (the trained
draft directory, tarred and cut into 15 MiB parts: ``cat draft.tar.part-* | tar x``).
docs/measuring.md gives the device calls in order.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from eagle_jax.train.data import file_sha256

REPO = Path(__file__).resolve().parents[2]
PART_BYTES = 15 * 2**20  # under the 16 MiB a returned file may have


def prepare_gguf(gguf: Path, parts_dir: Path, part_mb: int) -> list[Path]:
    """Cut ``gguf`` into ``part-NN`` files of ``part_mb`` MiB in ``parts_dir``, with a
    ``SHA256`` file (the whole file's digest): what the device calls carry, one part each."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    for old in parts_dir.glob("part-*"):
        old.unlink()
    out, size = [], part_mb * 2**20
    with open(gguf, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(size), b"")):
            p = parts_dir / f"part-{i:02d}"
            p.write_bytes(block)
            out.append(p)
    (parts_dir / "SHA256").write_text(f"{file_sha256(gguf)}  {gguf.name}\n")
    return out


def join_gguf(parts_dir: Path, dest: Path) -> Path:
    """The parts joined into ``dest`` and checked against ``SHA256`` (a missing or
    changed part is named)."""
    want, name = (parts_dir / "SHA256").read_text().split()
    parts = sorted(parts_dir.glob("part-*"))
    if not parts:
        raise SystemExit(f"{parts_dir}: no part-* files")
    with open(dest, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    got = file_sha256(dest)
    if got != want:
        raise SystemExit(f"{dest}: sha256 {got} is not {want} ({name}); parts {[p.name for p in parts]}: one missing or changed?")
    return dest


def store_counts(store: Path) -> dict:
    """Answers, response tokens and shard files of an answer store's split (0 when empty)."""
    m = store / "manifest.json"
    if not m.is_file():
        return {"answers": 0, "response_tokens": 0, "shards": []}
    d = json.loads(m.read_text())
    return {"answers": d["answers"], "response_tokens": d["response_tokens"], "shards": [s["file"] for s in d["shards"]]}


class Pipeline:
    def __init__(self, out: Path, total_s: float):
        self.out, self.t0, self.total_s = out, time.monotonic(), total_s
        self.record: dict = {"command": shlex.join(["scripts/device/draft_pipeline.sh", *sys.argv[1:]]), "phases": {}}
        self.log = open(out / "pipeline.log", "a", buffering=1)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        tmp = self.out / "pipeline.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=1) + "\n")
        os.replace(tmp, self.out / "pipeline.json")

    def run(self, phase: str, cmd: list[str], limit_s: float, ok_codes=(0,)) -> int:
        """Run ``cmd`` for at most ``limit_s`` (and what the whole call has left): SIGTERM at
        the limit, SIGKILL 20 s later. Returns the exit status (124 when cut off)."""
        limit = max(1.0, min(limit_s, self.left() - 5))
        self.log.write(f"== {time.strftime('%FT%TZ', time.gmtime())} {phase}: {shlex.join(cmd)} (limit {limit:.0f} s)\n")
        start = time.monotonic()
        p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        cut = False
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            cut = True
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            rc = 124
        seconds = time.monotonic() - start
        self.record["phases"][phase] = {"command": shlex.join(cmd), "seconds": round(seconds, 1), "exit": rc,
                                        "cut_off_at_limit": cut, "limit_s": round(limit, 1)}
        self.save()
        return rc


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "eagle_jax.cli", *map(str, args)]


def pack_outputs(out: Path, store: Path, shards_before: list[str], draft_dir: Path | None) -> dict:
    """answers-new.tar (new shards + manifest) and draft.tar.part-NN under ``out``."""
    packed: dict = {}
    new = [s for s in store_counts(store)["shards"] if s not in shards_before]
    if new:
        with tarfile.open(out / "answers-new.tar", "w") as tar:
            for name in ["manifest.json", *new]:
                tar.add(store / name, arcname=f"{store.name}/{name}")
        packed["answers-new.tar"] = {"shards": len(new), "bytes": (out / "answers-new.tar").stat().st_size}
    if draft_dir is not None and (draft_dir / "config.json").is_file():
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(draft_dir, arcname="draft")
        data = buf.getvalue()
        parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
        for i, part in enumerate(parts):
            (out / f"draft.tar.part-{i:02d}").write_bytes(part)
        packed["draft"] = {"parts": len(parts), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return packed


def evaluations(draft_dir: Path) -> list[dict]:
    """The held-out evaluations train-draft logged (``training_log.jsonl``), first to last."""
    path = draft_dir / "training_log.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "eval"]


def store_name(prompt_file: Path) -> str:
    """The answer store's subdirectory for a prompt file (as draft-data names it)."""
    return prompt_file.name.removesuffix(".gz").removesuffix(".jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="where everything goes ($OUT)")
    p.add_argument("--prepare-gguf", type=Path, metavar="GGUF", help="(here, before the calls) cut GGUF into --gguf-parts")
    p.add_argument("--part-mb", type=int, default=32, help="MiB a part (32: three parts, each under the 64 MiB a call carries with the working tree)")
    p.add_argument("--model", type=Path, default=None, help="target directory (default: imported from --gguf-parts)")
    p.add_argument("--gguf-parts", type=Path, default=REPO / ".cache" / "device" / "gguf")
    p.add_argument("--answers", type=Path, default=REPO / "data" / "draft-answers" / "smollm2-135m-instruct")
    p.add_argument("--prompt-file", type=Path, default=REPO / "data" / "prompts" / "train-prompts.jsonl.gz")
    p.add_argument("--eval-prompt-file", type=Path, default=REPO / "data" / "prompts" / "heldout-prompts.jsonl")
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--train-prompts", type=int, default=None, help="the first N training prompts (default: all)")
    p.add_argument("--settings", default="--max-new-tokens 256 --max-seq-len 1024",
                   help="draft-data answer settings (those of the committed store)")
    p.add_argument("--answer-batch", type=int, default=256)
    p.add_argument("--init-from", type=Path, default=REPO / "checkpoints" / "smollm2-135m-instruct-eagle3")
    p.add_argument("--train-args", default="--epochs 3 --ttt-length 4 --batch-size 32 --lr 3e-4 --warmup-steps 50 "
                                            "--eval-every 200 --checkpoint-every 200 --save-dtype float16")
    p.add_argument("--answer-s", type=float, default=150)
    p.add_argument("--features-s", type=float, default=90)
    p.add_argument("--train-s", type=float, default=180)
    p.add_argument("--total-s", type=float, default=480)
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: OUT/../draft-pipeline-work)")
    p.add_argument("--dry-run", action="store_true", help="record that this was a dry run (tiny inputs from the caller)")
    args = p.parse_args(argv)

    if args.prepare_gguf is not None:
        parts = prepare_gguf(args.prepare_gguf, args.gguf_parts, args.part_mb)
        print(f"{len(parts)} parts in {args.gguf_parts} (carry one per device call; see docs/measuring.md)")
        return 0
    if args.out is None:
        p.error("--out (or $OUT) is required")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or out.parent / "draft-pipeline-work"
    work.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline(out, args.total_s)
    from eagle_jax.environment import fingerprint

    pipe.record.update(dry_run=args.dry_run, environment=fingerprint("float32"))
    pipe.save()

    model = args.model
    if model is None:
        model = work / "target"
        if not (model / "config.json").is_file():
            gguf = join_gguf(args.gguf_parts, work / "target.gguf")
            if pipe.run("model", _cli("import-gguf", gguf, model), 120) != 0:
                return 1
    store = args.answers / store_name(args.prompt_file)
    before = store_counts(store)
    pipe.record["answers_before"] = {k: v for k, v in before.items() if k != "shards"}
    prompts = ["--prompt-file", args.prompt_file, "--eval-prompt-file", args.eval_prompt_file,
               *(["--train-prompts", args.train_prompts] if args.train_prompts else []), *shlex.split(args.settings)]
    rc = pipe.run("answers", _cli("draft-data", "--model", model, "--answers", args.answers, *prompts,
                                  "--batch-size", args.answer_batch, "--progress-every", 30), args.answer_s)
    after = store_counts(store)
    pipe.record["answers_after"] = {k: v for k, v in after.items() if k != "shards"}
    pipe.record["answers_new"] = {"answers": after["answers"] - before["answers"],
                                  "response_tokens": after["response_tokens"] - before["response_tokens"]}
    pipe.save()
    if rc not in (0, 124, 130):
        pipe.record["packed"] = pack_outputs(out, store, before["shards"], None)
        pipe.save()
        return 1
    data = work / "data"
    rc = pipe.run("features", _cli("draft-data", "--model", model, "--answers", args.answers, "--answered-only",
                                   "--out", data, *prompts, "--eval-prompts", args.eval_prompts,
                                   "--batch-size", args.answer_batch, "--progress-every", 30), args.features_s)
    draft = work / "draft"
    if rc in (0, 124, 130) and (data / "eval").is_dir():
        budget = max(30.0, min(args.train_s, pipe.left() - 40))
        init = ["--init-from", args.init_from] if args.init_from and (args.init_from / "config.json").is_file() else []
        pipe.run("train", _cli("train-draft", "--model", model, "--data", data, "--finished-shards", "--out", draft,
                               "--overwrite", *init, "--time-budget", f"{int(budget)}s", *shlex.split(args.train_args)),
                 budget + 30)
        evals = evaluations(draft)
        pipe.record["held_out"] = {"first": evals[0], "last": evals[-1]} if evals else None
    pipe.record["packed"] = pack_outputs(out, store, before["shards"], draft)
    pipe.record["seconds"] = round(time.monotonic() - pipe.t0, 1)
    pipe.save()
    return 0 if pipe.record["packed"].get("draft") else 1


if __name__ == "__main__":
    sys.exit(main())
