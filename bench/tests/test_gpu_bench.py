"""`make bench-gpu` (bench/gpu.py): its dry run on CPU gives the table and rewrites a doc's
record section; the table's verdicts follow the targets; it says what is missing; a section
past its share of the budget is cut and says so, and a killed run keeps what it finished."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from bench import airbench, budget, framework
from bench import gpu as G
from bench import gpu_table as T
from conftest import requires_cuda


@pytest.mark.slow  # each section in a process of its own: about 14 s on the 2-core box
def test_dry_run_prints_the_table_and_rewrites_the_record(tmp_path, capsys):
    doc = tmp_path / "benchmarks-gpu.md"
    doc.write_text(f"# GPU\n\nbefore\n\n{T.START}\nan older record\n{T.END}\n\nafter\n")
    out = tmp_path / "out"
    data = G.main(["--tiny", "--tests", "none", "--out", str(out), "--doc", str(doc)])
    printed = capsys.readouterr().out
    first = printed.splitlines()[:3]
    assert first[1].startswith("missing: ") and first[2].startswith("not a GPU")
    assert "| target | measured | holds |" in printed
    targets = [t for t, _, _ in T.rows(data)]
    # every section ran, in a process of its own (--tests none: nothing to run for that one)
    assert [*data["section_seconds"], "tests"] == list(G.SECTIONS) and "cut" not in data
    for promise in (
        "template >= 0.97 x plain loop",
        "mixed precision pays",
        "activation checkpointing, best setting",
        "precision=auto",
        "host work of a recipe step",
        "Lightning's extra host work",
        "speedrun_gpu: fit_seconds",
        "`pytest -m gpu`",
        "the default test suite",
    ):
        assert any(promise in t for t in targets), (promise, data.get("failed"))
    text = doc.read_text()
    assert text.startswith("# GPU\n\nbefore\n\n") and text.endswith(f"{T.END}\n\nafter\n")
    assert "an older record" not in text and text.count(T.START) == 1
    assert "**not a GPU**" in text and "| target | measured | holds |" in text
    assert "not run (--tests none)" in text and "raw JSON" in text
    saved = json.loads((out / "bench_gpu.json").read_text())
    assert saved["machine"]["gpu"] is None and saved["speedrun"]["epochs"] == 1
    assert saved["host"]["profile"]["us_per_step_by_owner"]["lightning"]["total"]["Lightning"] > 0
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "benchmarks-gpu.png").read_bytes()[:4] == b"\x89PNG"


def measured(images_per_sec: float, peak: float = 1000.0, step: float = 10.0) -> dict:
    # 500 MB on the device before each step (data, weights): not the step's
    return {
        "images_per_sec": images_per_sec,
        "step_ms": step,
        "step_peak_mb": peak,
        "peak_mb": peak + 500,
    }


def gpu_like(**changes) -> dict:
    data = {
        "sizes": {"net": "ResNet-18", "batch": 512, "images": 50_000},
        "defaults": {"32-true": False, "16-mixed": True, "bf16-mixed": True},
        "precision": [
            {
                "mode": "32-true",
                "channels_last": False,
                "lightning": measured(19_000, 2500),
                "plain": measured(19_800, 2500),
            },
            {
                "mode": "32-true",
                "channels_last": True,
                "lightning": measured(18_000, 2500),
                "plain": measured(18_500, 2500),
            },
            {
                "mode": "16-mixed",
                "channels_last": False,
                "lightning": measured(23_000, 1400),
                "plain": measured(26_000, 1366),
            },
            {
                "mode": "16-mixed",
                "channels_last": True,
                "lightning": measured(49_000, 1350),
                "plain": measured(50_000, 1346),
            },
        ],
        "checkpointing": [
            {"setting": "none", **measured(0, 1400, 10.0)},
            {"setting": "stage 0", **measured(0, 900, 12.0)},
            {"setting": "every block", **measured(0, 700, 17.0)},  # the least memory
        ],
        "framework": [
            {
                "case": "SpeedNet",
                "ratio_lightning_over_plain": 0.97,
                "plain_images_per_s": 1e5,
                "lightning_images_per_s": 9.7e4,
                "lightning_s_per_epoch": 0.52,
            },
        ],
        "auto": {
            "candidates": ["32-true", "16-mixed"],
            "images_per_sec": {},
            "chosen": "16-mixed",
            "probe_batch": 512,
            "finite": {"32-true": True, "16-mixed": True},
            "seconds": 12.0,
            "budget": 20.0,
            "channels_last": True,
        },
    }
    return data | changes


def verdicts(data: dict) -> dict[str, str]:
    return {target: holds for target, _, holds in T.rows(data)}


def test_the_table_judges_each_promise_by_its_target():
    got = verdicts(gpu_like())
    by = {k.split(":")[0] if "template >=" in k else k: v for k, v in got.items()}
    assert by["ResNet-18 b512 16-mixed NCHW"] == "no"  # 23,000 / 26,000 = 0.88
    assert by["ResNet-18 b512 16-mixed channels_last"] == "yes"  # 0.98
    assert next(v for k, v in got.items() if k.startswith("mixed precision pays")) == "yes"
    assert next(v for k, v in got.items() if k.startswith("each mode's default layout")) == "yes"
    ckpt = next(r for r in T.rows(gpu_like()) if r[0].startswith("activation checkpointing"))
    assert ckpt[1].startswith("every block: 700 vs 1,400 MB (0.50)") and ckpt[2] == "yes"
    memory = next(r for r in T.rows(gpu_like()) if r[0].startswith("16-bit modes' step peak"))
    assert memory[1] == "16-mixed NCHW 0.56; 16-mixed channels_last 0.54" and memory[2] == "yes"
    assert next(v for k, v in got.items() if k.startswith("precision=auto")) == "yes"
    assert got["Lightning / plain >= 0.95: SpeedNet"] == "yes"
    # auto picking a mode the table finds 2.5x slower does not hold
    slow = gpu_like(auto=gpu_like()["auto"] | {"chosen": "32-true"})
    assert next(v for k, v in verdicts(slow).items() if k.startswith("precision=auto")) == "no"
    # nor a probe at another batch than the run's: it times something else
    small = gpu_like(auto=gpu_like()["auto"] | {"probe_batch": 16})
    assert next(v for k, v in verdicts(small).items() if k.startswith("precision=auto")) == "no"


def test_a_cut_or_failed_section_is_a_row_after_its_finished_cases():
    framework = gpu_like()["framework"]
    data = gpu_like(
        cut={"framework": "cut by the deadline after 104 s"}, failed={"auto": "RuntimeError()"}
    )
    table = T.rows(data)
    at = table.index(
        ("`framework` ends within its share of --budget", data["cut"]["framework"], "no")
    )
    assert table[at - 1][0] == f"Lightning / plain >= 0.95: {framework[0]['case']}"
    assert ("`auto` runs", "failed: RuntimeError()", "no") in table


def finishes(arg, keep):
    return {"ran": arg}


def fails(arg, keep):
    keep(["a first case"])
    raise RuntimeError("no kernel")


def hangs(arg, keep):
    keep(["a first case"])
    time.sleep(3600)


def test_a_section_past_its_deadline_is_cut_and_the_next_gets_what_is_left(tmp_path):
    data, saved = {}, []
    jobs = [
        ("a", 1.0, finishes, 1),
        ("b", 1.0, hangs, 2),
        ("c", 1.0, fails, 3),
        ("d", 1.0, finishes, 4),
    ]
    budget.run_sections(jobs, 6.0, data, lambda d: saved.append(json.dumps(d)), tmp_path, "fork")
    assert data["a"] == {"ran": 1} and data["d"] == {"ran": 4}
    assert data["b"] == ["a first case"] and data["c"] == ["a first case"]
    assert list(data["cut"]) == ["b"] and data["cut"]["b"].startswith("cut by the deadline after")
    assert data["failed"] == {"c": "RuntimeError('no kernel')"}
    assert len(saved) == 4 and '"a": {"ran": 1}' in saved[0]  # written as each one ends


def backward(arg, keep):
    x = torch.ones(2, requires_grad=True)
    (x * arg).sum().backward()
    return x.grad.tolist()


@pytest.mark.slow  # a torch.compile: about 10 s
def test_a_section_trains_after_this_process_compiled_one(tmp_path):
    # A fork of a process whose compiled step ran backward cannot run one (autograd's threads):
    # a pytest worker may have run test_compile's before the dry run, so the CPU sections are
    # forks of a server instead.
    torch.compile(torch.nn.Linear(2, 2))(torch.ones(1, 2)).sum().backward()
    data = {}
    budget.run_sections(
        [("b", 1.0, backward, 3.0)], 60.0, data, lambda d: None, tmp_path, "forkserver"
    )
    assert "failed" not in data, data["failed"]
    assert data["b"] == [3.0, 3.0]


@pytest.mark.slow
def test_a_killed_run_keeps_the_sections_it_finished(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bench.gpu", "--tiny", "--tests", "none", "--no-doc"]
    command += ["--out", str(out), "--sections", "auto,speedrun,tests"]
    proc = subprocess.Popen(command, cwd=G.REPO, env=G._env(), stdout=subprocess.DEVNULL)
    saved = out / "bench_gpu.json"
    while proc.poll() is None and "auto" not in (saved.read_text() if saved.is_file() else ""):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # during the speedrun section, or after the last one
    proc.wait(timeout=120)
    data = json.loads(saved.read_text())
    assert data["auto"]["chosen"] in data["auto"]["candidates"]
    assert "| target | measured | holds |" in (out / "bench_gpu.md").read_text()


def test_unmeasured_promises_say_so():
    data = gpu_like(
        precision=[
            {
                "mode": "bf16-mixed",
                "channels_last": True,
                "lightning": {"skipped": "precision=bf16-mixed: Tesla V100 has no bfloat16"},
                "plain": {"skipped": "same"},
            },
        ],
        framework=[{"case": "x", "skipped": "dry run"}],
        tests={"gpu": {"summary": "not run: pytest is not installed"}},
    )
    rows = {t: (m, h) for t, m, h in T.rows(data)}
    skipped = next(v for k, v in rows.items() if "bf16-mixed channels_last" in k)
    assert skipped == ("skipped: precision=bf16-mixed: Tesla V100 has no bfloat16", "-")
    assert rows["`pytest -m gpu` passes on this machine in <= 180 s"][1] == "-"


@pytest.mark.parametrize(
    "output,expected",
    [
        (
            "...\n==== 412 passed, 3 skipped, 9 deselected in 250.1s ====\n",
            "412 passed, 3 skipped, 9 deselected in 250.1s",
        ),
        (
            "..F\nFAILED tests/x.py::t\n= 1 failed, 2 passed in 3.0s =\n",
            "1 failed, 2 passed in 3.0s",
        ),
        ("\n===== no tests ran in 0.5s =====\n", "no tests ran in 0.5s"),
        ("Traceback...\nImportError: no hydra\n", None),
    ],
)
def test_pytest_summary_line(output, expected):
    assert G.summary_line(output) == expected


def test_a_doc_without_the_markers_gets_a_record_section(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("# Title\n")
    T.write_record(doc, "the table\n")
    T.write_record(doc, "the new table\n")
    text = doc.read_text()
    assert text.startswith("# Title\n\n## Record") and "the new table" in text
    assert "the table\n" not in text.replace("the new table", "")


def test_missing_packages_are_named_first(monkeypatch, capsys):
    real = importlib.util.find_spec
    gone = {"hydra", "matplotlib"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a)
    )
    need, nice = G.missing()
    assert need == ["hydra-core"] and "matplotlib (no chart)" in nice
    with pytest.raises(SystemExit) as e:
        G.main(["--tests", "none"])
    assert e.value.code == 2
    assert capsys.readouterr().out.splitlines()[1].startswith("missing: hydra-core: cannot run")


def test_the_gpu_sizes_name_valid_cases():
    sizes = G.Sizes.gpu()
    every = [f"{m} {layout}" for m, _ in G.MODES for layout in ("nchw", "cl")]
    assert sorted(sizes.modes) == sorted(every)
    assert set(sizes.checkpointing) <= set(G.CHECKPOINTING)
    for _, argv in sizes.framework:
        framework.parse(argv)  # arguments bench.framework takes


# airbench94's table as it prints it (25a5182's H100 log, two runs, epochs cut for brevity)
AIRBENCH_LOG = """\
------------------------------------------------------------------------------------------------------
|  run     |  epoch  |  train_loss  |  train_acc  |  val_acc  |  tta_val_acc  |  total_time_seconds  |
------------------------------------------------------------------------------------------------------
|       0  |      0  |      1.2441  |     0.8496  |   0.6862  |               |              6.3719  |
|          |      1  |      1.0371  |     0.9541  |   0.6617  |               |              6.5958  |
|          |   eval  |      0.8711  |     1.0000  |   0.8272  |       0.8370  |              8.7924  |
------------------------------------------------------------------------------------------------------
|       1  |      0  |      1.2725  |     0.8193  |   0.6650  |               |              0.2219  |
|          |      1  |      1.0195  |     0.9658  |   0.6415  |               |              0.4399  |
|          |      9  |      0.8716  |     1.0000  |   0.8277  |               |              2.7234  |
|          |   eval  |      0.8716  |     1.0000  |   0.8277  |       0.8309  |              2.8057  |
|       2  |      0  |      1.2471  |     0.8291  |   0.6885  |               |              0.3307  |
"""


def test_airbench94_seconds_per_epoch_skip_its_warm_up_run_and_unfinished_ones():
    found = airbench.seconds_per_epoch(AIRBENCH_LOG)
    assert found["runs"] == 3 and found["epochs"] == [2, 3, 1]
    # run 1 only: from its first epoch's end to its last's (training time, cumulative)
    assert found["seconds_per_epoch"] == pytest.approx((2.7234 - 0.2219) / 9)
    assert airbench.seconds_per_epoch("Traceback ...")["seconds_per_epoch"] is None


@pytest.mark.gpu
@requires_cuda
def test_the_templates_step_peak_is_device_memory_that_16_bit_and_checkpointing_lower(tmp_path):
    # On 25a5182 the template's "peak" was the process's RSS (read after Lightning had moved
    # the module back to the CPU): it rose case after case and no setting lowered it.
    from bench import synthetic

    sizes = dataclasses.replace(G.Sizes.gpu(), images=1024, batch=256, warmup=2, timed=3)
    data_dir, _ = synthetic.write(tmp_path / "data", sizes.images, 256)

    def step_peak(*overrides: str) -> float:
        run = G.case_overrides(sizes, data_dir, tmp_path / "run", "cuda")
        measured = G.lightning_steps(G.compose([*run, *overrides]), sizes, {})
        assert 0 < measured["step_peak_mb"] < measured["peak_mb"]
        return measured["step_peak_mb"]

    cl = "precision.channels_last=true"
    fp32, mixed = step_peak("precision=32-true", cl), step_peak("precision=16-mixed", cl)
    stages = step_peak("precision=16-mixed", cl, "model.checkpoint_stages=[0,1]")
    assert mixed < 0.8 * fp32 and stages < 0.85 * mixed, (fp32, mixed, stages)
