"""The one-shot GPU check: prepared on a build machine, run on a GPU machine that has a driver and Python 3.12 but no
TVM, no compiler and no network.

    python -m benchmarks.gpu_check prepare PAYLOAD [--models M,..] [--paths ptx,nvrtc,nvcc] [--kernels K,..]
                                                   [--no-bench]                         (scripts/gpu_bundle.sh)
    python3 PAYLOAD/bundle/python/gpu_check.py run PAYLOAD OUT                          (scripts/gpu_run.sh)
    python -m benchmarks.gpu_check check-rehearsal OUT/results.jsonl PAYLOAD            (after a rehearsal)
    python -m benchmarks.gpu_check launches ARTIFACT [FUNCTION]     (kernels and host launches of a step function)

`prepare` writes PAYLOAD: a deploy bundle (the qwen2 tiny model through the ptx path) whose Python environment
every case uses; sm_90 CUDA artifacts of tiny Llama, Qwen2 and Qwen3.5 checkpoints through each CUDA path, with
their transformers logits and the CPU artifact's greedy tokens as references, and each model's kernel-call trace
(every kernel call of its CPU artifact for the prompt and a decode step, arguments before and after: replayed on
the device, it names the kernels whose outputs differ); single-kernel modules at real Qwen2.5-0.5B widths with the
CPU kernels' outputs (a tensor-core GEMM with numpy's bf16-rounded product); two 0.5B-shape bf16 artifacts (the
default, and bf16 prefill products on tensor cores) whose checkpoint the device regenerates from a seed and checks
by hash, timed beside the host's transformers and profiled kernel by kernel with ncu. `run` needs nothing else:
each case runs in its own process (isolated from the host's packages: -E -S) with a timeout, one JSON line per
case goes to OUT/results.jsonl as it ends, a failing case is rerun once with CUDA_LAUNCH_BLOCKING=1 (so the error
names the kernel), and a driver that is too old stops it at once. GPU_CHECK_ONLY=PREFIX,.. runs some cases.

This file is copied into the payload: the `run` side imports only the standard library, numpy and the bundle.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ir.contract import file_digest

MODELS = {"qwen2-bf16": dict(arch="qwen2", dtype="bfloat16"), "llama-f32-mha": dict(arch="llama", num_key_value_heads=4),
          "qwen3_5-bf16": dict(arch="qwen3_5", dtype="bfloat16", num_hidden_layers=3)}
PATHS = ("ptx", "nvrtc", "nvcc")
ARCH = "sm_90"  # the H200
BUCKETS = dict(prefill_buckets=(8, 16), max_context=128)
PROMPT_TOKENS, DECODE_STEPS, GREEDY_TOKENS = 24, 15, 32
BUNDLED = ("qwen2-bf16", "ptx")  # the case whose artifact the payload's bundle holds
PAGE_TABLE = np.arange(256, dtype=np.int32)[::-1].reshape(1, 256).copy()  # one sequence's pages, scattered
KERNEL_CASES = {  # real Qwen2.5-0.5B widths (arrays: int inputs as given): decode GEMV, prefill GEMM with bias, norms,
    # paged attention of a decode token at position 3001
    "gemv": ("linear", [((1, 896), "float32"), ((4864, 896), "bfloat16")], {}),
    "gemv-vocabulary": ("linear", [((1, 896), "float32"), ((151936, 896), "bfloat16")], {}),  # the 0.5B head
    "gemm-bias": ("linear", [((64, 896), "float32"), ((1152, 896), "bfloat16"), ((1152,), "bfloat16")], {}),
    "gemm-f32": ("linear", [((32, 4864), "float32"), ((896, 4864), "float32")], {}),
    "norm-decode": ("rms_norm", [((1, 896), "float32"), ((896,), "bfloat16")], {"eps": 1e-6}),
    "norm-prefill": ("add_rms_norm", [((16, 896), "float32"), ((16, 896), "float32"), ((896,), "float32")],
                     {"eps": 1e-6}),
    "attention-decode": ("paged_attention", [((1, 896), "float32"), ((256, 16, 128), "float32"),
                                             ((256, 16, 128), "float32"), PAGE_TABLE, np.zeros(1, np.int32),
                                             np.array([3001], np.int32)],
                         {"num_heads": 14, "num_kv_heads": 2, "head_dim": 64, "scale": 0.125}),
    "gemm-bf16-tensor-cores": ("linear", [((64, 896), "float32"), ((4864, 896), "bfloat16"), ((4864,), "bfloat16")],
                               {}),
}
# Cases built with --matmul-precision bfloat16 (tensor cores: the nvrtc and nvcc paths only), against numpy's product
# of the activations rounded to bfloat16.
BF16_PRODUCT_CASES = {"gemm-bf16-tensor-cores"}
BENCH = dict(shape="qwen2.5-0.5b", dtype="bfloat16", seed=0, tokens=128, runs=3)
BENCH_CHECKPOINT = "bench-checkpoint"  # the benchmark checkpoint's folder under $GPU_CHECK_WORK (1 GB, not in OUT)
DECODE_FUNCTION = "step_t1_r1"  # one token of one sequence
H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e peak
# Seconds a case may take (a case that hangs is not rerun); the benchmark's transformers peer runs inside its case.
TIMEOUTS = {"env": 60, "kernel": 45, "model": 90, "trace": 90, "bundle": 90, "bench": 300, "peer": 150,
            "profile": 120}
NOTE = "note: "  # a case's progress lines on stderr, kept in its record
BUDGET_SECONDS = 450  # the whole run: no new case starts after this (the device loan is 15 minutes, start-up included)


def kernel_inputs(case: str) -> list[np.ndarray]:
    """A kernel case's inputs, the same on every machine (random ones drawn from seed 0)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    return [spec if isinstance(spec, np.ndarray) else rng.standard_normal(spec[0]).astype(np.float32).astype(
        ml_dtypes.bfloat16 if spec[1] == "bfloat16" else np.float32) for spec in KERNEL_CASES[case][1]]


