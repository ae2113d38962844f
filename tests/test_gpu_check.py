"""The one-shot GPU check, rehearsed as scripts/gpu_bundle.sh does it, on a small payload (the bundled model through
the direct PTX path, one kernel, no benchmark): scripts/gpu_run.sh runs it under Python 3.12 with the stand-in
driver, every GPU case gets as far as its first GPU call and is rerun, and the CPU cases pass (the kernel-call trace
of the CPU artifact replays exactly, and a wrong output in it is named by its kernel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from cuda_standin import tvm_cuda_loader, write_standin
from test_bundle import PYTHON

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(PYTHON is None, reason="no Python 3.12 interpreter on this machine")


def test_gpu_check_rehearsal(tmp_path):
    payload = tmp_path / "payload"
    prepare = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "prepare", str(payload),
                              "--models", "qwen2-bf16", "--paths", "ptx", "--kernels", "gemv", "--no-bench"],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    with tarfile.open(tmp_path / "payload.tar.gz", "w:gz") as tar:
        tar.add(payload, arcname="payload")
    standin = write_standin(tmp_path / "standin", tvm_cuda_loader()).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TVM_"))}
    env.update(LD_LIBRARY_PATH=str(standin), RUDA_STANDIN_DEVICES="1", GPU_CHECK_CPU_CASES="1", RUDA_PYTHON=PYTHON,
               PAYLOAD=str(tmp_path / "payload.tar.gz"), OUT=str(tmp_path / "out"))
    run = subprocess.run([str(ROOT / "scripts" / "gpu_run.sh")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 1, run.stderr  # the GPU cases fail at the stand-in
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    env_case = records[0]
    assert env_case["case"] == "env" and env_case["status"] == "pass" and env_case["python"].startswith("3.12")
    assert env_case["driver_cuda_version"] == "13.0"
    reruns = [r for r in records if r.get("rerun") == "CUDA_LAUNCH_BLOCKING=1"]
    assert {r["case"] for r in reruns} == {"kernel:gemv:ptx", "model:qwen2-bf16:ptx", "trace:qwen2-bf16:ptx",
                                           "bundle"}
    final = {r["case"]: r for r in records}
    assert final["trace:qwen2-bf16:cpu"]["status"] == "pass" and final["trace:qwen2-bf16:cpu"]["calls"] > 30
    check = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "check-rehearsal",
                            str(tmp_path / "out" / "results.jsonl"), str(payload)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout
    assert json.loads(check.stdout)["rehearsal"] == "ok"
    _a_wrong_output_names_its_kernel(payload)


def _a_wrong_output_names_its_kernel(payload: Path) -> None:
    """The trace replay fails, naming the kernel, when one call's recorded output is not what its kernel computes."""
    import numpy as np

    from benchmarks.gpu_check import _replay_trace

    traces = payload / "traces"
    calls = json.loads((traces / "qwen2-bf16.json").read_text())
    call = next(c for c in calls if c["before"][-1] != c["after"][-1])  # a call that wrote its last argument
    arrays = dict(np.load(traces / "qwen2-bf16.npz"))
    arrays[call["after"][-1]] = arrays[call["after"][-1]] + np.ones_like(arrays[call["after"][-1]])
    np.savez(traces / "qwen2-bf16.npz", **arrays)
    with pytest.raises(AssertionError, match=call["kernel"]):
        _replay_trace(payload, "qwen2-bf16", "cpu")


def test_gpu_check_stops_at_a_driver_that_is_too_old(tmp_path, monkeypatch):
    """With a driver for CUDA 12.8, the env case says so and nothing else runs."""
    from benchmarks.gpu_check import run

    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "cases.json").write_text(json.dumps({"kernels": ["kernel:gemv:ptx"], "models": [], "cpu": [],
                                                    "bench": False}))
    standin = write_standin(tmp_path / "standin", tvm_cuda_loader()).parent
    monkeypatch.setenv("LD_LIBRARY_PATH", str(standin))
    monkeypatch.setenv("RUDA_STANDIN_DRIVER_VERSION", "12080")
    assert run(payload, tmp_path / "out") == 1
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["case"] for r in records] == ["env", "summary"]
    assert records[0]["stop"] and "driver >= 580" in records[0]["error"]


NCU_COLUMNS = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
               "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value")
NCU_KERNELS = (("linear_abc_kernel", "(112, 1, 1)", "ns", "3,456"), ("linear_abc_kernel_1", "(4, 1, 1)", "ns", "1,000"),
               ("rope_x_kernel", "(4, 1, 1)", "us", "2.5"))  # two kernels of one function; microseconds too


def _ncu_log() -> str:
    """ncu's CSV log (--csv --log-file) of NCU_KERNELS, after its own message line."""
    rows = [NCU_COLUMNS] + [(str(i), "1", "python3", "h", name, "1", "7", "(256, 1, 1)", grid, "0", "9.0",
                             "Command line profiler metrics", "gpu__time_duration.sum", unit, value)
                            for i, (name, grid, unit, value) in enumerate(NCU_KERNELS)]
    return "==PROF== Connected to process 1\n" + "".join(",".join(f'"{v}"' for v in row) + "\n" for row in rows)


def test_profile_sums_ncu_kernel_times_per_kernel_function(tmp_path, monkeypatch):
    """The profile case reads ncu's CSV log: a function's kernels (NAME_kernel, NAME_kernel_1) summed, units
    converted to microseconds, the slowest function first."""
    import stat
    import types

    import tvm

    from benchmarks import gpu_check

    ncu = tmp_path / "bin" / "ncu"
    ncu.parent.mkdir()
    (tmp_path / "log.csv").write_text(_ncu_log())
    ncu.write_text(f'#!/bin/sh\nwhile [ "$1" != "--log-file" ]; do shift; done\ncp {tmp_path / "log.csv"} "$2"\n')
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{ncu.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path))
    monkeypatch.setattr(tvm, "cuda", lambda index=0: types.SimpleNamespace(compute_version="9.0"))
    got = gpu_check._profile(tmp_path)
    assert got["kernels"] == 3 and got["total_us"] == 7.0 and got["units"] == ["ns", "us"]
    assert list(got["by_function"]) == ["linear_abc", "rope_x"]
    assert got["by_function"]["linear_abc"] == {"calls": 2, "us": 4.5, "grid": "(112, 1, 1)"}


def test_gpu_check_refuses_a_case_prefix_that_names_no_case(tmp_path, monkeypatch, capsys):
    """GPU_CHECK_ONLY with a misspelt prefix is an error naming it and the case kinds, before anything runs or is
    written (else the run would hold env alone, and pass)."""
    from benchmarks.gpu_check import run

    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "cases.json").write_text(json.dumps({"kernels": ["kernel:gemv:ptx"], "models": ["model:qwen2-bf16:ptx"],
                                                    "cpu": [], "bench": True}))
    monkeypatch.setenv("GPU_CHECK_ONLY", "kernel:gemv,modle")
    assert run(payload, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "no case of this payload starts with modle" in err and "bench, bundle, env, kernel, model" in err
    assert not (tmp_path / "out").exists()
