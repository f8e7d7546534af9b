"""docs/results.md is what scripts/readme_results.py makes of the committed results: a
figure changes only with the results file behind it, and every table names its command,
machine and date."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_results_document_is_generated_from_the_committed_results(tmp_path):
    out = tmp_path / "results.md"
    subprocess.run([sys.executable, str(REPO / "scripts" / "readme_results.py"), "--dir", str(REPO / "results" / "ablations"),
                    "--write", str(out)], check=True, capture_output=True, text=True, timeout=300, cwd=REPO)
    committed = (REPO / "docs" / "results.md").read_text()
    assert out.read_text() == committed, "rerun: python scripts/readme_results.py --write docs/results.md"
    tables = committed.count("\n### ")
    assert tables >= 5 and committed.count("Command: `") == tables and committed.count("Taken: 20") == tables