def prompt_ids(vocab: int) -> list[int]:
    """The prompt of the model cases."""
    return [int(t) for t in np.random.default_rng(0).integers(0, vocab, PROMPT_TOKENS)]


# ---------------------------------------------------------------- run (on the GPU machine) -----------------------

def cases(payload: Path, cpu: bool = False) -> list[str]:
    """Every case the payload holds, in the order they run; with `cpu`, the model cases on the CPU artifacts too."""
    listed = json.loads((payload / "cases.json").read_text())
    traces = [f"trace:{m.split(':', 1)[1]}" for m in listed["models"]]
    return ["env", *listed["kernels"], *listed["models"], *traces, "bundle",
            *(["bench", "profile"] if listed["bench"] else []),
            *([f"{kind}:{m}:cpu" for m in listed["cpu"] for kind in ("model", "trace")] if cpu else [])]


def run_case(payload: Path, name: str) -> dict:
    """One case's measurements; raises when it fails. Model cases of path `cpu` run the CPU artifact (rehearsals)."""
    kind, _, rest = name.partition(":")
    if kind == "env":
        return _env()
    if not name.endswith(":cpu"):
        from runtime.cuda import load_cuda

        load_cuda()
    if kind == "kernel":
        return _kernel(payload, *rest.split(":"))
    if kind == "model":
        return _model(payload, *rest.split(":"))
    if kind == "trace":
        return _replay_trace(payload, *rest.split(":"))
    if kind == "bundle":
        return _bundle(payload)
    if kind == "profile":
        return _profile(payload)
    if kind == "decode-step":  # what `_profile` runs under ncu
        return _decode_step(payload)
    return _bench(payload)


def _env() -> dict:
    import platform

    from runtime.cuda import CudaUnavailable, load_cuda_libraries

    info = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    try:
        driver = load_cuda_libraries()
    except CudaUnavailable as e:
        raise SystemExit(f"STOP {e}")  # no usable driver: nothing else can run
    import ctypes

    version = ctypes.c_int(0)
    driver.cuDriverGetVersion(ctypes.byref(version))
    info["driver_cuda_version"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    return info


def _kernel(payload: Path, case: str, path: str) -> dict:
    import tvm

    data = np.load(payload / "kernels" / f"{case}.npz")
    lib = tvm.runtime.load_module(str(payload / "kernels" / f"{case}-{path}.so"))
    dev = tvm.cuda(0)
    inputs = kernel_inputs(case)
    wants = [data[f"out{i}"] for i in range(len(data.files))]
    args = [tvm.runtime.tensor(x, dev) for x in inputs] + [tvm.runtime.empty(w.shape, str(w.dtype), dev) for w in wants]
    lib["main"](*args)
    errors = []
    for got, want in zip((a.numpy() for a in args[len(inputs):]), wants):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
        errors.append(float(np.abs(got.astype(np.float64) - want).max()))
    return {"max_abs_error": max(errors)}


def _logits_close(ours: np.ndarray, theirs: np.ndarray) -> float:
    tol = 1e-4 * max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=tol)
    return float(np.abs(ours - theirs).max())


