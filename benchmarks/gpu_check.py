"""One-command GPU check of what a real GPU run uses, under a hard time budget: each stage in a process of its own.

    python benchmarks/gpu_check.py                     # one GPU, ends within --budget-seconds (360 s by default)
    python benchmarks/gpu_check.py --tiny              # the CPU rehearsal at tiny sizes (every case)
    python benchmarks/gpu_check.py --stages equivalence --families gpt_oss kimi_linear
    python benchmarks/gpu_check.py --rerun-failed benchmarks/results/gpu_check.json --budget-seconds 240
    python benchmarks/gpu_check.py --tiny --calibrate  # seconds of the calibration row (scripts/rehearse_device.sh)

The stages run in this order, ``benchmarks/gpu_check_stages.py`` has what each compares: ops (the prefix-attention
ops at real layer shapes, gpt-oss's sinks included) and scale (memory and time at growing prompt length at real
widths), the only real-shape measurements, then equivalence and fsdp2 (every tiny model case, newest first,
bfloat16 -> autocast -> float32). Each stage runs in a fresh process (``gpu_check_stages.py``) with a deadline: its
share (SHARES) of the budget left, what earlier stages left unused going to the later ones, less the last stage's
overrun and END_SECONDS for the end. A process still running OVERRUN_SECONDS past its deadline (an NCCL hang, a CUDA
backward that never returns: C++ that no signal interrupts) is killed and recorded as hung. So a sticky CUDA error or
a hang costs its stage only, and the rows it wrote before stay.

The report (``--out``, ``benchmarks/results/`` by default; ``gpu_check.json`` / ``.md``, ``gpu_check_tiny.*`` with
``--tiny``) is rewritten after every stage: the rows of each stage (a row's ``key`` names it: ``row_key``), what each
stage planned, the rows never compared (skipped at a time limit, failed to run, or planned but not reached) and
those whose verdict failed, per stage, kernels per stage, versions, machine, stage errors (with hung stages) and
seconds. The markdown opens with a summary per stage that names the rows never compared, newest first. The exit
status is 1 when any planned row was never compared (stderr names them), else 0; verdicts are in the report.

``--rerun-failed REPORT`` runs only the rows REPORT lacks, never compared or failed (a stage REPORT never planned
runs whole), and writes the merged report: REPORT's passed rows with the new ones. Needs only the standard library;
the stages need torch and transformers (flash-linear-attention when installed, warmed before a row's clock).
``benchmarks/device_run.sh`` runs it on a lent GPU machine (``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAGES_SCRIPT = HERE / "gpu_check_stages.py"
STAGES = ("ops", "scale", "equivalence", "fsdp2")  # the run's order: the real-shape stages before the tiny rows
SHARES = {"ops": 0.1, "scale": 0.4, "equivalence": 0.33, "fsdp2": 0.17}  # of the budget left for the stages
OVERRUN_SECONDS = 30.0  # how long a stage's process may run past its deadline before it is killed as hung
END_SECONDS = 5.0  # the last report, after the last stage's overrun, still inside the budget
NO_KERNELS = {"attention": {}, "gated_delta_rule": []}  # a stage that recorded none
EQUIVALENCE_DTYPES = ("bfloat16", "autocast_bfloat16", "float32")  # a case's rows in this order
CALIBRATION_ROW = "qwen3 float32"  # the equivalence row whose seconds compare a CPU with the lent GPU
# its seconds on the lent H200 until a device run's report (DEVICE_REPORT) has them: the GPU review's estimate of a
# launch-bound tiny evaluation (0.7-1.5 s)
ASSUMED_DEVICE_CALIBRATION_SECONDS = 1.0
DEVICE_REPORT = HERE / "results" / "gpu_check.json"


def row_key(stage: str, row: dict) -> str:
    """The name of ``row`` of ``stage`` (a scale row: of its series), the same in every run."""
    if stage == "equivalence":
        return f"{row['family']} {row['dtype']}"
    if stage == "fsdp2":
        return row["family"]
    if stage == "ops":
        return f"{row['shape']} {row['op']}"
    return f"{row['model']} G={row['G']} {row['path']}"


def verdict(stage: str, rows: list[dict]) -> str:
    """"passed", "failed" or "never compared" of the rows of one key: a row skipped (time limit, error, out of
    memory) never compared; a scale series compared when one step fit or ran out of memory, failed when a step
    raised."""
    if stage == "scale":
        if any(str(r.get("skipped", "")).startswith(("error", "warming")) for r in rows):
            return "failed"
        return "passed" if any(r.get("fits") is not None for r in rows) else "never compared"
    if not rows or "skipped" in rows[-1]:
        return "never compared"
    return "passed" if rows[-1].get("passed", True) else "failed"


def verdicts(stage: str, planned: list[str], rows: list[dict]) -> dict[str, str]:
    """``verdict`` of each planned key."""
    by_key: dict[str, list[dict]] = {key: [] for key in planned}
    for row in rows:
        by_key.setdefault(row["key"], []).append(row)
    return {key: verdict(stage, key_rows) for key, key_rows in by_key.items()}


# -- the report -----------------------------------------------------------------------------------------------------

def error_cells(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']} | | |"
    lp = f"{r['log_prob_error']:.2e} ({r['standard_log_prob_error']:.2e})"
    grad = f"{r['grad_rel_l2']:.2e} ({r['standard_grad_rel_l2']:.2e})"
    return f"{lp} | {grad} | {r['passed']} |"


ERROR_HEADER = "max abs log-prob error (standard path's) | gradient rel L2 (standard's) | passed |"


def family_cell(r: dict) -> str:
    """A row's family, with the number of groups its errors are the largest over when that is more than one."""
    groups = r.get("groups", 1)
    return r["family"] if groups == 1 else f"{r['family']} (largest of {groups} groups)"


