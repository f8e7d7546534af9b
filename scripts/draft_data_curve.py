"""The draft's data-scaling curve across releases (issue 26's learning curve): held-out
agreement with the target by draft step, and MT-bench mean accept length, against the
distinct response tokens the release learned from (its own run's and those of the drafts
it was continued from).

Every release is measured here on the same held-out features (a ``draft-data`` eval split,
e.g. the 199 real held-out prompts of data/prompts/heldout-prompts.jsonl), with
``ttt.teacher_forced_agreement``, so the releases are compared on equal terms (each
card's own ``final_eval`` may come from another held-out set: v1's was template prompts).
MT-bench accept lengths come from each release's eval-draft report.

    .venv/bin/python scripts/draft_data_curve.py --heldout .cache/draft-v3-data/eval \\
        --release v1=.cache/releases/v1:209239:checkpoints/smollm2-135m-instruct-eagle3/history/v1/eval_mt_bench.json \\
        --release v2=checkpoints/smollm2-135m-instruct-eagle3:955514:... \\
        --out checkpoints/smollm2-135m-instruct-eagle3/data_curve.json

Each ``--release LABEL=DRAFT_DIR:NEW_TOKENS:EVAL_JSON`` gives the draft, the distinct
response tokens its own run added (the curve's x is the running sum over the releases in
the order given), and its ``eval-draft --suite mt_bench`` report. Writes the JSON and a PNG
beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_release(text: str) -> dict:
    try:
        label, rest = text.split("=", 1)
        draft, tokens, report = rest.split(":", 2)
        return {"label": label, "draft": Path(draft), "new_tokens": int(tokens), "eval": Path(report)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--release {text!r}: give LABEL=DRAFT_DIR:NEW_TOKENS:EVAL_JSON") from None


def mt_bench_lengths(report_path: Path) -> dict[str, float]:
    report = json.loads(report_path.read_text())
    shapes = report["suites"]["mt_bench"]["shapes"]
    return {name: row["mean_accept_length"] for name, row in shapes.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-instruct")
    p.add_argument("--heldout", type=Path, required=True, help="a draft-data eval split (FeatureSet directory)")
    p.add_argument("--release", type=parse_release, action="append", required=True)
    p.add_argument("--steps", type=int, default=4, help="draft steps measured (default 4)")
    p.add_argument("--out", type=Path, required=True, help="JSON path; the PNG goes beside it")
    args = p.parse_args(argv)

    from eagle_jax.checkpoint.load import load_models
    from eagle_jax.environment import fingerprint
    from eagle_jax.train.data import FeatureSet
    from eagle_jax.train.ttt import expected_accept_length, teacher_forced_agreement

    data = FeatureSet.load(args.heldout)
    rows, seen = [], 0
    for rel in args.release:
        target, draft = load_models(args.model, rel["draft"], "float32")
        got = teacher_forced_agreement(draft, target, data, args.steps)
        seen += rel["new_tokens"]
        row = {
            "label": rel["label"], "draft": rel["draft"].as_posix(), "response_tokens": seen,
            "heldout_agreement_by_step": got["agreement"], "heldout_positions": got["positions"],
            "heldout_predicted_chain_accept_length": expected_accept_length(got["agreement"][:3]),
            "mt_bench_accept_length": mt_bench_lengths(rel["eval"]), "mt_bench_report": rel["eval"].as_posix(),
        }
        rows.append(row)
        print(f"{rel['label']}: {seen:,} tokens; held-out agreement "
              + " / ".join(f"{a:.3f}" for a in got["agreement"]) + "; MT-bench "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["mt_bench_accept_length"].items()), flush=True)
    out = {
        "command": "python scripts/draft_data_curve.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "environment": fingerprint("float32"),
        "heldout": {"features": args.heldout.as_posix(), "sequences": len(data)},
        "measures": "held-out: top-1 agreement with the target by draft step, the true tokens fed (training's metric), "
                    "on the same held-out sequences for every release; MT-bench: mean accept length (bonus token "
                    "included) at batch 1, greedy, from each release's eval-draft report",
        "releases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["response_tokens"] / 1e6 for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for k in range(args.steps):
        a1.plot(x, [r["heldout_agreement_by_step"][k] for r in rows], "o-", label=f"step {k + 1}")
    a1.set_xlabel("distinct response tokens learned from (M)")
    a1.set_ylabel("held-out agreement with the target")
    a1.set_title("held-out real prompts (teacher-forced)")
    a1.legend()
    for shape in rows[-1]["mt_bench_accept_length"]:
        a2.plot(x, [r["mt_bench_accept_length"].get(shape) for r in rows], "o-", label=shape)
    a2.set_xlabel("distinct response tokens learned from (M)")
    a2.set_ylabel("mean accept length")
    a2.set_title("MT-bench, batch 1, greedy")
    a2.legend()
    for ax in (a1, a2):
        for xi, r in zip(x, rows):
            ax.annotate(r["label"], (xi, ax.get_ylim()[0]), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=100)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