def _model(payload: Path, model: str, path: str) -> dict:
    from runtime import CompiledModel, GreedyGenerationConfig, generate

    ref = np.load(payload / "references" / f"{model}.npz")
    artifact = payload / ("cpu" if path == "cpu" else "cuda") / (model if path == "cpu" else f"{model}-{path}")
    ours = CompiledModel(payload / "models" / model, artifact, device="cpu" if path == "cpu" else "cuda")
    prompt, steps = [int(t) for t in ref["prompt"]], [int(t) for t in ref["steps"]]
    cache = ours.new_cache(len(prompt) + len(steps) + 1)
    worst = _logits_close(ours.forward(prompt, cache), ref["logits"][0])
    for k, token in enumerate(steps):
        worst = max(worst, _logits_close(ours.forward([token], cache), ref["logits"][k + 1]))
    cache.release()
    tokens = generate(ours, [5, 6, 7], GreedyGenerationConfig(GREEDY_TOKENS, eos_token_ids=[])).generated_token_ids
    if tokens != [int(t) for t in ref["greedy"]]:
        raise AssertionError(f"greedy tokens differ from the CPU artifact's: {tokens} vs {ref['greedy'].tolist()}")
    return {"max_logit_error": worst, "steps": len(steps) + 1, "greedy_tokens": len(tokens)}


def _replay_trace(payload: Path, model: str, path: str) -> dict:
    """Each kernel call the CPU artifact made for the prompt and a decode step (`_trace`), replayed alone on this
    device from the recorded arguments: which kernels' outputs differ (so a wrong model case names its kernel)."""
    import tvm

    calls = json.loads((payload / "traces" / f"{model}.json").read_text())
    arrays = np.load(payload / "traces" / f"{model}.npz")
    artifact = payload / ("cpu" if path == "cpu" else "cuda") / (model if path == "cpu" else f"{model}-{path}")
    library = tvm.runtime.load_module(str(artifact / "model.so")).imports[0]
    dev = tvm.cpu() if path == "cpu" else tvm.cuda(0)
    failing = {}
    for index, call in enumerate(calls):
        args = [tvm.runtime.tensor(_unpacked(arrays, key), dev) for key in call["before"]]
        library.get_function(call["kernel"], query_imports=True)(*args)
        dev.sync()
        for position, (got, key) in enumerate(zip(args, call["after"])):
            want = _unpacked(arrays, key).astype(np.float64)
            if not want.size:
                continue
            error = float(np.abs(got.numpy().astype(np.float64) - want).max())
            scale = max(1.0, float(np.abs(want).max()))
            if not error <= 1e-4 * scale:
                worst = failing.setdefault(call["kernel"], {"first_call": index, "calls": 0, "worst_error": 0.0})
                worst["calls"] += 1
                worst.update(worst_error=max(worst["worst_error"], error), argument=position, scale=scale)
    if failing:
        raise AssertionError(f"kernels whose outputs differ from the CPU's: {json.dumps(failing)}")
    return {"calls": len(calls), "kernels": len({c["kernel"] for c in calls})}


def _unpacked(arrays, key: str) -> np.ndarray:
    """A recorded array (bfloat16 ones are kept as their uint16 bits)."""
    import ml_dtypes

    return arrays[key].view(ml_dtypes.bfloat16) if key.endswith("bf16") else arrays[key]


def _bundle(payload: Path) -> dict:
    """The bundle's own launcher, as a user runs it: its tokens equal the CPU artifact's."""
    bundle = payload / "bundle"
    result = subprocess.run([str(bundle / "run"), "generate", "hello", "16"], capture_output=True, text=True,
                            env={**os.environ, "RUDA_PYTHON": sys.executable}, timeout=TIMEOUTS["bundle"])
    if result.returncode != 0:
        raise RuntimeError(_last_error(result))
    run = json.loads(result.stdout.splitlines()[-1])
    want = json.loads((payload / "references" / "bundle.json").read_text())["generated_token_ids"]
    if run["generated_token_ids"] != want:
        raise AssertionError(f"bundle tokens {run['generated_token_ids']} differ from the CPU artifact's {want}")
    return {"tokens": len(want), "decode_tokens_per_s": run["decode_tokens_per_s"]}


def regenerate_checkpoint(payload: Path, work: Path) -> Path:
    """The benchmark checkpoint, written from its seed into `work` and checked against the hash taken where it was
    built."""
    from models.tiny import random_weights, save_weights

    spec = json.loads((payload / "bench" / "checkpoint.json").read_text())
    out = work / BENCH_CHECKPOINT
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((payload / "bench" / "config.json").read_text())
    save_weights(random_weights(config, seed=spec["seed"]), out)
    (out / "config.json").write_bytes((payload / "bench" / "config.json").read_bytes())
    digest = file_digest(out / "model.safetensors")
    if digest != spec["sha256"]:
        raise AssertionError(f"the regenerated checkpoint's hash {digest[:12]} is not the built one's "
                             f"{spec['sha256'][:12]} (numpy draws differently here)")
    return out