def equivalence_markdown(rows: list[dict]) -> list[str]:
    return ["## Equivalence vs the float32 standard path", "", f"| case | dtype | {ERROR_HEADER}",
            "|---|---|---|---|---|", *(f"| {family_cell(r)} | {r['dtype']} | {error_cells(r)}" for r in rows)]


def fsdp2_markdown(rows: list[dict]) -> list[str]:
    return ["## FSDP2 (1 rank, bfloat16 parameters, float32 reduce, autocast) vs the float32 standard path", "",
            f"| case | {ERROR_HEADER}", "|---|---|---|---|", *(f"| {family_cell(r)} | {error_cells(r)}" for r in rows)]


def ops_markdown(rows: list[dict]) -> list[str]:
    lines = ["## Attention ops, bfloat16 forward + backward, vs float64 (relative L2 of output and input "
             "gradients, sinks' included; standard: the baseline named, in bfloat16)", "",
             "| shape | op | T | P | paths | standard | largest error / standard's | passed | s (standard s) | "
             "peak GiB above inputs (standard) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['op']} | | | skipped: {r['skipped']} | | | | | |")
            continue
        peak = ("-" if r["peak_bytes"] is None else
                f"{r['peak_bytes'] / 2**30:.2f} ({r['standard_peak_bytes'] / 2**30:.2f})")
        lines.append(f"| {r['shape']} | {r['op']} | {r['T']} | {r['P']} | {r['paths']} | {r['standard']} | "
                     f"{r['error_ratio']:.2f} | {r['passed']} | {r['seconds']:.3f} ({r['standard_seconds']:.3f}) | "
                     f"{peak} |")
    return lines


def longest_fitting(rows: list[dict]) -> list[dict]:
    longest: dict = {}
    for r in rows:
        if "P" in r and not r.get("warm_up"):
            key = (r["model"], r["G"], r["path"])
            longest[key] = max(longest.get(key, 0), r["P"] if r["fits"] else 0)
    return [{"model": m, "G": g, "path": p, "P": n} for (m, g, p), n in longest.items()]


