"""``benchmarks/run_all.py``: it knows every benchmark script, and its summary of the committed results repeats each
benchmark's own numbers (the ratios the scripts computed themselves) in one JSON and one markdown table."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", REPO / "benchmarks" / "run_all.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_script_is_run_and_summarized() -> None:
    run_all = _run_all()
    helpers = {"harness.py", "run_all.py"}
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if p.name not in helpers}
    scripts = {s for s in scripts if not s.startswith("peer_")}  # run inside the peer's venv by the others
    assert scripts == {script for script, _, _ in run_all.BENCHMARKS.values()}
    assert set(run_all.EXTRACT) == set(run_all.BENCHMARKS)


def test_summary_of_the_committed_results(tmp_path: Path) -> None:
    run_all = _run_all()
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results)
    (results / "train_2020-01-01.json").write_text("{}")  # older files are ignored: the newest date wins
    assert run_all.main(["--summary-only", "--results", str(results)]) == 0

    summary = json.loads((results / "summary.json").read_text())
    table = (results / "SUMMARY.md").read_text()
    for name, entry in summary["benchmarks"].items():
        assert entry["file"] and entry["rows"], f"{name}: no committed result or no rows"
        assert all(row["ours"] is not None for row in entry["rows"]), (name, entry["rows"])
        for row in entry["rows"]:
            assert f"| {name} | {row['what']} |" in table

    train = json.loads((results / summary["benchmarks"]["train"]["file"]).read_text())
    row = summary["benchmarks"]["train"]["rows"][0]  # fp32 eager
    assert row["times_better"] == pytest.approx(
        train["speedup"]["samples_per_s"]["ours_fp32_vs_lerobot_fp32"]
    )
    loader = json.loads((results / summary["benchmarks"]["data_loader"]["file"]).read_text())
    first = summary["benchmarks"]["data_loader"]["rows"][0]
    assert first["times_better"] == pytest.approx(
        loader["speedup"]["w0_ours_nocache_vs_lerobot_torchcodec"], rel=0.01
    )
    model = summary["benchmarks"]["model"]["rows"][0]  # a time: lower is better, so the ratio is peer / ours
    assert model["times_better"] == pytest.approx(model["peer"] / model["ours"]) and model["times_better"] > 1
    assert "matmul peak fp32" in table


def test_each_cpu_keeps_its_newest_result(tmp_path: Path) -> None:
    """Ratios differ between CPU families: a newer run on one CPU must not hide the newest run on another, and a
    second CPU's run on the same day must not overwrite the first's file."""
    run_all = _run_all()
    committed = json.loads(run_all._result_files("train", run_all.RESULTS)[-1].read_text())

    def result(day: str, cpu: str, fp32_ratio: float, time: str = "12:00:00") -> dict:
        r = json.loads(json.dumps(committed))
        r["started"], r["cpu_model"] = f"{day}T{time}", cpu
        r.pop("cpu_features", None)  # as results recorded before cpu_features
        r["setting"]["rounds"] = 1  # one round: the ratio is ours over the peer's (several: the script's own)
        r["ours"]["fp32"]["samples_per_s"] = 10.0 * fp32_ratio
        r["peer_lerobot"]["fp32"]["samples_per_s"] = 10.0
        return r

    results = tmp_path / "results"
    results.mkdir()
    files = {
        "train_2030-01-01.json": result("2030-01-01", "Intel(R) Xeon(R) Processor", 1.1),  # older, same CPU
        "train_2030-01-02.json": result("2030-01-02", "Intel(R) Xeon(R) Processor", 1.2),
        "train_2030-01-02_amd-epyc.json": result("2030-01-02", "AMD EPYC", 1.3),
        # same day, earlier: its file name sorts after the plain one's, but its recorded start time decides
        "train_2030-01-02_amd-epyc_run2.json": result("2030-01-02", "AMD EPYC", 1.4, "09:00:00"),
    }
    undated = result("2030-01-02", "Intel(R) Xeon(R) Processor", 1.25)
    del undated["started"]  # no recorded time: midnight of its file's day, older than the 12:00 run
    files["train_2030-01-02_xeon-rerun.json"] = undated
    for name, r in files.items():
        (results / name).write_text(json.dumps(r))
    train = run_all.summarize(results)["benchmarks"]["train"]
    assert (train["file"], train["cpu_model"]) == ("train_2030-01-02_amd-epyc.json", "AMD EPYC")
    assert train["rows"][0]["times_better"] == pytest.approx(1.3)
    assert [(o["file"], o["cpu_model"]) for o in train["other_cpus"]] == [
        ("train_2030-01-02.json", "Intel(R) Xeon(R) Processor")
    ]
    assert train["other_cpus"][0]["rows"][0]["times_better"] == pytest.approx(1.2)
    table = run_all.markdown(run_all.summarize(results))
    assert "AMD EPYC, 2030-01-02 |" in table and "Intel(R) Xeon(R) Processor, 2030-01-02 |" in table
    assert "Intel(R) Xeon(R) Processor, 2030-01-01" not in table
    # a newer "AMD EPYC" of another family (recorded cpu_features) does not hide the one above
    zen1 = {**result("2030-01-04", "AMD EPYC", 0.9), "cpu_features": {"family": "23", "model": "1"}}
    (results / "train_2030-01-04.json").write_text(json.dumps(zen1))
    train = run_all.summarize(results)["benchmarks"]["train"]
    assert (train["file"], train["cpu_model"]) == ("train_2030-01-04.json", "AMD EPYC (family 23 model 1)")
    assert [o["file"] for o in train["other_cpus"]] == [
        "train_2030-01-02_amd-epyc.json",
        "train_2030-01-02.json",
    ]
    label = run_all.cpu_label("AMD EPYC", {"family": "23", "model": "1"})
    assert (
        run_all.result_path("train", "2030-01-04", label, results).name == "train_2030-01-04.json"
    )  # its own
    assert (
        run_all.result_path("train", "2030-01-04", "AMD EPYC", results).name
        == "train_2030-01-04_amd-epyc.json"
    )

    assert run_all.cpu_slug("Intel(R) Xeon(R) Processor") == "intel-r-xeon-r-processor"
    xeon, epyc = "Intel(R) Xeon(R) Processor", "AMD EPYC"
    assert run_all.result_path("train", "2030-01-02", xeon, results).name == "train_2030-01-02.json"  # rerun
    assert run_all.result_path("train", "2030-01-02", epyc, results).name == "train_2030-01-02_amd-epyc.json"
    new_day = run_all.result_path("train", "2030-01-03", epyc, results)
    assert new_day.name == "train_2030-01-03.json"


def test_a_missing_benchmark_result_is_named(tmp_path: Path) -> None:
    run_all = _run_all()
    summary = run_all.summarize(tmp_path)
    assert all(e["rows"] == [] and "no " in e["missing"] for e in summary["benchmarks"].values())
    assert "| serve | no serve_<date>.json in" in run_all.markdown(summary)


def test_ours_and_the_peers_latency_percentiles_are_one_function() -> None:
    """Serving's p99 beside LeRobot's compares only if both sides interpolate alike: the peer script (run in the
    peer venv) uses ``harness.percentiles`` too, so ``harness`` may import only the standard library."""
    import ast

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import harness
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    got = harness.percentiles([float(x) for x in range(1, 101)])
    assert got == {"n": 100, "p50_ms": 50.5, "p99_ms": pytest.approx(99.01), "mean_ms": 50.5}
    assert set(harness.percentiles([3.0], suffix="")) == {"n", "p50", "p99", "mean"}

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return names | {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }

    assert imports(REPO / "benchmarks" / "harness.py") - {"__future__"} <= set(sys.stdlib_module_names)
    for script in ("serve.py", "peer_lerobot_grpc.py"):
        source = (REPO / "benchmarks" / script).read_text()
        assert "from harness import" in source and "percentiles" in source, script
        assert "quantiles(" not in source and "round(0.99" not in source, (
            f"{script} computes its own percentiles"
        )


def test_train_benchmark_rounds_compare_side_by_side() -> None:
    """With several rounds the speed-up is the median of the ratios within a round (runs side by side), not the
    ratio of each side's median: a VM that drifts between rounds must not decide it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import train
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    ours = [{"samples_per_s": v, "samples_per_s_median_step": v} for v in (10.0, 20.0, 12.0)]
    peer = [{"samples_per_s": v, "samples_per_s_median_step": v} for v in (5.0, 16.0, 10.0)]
    res = {
        "ours": {"bf16": train.median_round(ours)},
        "peer_lerobot": {"bf16": train.median_round(peer)},
        "flops": {},
        "matmul_peak": {},
    }
    assert res["ours"]["bf16"]["samples_per_s"] == 12.0  # the median round's run is the one reported
    assert res["ours"]["bf16"]["rounds"]["samples_per_s"] == [10.0, 20.0, 12.0]
    train.compare(res, batch=8)
    # within-round ratios 2.0, 1.25, 1.2 -> median 1.25 (the ratio of the medians would say 1.2)
    assert res["speedup"]["samples_per_s"]["ours_bf16_vs_lerobot_bf16"] == pytest.approx(1.25)
    assert res["targets"]["bf16_speedup_ge_1.5x_by_samples_per_s"] is False
    single = {"ours": {"bf16": train.median_round(ours[:1])}, "peer_lerobot": {"bf16": train.median_round(peer[:1])},
              "flops": {}, "matmul_peak": {}}  # fmt: skip
    assert "rounds" not in single["ours"]["bf16"]
    train.compare(single, batch=8)
    assert single["speedup"]["samples_per_s"]["ours_bf16_vs_lerobot_bf16"] == pytest.approx(2.0)
    # the runs a ratio compares sit back to back, who goes first alternating between rounds
    assert train.schedule(2, ["fp32", "bf16"], ["fp32", "bf16"]) == [
        ("ours", "fp32"), ("peer", "fp32"), ("ours", "bf16"), ("peer", "bf16"),
        ("peer", "fp32"), ("ours", "fp32"), ("peer", "bf16"), ("ours", "bf16"),
    ]  # fmt: skip
    assert train.schedule(1, ["bf16"], []) == [("ours", "bf16")]  # --skip-peer


