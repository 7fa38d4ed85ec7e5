"""bench_diloco_seeds: how far DiLoCo ends from dense AdamW, seed by seed (one seed does not settle 2%).

The question (issue 22): is DiLoCo within 2% of dense's validation loss at the same tokens? On the LM task's
500-step runs from scratch, the gap moves by several points with ``train_lm --seed`` (the initial weights
and the data order; the validation rows are the same). This trains each ``--methods`` method and dense
(``none``) at every ``--seeds`` seed, exactly as :mod:`benchmarks.bench_diloco` trains its loss runs (2 gloo
ranks, ``examples/train_lm.py``, cached in ``--work-dir`` as ``loss-<method>-<steps>[-s<seed>].json``), and
tables each method's gap to dense *at the same seed*, the mean and the worst over the seeds.

Written to ``harness.output_dir()``: ``bench_diloco_seeds.json/.md/.png`` (rows ``val_loss`` per seed with
the ratio to that seed's dense run, and ``gap_mean_pct`` / ``gap_worst_pct`` per method; the plot draws the
mean gaps).

Run::

    python -m benchmarks.bench_diloco_seeds --work-dir W                     # the committed result's runs
    python -m benchmarks.bench_diloco_seeds --methods diloco_q4 --seeds 0,1 --steps 100   # a short look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import convergence_runs as conv
from benchmarks.bench_diloco import _loss_runs
from benchmarks.harness import Row, output_dir, write_results
from benchmarks.lm_methods import METHODS as LM_METHODS
from benchmarks.lm_methods import load_example

__all__ = ["METHODS", "gap_rows", "main"]

NAME = "bench_diloco_seeds"
# H=10 in fp32 and 4-bit, 4-bit at outer lr 0.5, 4-bit at H=5, H=1 averaging (no local steps at all), and
# the outer lr ramp (0.5, then up to 1.0) at H=10 in fp32 and 4-bit (at once and 2 steps late), and 4-bit at
# H=15 and at H=13 2 steps late (>= 100x fewer bytes than dense)
METHODS = ("diloco", "diloco_q4", "diloco_q4_lr05", "diloco_q4_h5", "diloco_h1_avg", "diloco_ramp",
           "diloco_q4_ramp", "diloco_q4_d2_ramp", "diloco_q4_h15_ramp", "diloco_q4_h13_d2_ramp")  # fmt: skip
SEEDS = (0, 1, 2)
# seeds the outer lr ramp was not chosen on (it was chosen on seeds 0-2): the ramp and H=10 against them
MORE_SEEDS = (3, 4)
MORE_METHODS = ("diloco_q4", "diloco_ramp", "diloco_q4_ramp")
TARGET_PCT = 2.0  # issue 22: within 2% of dense's validation loss


def _final(result: Any) -> float | None:
    return result["val_losses"][-1] if isinstance(result, dict) and result.get("val_losses") else None


def gap_rows(
    found: dict[int, dict[str, Any]], methods: Sequence[str], steps: int
) -> tuple[list[Row], str, list[str]]:
    """Rows, a Markdown table (method x seed, % over dense at that seed) and verdict notes, from
    ``found[seed][method]`` (a train_lm result dict, or a status string for a run that did not finish)."""
    rows: list[Row] = []
    seeds = sorted(found)
    header = "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | worst |"
    lines = [header, "|---" * (len(seeds) + 3) + "|"]
    dense = {seed: _final(found[seed].get("none")) for seed in seeds}
    lines.append("| dense (val loss) | " + " | ".join(f"{dense[s]:.4f}" if dense[s] else "-" for s in seeds)
                 + " | | |")  # fmt: skip
    notes = []
    for seed in seeds:
        if dense[seed]:
            rows.append(
                Row(f"{steps} steps, seed {seed}", "none", "val_loss", dense[seed], "nats/byte", 1.0, "none")
            )
    for method in methods:
        gaps: list[float] = []
        cells = []
        for seed in seeds:
            value, base = _final(found[seed].get(method)), dense[seed]
            if value is None or not base:
                status = found[seed].get(method)
                cells.append("-" if not isinstance(status, str) else status.split(":")[0])
                continue
            gaps.append(100.0 * (value / base - 1.0))
            cells.append(f"{gaps[-1]:+.2f}%")
            rows.append(
                Row(
                    f"{steps} steps, seed {seed}",
                    method,
                    "val_loss",
                    value,
                    "nats/byte",
                    value / base,
                    "none",
                )
            )
        if len(gaps) == len(seeds):
            mean, worst = statistics.fmean(gaps), max(gaps)
            case = f"{steps} steps, over seeds {','.join(map(str, seeds))}"
            rows.append(Row(case, method, "gap_mean_pct", mean, "% over dense"))
            rows.append(Row(case, method, "gap_worst_pct", worst, "% over dense"))
            cells += [f"{mean:+.2f}%", f"{worst:+.2f}%"]
            verdict = (
                "meets"
                if worst <= TARGET_PCT
                else ("meets on average only" if mean <= TARGET_PCT else "misses")
            )
            notes.append(
                f"{method}: {mean:+.2f}% over dense on average over seeds {seeds}, {worst:+.2f}% at worst: "
                f"{verdict} the {TARGET_PCT:.0f}% target"
            )
        else:
            cells += ["", ""]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return rows, "\n".join(lines), notes


def main(argv: Sequence[str] | None = None) -> str:
    """Train what is missing from ``--work-dir``, write ``bench_diloco_seeds.*``; return the Markdown."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=conv.FULL_STEPS)
    parser.add_argument("--methods", default=",".join(METHODS), help="train_lm methods besides dense (none)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--more-seeds", default=",".join(map(str, MORE_SEEDS)),
                        help="further seeds, for --more-methods only: a second table over all the seeds")
    parser.add_argument("--more-methods", default=",".join(MORE_METHODS))
    parser.add_argument("--parallel", type=int, default=1, help="loss runs at once (2 cores each)")
    parser.add_argument("--reuse-only", action="store_true", help="train nothing: a missing run is a '-'")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep (and reuse) each run's result")
    args = parser.parse_args(argv)
    started = time.monotonic()
    train_lm = load_example()
    methods = [m for m in args.methods.split(",") if m]
    more_methods = [m for m in args.more_methods.split(",") if m]
    unknown = sorted(set(methods + more_methods) - set(LM_METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; see benchmarks/lm_methods.py METHODS")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    more_seeds = [int(s) for s in args.more_seeds.split(",") if s] if more_methods else []
    work = args.work_dir or Path(output_dir()) / "bench_diloco-work"
    work.mkdir(parents=True, exist_ok=True)
    data = train_lm.prepare_data(train_lm.default_data_dir()).train.parent
    found: dict[int, dict[str, Any]] = {}
    for seed in seeds + more_seeds:
        settings = conv.Settings(args.steps, 2, 0, data, work, True, args.reuse_only, seed=seed)
        wanted = ["none", *(methods if seed in seeds else []), *more_methods]
        found[seed] = _loss_runs([(m, settings) for m in dict.fromkeys(wanted)], args.parallel)[
            args.steps
        ]
    rows, table, notes = gap_rows({s: found[s] for s in seeds}, methods, args.steps)
    more_table = ""
    if more_seeds:
        more_rows, more_table, more_notes = gap_rows(found, more_methods, args.steps)
        known = {(r.case, r.backend, r.metric) for r in rows}
        rows += [r for r in more_rows if (r.case, r.backend, r.metric) not in known]
        notes += more_notes
    notes.append(
        f"{args.steps} steps of examples/train_lm.py per run (2 gloo ranks, AdamW inner lr 2e-3, warm-up 30, "
        "cosine), the same tokens per rank as dense; a seed sets the initial weights and the data order, the "
        "validation rows are the same; each gap is against dense's run at the same seed"
    )
    notes.append(f"benchmark wall time: {time.monotonic() - started:.0f} s")
    text = write_results(NAME, rows, notes=notes, plot_metric="gap_mean_pct")
    text += f"\n## Validation loss over dense's at the same seed, {args.steps} steps\n\n{table}\n"
    if more_table:
        text += (f"\n## The same over seeds {seeds + more_seeds} ({more_seeds}: not used to choose the outer "
                 f"lr ramp)\n\n{more_table}\n")
    (output_dir() / f"{NAME}.md").write_text(text)
    print(text, file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