def _bench(payload: Path) -> dict:
    from runtime import CompiledModel

    start = time.perf_counter()
    model_dir = regenerate_checkpoint(payload, _work(payload))
    regenerated = time.perf_counter() - start
    print(f"{NOTE}checkpoint regenerated in {regenerated:.1f} s, sha256 matches", file=sys.stderr, flush=True)
    spec = json.loads((payload / "bench" / "checkpoint.json").read_text())
    model = CompiledModel(model_dir, payload / "bench" / "artifact", device="cuda")
    tokens = BENCH["tokens"]
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, tokens)]
    prefill, decode = [], []
    for _ in range(BENCH["runs"]):
        cache = model.new_cache(2 * tokens)
        t0 = time.perf_counter()
        logits = model.forward(prompt, cache)
        t1 = time.perf_counter()
        token = int(np.argmax(logits))
        for _ in range(tokens):
            token = int(np.argmax(model.forward([token], cache)))
        t2 = time.perf_counter()
        cache.release()
        prefill.append(tokens / (t1 - t0))
        decode.append(tokens / (t2 - t1))
    decode_rate = float(np.median(decode))
    tensor_cores = CompiledModel(model_dir, payload / "bench" / "artifact-bf16", device="cuda")
    prefill_bf16 = []
    for _ in range(BENCH["runs"]):
        cache = tensor_cores.new_cache(tokens)
        t0 = time.perf_counter()
        logits_bf16 = tensor_cores.forward(prompt, cache)
        prefill_bf16.append(tokens / (time.perf_counter() - t0))
        cache.release()
    import tvm

    text = tvm.runtime.load_module(str(payload / "bench" / "artifact" / "model.so"))["as_text"]()
    step_bytes = spec["weight_bytes_per_token"]
    return {"model": f"{BENCH['shape']}-shape {BENCH['dtype']}", "regenerate_seconds": round(regenerated, 1),
            "prefill_tokens_per_s": round(float(np.median(prefill)), 1), "decode_tokens_per_s": round(decode_rate, 1),
            "prefill_tokens_per_s_bf16_tensor_cores": round(float(np.median(prefill_bf16)), 1),
            "bf16_logit_difference": round(float(np.abs(logits_bf16 - logits).max() / np.abs(logits).max()), 5),
            "ms_per_step": round(1000 / decode_rate, 3), "bytes_per_step": step_bytes,
            "achieved_bandwidth_gb_s": round(step_bytes * decode_rate / 1e9, 1),
            "roofline_tokens_per_s": round(H200_BANDWIDTH / step_bytes, 1),
            "kernels_per_decode_step": spec["kernels_per_decode_step"],
            "host_launches_per_decode_step": host_launches(text, DECODE_FUNCTION),
            "transformers_peer": _transformers_peer(model_dir, prompt)}


# The peer on the same GPU, checkpoint and prompt: the host Python's transformers (eager, bf16), if it has one.
PEER = """
import json, statistics, sys, time
import torch, transformers
model_dir, tokens, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = torch.tensor([json.loads(sys.stdin.read())], device="cuda")
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
def timed(run):
    torch.cuda.synchronize(); start = time.perf_counter(); run(); torch.cuda.synchronize()
    return time.perf_counter() - start
def generate(n):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
with torch.no_grad():
    generate(4)
    prefill = statistics.median(timed(lambda: model(ids)) for _ in range(runs))
    whole = statistics.median(timed(lambda: generate(tokens + 1)) for _ in range(runs))
print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                  "prefill_tokens_per_s": round(tokens / prefill, 1),
                  "decode_tokens_per_s": round(tokens / (whole - prefill), 1)}))
"""


def _transformers_peer(model_dir: Path, prompt: list[int]) -> dict | str:
    """transformers' prefill and decode rates beside ours (same run, GPU and prompt), in the host's own Python (this
    case's runs isolated from it, -E -S); what stopped it, if it could not run."""
    try:
        done = subprocess.run([sys.executable, "-c", PEER, str(model_dir), str(BENCH["tokens"]), str(BENCH["runs"])],
                              input=json.dumps(prompt), capture_output=True, text=True, timeout=TIMEOUTS["peer"],
                              cwd=model_dir)
    except subprocess.TimeoutExpired:
        return f"unavailable: over {TIMEOUTS['peer']} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return "unavailable: " + _last_error(done)
    return json.loads(lines[-1])


