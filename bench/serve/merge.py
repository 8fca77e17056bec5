"""Replace one target's runs in a serving-benchmark JSON with the runs of a later file, keeping
a note of where they came from (the README renders the note next to the table).

    python -m bench.serve.merge results/serve_sweep.json results/serve_static_rerun.json --target static \
        --reason "static batching re-measured after the scheduler fix in commit <sha>"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def merge(base: dict, later: dict, target: str, reason: str) -> dict:
    runs = [r for r in later["runs"] if r["target"] == target]
    if not runs:
        raise SystemExit(f"no runs of target {target!r} in the later file")
    base["runs"] = [r for r in base["runs"] if r["target"] != target] + runs
    base["targets"] = [t for t in base["targets"] if t["label"] != target] + \
                      [t for t in later["targets"] if t["label"] == target]
    base.setdefault("notes", []).append(
        f"`{target}` runs replaced by those of `{later['command']}` "
        f"(commit {(later['machine'].get('git_commit') or '')[:10]}, {later['machine'].get('date')}): {reason}")
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("later")
    parser.add_argument("--target", required=True)
    parser.add_argument("--reason", required=True)
    args = parser.parse_args()
    base = json.loads(Path(args.base).read_text())
    later = json.loads(Path(args.later).read_text())
    Path(args.base).write_text(json.dumps(merge(base, later, args.target, args.reason), indent=1))
    print(f"{args.base}: {args.target} runs replaced from {args.later}")


if __name__ == "__main__":
    main()
