"""The learning curve of a ``train-draft`` run: held-out agreement with the target against
the response tokens trained on, from the run's ``training_log.jsonl`` records.

Whether more data would still pay is read off its slope within the first epoch: past
one epoch the tokens are seen again, so the curve there measures more passes, not more
data. The figure marks where each epoch ends for that reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from eagle_jax.errors import InputError


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a training log (one JSON object a line); a bad line is named."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not JSON ({e})") from e
        if not isinstance(rec, dict) or "event" not in rec:
            raise InputError(f"{path}:{n}: not a training record")
        out.append(rec)
    return out


def curve_points(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval records that carry ``response_tokens_seen``, in step order: {step, epoch,
    tokens, acc (by TTT step), expected_accept_length}."""
    pts = [
        {"step": r["step"], "epoch": r["epoch"], "tokens": r["response_tokens_seen"], "acc": list(r["acc"]),
         "expected_accept_length": r["expected_accept_length"]}
        for r in records if r.get("event") == "eval" and "response_tokens_seen" in r
    ]
    return sorted(pts, key=lambda p: p["step"])


def save_learning_curve(records: list[dict[str, Any]], path: Path, *, title: str, epoch_tokens: int | None = None) -> int:
    """Draw the curve to ``path`` (PNG): held-out top-1 agreement at each TTT step and the
    implied chain accept length, against response tokens seen. ``epoch_tokens``: the
    response tokens of one pass over the data (the epoch boundaries drawn). Returns the
    number of points drawn; with none, nothing is written."""
    pts = curve_points(records)
    if not pts:
        return 0
    from matplotlib.figure import Figure

    x = [p["tokens"] / 1e6 for p in pts]
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    depth = len(pts[0]["acc"])
    for t in range(depth):
        a1.plot(x, [p["acc"][t] for p in pts], marker="o" if t == 0 else None, lw=2.2 if t == 0 else 1,
                color=f"C{t}", label="first position" if t == 0 else f"step {t + 1}")
    a1.set_ylim(0, 1)
    a1.set_ylabel("held-out top-1 agreement with the target")
    a1.set_title("acceptance by TTT step")
    a2.plot(x, [p["expected_accept_length"] for p in pts], marker="o", color="k")
    a2.set_ylabel("implied chain accept length (tokens per step)")
    a2.set_title("expected accept length")
    for ax in (a1, a2):
        ax.set_xlabel("response tokens trained on (millions)")
        ax.grid(alpha=0.3)
        if epoch_tokens:
            e = 1
            while e * epoch_tokens <= pts[-1]["tokens"]:
                ax.axvline(e * epoch_tokens / 1e6, color="grey", ls=":", lw=1)
                e += 1
    a1.legend(fontsize=8, ncol=2)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return len(pts)


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle_jax.train.curve RUN_DIR [--out PNG]``: draw a run's curve so far
    (also while it trains)."""
    import argparse

    import numpy as np

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("run", type=Path, help="a train-draft --out directory")
    ap.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN/learning_curve.png)")
    args = ap.parse_args(argv)
    records = read_log(args.run / "training_log.jsonl")
    epoch_tokens = None
    run = args.run / "run.json"
    if run.is_file():
        data = Path(json.loads(run.read_text())["data"]) / "train"
        if (data / "lengths.npy").is_file():
            epoch_tokens = int((np.load(data / "lengths.npy") - np.load(data / "prompt_lengths.npy")).sum())
    out = args.out or args.run / "learning_curve.png"
    n = save_learning_curve(records, out, title=args.run.name, epoch_tokens=epoch_tokens)
    if not n:
        print(f"{args.run}: no evaluation with tokens seen yet", flush=True)
        return 1
    print(f"wrote {out} ({n} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