#: A stand-in trainer for ``time_sliced``: sleeps ``delay`` s (start-up), then logs ``steps`` steps of ``step`` s
#: each, one line per step: "<monotonic start> <monotonic end> <seconds>" (CLOCK_MONOTONIC is one clock for all
#: processes), and prints its RESULT.
FAKE_TRAINER = """
import json, sys, time
log, delay, steps, step = sys.argv[1], *map(float, sys.argv[2:5])
time.sleep(delay)
out = []
for _ in range(int(steps)):
    t0 = time.monotonic(); time.sleep(step); t1 = time.monotonic()
    out.append(t1 - t0)
    with open(log, "a") as f:
        f.write(f"{t0} {t1} {t1 - t0}\\n")
print("RESULT " + json.dumps({"step_s": out}), flush=True)
"""


def test_time_sliced_runs_take_turns_start_together_and_drop_paused_steps(tmp_path: Path) -> None:
    """``benchmarks/harness.time_sliced``: children run one at a time (SIGSTOP/SIGCONT of their process groups);
    one that reaches its first step early waits, stopped, for the slower starter; the common window ends when the
    first one exits; steps a pause fell into are dropped by ``kept_steps`` and not counted by ``window_rates``."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import harness
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    logs = {name: tmp_path / f"{name}.log" for name in ("quick", "slow")}

    def steps_done(name: str) -> Callable[[object], int]:
        return lambda child: len(logs[name].read_text().splitlines()) if logs[name].exists() else 0

    # "quick" starts at once and has many steps; "slow" starts after 1 s and ends first; "crash" dies at start-up
    args = {"quick": (0.0, 60, 0.02), "slow": (1.0, 15, 0.02)}
    children = [
        harness.Child([sys.executable, str(script), str(logs[n]), *map(str, args[n])], n, steps_done=steps_done(n))
        for n in ("quick", "slow")
    ]  # fmt: skip
    crash = harness.Child([sys.executable, "-c", "raise SystemExit('no model here')"], "crash")
    turns = harness.time_sliced([*children, crash], slice_s=0.5, timeout=60)
    assert all(c.proc.poll() is not None for c in [*children, crash])  # nothing left running or stopped
    results = {c.name: c.result() for c in children}
    assert all("step_s" in r for r in results.values()), results
    assert "no model here" in crash.result()["error"] and turns["children"]["crash"]["window_steps"] == [0, 0]
    rows = {n: [tuple(map(float, line.split())) for line in logs[n].read_text().splitlines()] for n in logs}
    window = {n: turns["children"][n]["window_steps"] for n in logs}
    # "quick" was stopped right after its first steps (a whole turn would be ~25) until "slow" was training too;
    # every step of its window that no pause fell into ran after "slow"'s first step (but the first: a step done
    # and not yet logged when "quick" was stopped counts one early)
    assert 1 <= window["quick"][0] <= 12, window
    longest = harness.paused_step_s(0.5)
    in_window = rows["quick"][window["quick"][0] + 1 : window["quick"][1]]
    assert all(start > rows["slow"][0][1] for start, _, seconds in in_window if seconds <= longest), in_window
    assert window["slow"][1] is None  # the first to exit after the window opened: all of its steps count
    assert window["quick"][1] < 60  # quick's last steps ran alone, after "slow" exited
    quick = results["quick"]["step_s"]
    paused = [i for i, d in enumerate(quick) if d > longest]
    assert paused, quick  # turns of 0.5 s over 60 steps of 0.02 s: pauses fell into some steps
    kept = harness.kept_steps(quick, longest)
    assert not set(kept) & {*paused, *(i + 1 for i in paused)}
    rates = harness.window_rates(quick, window["quick"], warmup=2, batch=8, longest_s=longest)
    assert rates["counted_steps"] <= window["quick"][1] - max(window["quick"][0], 2)
    # steps of at least 0.02 s (sleeps), none holding a pause (> longest) counted
    assert 8 / longest < rates["samples_per_s"] <= 8 / 0.02
    assert "error" in harness.window_rates(quick, [0, 0], warmup=2, batch=8, longest_s=longest)
    assert harness.kept_steps([1.0, 9.0, 1.0, 1.0], None) == [0, 1, 2, 3]  # not time-sliced: every step
    assert harness.kept_steps([1.0, 9.0, 1.0, 1.0], 4.5) == [0, 3]


def test_results_that_name_their_cpu_carry_its_features(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """lscpu's "AMD EPYC" names CPUs several-fold apart (an AVX2-only Zen 1 and an AVX-512 BF16 one): every
    result that names its CPU also records family/model and the matmul-relevant flags, read from /proc/cpuinfo."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import harness
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    features = harness.cpu_features()
    if not Path("/proc/cpuinfo").exists():
        assert features == {}
        pytest.skip("no /proc/cpuinfo")
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
                .split(":", 1)[1].split())  # fmt: skip
    assert features["matmul_flags"] == [f for f in harness.MATMUL_FLAGS if f in flags]
    assert features["bf16_units"] == bool(flags & {"avx512_bf16", "amx_bf16"})
    out = tmp_path / "r.json"
    harness.emit({"benchmark": "x", "cpu_model": "AMD EPYC"}, str(out))
    assert json.loads(out.read_text())["cpu_features"] == features
    assert json.loads(capsys.readouterr().out)["cpu_features"] == features
    harness.emit({"benchmark": "x"}, str(out))  # a result that names no CPU is left as it is
    assert "cpu_features" not in json.loads(out.read_text())


