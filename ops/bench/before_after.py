"""Before/after: run one bench from two checkouts, interleaved (A B A B ...), and compare its figures.

The "before" tree is a temporary `git worktree add --detach` of `--before REF` (removed at the
end); the "after" tree is this checkout as it is (uncommitted changes included), or a second
temporary worktree with `--after REF`. Both run with this script's Python (the same venv) and,
per tree, `PYTHONPATH=<tree>` and the tree as working directory, so every import (and every
process the bench starts with `python -m ...`) comes from that tree, never from where the venv's
editable install points; the script checks that before timing anything.

Figures are read from each run's output with regular expressions: a preset per known bench
(`gateway_overhead`, `engine_gsp`, chosen from the bench's name), or your own `--figure REGEX`
(named groups `v_<metric>` are values, other named groups name the figure; a group `X_eq`
names it `X=<match>`). The table shows every
round's value, the median per tree, and after / before of the medians, flagged where it is
outside `--tolerance` (issue 19 asks for +-5%). Figures of code that is the same in both trees
(engine_gsp's transformers rows, gateway_overhead's direct rows) are the control: their spread is
the machine's noise. Rounds run A B A B (`--order abba`: A B B A).

    .venv/bin/python ops/bench/before_after.py --before 3be0e08 [--after REF] [--rounds 2] -- \\
        python -m ops.bench.gateway_overhead --seconds 5 --concurrency 1,64 --no-stream
    .venv/bin/python ops/bench/before_after.py --before 3be0e08 -- \\
        python ops/bench/engine_gsp.py --home "$PWD/.tollway" --skip-generate-batch

`python` as the command's first word means this script's interpreter. Use an absolute `--home`
for benches that load the model: each bench runs in its own tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("accounting", "cache", "gateway", "kernels", "ops", "workers")

_RPS = r"(?P<v_req_s>[\d,]+) req/s\s+p50\s+(?P<v_p50_ms>[\d.]+) ms\s+p99\s+(?P<v_p99_ms>[\d.]+) ms"
_ROW = r"\s+(?P<v_out_tok_s>[\d.]+)\s+(?P<v_tot_tok_s>[\d.]+)\s+(?P<v_ttft_p50_s>[\d.]+)\s+(?P<v_ttft_p99_s>[\d.]+)"
PRESETS: dict[str, dict[str, object]] = {
    "gateway_overhead": {
        "section": None,
        "figures": [
            rf"^\s+(?P<target>direct|gateway)\s+C=(?P<C_eq>\d+)\s*(?P<stream>stream)?\s+{_RPS}",
            r"^\s*(?P<C_eq>\d+) \|[^|]*\|[^|]*\|\s*(?P<v_added_p50_ms>[+-][\d.]+)\s+(?P<v_added_p99_ms>[+-][\d.]+)"
            r"\s*\|\s*(?P<v_gw_cpu_ms_per_req>[\d.]+)",
        ],
    },
    "engine_gsp": {
        "section": r"^(?P<section>shared-prefix|no-sharing) workload",
        "figures": [
            rf"^(?P<mode>tollway engine|transformers static \w+|transformers generate_batch){_ROW}",
            r"^TTFT one request at a time: cold (?P<v_cold_ms>[\d.]+) ms, system prompt cached (?P<v_cached_ms>[\d.]+) ms",
            r"^decode step at batch 32.*?: (?P<v_step_ms>[\d.]+) ms; matmuls alone (?P<v_matmuls_ms>[\d.]+) ms",
        ],
    },
}


def parse_figures(output: str, patterns: list[str], section: str | None) -> dict[str, float]:
    """Every value a pattern matches in `output`, by name: section, naming groups, metric."""
    figures: dict[str, float] = {}
    current = ""
    compiled = [re.compile(p) for p in patterns]
    for line in output.splitlines():
        if not line.strip():  # a blank line ends a section
            current = ""
        if section and (found := re.match(section, line)):
            current = found.group("section")
            continue
        for pattern in compiled:
            if not (match := pattern.match(line)):
                continue
            names = [current] + [f"{k.removesuffix('_eq')}={v}" if k.endswith("_eq") else v
                                 for k, v in match.groupdict().items() if not k.startswith("v_") and v]
            for key, value in match.groupdict().items():
                if key.startswith("v_") and value is not None:
                    label = " ".join(n for n in [*names, key[2:]] if n)
                    figures[label] = float(value.replace(",", ""))
    return figures


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A detached worktree of `ref` in a temp folder, removed (and pruned) afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="tollway-before-after-"))
    path = parent / "tree"
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True, text=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(path)], check=False,
                       capture_output=True)
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "prune"], check=False, capture_output=True)
        shutil.rmtree(parent, ignore_errors=True)


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports(tree: Path) -> None:
    """Every first-party package must import from `tree` (PYTHONPATH beats the editable install)."""
    code = "import importlib, sys\n" + "".join(
        f"m = importlib.import_module({p!r}); print({p!r}, list(m.__path__)[0])\n" for p in PACKAGES)
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=tree_env(tree), capture_output=True,
                          text=True, check=False)
    wrong = [line for line in done.stdout.splitlines() if not line.split(" ", 1)[1].startswith(str(tree))]
    if done.returncode != 0 or wrong:
        raise SystemExit(f"imports do not come from {tree}: {wrong or done.stderr}")


def run_bench(tree: Path, command: list[str], label: str, log_dir: Path, round_no: int) -> str:
    argv = [sys.executable if command[0] in ("python", "python3") else command[0], *command[1:]]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=tree_env(tree), capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    (log_dir / f"{label}-{round_no}.log").write_text(output)
    print(f"  round {round_no} {label:6} ({tree}): exit {done.returncode}, {time.perf_counter() - start:.0f} s",
          flush=True)
    if done.returncode != 0:
        raise SystemExit(f"the bench failed in {tree} ({label}):\n{output[-3000:]}")
    return output


def report(before: list[dict[str, float]], after: list[dict[str, float]], tolerance: float) -> int:
    """The table; returns how many figures are outside the tolerance."""
    labels = [k for k in before[0] if k in after[0]]
    missing = sorted(set(before[0]) ^ set(after[0]))
    width = max((len(k) for k in labels), default=10)
    rounds = len(before)
    print(f"\n{'figure':{width}} | {'before (each round)':>{10 * rounds}} | {'after (each round)':>{10 * rounds}}"
          f" | {'before med':>10} {'after med':>10} {'after/before':>12}")
    outside = 0
    for label in labels:
        b = [run.get(label, float("nan")) for run in before]
        a = [run.get(label, float("nan")) for run in after]
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = ma / mb if mb else float("nan")
        flag = "" if abs(ratio - 1) <= tolerance else f"  outside +-{tolerance:.0%}"
        outside += bool(flag)
        print(f"{label:{width}} | {''.join(f'{v:10.2f}' for v in b)} | {''.join(f'{v:10.2f}' for v in a)}"
              f" | {mb:10.2f} {ma:10.2f} {ratio:11.3f}x{flag}")
    if missing:
        print(f"(figures only one side printed: {', '.join(missing)})")
    return outside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--before", required=True, help="git ref of the 'before' tree")
    parser.add_argument("--after", default=None, help="git ref of the 'after' tree (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs (interleaved)")
    parser.add_argument("--order", choices=("abab", "abba"), default="abab",
                        help="abba swaps each pair's order every other round (no side always first)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: from the bench's name")
    parser.add_argument("--figure", action="append", default=[], help="a regex of figures (see above)")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--logs", type=Path, default=None, help="keep every run's output here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the bench command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the bench command after --")
    preset_name = args.preset or next((name for name in PRESETS if any(name in part for part in command)), None)
    preset = PRESETS.get(preset_name or "", {"section": None, "figures": []})
    patterns = [*args.figure, *(preset["figures"] if isinstance(preset["figures"], list) else [])]
    if not patterns:
        parser.error("no figures to read: give --preset or --figure")
    section = preset["section"] if isinstance(preset["section"], str) else None
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="tollway-before-after-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    with worktree(args.before) as before_tree:
        after_ctx = worktree(args.after) if args.after else nullpath(REPO_ROOT)
        with after_ctx as after_tree:
            for tree in (before_tree, after_tree):
                check_imports(tree)
            print(f"before: {args.before} at {before_tree}\nafter:  {args.after or 'this checkout'} at {after_tree}\n"
                  f"bench:  {' '.join(command)}  ({args.rounds} rounds, interleaved; preset {preset_name}; "
                  f"logs in {log_dir})", flush=True)
            runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for round_no in range(1, args.rounds + 1):
                order = [("before", before_tree), ("after", after_tree)]
                for label, tree in order if round_no % 2 or args.order == "abab" else order[::-1]:
                    output = run_bench(tree, command, label, log_dir, round_no)
                    runs[label].append(parse_figures(output, patterns, section))
    if not runs["before"][0] or not runs["after"][0]:
        raise SystemExit(f"no figures matched; see the logs in {log_dir}")
    outside = report(runs["before"], runs["after"], args.tolerance)
    print(f"\n{outside} figure(s) outside +-{args.tolerance:.0%} (medians of {args.rounds} rounds)")


@contextmanager
def nullpath(path: Path) -> Iterator[Path]:
    yield path


if __name__ == "__main__":
    main()