def _profile(payload: Path) -> dict:
    """Where a decode step's time goes: each kernel of the benchmark artifact's decode step timed by Nsight Compute
    (ncu, its clocks left alone), summed by kernel function (a function runs once per layer)."""
    import csv
    import glob
    import shutil

    import tvm

    tvm.cuda(0).compute_version  # a GPU must answer before ncu is looked for
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) +
                                           glob.glob("/usr/local/cuda/bin/ncu")), None)
    if ncu is None:
        raise RuntimeError("no ncu (Nsight Compute) on this machine")
    log = _work(payload) / "ncu.csv"
    done = subprocess.run([ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
                           "--print-units", "base", "--log-file", str(log), *_interpreter(), __file__, "case",
                           str(payload), "decode-step"], capture_output=True, text=True,
                          timeout=TIMEOUTS["profile"] - 10)
    if done.returncode != 0 or not log.is_file():
        raise RuntimeError("ncu failed: " + _last_error(done))
    rows = list(csv.DictReader(line for line in log.read_text().splitlines() if line.startswith('"')))
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    functions = {}
    for row in rows:
        name = re.sub(r"_kernel(_\d+)?$", "", row["Kernel Name"])
        entry = functions.setdefault(name, {"calls": 0, "us": 0.0, "grid": row.get("Grid Size")})
        entry["calls"] += 1
        entry["us"] += float(row["Metric Value"].replace(",", "")) * scale.get(row["Metric Unit"], 1.0)
    slowest = sorted(functions.items(), key=lambda kv: -kv[1]["us"])
    return {"kernels": len(rows), "total_us": round(sum(f["us"] for f in functions.values()), 1),
            "units": sorted({row["Metric Unit"] for row in rows}),
            "by_function": {name: {**f, "us": round(f["us"], 1)} for name, f in slowest[:16]}}


def _decode_step(payload: Path) -> dict:
    """One decode step of the benchmark artifact from a fresh cache: its first call runs each kernel on its own
    (the CUDA graph is captured after), which is what `_profile` times."""
    from runtime import CompiledModel

    model_dir = _work(payload) / BENCH_CHECKPOINT
    if not (model_dir / "model.safetensors").is_file():
        model_dir = regenerate_checkpoint(payload, _work(payload))
    model = CompiledModel(model_dir, payload / "bench" / "artifact", device="cuda")
    cache = model.new_cache(8)
    model.forward([1], cache)
    cache.release()
    return {}


def _last_error(done: subprocess.CompletedProcess) -> str:
    """The last line a process that failed wrote to stderr, else its exit status."""
    return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]


def _work(payload: Path) -> Path:
    """Where large files go on the device (the benchmark's checkpoint): $GPU_CHECK_WORK, else the payload."""
    return Path(os.environ.get("GPU_CHECK_WORK", payload))


def host_launches(module_text: str, function: str) -> dict:
    """What one call of VM function `function` launches from the host, from its executable's text (`as_text`): CUDA
    graph replays, and kernel functions called outside any graph (each launches its device kernels)."""
    block = re.search(rf"^@{function}:\n(.*?)(?=^@|\Z)", module_text, re.M | re.S)
    calls = re.findall(r"^\s*call\s+(\S+)", block.group(1), re.M) if block else []
    return {"graphs": calls.count("vm.builtin.cuda_graph.run_or_capture"),
            "kernels_outside_graphs": sum(not c.startswith("vm.builtin.") for c in calls)}


def run(payload: Path, out: Path) -> int:
    """Run every case, each in its own process, appending one JSON line per case to OUT/results.jsonl."""
    names = cases(payload, cpu=bool(os.environ.get("GPU_CHECK_CPU_CASES")))
    only = [p for p in os.environ.get("GPU_CHECK_ONLY", "").split(",") if p]  # a rerun of some cases: name prefixes
    unmatched = [p for p in only if not any(n.startswith(p) for n in names)]
    if unmatched:  # a misspelt prefix would run nothing but env, and pass
        print(f"error: GPU_CHECK_ONLY: no case of this payload starts with {', '.join(unmatched)}; case kinds: "
              f"{', '.join(sorted({n.split(':')[0] for n in names}))}", file=sys.stderr)
        return 2
    names = [n for n in names if n == "env" or not only or n.startswith(tuple(only))]
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    start, statuses = time.perf_counter(), []
    for name in names:
        if time.perf_counter() - start > BUDGET_SECONDS:
            _append(results, {"case": name, "status": "skipped", "reason": "out of time"})
            statuses.append("skipped")
            continue
        record = _child(payload, name, {})
        if record["status"] == "fail" and name != "env":
            _append(results, record)
            record = _child(payload, name, {"CUDA_LAUNCH_BLOCKING": "1"})
            record["rerun"] = "CUDA_LAUNCH_BLOCKING=1"
        _append(results, record)
        statuses.append(record["status"])
        if record.get("stop"):
            break
    _append(results, {"case": "summary", "cases": len(names), **{s: statuses.count(s) for s in sorted(set(statuses))},
                      "seconds": round(time.perf_counter() - start, 1)})
    return 0 if statuses == ["pass"] * len(names) else 1


