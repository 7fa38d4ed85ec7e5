"""The regression guard of `make bench`: each headline figure of this run against the committed results.

On a shared 2-core host an absolute timing moves 10-40% between runs, so a drop in one is a hint, not
evidence. A figure becomes evidence when it comes as a pair measured in the same run: ours against an
alternative (DataLoader, WebDataset, a peer library, dense allreduce, memcpy) that suffered the same load.
So each :class:`Headline` names, where one exists, the row it is divided by (``versus``); the guard then
compares this run's ratio with the committed run's ratio, and says which kind each comparison is.

1. Before the benchmarks run, :func:`read_figures` reads every headline's figure from the committed
   results (so ``--update-results``, which overwrites them, still compares against what was there).
2. After they ran, :func:`compare` reads the same figures from the run folder and flags a drop of more than
   :data:`DROP_LIMIT` (10%): for a higher-is-better figure, ``new < old * 0.9``; for a lower-is-better one
   (a step time), ``new > old / 0.9``. A figure missing on either side is reported as missing, never a crash.
3. :func:`write_report` prints and writes ``guard.md`` and ``guard.json`` into the run folder. A flag does
   not change the exit status: it asks for a rerun, or for an old/new pair of code trees in one run where
   one can be built (``pair`` of the headline, e.g. ``bench_tar_versions.py`` for the tar reader).

The short profile measures smaller data than the committed full runs; the ratios carry over better than the
absolute figures, which is one more reason the guard prefers them.

Example::

    from benchmarks import guard
    old = guard.read_figures(guard.HEADLINES, guard.harness.RESULTS_DIR)
    # ... run the benchmarks into out ...
    checks = guard.compare(guard.HEADLINES, old, guard.read_figures(guard.HEADLINES, out))
    print(guard.write_report(checks, out))
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

__all__ = [
    "DROP_LIMIT",
    "HEADLINES",
    "Check",
    "Headline",
    "compare",
    "figure",
    "markdown",
    "read_figures",
    "results_commit",
    "write_report",
]

DROP_LIMIT = 0.10  # a drop of more than this fraction is flagged
# the short profile's committed baseline, a folder of the results (a quiet `make bench` run's JSON)
SHORT_BASELINE = "short"
SAME_RUN = "same-run ratio"
ACROSS_RUNS = "absolute, across runs"


@dataclasses.dataclass(frozen=True)
class Headline:
    """One figure the guard watches: a row of a result file, optionally divided by another row of the same
    file (``versus``), measured in the same run.

    Attributes:
        result: the result file's name, e.g. ``"bench_loader"``.
        case, backend, metric: the row.
        higher_is_better: True for a rate (samples/s, GB/s), False for a time (s per step).
        versus: ``(case, backend)`` of the same-run row the figure is divided by, same metric; None for an
            absolute figure.
        pair: how to build a same-run old/new pair of code trees for this figure, where one exists.
    """

    result: str
    case: str
    backend: str
    metric: str
    higher_is_better: bool = True
    versus: tuple[str, str] | None = None
    pair: str | None = None

    @property
    def kind(self) -> str:
        return ACROSS_RUNS if self.versus is None else SAME_RUN

    @property
    def label(self) -> str:
        name = f"{self.result}: {self.case} / {self.backend}"
        return name if self.versus is None else f"{name} vs {self.versus[1]}"


_TAR_PAIR = (
    "python -m benchmarks.bench_tar_versions --tree old=<git worktree of {commit}> --tree new=. "
    "(old and new code in turn, one run)"
)
_SL_FIXED = "StreamLoader shuffle=full workers=2"
_SL_IN_TURNS = "StreamLoader shuffle=full workers=0, in turns with the peers"
_SL_TAR = "StreamLoader (tar) workers=0"
_FASTIO_IMAGES = "fastio StreamLoader+ImageStage workers=2"
_DL_IMAGES = "DataLoader+WebDataset(decode='pil') workers=2"
_MEMCPY = ("memcpy (Tensor.copy_)", "torch")


def _loader(case: str, backend: str, versus: str | None, metric: str = "samples/s", **kw: Any) -> Headline:
    pair = None if versus is None else (case, versus)
    return Headline("bench_loader", case, backend, metric, versus=pair, **kw)


def _images(case: str, versus: str) -> Headline:
    return Headline("bench_images", case, _FASTIO_IMAGES, "samples/s", versus=(case, versus))


def _step_time(result: str, case: str, backend: str, versus: str) -> Headline:
    return Headline(result, case, backend, "step_time", higher_is_better=False, versus=(case, versus))


# The headline figures, benchmark by benchmark: the claims of docs/benchmarks.md and the README.
HEADLINES: tuple[Headline, ...] = (
    Headline("bench_kernels", "quantize_blockwise 8-bit", "native", "throughput", versus=_MEMCPY),
    Headline("bench_kernels", "sign_compress", "native", "throughput", versus=_MEMCPY),
    _loader("fixed", _SL_FIXED, "DataLoader workers=0"),
    _loader("fixed", _SL_IN_TURNS, "torchdata.nodes ParallelMapper threads=2"),
    _loader("fixed", _SL_IN_TURNS, "torchdata.nodes batch gather threads=2"),
    _loader("fixed", _SL_IN_TURNS, "SPDL pipeline threads=2"),
    _loader("fixed", _SL_IN_TURNS, "SPDL batch gather threads=2"),
    _loader("fixed", _SL_FIXED, None),
    _loader("variable", "StreamLoader workers=0", "DataLoader workers=0"),
    _loader("tar", _SL_TAR, "webdataset.WebLoader workers=2", pair=_TAR_PAIR),
    _loader("tar", _SL_TAR, None, pair=_TAR_PAIR),
    _loader("packing", "StreamLoader pack= workers=0", "StreamLoader raw docs, 256/batch", "tokens/s"),
    _images("train", _DL_IMAGES),
    _images("eval", _DL_IMAGES),
    _images("train", "torchdata.nodes+Pillow threads=2"),
    _images("train", "SPDL pipeline+FFmpeg threads=2"),
    _step_time("bench_hooks", "loopback", "quant4", "allreduce"),
    _step_time("bench_hooks", "netlab", "quant4", "allreduce"),
    _step_time("bench_hooks", "netlab", "topk_0.01", "allreduce"),
    _step_time("bench_fsdp", "speed-loopback", "q8", "dense"),
    _step_time("bench_fsdp", "speed-1gbit", "q8", "dense"),
    _step_time("bench_fsdp", "speed-1gbit bf16-keep", "q8", "dense"),
    Headline("bench_remote", "fastio shards", "fastio http workers=0 epoch 1", "MB/s over the link",
             versus=("link", "curl download of 256 MB (link rate)")),
    Headline("bench_remote", "fastio shards", "fastio http workers=0 cache epochs 2-4", "MB/s local",
             versus=("fastio shards", "fastio local disk workers=0 epochs 2-4")),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Check:
    """One headline compared: its figure in the committed results (``old``) and in this run (``new``)."""

    headline: Headline
    old: float | None
    new: float | None

    @property
    def change(self) -> float | None:
        """``new / old - 1`` (a rate) or ``old / new - 1`` (a time): negative is worse; None when missing."""
        if not self.old or not self.new:
            return None
        return self.new / self.old - 1 if self.headline.higher_is_better else self.old / self.new - 1

    @property
    def status(self) -> str:
        if self.old is None or self.new is None:
            side = " and ".join(s for s, v in (("committed", self.old), ("this run", self.new)) if v is None)
            return f"missing in {side}"
        change = self.change
        if change is not None and change < -DROP_LIMIT:
            return "DROP"
        return "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "headline": dataclasses.asdict(self.headline),
            "kind": self.headline.kind,
            "old": self.old,
            "new": self.new,
            "change": self.change,
            "status": self.status,
        }


def _value(rows: Sequence[Mapping[str, Any]], case: str, backend: str, metric: str) -> float | None:
    for row in rows:
        if (row.get("case"), row.get("backend"), row.get("metric")) == (case, backend, metric):
            value = row.get("value")
            return float(value) if isinstance(value, (int, float)) and value == value else None
    return None


def figure(headline: Headline, rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The headline's figure in one result file's rows: the row's value, divided by the ``versus`` row's
    value when there is one; None when either row is missing or has no value (a skip, a crash).

    Example::

        rows = json.loads(Path("benchmarks/results/bench_loader.json").read_text())["rows"]
        figure(HEADLINES[2], rows)   # StreamLoader / DataLoader samples/s, in the same run
    """
    value = _value(rows, headline.case, headline.backend, headline.metric)
    if value is None or headline.versus is None:
        return value
    base = _value(rows, *headline.versus, headline.metric)
    return value / base if base else None


