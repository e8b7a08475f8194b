"""Every committed dry run (benchmarks/results/dryrun/*.txt) priced again by today's estimate: the peak each one
measured (its raw output's "walk peak" or, with FSDP2, "walks' peak") beside what ``dryrun.estimate`` (the walks
alone) or ``gpu_table`` (the whole step) says now for the same command, and the ratio. A dry run takes minutes to
hours on a CPU; the estimate takes seconds, so a change to the estimate is checked against every run at once. The
measured peaks are those of the code each run was made with (its file's date): a run older than a change to the
walk itself is not re-measured here.

    python benchmarks/dryrun_estimates.py            # a markdown table on stdout
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from pathlib import Path

from verl_longstraw import dryrun
from verl_longstraw.estimate import GIB
from verl_longstraw.gpu_table import gpu_table

RESULTS = Path(__file__).resolve().parent / "results" / "dryrun"
PEAK = re.compile(r"(?:walk peak|walks' peak) ([\d.]+) GiB")


def repriced(path: Path) -> tuple[str, float, float]:
    """(the run's command line, its measured peak GiB, today's estimate GiB) of one raw dry-run output."""
    text = path.read_text()
    command = text.splitlines()[0].removeprefix("# ")
    measured = PEAK.search(text)
    if measured is None:
        raise ValueError(f"{path}: no measured peak (a run that did not finish?)")
    # the arguments, without a trailing remark in parentheses
    args = dryrun.parse_args(shlex.split(command.split("verl_longstraw.dryrun", 1)[1].split("(")[0]))
    config = dryrun.model_config(args.model or args.config, args.layers)
    # whole step or walks alone as the run was made (a --recipe run's default changed to the whole step later)
    step = dataclasses.replace(dryrun.step_of(args), fsdp2="with FSDP2" in text)
    if step.fsdp2:
        estimate = gpu_table(config, step.training, int(args.gpu_gb * 1e9)).peak
    else:
        estimate = dryrun.estimate(config, step).total_bytes
    return command, float(measured.group(1)), estimate / GIB


def main() -> int:
    rows = ["| run | command | dry-run peak GiB | estimate now GiB | estimate / dry run |", "|---|---|---:|---:|---:|"]
    below = []
    for path in sorted(RESULTS.glob("*.txt")):
        command, measured, estimate = repriced(path)
        rows.append(f"| {path.stem} | `{command}` | {measured:.2f} | {estimate:.2f} | {estimate / measured:.3f} |")
        if estimate < measured:
            below.append(path.stem)
    print("\n".join(rows))
    if below:
        print(f"\nthe estimate is below the dry run for: {', '.join(below)}")
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
