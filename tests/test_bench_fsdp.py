"""benchmarks/bench_fsdp.py and benchmarks/fsdp_jobs.py: rows, notes and merges on made-up outcomes
(nothing is trained), the methods, the /proc reader."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import fastcomm
import fastcomm.fsdp
from benchmarks import bench_fsdp, fsdp_jobs, fsdp_rows, harness, lm_methods
from benchmarks.common import free_port

LOSS = {
    m: {"val_loss": v, "grad_rel_error": 0.0, "residual_bytes_per_param": 0.0, "compression_ratio": 1.0,
        "params": 9}
    for m, v in {"dense": 2.0, "q8": 2.004, "sign-ef": 2.1}.items()
}  # fmt: skip
SPEEDS = {
    "loopback": {"dense": {"step_s": 1.0, "params": 9}, "q8": {"step_s": 1.05, "params": 9}},
    "1gbit": {"dense": {"step_s": 3.0, "params": 9, "link_bytes_per_step": 300e6},
              "q8": {"step_s": 2.0, "params": 9, "link_bytes_per_step": 225e6},
              "q8-qwz": {"step_s": 1.25, "params": 9, "link_bytes_per_step": 75e6}},
}  # fmt: skip
HSDP = {
    "dense": {"step_s": 1.0, "params": 9, "link_bytes_per_step": 4e6, "payload_bytes_per_step": 3.9e6},
    "q8": {"step_s": 0.9, "params": 9, "link_bytes_per_step": 1.04e6, "payload_bytes_per_step": 1e6},
    "q4": {"step_s": 0.8, "params": 9, "link_bytes_per_step": 0.6e6, "payload_bytes_per_step": 0.55e6},
}
MEMORY = {
    "dense": {"peak_bytes": 100.0, "persistent_bytes": 60.0, "residual_bytes": 0, "params": 10},
    "q8": {"peak_bytes": 150.0, "persistent_bytes": 100.0, "residual_bytes": 40, "params": 10},
}


def _lm(val_loss: float, optimizer: str) -> dict:
    return {"val_loss": val_loss, "params": 9, "optimizer": optimizer, "step_s": 0.5, "val_steps": [500],
            "val_losses": [val_loss], "description": "made up"}  # fmt: skip


LM = {"none": _lm(2.0, "adamw"), "q8": _lm(2.006, "adamw"), "sign": _lm(3.0, "adamw"),
      "sign_c64": _lm(2.5, "adamw"), "sgd": _lm(2.5, "sgd"), "sign_sgd": _lm(2.52, "sgd")}  # fmt: skip


def _all_rows() -> list[harness.Row]:
    rows = fsdp_rows.loss_rows(LOSS)
    rows += fsdp_rows.speed_rows(SPEEDS["loopback"], "speed-loopback")
    rows += fsdp_rows.speed_rows(SPEEDS["1gbit"], "speed-1gbit")
    rows += fsdp_rows.hsdp_rows(HSDP) + fsdp_rows.memory_rows(MEMORY)
    return fsdp_rows.lm_rated(rows + fsdp_rows.lm_rows(LM))


def test_speed_rows_are_ratios_to_dense_with_link_bytes():
    rows = fsdp_rows.speed_rows(SPEEDS["1gbit"], "speed-1gbit")
    expected = {"dense": 1.0, "q8": 2 / 3, "q8-qwz": 1.25 / 3}
    assert {r.backend: r.ratio for r in rows} == pytest.approx(expected)
    assert {r.backend: r.extra["link_vs_dense"] for r in rows} == {"dense": 1.0, "q8": 0.75, "q8-qwz": 0.25}


def test_each_layout_is_its_own_case_with_its_own_verdict_and_byte_bound():
    rows = fsdp_rows.speed_rows(SPEEDS["1gbit"], "speed-1gbit")
    keep = {"dense": {"step_s": 2.4, "params": 9, "link_bytes_per_step": 250e6},
            "q8": {"step_s": 1.0, "params": 9, "link_bytes_per_step": 75e6}}  # fmt: skip
    rows += fsdp_rows.speed_rows(keep, fsdp_rows.speed_case("1gbit", "bf16-keep"))
    notes = fsdp_rows.verdicts(rows)
    assert "1gbit: q8 is 1.50x dense's speed (target 2x (1 Gbit/s))" in notes
    assert "1gbit bf16-keep: q8 is 2.40x dense's speed (target 2x (1 Gbit/s))" in notes
    bound = next(n for n in notes if n.startswith("1gbit bf16-keep bytes on the link per step"))
    assert "q8 75.0 MB (0.300)" in bound, bound
    assert bound.endswith("cannot be more than 3.33x faster even if the link were all of the step"), bound
    assert {bench_fsdp.case_part(r.case) for r in rows} == {"speed"}
    assert fsdp_rows.speed_case("loopback", "fp32") == "speed-loopback"


@pytest.mark.parametrize("layout", sorted(fsdp_jobs.LAYOUTS))
def test_every_speed_layout_shards_and_steps(layout, monkeypatch: pytest.MonkeyPatch):
    """Each layout is a valid FSDP2 set-up (one process, world size 1) whose parameters compute in its
    dtype and whose gradients come back in fp32."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = fsdp_jobs._mlp([8, 8, 8])
        fsdp_jobs._shard(model, init_device_mesh("cpu", (1,)), layout)
        out = model(torch.randn(4, 8))
        param_dtype, _ = fsdp_jobs.LAYOUTS[layout]
        assert out.dtype == getattr(torch, param_dtype or "float32")
        out.float().square().mean().backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_hsdp_rows_give_cross_node_bytes_against_dense_and_step_times():
    rows = {(r.backend, r.metric): r for r in fsdp_rows.hsdp_rows(HSDP)}
    assert rows["q8", "cross_node_bytes"].ratio == pytest.approx(0.26)
    assert rows["q8", "cross_node_bytes"].extra["payload_vs_dense"] == pytest.approx(1 / 3.9, abs=1e-4)
    assert rows["q4", "step_time"].ratio == pytest.approx(0.8)