def test_serving_batching_bound_arithmetic_and_its_summary_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/serve.py``'s batching bound from a result's warm-up trials (and, with a fixed ``--dtype``, from
    the in-process and 8-client numbers), with the FLOP count and peak children stubbed: 30 GFLOP per chunk at a
    1.0 TFLOP/s peak, 100 ms at batch 1 (0.3 TFLOP/s: 30 % of peak, ceiling 3.33x) and 50 ms per chunk at batch 8
    (gain 2x); the summary's serving row then names both."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import harness
    import serve

    jobs = []

    def child(script: str, job: dict, *a, **k) -> dict:
        jobs.append(job)
        return {"flops_per_chunk": 30e9} if job["kind"] == "infer" else {"bf16_tflops": 1.0}

    monkeypatch.setattr(harness, "run_child", child)
    trials = [  # as the server reports them: string keys
        {"mode": "float32 eager sdpa", "ms_per_chunk": {"1": 300.0, "8": 200.0}},
        {"mode": "bfloat16 compiled sdpa", "ms_per_chunk": {"1": 120.0, "8": 60.0}},
        {"mode": "bfloat16 compiled explicit", "ms_per_chunk": {"1": 100.0, "8": 50.0}},
    ]
    kept = {
        "mode": "bfloat16 compiled explicit",
        "dtype": "bfloat16",
        "compile": True,
        "attention": "explicit",
    }
    result = {"serving_mode": {"micro_batched": {**kept, "trials": trials}}}
    bound = serve.batching_bound(result, 2)
    assert jobs[1] == {"kind": "peak", "threads": 2, "dtypes": ["bf16"]}  # the kept mode's dtype only
    assert bound["inside_model_gain_8"] == pytest.approx(2.0)
    assert bound["batch1_fraction_of_peak"] == pytest.approx(0.3)
    assert bound["ceiling"] == pytest.approx(1 / 0.3)
    assert bound["source"] == "the server's warm-up trials"
    # a fixed mode (a result file from before the attention kernel was part of it): no trials; batch 1 in process, batch 8 from the 8-client throughput (10 chunks/s: 100 ms)
    fixed = {"serving_mode": {"micro_batched": {"mode": "float32 eager", "trials": []}},
             "in_process": {"p50_ms": 150.0},
             "throughput": {"micro_batched": [{"clients": 1, "chunks_per_s": 6.0}, {"clients": 8, "chunks_per_s": 10.0}]}}  # fmt: skip
    monkeypatch.setattr(
        harness, "run_child", lambda s, job, *a, **k: {"flops_per_chunk": 30e9, "fp32_tflops": 0.5}
    )
    assert serve.batching_bound(fixed, 2)["inside_model_gain_8"] == pytest.approx(1.5)
    note = _run_all()._serve({"speedup_8_clients": 1.5, "batching_bound": bound})[1]["note"]
    assert "inside the model 2x, ceiling at the matmul peak 3.33x" in note, note
    bound_ops = {"batching_bound": bound, "speedup_8_clients": 1.5,
                 "op_breakdown": {"8": {"linear_fraction_of_peak": 0.93, "linear_ms_per_chunk": 75.0,
                                        "wall_ms_per_chunk": 100.0}}}  # fmt: skip
    note = _run_all()._serve(bound_ops)[1]["note"]
    assert "batch 8's linear layers at 93% of the peak, 75 of 100 ms per chunk" in note, note
    interleaved = {"speedup_8_clients": 1.7, "speedup_8_clients_rounds": [1.6, 1.7, 1.9]}
    note = _run_all()._serve(interleaved)[1]["note"]
    assert "median of 3 interleaved rounds (1.6-1.9x)" in note, note


