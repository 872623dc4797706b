#!/usr/bin/env python3
"""Greedy accuracy of a run's evals, split by keys of the rows' `extra_info`.

    python3 tools/eval_breakdown.py RUN_DIR [--by template] ...

Reads RUN_DIR/evals/global_step_*.jsonl (floe train writes one per eval) and prints, per
step, the share of first samples with full reward (the `accuracy` metric) overall and for
each value of the named keys. Standard library only.
"""

import argparse
import collections
import json
import pathlib
import re


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--by", action="append", default=[], help="an extra_info key")
    args = parser.parse_args()
    files = sorted(
        (args.run_dir / "evals").glob("global_step_*.jsonl"),
        key=lambda f: int(re.search(r"(\d+)", f.name).group(1)),
    )
    if not files:
        raise SystemExit(f"{args.run_dir}/evals holds no global_step_*.jsonl")
    for path in files:
        groups = collections.defaultdict(list)
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["sample"] != 0:
                continue
            correct = record["reward"] >= 1.0
            groups["all"].append(correct)
            extra = record.get("extra_info", {})
            for key in args.by:
                groups[f"{key}={extra.get(key)}"].append(correct)
        cells = [f"{name} {sum(v) / len(v):.3f} ({len(v)})" for name, v in sorted(groups.items())]
        print(f"{path.stem}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