def test_memory_rows_are_bytes_per_parameter():
    rows = {(r.backend, r.metric): r for r in fsdp_rows.memory_rows(MEMORY)}
    assert rows["q8", "peak_bytes_per_param"].value == 15.0
    assert rows["q8", "persistent_bytes_per_param"].ratio == pytest.approx(100 / 60)
    assert rows["q8", "peak_bytes_per_param"].extra["residual_B/param"] == 4.0


def test_lm_rows_are_rated_against_their_optimizers_dense_run():
    rows = {r.backend: r for r in fsdp_rows.lm_rated(fsdp_rows.lm_rows(LM))}
    assert (rows["sign"].ratio, rows["sign"].ratio_to) == (pytest.approx(1.5), "none")
    assert (rows["sign_sgd"].ratio, rows["sign_sgd"].ratio_to) == (pytest.approx(2.52 / 2.5), "sgd")


def test_notes_say_which_targets_were_met():
    notes = fsdp_rows.verdicts(_all_rows())
    assert any(n.startswith("q8 validation loss +0.20%") and "meets" in n for n in notes), notes
    assert any(n.startswith("sign-ef validation loss +5.00%") and "misses" in n for n in notes), notes
    assert "1gbit: q8-qwz is 2.40x dense's speed (target 2x (1 Gbit/s))" in notes
    assert "loopback: q8 is 0.95x dense's speed (target 1/1.1x (loopback))" in notes
    assert any(n.startswith("hsdp-nodes: q8 replicate-only sends 0.260") and "misses" in n for n in notes)
    assert any(n.startswith("hsdp-nodes: q4 replicate-only sends 0.150") and "meets" in n for n in notes)
    assert any(n.startswith("lm q8 (AdamW) validation loss +0.30% vs none") and "meets" in n for n in notes)
    assert any(n.startswith("lm sign-ef (SGD momentum) validation loss +0.80% vs sgd") for n in notes)
    assert any(n.startswith("lm sign-ef chunk 64 (AdamW) validation loss +25.00% vs none") for n in notes)
    assert "memory-peak: q8 peaks at 15.00 B/param per rank, dense FSDP2 at 10.00 (+5.00)" in notes
    bound = next(n for n in notes if n.startswith("1gbit bytes on the link per step"))
    assert "q8 225.0 MB (0.750)" in bound and "cannot be more than 1.33x faster" in bound, bound
    assert bound.endswith("it could be 4.0x"), bound