def test_serving_op_breakdown_splits_time_and_flops_by_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/serve.py``'s op breakdown: profiler self times and counted FLOPs of a batch of 8 split into the
    linear layers, the attention matmuls and the rest, per chunk (the rest is the wall time the two leave); then,
    with the child stubbed, each kind's TFLOP/s, its fraction of the peak, and the batch-8 gain if the linears ran
    at the peak."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import harness
    import serve

    events = {"mkldnn::_linear_pointwise": 560.0, "aten::mm": 40.0, "aten::baddbmm": 40.0, "aten::bmm": 30.0,
              "graph_5_cpp_fused__softmax_6": 50.0, "aten::copy_": 10.0}  # fmt: skip
    flops = {"mm": 200e9, "addmm": 40e9, "bmm": 8e9, "baddbmm": 8e9, "convolution": 2e9}
    row = serve.split_ops(events, flops, wall_ms=800.0, batch=8)
    assert row == pytest.approx({
        "wall_ms_per_chunk": 100.0, "linear_ms_per_chunk": 75.0, "attention_matmul_ms_per_chunk": 8.75,
        "other_ms_per_chunk": 16.25, "linear_gflop_per_chunk": 30.0, "attention_gflop_per_chunk": 2.0,
        "other_gflop_per_chunk": 0.25,
    })  # fmt: skip
    per_chunk = {op: f / 8 for op, f in flops.items()}
    one = serve.split_ops({"aten::addmm": 100.0, "aten::bmm": 10.0}, per_chunk, wall_ms=160.0, batch=1)
    jobs = []

    def child(script: str, job: dict, *a, **k) -> dict:
        jobs.append(job)
        return {"1": dict(one), "8": dict(row)}

    monkeypatch.setattr(harness, "run_child", child)
    mode = {
        "mode": "bfloat16 compiled explicit",
        "dtype": "bfloat16",
        "compile": True,
        "attention": "explicit",
    }
    result = {"serving_mode": {"micro_batched": mode}, "batching_bound": {"peak_tflops": 0.5}}
    out = serve.op_breakdown(Path("/ckpt"), result, 2)
    assert jobs == [{"kind": "ops", "ckpt": "/ckpt", "threads": 2, "batches": [1, 8], "dtype": "bfloat16",
                     "compile": True, "attention": "explicit"}]  # fmt: skip
    assert out["8"]["linear_tflops"] == pytest.approx(0.4)  # 30 GFLOP in 75 ms
    assert out["8"]["linear_fraction_of_peak"] == pytest.approx(0.8)
    assert out["8"]["attention_tflops"] == pytest.approx(2.0 / 8.75)
    # batch 8 with its linears at 0.5 TFLOP/s: 60 + 8.75 + 16.25 = 85 ms per chunk, against batch 1's 160
    assert out["gain_8_if_linears_at_peak"] == pytest.approx(160.0 / 85.0)
    assert out["mode"] == "bfloat16 compiled explicit"
    # linears timed faster than the peak (kernels the profiler did not see): flagged, no gain computed
    unseen = {**row, "linear_ms_per_chunk": 5.0}
    monkeypatch.setattr(harness, "run_child", lambda *a, **k: {"1": dict(one), "8": dict(unseen)})
    flagged = serve.op_breakdown(Path("/ckpt"), result, 2)
    assert "did not see" in flagged["error"] and "gain_8_if_linears_at_peak" not in flagged
    monkeypatch.setattr(harness, "run_child", lambda *a, **k: {"error": "boom"})
    assert serve.op_breakdown(Path("/ckpt"), result, 2) == {"error": "boom"}