def _rows(path: Path) -> list[dict[str, Any]]:
    """A result file's rows; none when it is absent or unreadable (reported as missing, not a crash)."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return rows if isinstance(rows, list) else []


def read_figures(headlines: Sequence[Headline], folder: Path) -> dict[Headline, float | None]:
    """Every headline's figure in the result files of ``folder``; None where a file or row is missing."""
    cache: dict[str, list[dict[str, Any]]] = {}
    figures = {}
    for headline in headlines:
        if headline.result not in cache:
            cache[headline.result] = _rows(folder / f"{headline.result}.json")
        figures[headline] = figure(headline, cache[headline.result])
    return figures


def results_commit(results_dir: Path) -> str:
    """The short hash of the commit that last changed ``results_dir``, or a phrase when git cannot say."""
    try:
        done = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", "."],
            cwd=results_dir,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "the committed results' commit"
    return done.stdout.strip() or "the committed results' commit"


def compare(
    headlines: Sequence[Headline],
    old: Mapping[Headline, float | None],
    new: Mapping[Headline, float | None],
) -> list[Check]:
    """One :class:`Check` per headline, in order; a headline absent from either mapping counts as missing.

    Example::

        h = Headline("bench_x", "case", "ours", "samples/s", versus=("case", "theirs"))
        compare([h], {h: 2.0}, {h: 1.7})[0].status   # 'DROP' (-15%)
    """
    return [Check(h, old.get(h), new.get(h)) for h in headlines]


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def markdown(checks: Sequence[Check], pair_commit: str = "the committed results' commit") -> str:
    """The guard's table, then a line per flagged figure saying how to confirm it."""
    lines = [
        "| figure | kind | committed | this run | change | status |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        change = "" if c.change is None else f"{c.change:+.0%}"
        lines.append(
            f"| {c.headline.label} ({c.headline.metric}) | {c.headline.kind} | {_fmt(c.old)} | {_fmt(c.new)} "
            f"| {change} | {c.status} |"
        )
    drops = [c for c in checks if c.status == "DROP"]
    lines.append("")
    lines.append(
        f"{len(drops)} of {len(checks)} headline figures dropped more than {DROP_LIMIT:.0%}; "
        f"{sum(c.status.startswith('missing') for c in checks)} missing. Only a same-run ratio is evidence "
        "(both sides took the same load); an absolute figure across runs moves 10-40% on a shared host."
    )
    for c in drops:
        how = c.headline.pair.format(commit=pair_commit) if c.headline.pair else "rerun the benchmark"
        lines.append(f"- DROP {c.headline.label}, {c.headline.kind}: confirm with {how}")
    return "\n".join(lines)


def baseline(full: bool) -> Path:
    """The committed figures a run is compared with: the full results for a full run; for the short profile,
    ``results/short/`` (a quiet short-profile run's JSON, same settings) where it exists, so that a figure
    is compared with one taken at the same sizes and steps, else the full results.

    Example::

        guard.read_figures(guard.HEADLINES, guard.baseline(full=False))
    """
    short = harness.RESULTS_DIR / SHORT_BASELINE
    if not full and any(short.glob("*.json")):
        return short
    return harness.RESULTS_DIR


def write_report(
    checks: Sequence[Check],
    out: Path,
    pair_commit: str = "the committed results' commit",
    against: Path | None = None,
) -> str:
    """Write ``guard.md`` and ``guard.json`` into ``out``; return the Markdown. ``against``: the folder the
    committed figures came from (default: the full results)."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(checks, pair_commit)
    against = harness.RESULTS_DIR if against is None else against
    (out / "guard.md").write_text(f"# guard: this run against {against.name}/\n\n{text}\n")
    payload = {"drop_limit": DROP_LIMIT, "checks": [c.to_dict() for c in checks]}
    (out / "guard.json").write_text(json.dumps(payload, indent=2))
    return text