def _interpreter() -> list[str]:
    """This Python with the isolation it was started with (gpu_run.sh starts it as a bundle's launcher does)."""
    return [sys.executable, *(["-E"] if sys.flags.ignore_environment else []), *(["-S"] if sys.flags.no_site else [])]


def _child(payload: Path, name: str, env: dict) -> dict:
    t0 = time.perf_counter()
    timeout = TIMEOUTS[name.split(":")[0]]
    try:
        done = subprocess.run([*_interpreter(), __file__, "case", str(payload), name], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"case": name, "status": "timeout", "seconds": timeout}
    seconds = round(time.perf_counter() - t0, 2)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return {"case": name, "status": "pass", "seconds": seconds, **json.loads(lines[-1])}
    errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
    record = {"case": name, "status": "fail", "seconds": seconds, "error": errors[-1] if errors else
              f"exit {done.returncode}", "notes": [line[len(NOTE):] for line in errors if line.startswith(NOTE)],
              "stderr_tail": errors[-12:]}
    if record["error"].startswith("STOP "):
        record.update(error=record["error"][5:], stop=True)
    return record


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


# ---------------------------------------------------------------- prepare (on the build machine) -------------------

def prepare(payload: Path, models: tuple[str, ...], paths: tuple[str, ...], kernels: tuple[str, ...], bench: bool,
            cache: Path) -> None:
    """Write everything the GPU run needs into `payload` (the bundled model and path are always among them)."""
    import shutil

    from compiler.build import build
    from compiler.bundle import bundle
    from models.tiny import write_tiny_checkpoint

    payload.mkdir(parents=True, exist_ok=True)
    listed = {"kernels": [], "models": [], "cpu": list(models), "bench": bench, "paths": list(paths)}
    for model in models:
        model_dir = write_tiny_checkpoint(payload / "models" / model, **MODELS[model])
        build(model_dir, out=payload / "cpu" / model, quiet=True, **BUCKETS)
        for path in paths:
            build(model_dir, target="cuda", arch=ARCH, cuda_compiler=path, out=payload / "cuda" / f"{model}-{path}",
                  quiet=True, **BUCKETS)
            listed["models"].append(f"model:{model}:{path}")
        _references(payload, model)
        _trace(payload, model)
    model, path = BUNDLED
    bundle(payload / "cuda" / f"{model}-{path}", payload / "bundle", model_dir=payload / "models" / model,
           python="3.12")
    shutil.copy2(__file__, payload / "bundle" / "python" / "gpu_check.py")
    _add_wheel(payload / "bundle" / "python", "safetensors")  # the benchmark checkpoint is written on the device
    _bundle_reference(payload)
    for case in kernels:
        built = _kernel_modules(payload, case, paths)
        listed["kernels"] += [f"kernel:{case}:{path}" for path in built]
    if bench:
        _bench_artifact(payload, cache)
    (payload / "cases.json").write_text(json.dumps(listed, indent=1) + "\n")


