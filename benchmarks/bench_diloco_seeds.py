"""bench_diloco_seeds: how far DiLoCo ends from dense AdamW at every seed, read against dense's own noise.

The question (issue 37): at which settings is DiLoCo within a target of dense's validation loss at *every*
seed (the worst seed, not the mean)? Each row of :data:`SETTINGS` is trained at every ``--seeds`` seed
(``train_lm`` seed: the initial weights and the data order; the validation rows are the same) on the LM of
``examples/train_lm.py``, at :data:`benchmarks.diloco_jobs.SMALL_MODEL`'s size by default (cheap enough
for six seeds per row on two cores), and compared with its reference row (dense, or the same setting
applied at once for an overlapped one) *at the same seed*. The first row is the noise: dense against dense
with another data order (``data_seed = seed + 100``), so every gap is read against what a rerun of dense
itself moves.

Rows are chosen on seeds 0-2 and confirmed on 3-5 (:data:`CHOICE_SEEDS`, :data:`CONFIRM_SEEDS`); the runs
are :class:`benchmarks.diloco_jobs.Job` s, cached in ``--work-dir``.

Written to ``harness.output_dir()``: ``bench_diloco_seeds.json/.md/.png`` (``_<steps>`` added for runs longer
than 250 steps) (rows ``val_loss`` per
seed with the ratio to its reference, ``gap_mean_pct`` / ``gap_worst_pct`` per setting and
``fewer_bytes`` against dense fp32 gradients; the plot draws the mean and the worst gap side by side).

Run::

    python -m benchmarks.bench_diloco_seeds --work-dir W                      # the committed result
    python -m benchmarks.bench_diloco_seeds --steps 1500 --seeds 0,1,2 --rows none,diloco_q4_defaults
    python -m benchmarks.bench_diloco_seeds --rows none,sparseloco --seeds 0,1 --steps 60   # a short look
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.diloco_jobs import WORLD, Job, run_jobs
from benchmarks.harness import Row, output_dir, write_results

__all__ = ["CHOICE_SEEDS", "CONFIRM_SEEDS", "SETTINGS", "Setting", "gap_rows", "jobs_of", "main"]

NAME = "bench_diloco_seeds"
STEPS = 250
CHOICE_SEEDS = (0, 1, 2)  # the defaults were chosen on these
CONFIRM_SEEDS = (3, 4, 5)  # and confirmed on these, which played no part in choosing them
REORDER = 100  # dense's noise: data_seed = seed + REORDER
_Q4 = {"sync_every": 10, "compressor": "quantize", "bits": 4}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row: ``options`` None is dense DDP AdamW, else ``fastcomm.DiLoCo``'s keyword arguments; the gap
    is against row ``against`` at the same seed, and ``target`` (%) is the issue's limit for it."""

    description: str
    options: dict[str, Any] | None
    against: str = "none"
    target: float | None = None
    reorder: bool = False


SETTINGS: dict[str, Setting] = {
    "none": Setting("dense DDP AdamW", None, against=""),
    "none_reorder": Setting("dense with another data order (the noise)", None, reorder=True),
    "diloco_q4_defaults": Setting("DiLoCo(sync_every=10, compressor='quantize', bits=4), nothing else set",
                                  dict(_Q4), target=2.0),
    "diloco_q4_paper_outer": Setting("the same with the paper's outer step (Nesterov lr 0.7, momentum 0.9: "
                                     "the defaults before issue 37)",
                                     dict(_Q4, outer_lr=0.7, outer_momentum=0.9)),
    "diloco_q4_avg": Setting("plain averaging (outer lr 1, no momentum)",
                             dict(_Q4, outer_lr=1.0, outer_momentum=0.0)),
    "diloco_q4_m05": Setting("constant outer Nesterov lr 0.7, momentum 0.5",
                             dict(_Q4, outer_lr=0.7, outer_momentum=0.5)),
    "diloco_q4_ramp": Setting("outer_lr_ramp(0.5, 1.0, 50, steps), momentum 0.5 (needs the run's length)",
                              dict(_Q4, outer_lr_ramp=[0.5, 1.0, 50, STEPS], outer_momentum=0.5)),
    "diloco_q4_defaults_eager_d2": Setting("the defaults with each exchange in flight for 2 inner steps, "
                                           "eager updates (delay=2, eager=True)",
                                           dict(_Q4, delay=2, eager=True), against="diloco_q4_defaults",
                                           target=0.5),
    "diloco_q4_defaults_d2": Setting("the same 2 steps late without eager updates (delay=2)",
                                     dict(_Q4, delay=2), against="diloco_q4_defaults"),
    "sparseloco": Setting("DiLoCo(sync_every=10, compressor='sparseloco'): top-120 of 4096 per chunk, "
                          "2-bit values, error feedback in place of outer momentum, outer lr 1, the unsent "
                          "part kept in the local weights, the mean rescaled by its senders (rescale)",
                          {"sync_every": 10, "compressor": "sparseloco"}, target=3.0),
    "sparseloco_mean": Setting("the same with the plain mean over ranks (rescale=False, the default before): "
                               "an entry sent by one rank of two arrives at half its value",
                               {"sync_every": 10, "compressor": "sparseloco", "rescale": False}, target=3.0),
    "sparseloco_lr15": Setting("the plain mean with outer_lr=1.5 (picked at seed 0, tied to 2 ranks)",
                               {"sync_every": 10, "compressor": "sparseloco", "rescale": False,
                                "outer_lr": 1.5}, target=3.0),
    "sparseloco_decay095": Setting("the plain mean with the paper's decay 0.95",
                                   {"sync_every": 10, "compressor": "sparseloco", "decay": 0.95,
                                    "rescale": False}),
    "sparseloco_k64_reset": Setting("the paper's restart from the global weights, top-64 of 4096 (1.6%), "
                                    "the plain mean",
                                    {"sync_every": 10, "compressor": "sparseloco", "k": 64,
                                     "keep_unsent": False, "rescale": False}),
}
# rows trained on the choice seeds only (candidates that were not chosen)
CHOICE_ONLY = ("diloco_q4_avg", "diloco_q4_m05", "diloco_q4_ramp", "sparseloco_decay095",
               "sparseloco_k64_reset")