def scale_markdown(rows: list[dict], memory_metric: str) -> list[str]:
    def gib(n: int | None) -> str:
        return "" if n is None else f"{n / 2**30:.3f}"

    lines = [f"## Peak memory ({memory_metric}) and seconds", "",
             "| model | G | path | P | peak GiB (estimate) | pinned host GiB (estimate) | seconds | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            warm = " (warm-up)" if r.get("warm_up") else ""
            lines.append(f"| {r['model']} | {r.get('G', '')} | {r.get('path', '')} | {r.get('P', '')}{warm} | "
                         f"skipped: {r['skipped']} | | | |")
            continue
        peak = f"{gib(r['peak_bytes'])} ({gib(r['estimated_total_bytes']) or '-'})" if r["fits"] else "OOM"
        host = f"{gib(r['host_peak_bytes'])} ({gib(r['estimated_host_bytes'])})" if "host_peak_bytes" in r else ""
        secs = f"{r['seconds']:.2f}" if r["fits"] else ""
        lines.append(f"| {r['model']} | {r['G']} | {r['path']} | {r['P']} | {peak} | {host} | {secs} | {r['fits']} |")
    lines += ["", "## Longest P that fits", "", "| model | G | path | longest P |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['G']} | {r['path']} | {r['P']} |" for r in longest_fitting(rows)]
    lines += ["", "## Prompt state streamed from the host against resident (exact_streamed / exact_host)", "",
              "| model | G | P | seconds ratio | peak ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['G']} | {r['P']} | {r['seconds']:.3f} | {r['peak']:.3f} |"
              for r in streamed_against_resident(rows)]
    return lines


def streamed_against_resident(rows: list[dict]) -> list[dict]:
    """Per (model, G, P) where both fit: the ``exact_streamed`` row's seconds and peak bytes over the ``exact_host``
    row's (the same walk with the prompt state resident on the device)."""
    fitting = {(r["model"], r["G"], r["P"], r["path"]): r for r in rows
               if r.get("fits") and not r.get("warm_up") and "skipped" not in r}
    return [{"model": model, "G": g, "P": length,
             "seconds": streamed["seconds"] / resident["seconds"],
             "peak": streamed["peak_bytes"] / resident["peak_bytes"]}
            for (model, g, length, path), streamed in fitting.items() if path == "exact_streamed"
            and (resident := fitting.get((model, g, length, "exact_host"))) is not None]


def stage_markdown(result: dict, stage: str) -> list[str]:
    """``stage``'s section: its rows, the rows never compared, and what stopped it (an error outside its rows, a
    hang) or why it did not run."""
    rows = result[stage]
    memory_metric = "torch.cuda.max_memory_allocated" if result["device"] not in ("cpu", None) else \
        "bytes saved for backward"
    lines = {"equivalence": equivalence_markdown, "fsdp2": fsdp2_markdown, "ops": ops_markdown,
             "scale": lambda r: scale_markdown(r, memory_metric)}[stage](rows)
    never, planned = result["never_compared"].get(stage), result["planned"].get(stage)
    if never:
        counts = f" ({len(never)} of {len(planned)} planned)" if planned else ""
        lines += ["", f"**Never compared**{counts}: {', '.join(never)}"]
    if stage in result["not_run"]:
        lines += ["", f"**Not run**: {result['not_run'][stage]}"]
    if stage in result["stage_errors"]:
        lines += ["", "**Stopped by an error outside its rows:**", "", "```", result["stage_errors"][stage], "```"]
    return lines


def summary_markdown(result: dict) -> list[str]:
    lines = ["| stage | planned | passed | failed | never compared (newest first) | seconds |",
             "|---|---|---|---|---|---|"]
    for stage in result["stage_order"]:
        planned, never = result["planned"].get(stage, []), result["never_compared"].get(stage, [])
        failed = result["failed"].get(stage, [])
        seconds = result["stage_seconds"].get(stage)
        lines.append(f"| {stage} | {len(planned)} | {len(planned) - len(failed) - len(never)} | {len(failed)} | "
                     f"{len(never)}{': ' + ', '.join(never) if never else ''} | "
                     f"{'' if seconds is None else f'{seconds:.0f}'} |")
    return lines


def markdown(result: dict) -> str:
    lines = ["# GPU check", "", f"device: {result['device']}, total {result['seconds']:.0f} s "
             f"(budget {result['budget_seconds']:.0f} s)" + (f", a rerun of {result['rerun_of']}"
                                                             if result["rerun_of"] else ""), "",
             f"Machine: {result['machine']}", "", f"Versions: {result['versions']}", "",
             "## Summary", "", *summary_markdown(result), "",
             "## Kernels per stage", "", "| stage | prefix attention (calls per path) | gated delta rule |",
             "|---|---|---|"]
    for stage, kernels in result["kernels"].items():
        lines.append(f"| {stage} | {kernels['attention']} | {'; '.join(kernels['gated_delta_rule']) or '-'} |")
    for stage in result["stage_order"]:
        lines += ["", *stage_markdown(result, stage)]
    return "\n".join(lines) + "\n"


class Report:
    """The run's ``result``, written as ``<stem>.json`` and ``<stem>.md`` under ``out`` when made and rewritten after
    every stage, each file replaced whole (a kill leaves the last complete one)."""

    def __init__(self, result: dict, out: Path, stem: str, started: float):
        self.result, self.out, self.stem, self.started = result, out, stem, started
        self.write()

    def write(self) -> None:
        result = self.result
        result["seconds"] = time.monotonic() - self.started
        result["longest_fitting_P"] = longest_fitting(result["scale"])
        for stage in result["planned"]:
            states = verdicts(stage, result["planned"][stage], result[stage])
            result["never_compared"][stage] = [k for k, v in states.items() if v == "never compared"]
            result["failed"][stage] = [k for k, v in states.items() if v == "failed"]
            if not states and stage in result["stage_errors"]:  # it ended before it planned its rows
                result["never_compared"][stage] = [f"every {stage} row (the stage ended before planning them)"]
        self.out.mkdir(parents=True, exist_ok=True)
        for suffix, text in ((".json", json.dumps(result, indent=1)), (".md", markdown(result))):
            path = self.out / f"{self.stem}{suffix}"
            staged = path.with_name(f"{path.name}.partial")
            staged.write_text(text)
            staged.replace(path)


# -- the stages' processes ------------------------------------------------------------------------------------------

def run_stage_process(stage: str, deadline: float, overrun: float, tiny: bool, families: list[str] | None,
                      skip: list[str], folder: Path) -> tuple[dict | None, str | None]:
    """Run ``stage`` in a process of its own until ``deadline`` (monotonic seconds), killed (its process group,
    SIGKILL) ``overrun`` seconds past it, on the cases ``families`` (None: every case): (its part, or None when it
    wrote none; why it ended badly, or None)."""
    part = folder / f"{stage}.json"
    skip_file = folder / f"{stage}.skip.json"
    skip_file.write_text(json.dumps(skip))
    command = [sys.executable, str(STAGES_SCRIPT), "--stage", stage, "--part", str(part), "--until", repr(deadline),
               "--skip-file", str(skip_file), *(["--families", *families] if families else []),
               *(["--tiny"] if tiny else [])]
    process = subprocess.Popen(command, start_new_session=True)
    problem = None
    try:
        status = process.wait(timeout=max(deadline + overrun - time.monotonic(), 1.0))
        if status:
            problem = f"its process exited with status {status}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        problem = f"hung: its process was still running {overrun:.0f} s past the stage's deadline and was killed"
    return (json.loads(part.read_text()) if part.exists() else None), problem


def merge(result: dict, stage: str, part: dict | None, problem: str | None, old: dict | None) -> None:
    """Put ``stage``'s ``part`` into ``result``: its rows after ``old``'s passed rows (a rerun), in the planned
    order; its kernels, its stage error or ``problem``; the machine facts of the first part."""
    kept = _passed_rows(old, stage)
    planned = list(dict.fromkeys([*(old or {}).get("planned", {}).get(stage, []), *(part or {}).get("planned", [])]))
    rows = kept + (part or {}).get("rows", [])
    order = {key: i for i, key in enumerate(planned)}
    result[stage] = sorted(rows, key=lambda r: order.get(r["key"], len(order)))  # stable: a series keeps its steps
    result["planned"][stage] = planned
    if part is None and not problem:
        problem = "its process wrote no part"
    errors = [text for text in ((part or {}).get("stage_error"), problem) if text]
    if errors:
        result["stage_errors"][stage] = "\n".join(errors)
    if part is not None:
        result["kernels"][stage] = part["kernels"] or NO_KERNELS
        if result["device"] is None:
            result.update(device=part["device"], machine=part["machine"], versions=part["versions"])


def _passed_rows(old: dict | None, stage: str) -> list[dict]:
    """``old``'s rows of ``stage`` whose key passed (kept by a rerun); [] without ``old``."""
    if old is None or stage not in old.get("planned", {}):
        return []
    states = verdicts(stage, old["planned"][stage], old[stage])
    return [r for r in old[stage] if states.get(r["key"]) == "passed"]


def device_calibration_seconds() -> tuple[float, str]:
    """(seconds of CALIBRATION_ROW on the lent GPU, where that number comes from)."""
    if DEVICE_REPORT.exists():
        report = json.loads(DEVICE_REPORT.read_text())
        rows = [r for r in report.get("equivalence", []) if r.get("key") == CALIBRATION_ROW and "skipped" not in r]
        if rows:
            return rows[0]["seconds"], f"{DEVICE_REPORT.relative_to(HERE.parent)} ({report['device']})"
    return ASSUMED_DEVICE_CALIBRATION_SECONDS, "assumed (no device report yet: the GPU review's estimate)"


def calibrate(tiny: bool, timeout: float) -> dict:
    """CALIBRATION_ROW's seconds on this machine, against the lent GPU's, and the budget scale a CPU rehearsal
    gives gpu_check: this machine's seconds over the device's, at least 1."""
    family, dtype = CALIBRATION_ROW.split()
    skip = [f"{family} {name}" for name in EQUIVALENCE_DTYPES if name != dtype]
    with tempfile.TemporaryDirectory() as folder:
        part, problem = run_stage_process("equivalence", time.monotonic() + timeout, OVERRUN_SECONDS, tiny, (family,),
                                          skip, Path(folder))
    rows = (part or {}).get("rows", [])
    if problem or not rows or "skipped" in rows[0]:
        raise RuntimeError(f"the calibration row did not run: {problem or rows}")
    device_seconds, source = device_calibration_seconds()
    seconds = rows[0]["seconds"]
    return {"row": CALIBRATION_ROW, "seconds": seconds, "device_seconds": device_seconds, "device_source": source,
            "budget_scale": max(1.0, seconds / device_seconds)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, small sizes (every case)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--budget-seconds", type=float, default=360.0,
                        help="the whole run, the stages' imports included, ends within this")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=STAGES, help="run these (in the run's order)")
    parser.add_argument("--families", nargs="+", metavar="CASE",
                        help="the equivalence / FSDP2 cases to run, newest first whatever the order given (default: "
                             "every case of gpu_check_stages.CASES_NEWEST_FIRST, which the stage checks the names "
                             "against)")
    parser.add_argument("--rerun-failed", type=Path, metavar="REPORT",
                        help="run only the rows REPORT lacks, never compared or failed; write the merged report")
    parser.add_argument("--overrun-seconds", type=float, default=OVERRUN_SECONDS,
                        help="a stage's process is killed this long past its deadline")
    parser.add_argument("--calibrate", action="store_true", help=f"print {CALIBRATION_ROW!r}'s seconds as JSON")
    for stage, share in SHARES.items():
        parser.add_argument(f"--{stage}-seconds", type=float, default=None,
                            help=f"this stage's time (default {100 * share:.0f} percent of the budget left)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, started: float | None = None) -> dict:
    """Run the stages within the budget and return the result, also written under ``--out`` (module docstring)."""
    args = parse(argv)
    started = time.monotonic() if started is None else started
    if args.calibrate:
        calibration = calibrate(args.tiny, args.budget_seconds)
        print(json.dumps(calibration), flush=True)
        return calibration
    end = started + max(args.budget_seconds - args.overrun_seconds - END_SECONDS, 0.1 * args.budget_seconds)
    old = json.loads(args.rerun_failed.read_text()) if args.rerun_failed else None
    old_stages = set(old["planned"]) if old else set()
    stages = [stage for stage in STAGES if stage in args.stages or stage in old_stages]
    result = {"device": None, "machine": None, "versions": None, "budget_seconds": args.budget_seconds,
              "rerun_of": str(args.rerun_failed) if old else None, "stage_order": stages, "stage_seconds": {},
              "kernels": {}, "stage_errors": {}, "not_run": {}, "planned": {}, "never_compared": {}, "failed": {},
              **{stage: [] for stage in STAGES}}
    report = Report(result, args.out, "gpu_check_tiny" if args.tiny else "gpu_check", started)
    # a rerun carries over, as they were, REPORT's stages not selected and those whose every row passed
    carried = {stage: "not selected (--stages)" for stage in stages if stage not in args.stages}
    carried |= {stage: f"every row passed in {args.rerun_failed}" for stage in stages if stage in old_stages
                and set(verdicts(stage, old["planned"][stage], old[stage]).values()) == {"passed"}}
    for stage, why in carried.items():
        result["planned"][stage], result[stage] = old["planned"][stage], old[stage]
        result["not_run"][stage] = why
        result["kernels"][stage] = old["kernels"].get(stage, NO_KERNELS)
        if stage in old["stage_errors"]:
            result["stage_errors"][stage] = old["stage_errors"][stage]
        result.update({k: old[k] for k in ("device", "machine", "versions") if result[k] is None})
    to_run = [stage for stage in stages if stage not in carried]
    with tempfile.TemporaryDirectory() as folder:
        for index, stage in enumerate(to_run):
            seconds = getattr(args, f"{stage}_seconds")
            if seconds is None:  # its share of the time left (what earlier stages left unused goes to the later ones)
                seconds = (end - time.monotonic()) * SHARES[stage] / sum(SHARES[s] for s in to_run[index:])
            stage_started = time.monotonic()
            skip = [r["key"] for r in _passed_rows(old, stage)]
            part, problem = run_stage_process(stage, min(end, stage_started + max(seconds, 0.0)),
                                              args.overrun_seconds, args.tiny, args.families, skip, Path(folder))
            merge(result, stage, part, problem, old)
            result["stage_seconds"][stage] = time.monotonic() - stage_started
            report.write()
            print("\n".join(stage_markdown(result, stage)) + "\n", flush=True)
    report.write()
    return result


def exit_status(result: dict) -> int:
    """1 when a planned row was never compared (named on stderr, as in the report), else 0."""
    never = {stage: keys for stage, keys in result["never_compared"].items() if keys}
    for stage, keys in never.items():
        print(f"gpu_check: {stage}: {len(keys)} of {len(result['planned'][stage])} planned rows never compared: "
              f"{', '.join(keys)}", file=sys.stderr, flush=True)
    return 1 if never else 0


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if "budget_scale" in outcome else exit_status(outcome))