def _references(payload: Path, model: str) -> None:
    """transformers' logits of the prompt and 15 greedy steps; the CPU artifact's 32 greedy tokens."""
    import torch
    import transformers

    from runtime import CompiledModel, GreedyGenerationConfig, generate

    model_dir = payload / "models" / model
    if model.startswith("qwen3_5"):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from test_qwen35_vs_transformers import reference_model

        hf = reference_model(model_dir)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cpu = CompiledModel(model_dir, payload / "cpu" / model)
    prompt = prompt_ids(cpu.config.vocab_size)
    logits, steps = [], []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(DECODE_STEPS + 1):
            logits.append(out.logits[0, -1].numpy())
            token = int(out.logits[0, -1].argmax())
            if len(steps) < DECODE_STEPS:
                steps.append(token)
                out = hf(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    greedy = generate(cpu, [5, 6, 7], GreedyGenerationConfig(GREEDY_TOKENS, eos_token_ids=[])).generated_token_ids
    (payload / "references").mkdir(exist_ok=True)
    np.savez(payload / "references" / f"{model}.npz", prompt=np.array(prompt), steps=np.array(steps),
             logits=np.stack(logits), greedy=np.array(greedy))


def _trace(payload: Path, model: str) -> None:
    """Every kernel call of the CPU artifact's steps for the prompt and one decode step, with its arguments before
    and after the call (each distinct array stored once), for `_replay_trace`."""
    import hashlib
    from unittest import mock

    import tvm
    from tvm.runtime.vm import VirtualMachine

    from runtime import CompiledModel
    from runtime.artifact import OpenedArtifact

    arrays, calls = {}, []

    def keep(tensor) -> str:
        a = tensor.numpy()
        bf16 = a.dtype.name == "bfloat16"
        a = a.view(np.uint16) if bf16 else a
        key = hashlib.sha1(a.tobytes() + repr((a.shape, a.dtype.str)).encode()).hexdigest()[:20] + ("bf16" * bf16)
        arrays[key] = a
        return key

    def instrument(func, symbol, before, ret, *args):
        if not symbol.startswith("vm.builtin."):
            if not all(isinstance(a, tvm.runtime.Tensor) for a in args):
                raise TypeError(f"kernel {symbol} takes an argument that is not a tensor; the trace keeps tensors only")
            keys = [keep(a) for a in args]
            if before:
                calls.append({"kernel": symbol, "before": keys})
            else:
                calls[-1]["after"] = keys
        return 0

    def functions(self, device):
        vm = VirtualMachine(self.executable, device)
        vm.set_instrument(instrument)
        return {name: vm[name] for name in self.manifest.functions}

    ref = np.load(payload / "references" / f"{model}.npz")
    with mock.patch.object(OpenedArtifact, "functions", functions):
        cpu = CompiledModel(payload / "models" / model, payload / "cpu" / model)
        cache = cpu.new_cache(PROMPT_TOKENS + 2)
        calls.clear()  # the load's own calls
        cpu.forward([int(t) for t in ref["prompt"]], cache)
        cpu.forward([int(ref["steps"][0])], cache)
        cache.release()
    (payload / "traces").mkdir(exist_ok=True)
    np.savez_compressed(payload / "traces" / f"{model}.npz", **arrays)
    (payload / "traces" / f"{model}.json").write_text(json.dumps(calls))


def _bundle_reference(payload: Path) -> None:
    """What `bundle/run generate hello 16` prints with the CPU artifact of the same model."""
    from runtime import GreedyGenerationConfig, load_pipeline

    model, _ = BUNDLED
    pipeline = load_pipeline(payload / "models" / model, payload / "cpu" / model)
    r = pipeline.generate_text("hello", GreedyGenerationConfig(16), add_special_tokens=True, skip_special_tokens=True)
    (payload / "references" / "bundle.json").write_text(json.dumps({"generated_token_ids": r.generated_token_ids}))


def _add_wheel(site: Path, distribution: str) -> None:
    from compiler.bundle import _unpack, default_wheel_cache, fetch_wheels

    for wheel in fetch_wheels((distribution,), "3.12", default_wheel_cache()):
        _unpack(wheel, site)


def _kernel_modules(payload: Path, case: str, paths: tuple[str, ...]) -> list[str]:
    """The case's GPU kernel through each path that can build it as a loadable module, and the reference outputs:
    the CPU kernel's, or for a bfloat16-products case numpy's product of the rounded activations. The paths built."""
    import tvm

    from compiler import cuda
    from compiler.kernels import make_kernel
    from compiler.target import cpu_target
    from ir import OPS, TensorType, infer_types
    from schedules import cpu, gpu

    kind, _, attrs = KERNEL_CASES[case]
    inputs = kernel_inputs(case)
    types = [TensorType(x.shape, str(x.dtype)) for x in inputs]
    every = infer_types(kind, types, attrs)
    outs = [o for o, src in zip(every, OPS[kind].sources(len(every))) if src < 0]
    cuda.prepare_environment()
    folder = payload / "kernels"
    folder.mkdir(exist_ok=True)
    bf16 = case in BF16_PRODUCT_CASES
    built = [path for path in paths if not (bf16 and path == "ptx")]
    for path in built:
        target = cuda.cuda_target(ARCH, path, matmul_precision="bfloat16" if bf16 else "float32")
        func = gpu.schedule(make_kernel(kind, types, attrs).func, kind, attrs, target)
        lib = tvm.compile(func, target.tvm_target(), tir_pipeline=target.tir_pipeline())
        cuda.export_with_ptx(lib, folder / f"{case}-{path}.so", target)  # PTX in the module, as in an artifact
    if bf16:
        import ml_dtypes

        x, w, b = (a.astype(np.float64) for a in (inputs[0].astype(ml_dtypes.bfloat16), *inputs[1:]))
        np.savez(folder / f"{case}.npz", out0=(x @ w.T + b).astype(np.float32))
        return built
    host = cpu_target()
    lib = tvm.compile(cpu.schedule(make_kernel(kind, types, attrs).func, kind, attrs, host), host.tvm_target())
    args = [tvm.runtime.tensor(x) for x in inputs] + [tvm.runtime.empty(o.shape, o.dtype) for o in outs]
    lib["main"](*args)
    np.savez(folder / f"{case}.npz", **{f"out{i}": a.numpy() for i, a in enumerate(args[len(inputs):])})
    return built


def _bench_artifact(payload: Path, cache: Path) -> None:
    """The 0.5B-shape artifacts (default; bf16 prefill products on tensor cores, through nvcc), the checkpoint's
    config, seed and hash (its weights are written on the device)."""
    import shutil

    from benchmarks.checkpoints import real_shape_checkpoint, weight_bytes_per_token
    from compiler.build import build
    from compiler.cuda import kernel_launches
    model_dir = real_shape_checkpoint(cache, BENCH["shape"], BENCH["dtype"])
    folder = payload / "bench"
    folder.mkdir(exist_ok=True)
    buckets = dict(prefill_buckets=(BENCH["tokens"],), max_context=2 * BENCH["tokens"], batch_rows=(1,), quiet=True)
    artifact = build(model_dir, target="cuda", arch=ARCH, out=folder / "artifact", **buckets).path
    build(model_dir, target="cuda", arch=ARCH, cuda_compiler="nvcc", matmul_precision="bfloat16",
          out=folder / "artifact-bf16", **buckets)  # prefill products on tensor cores
    shutil.copy2(model_dir / "config.json", folder / "config.json")
    (folder / "checkpoint.json").write_text(json.dumps({
        "shape": BENCH["shape"], "dtype": BENCH["dtype"], "seed": BENCH["seed"],
        "sha256": file_digest(model_dir / "model.safetensors"),
        "weight_bytes_per_token": weight_bytes_per_token(model_dir),
        "kernels_per_decode_step": kernel_launches(artifact)[DECODE_FUNCTION]},
        indent=1) + "\n")


def launches(artifact: Path, function: str) -> int:
    """Print the GPU kernels one call of `function` of a CUDA artifact runs, and what the host launches for it (the
    module is loaded, so this needs a driver: a real one, or tests/cuda_standin.py's on LD_LIBRARY_PATH)."""
    import tvm

    from compiler.cuda import kernel_launches
    from runtime.cuda import load_cuda_libraries

    load_cuda_libraries()
    text = tvm.runtime.load_module(str(artifact / "model.so"))["as_text"]()
    print(json.dumps({"function": function, "gpu_kernels": kernel_launches(artifact)[function],
                      "host_launches": host_launches(text, function)}))
    return 0


def check_rehearsal(results: Path, payload: Path) -> int:
    """After a rehearsal with the stand-in driver: every case ran; the CPU cases passed; every GPU case got as far as
    its first GPU call (its error is CUDA's) and was rerun; the benchmark's checkpoint matched its hash."""
    records = [json.loads(line) for line in results.read_text().splitlines()]
    payload_cases = cases(payload, cpu=True)
    final = {r["case"]: r for r in records}
    problems = [f"{name}: not run" for name in payload_cases if name not in final]
    for name in payload_cases:
        r = final.get(name)
        if r is None:
            continue
        if name == "env" or name.endswith(":cpu"):
            if r["status"] != "pass":
                problems.append(f"{name}: {r['status']} ({r.get('error')})")
        elif r["status"] != "fail" or "CUDA" not in r.get("error", "") or r.get("rerun") is None:
            problems.append(f"{name}: expected to stop at its first GPU call, got {r['status']} ({r.get('error')})")
        elif name == "bench" and not any("sha256 matches" in line for line in r.get("notes", [])):
            problems.append(f"bench: the checkpoint was not regenerated and matched ({r.get('error')})")
    seconds = final.get("summary", {}).get("seconds")
    print(json.dumps({"rehearsal": "ok" if not problems else "FAILED", "cases": len(payload_cases),
                      "seconds": seconds, "problems": problems}, indent=1))
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    """Dispatch `prepare`, `run`, `case`, `check-rehearsal` or `launches`."""
    command, *args = argv
    if command == "check-rehearsal":
        return check_rehearsal(Path(args[0]), Path(args[1]))
    if command == "launches":
        return launches(Path(args[0]), args[1] if len(args) > 1 else DECODE_FUNCTION)
    if command == "case":
        print(json.dumps(run_case(Path(args[0]), args[1])))
        return 0
    if command == "run":
        return run(Path(args[0]), Path(args[1]))
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check prepare")
    parser.add_argument("payload")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--kernels", default=",".join(KERNEL_CASES))
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "ruda" / "gpu-check"),
                        help="where the 0.5B-shape checkpoint is kept between preparations")
    parsed = parser.parse_args(args)
    models, paths = parsed.models.split(","), parsed.paths.split(",")
    if BUNDLED[0] not in models or BUNDLED[1] not in paths:
        parser.error(f"--models must hold {BUNDLED[0]} and --paths {BUNDLED[1]}: the bundle is made of them")
    prepare(Path(parsed.payload), tuple(models), tuple(paths), tuple(parsed.kernels.split(",")), not parsed.no_bench,
            Path(parsed.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