def test_merge_keeps_what_was_not_measured_again(tmp_path: Path):
    earlier = _all_rows()
    notes = ["loss: earlier loss settings", "lm: earlier lm settings", "lm: sign: earlier sign curve",
             "lm: q8: earlier q8 curve", "q8 validation loss +0.20% vs dense: a verdict",
             "hsdp: earlier hsdp settings", "hsdp-nodes: q8 sends 0.254: a verdict",
             "memory: earlier memory settings", "memory-peak: q8 peaks at 15: a verdict"]  # fmt: skip
    previous = tmp_path / "bench_fsdp.json"
    previous.write_text(json.dumps({"rows": [r.__dict__ for r in earlier], "notes": notes}))
    new = fsdp_rows.lm_rows({"q8": _lm(2.2, "adamw")})
    rows, kept_notes = bench_fsdp._merged(previous, ["lm"], new, ["lm: new lm settings", "lm: q8: new curve"])
    assert len(rows) == len(earlier)
    q8 = next(r for r in rows if (r.case, r.backend) == ("lm", "q8"))
    assert (q8.value, q8.ratio) == (2.2, pytest.approx(1.1))
    assert kept_notes == ["loss: earlier loss settings", "lm: sign: earlier sign curve",
                          "hsdp: earlier hsdp settings", "memory: earlier memory settings",
                          "lm: new lm settings", "lm: q8: new curve"]  # fmt: skip
    assert [bench_fsdp.PARTS.index(bench_fsdp.case_part(r.case)) for r in rows] == sorted(
        bench_fsdp.PARTS.index(bench_fsdp.case_part(r.case)) for r in rows
    )


def test_no_parts_renders_the_merged_file_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({"rows": [r.__dict__ for r in _all_rows()], "notes": ["hsdp: settings"]}))
    monkeypatch.setenv(harness.OUTPUT_ENV, str(tmp_path / "out"))
    table = bench_fsdp.main(["--parts", "", "--merge", str(previous)])
    assert "| hsdp-nodes | q8 | cross_node_bytes |" in table and "- hsdp: settings" in table
    assert "1gbit bytes on the link per step" in table


def test_an_unknown_part_is_named(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        bench_fsdp.main(["--parts", "loss,speeed"])
    assert "unknown part(s) ['speeed']" in capsys.readouterr().err


def test_status_bytes_reads_kilobyte_fields():
    status = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n"
    assert fsdp_jobs.status_bytes("VmHWM", status) == 2048 * 1024
    assert fsdp_jobs.status_bytes("VmRSS") > 0
    with pytest.raises(KeyError, match="VmNone"):
        fsdp_jobs.status_bytes("VmNone", status)


@pytest.mark.parametrize("method", sorted(m for m, options in bench_fsdp.METHODS.items() if options))
def test_every_method_is_a_compressor_and_compress_options(method):
    options = dict(bench_fsdp.METHODS[method])
    name = options.pop("compressor")
    own = {k: options.pop(k) for k in ("bits", "block", "stochastic", "chunk") if k in options}
    assert isinstance(fastcomm.hooks.compressor_of(name, own), fastcomm.compress.Compressor)
    accepted = inspect.signature(fastcomm.fsdp.compress).parameters
    assert set(options) <= set(accepted), sorted(set(options) - set(accepted))


@pytest.mark.parametrize("method", bench_fsdp.LM_METHODS)
def test_every_lm_method_runs_under_fsdp(method):
    fields = lm_methods.config_fields(method)
    assert lm_methods.load_example().fsdp_unavailable(fields["optimizer"], fields["hook"]) is None


def test_a_diverged_lm_run_is_a_row_without_a_ratio_and_a_note_that_says_so():
    diverged = {**_lm(float("nan"), "sgd"), "diverged": "sign_sgd: training loss nan at step 162"}
    rows = fsdp_rows.lm_rated(fsdp_rows.lm_rows({"sgd": _lm(2.5, "sgd"), "sign_sgd": diverged}))
    row = next(r for r in rows if r.backend == "sign_sgd")
    assert row.ratio is None and row.extra["diverged"].endswith("step 162")
    notes = fsdp_rows.verdicts(rows)
    assert notes == ["lm sign-ef (SGD momentum) diverged (sign_sgd: training loss nan at step 162): misses "
                     "the target of at most 2.0% above"]  # fmt: skip