def _final(result: Any) -> float | None:
    return result["val_losses"][-1] if isinstance(result, dict) and result.get("val_losses") else None


def jobs_of(name: str, seeds: Sequence[int], steps: int) -> list[Job]:
    """The runs of row ``name`` at ``seeds``."""
    setting = SETTINGS[name]
    return [Job(name, setting.options, seed=seed, data_seed=seed + REORDER if setting.reorder else None,
                steps=steps) for seed in seeds]  # fmt: skip


def fewer_bytes(result: dict[str, Any]) -> float | None:
    """Dense fp32 gradients' ring all-reduce bytes per step over what this DiLoCo run sent per step."""
    stats = result.get("hook_stats") or {}
    sent = stats.get("sent_bytes")
    if not sent:
        return None
    steps = len(result["train_losses"])
    dense_per_step = 2 * (WORLD - 1) / WORLD * 4 * result["parameters"]
    return dense_per_step * steps / float(sent)


def gap_rows(
    found: dict[int, dict[str, Any]], names: Sequence[str], steps: int
) -> tuple[list[Row], str, list[str]]:
    """Rows, a Markdown table (setting x seed, % over its reference at that seed, mean, worst, bytes) and
    verdict notes, from ``found[seed][name]`` (a train_lm result dict, or a status string)."""
    rows: list[Row] = []
    seeds = sorted(found)
    header = "| setting | vs | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | worst | fewer bytes |"
    lines = [header, "|---" * (len(seeds) + 5) + "|"]
    dense = {seed: _final(found[seed].get("none")) for seed in seeds}
    lines.append("| dense (val loss) | | " + " | ".join(f"{dense[s]:.4f}" if dense[s] else "-" for s in seeds)
                 + " | | | 1x |")  # fmt: skip
    notes = []
    for seed in seeds:
        if dense[seed]:
            rows.append(Row(f"{steps} steps, seed {seed}", "none", "val_loss", dense[seed], "nats/byte", 1.0,
                            "none"))  # fmt: skip
    for name in names:
        setting = SETTINGS.get(name, Setting(name, {}))
        against = setting.against or "none"
        gaps: list[float] = []
        ratios: list[float] = []
        cells = []
        for seed in seeds:
            value, base = _final(found[seed].get(name)), _final(found[seed].get(against))
            if value is None or not base:
                status = found[seed].get(name)
                cells.append("-" if not isinstance(status, str) else status.split(":")[0])
                continue
            gaps.append(100.0 * (value / base - 1.0))
            cells.append(f"{gaps[-1]:+.2f}%")
            rows.append(Row(f"{steps} steps, seed {seed}", name, "val_loss", value, "nats/byte", value / base,
                            against))  # fmt: skip
            ratio = fewer_bytes(found[seed][name])
            if ratio is not None:
                ratios.append(ratio)
        case = f"{steps} steps, over seeds {','.join(map(str, seeds))}"
        if ratios:
            rows.append(Row(case, name, "fewer_bytes", min(ratios), "x dense fp32 gradients"))
        bytes_cell = f"{min(ratios):,.0f}x" if ratios else ("1x" if setting.options is None else "")
        if len(gaps) == len(seeds):
            mean, worst = statistics.fmean(gaps), max(gaps)
            rows.append(Row(case, name, "gap_mean_pct", mean, f"% over {against}"))
            rows.append(Row(case, name, "gap_worst_pct", worst, f"% over {against}"))
            cells += [f"{mean:+.2f}%", f"{worst:+.2f}%"]
            if setting.target is not None:
                verdict = "meets" if worst <= setting.target else (
                    "meets on average only" if mean <= setting.target else "misses")  # fmt: skip
                notes.append(f"{name}: {mean:+.2f}% over {against} on average over seeds {seeds}, "
                             f"{worst:+.2f}% at the worst seed: {verdict} the {setting.target:g}% target")
        else:
            cells += ["", ""]
        lines.append(f"| {name} | {against} | " + " | ".join(cells) + f" | {bytes_cell} |")
    return rows, "\n".join(lines), notes


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = {r.backend: r.value for r in rows if r.metric == "gap_mean_pct"}
    worst = {r.backend: r.value for r in rows if r.metric == "gap_worst_pct"}
    names = [n for n in means if n in worst]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4.5))
    positions = range(len(names))
    ax.bar([p - 0.2 for p in positions], [means[n] for n in names], 0.4, label="mean over seeds")
    ax.bar([p + 0.2 for p in positions], [worst[n] for n in names], 0.4, label="worst seed")
    for level, style in ((2.0, "--"), (3.0, ":")):
        ax.axhline(level, color="grey", linestyle=style, linewidth=1)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(list(positions), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("validation loss over the reference (%)")
    ax.set_title("DiLoCo against dense, seed by seed (lines: the 2% and 3% targets)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> str:
    """Train what is missing from ``--work-dir``, write ``bench_diloco_seeds[_<steps>].*``; return the
    Markdown."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rows", default=",".join(n for n in SETTINGS if n not in CHOICE_ONLY),
                        help=f"rows of SETTINGS ({', '.join(SETTINGS)}); dense (none) is always trained")
    parser.add_argument("--seeds", default=",".join(map(str, CHOICE_SEEDS + CONFIRM_SEEDS)))
    parser.add_argument("--choice-rows", default=",".join(CHOICE_ONLY),
                        help="rows trained at the choice seeds only (0-2): the candidates not chosen")
    parser.add_argument("--reuse-only", action="store_true", help="train nothing: a missing run is a '-'")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep (and reuse) each run's result")
    args = parser.parse_args(argv)
    started = time.monotonic()
    names = [n for n in args.rows.split(",") if n and n != "none"]
    choice = [n for n in args.choice_rows.split(",") if n and n not in names]
    unknown = sorted(set(names + choice) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown rows {unknown}; see SETTINGS in {__name__}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    choice_seeds = [s for s in seeds if s in CHOICE_SEEDS]
    work = args.work_dir or Path(output_dir()) / "bench_diloco-work"
    against = {SETTINGS[n].against for n in names + choice} - {"", "none"}
    jobs = [job for n in ["none", *against, *names] for job in jobs_of(n, seeds, args.steps)]
    jobs += [job for n in choice for job in jobs_of(n, choice_seeds, args.steps)]
    results = run_jobs(list(dict.fromkeys(jobs)), work, reuse_only=args.reuse_only,
                       log=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
    found: dict[int, dict[str, Any]] = {seed: {} for seed in seeds}
    for job, result in results.items():
        found[job.seed][job.name] = result if result is not None else "not run: not in --work-dir"
    rows, table, notes = gap_rows(found, [*dict.fromkeys([*names, *against])], args.steps)
    choice_table = ""
    if choice and choice_seeds:
        more_rows, choice_table, _ = gap_rows({s: found[s] for s in choice_seeds}, choice, args.steps)
        rows += [r for r in more_rows if r.backend in choice]
    notes.append(f"{args.steps} steps of examples/train_lm.py's train() per run, 2 gloo ranks, the LM at "
                 f"{Job('', None).model} (AdamW inner lr 2e-3, warm-up 30, cosine; batch 16 per rank), the "
                 "same tokens per rank as dense; each gap is against its reference at the same seed")
    notes.append(f"the defaults were chosen on seeds {list(CHOICE_SEEDS)} and confirmed on "
                 f"{list(CONFIRM_SEEDS)}, which played no part in choosing them")  # fmt: skip
    trained = sum(result.get("wall_s", 0.0) for result in results.values() if result)
    notes.append(f"benchmark wall time: {time.monotonic() - started:.0f} s; the runs' own: "
                 f"{trained / 60:.0f} min (each timed when it was trained, cached in --work-dir)")
    name = NAME if args.steps <= STEPS else f"{NAME}_{args.steps}"  # a longer run beside the main one
    text = write_results(name, rows, notes=notes, plot_metric="gap_worst_pct")
    _plot(rows, output_dir() / f"{name}.png")
    text += f"\n## Validation loss over the reference at the same seed, {args.steps} steps\n\n{table}\n"
    if choice_table:
        text += f"\n## Candidates at the choice seeds {choice_seeds} only\n\n{choice_table}\n"
    (output_dir() / f"{name}.md").write_text(text)
    print(text, file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
