"""Fault injection: damaged files, killed builds, a full disk, bad text, closed pipes, user data in the way.

Every case runs the real CLI in a subprocess and asserts what a user sees (one line on stderr, a distinct
exit code, no traceback) and what is left on disk (the user's files intact, no half-written artifact, no
temporaries). As root, permission cases drop the capabilities that let root read any file.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from compiler.build import build
from ir.contract import FORMAT, MANIFEST
from models.tiny import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = ["--prefill-buckets", "8,16", "--max-context", "256"]
USER_ERRORS = {2, 3, 4, 5, 6, 7, 8}  # docs/errors.md


def _drop_root_file_access():
    """In the child before exec: lose CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so file permissions bind root too."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        libc.prctl(24, capability)  # PR_CAPBSET_DROP: exec recomputes root's capabilities from the bounding set


NO_TORCH = Path(__file__).parent / "no_torch"  # `import torch` fails there, as in a runtime install without extras


def _command(args, env):
    """argv and environment of `python -m ARGS`; torch (a test-only dependency that TVM imports when it can, ~2 s)
    is hidden, as it is from users who installed the project without its test extra."""
    path = f"{NO_TORCH}{os.pathsep}{ROOT}"
    return [sys.executable, "-m", *map(str, args)], {**os.environ, "PYTHONPATH": path, **(env or {})}


def cli(*args, cwd, env=None, preexec=None, stdin=None, timeout=600):
    """Run `python -m ARGS` as a user would (permissions binding even for root)."""
    def before_exec():
        _drop_root_file_access()
        if preexec:
            preexec()
    command, full_env = _command(args, env)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, timeout=timeout, preexec_fn=before_exec,
                          input=stdin)


def cli_all(runs: list[tuple], cwd) -> list[subprocess.CompletedProcess]:
    """Run several `python -m ARGS` commands at once (each on one thread); their results in order."""
    procs = []
    for args in runs:
        command, env = _command(args, {"TVM_NUM_THREADS": "1"})
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=_drop_root_file_access))
    outputs = [p.communicate(timeout=600) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *output) for p, output in zip(procs, outputs)]


def assert_user_error(result, code: int | None = None, *phrases: str) -> str:
    """A clean failure: a user-error exit code (or `code`), one line on stderr with every phrase, no traceback
    (argparse's usage block may come before a usage error's line)."""
    err = result.stderr.decode()
    lines = [line for line in err.replace("\r", "\n").splitlines()
             if line.strip() and not line.startswith(("warning: ", "scheduling kernels", "compiling "))]
    if result.returncode == 2 and lines and lines[0].startswith("usage: "):
        lines = [line for line in lines if not line.startswith(("usage: ", " "))]
    assert (result.returncode == code) if code is not None else result.returncode in USER_ERRORS, err
    assert "Traceback" not in err and len(lines) == 1 and re.match(r"(python -m \S+: )?error: |interrupted", lines[0]), err
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def snapshot(*folders: Path) -> dict[str, str]:
    """Path -> content hash of every file below the folders (what must survive a failure unchanged)."""
    out = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def space():
    """A folder (world-traversable, as permission cases need) with a tiny model and its artifact, built once."""
    root = Path(tempfile.mkdtemp(prefix="ruda-faults-"))
    root.chmod(0o755)
    model = write_tiny_checkpoint(root / "pristine" / "model", arch="qwen2", seed=3)
    build(model, out=root / "pristine" / "artifact", prefill_buckets=(8, 16), max_context=256, quiet=True)
    write_tiny_checkpoint(root / "foreign" / "model", arch="llama", seed=5)
    build(root / "foreign" / "model", out=root / "foreign" / "artifact", prefill_buckets=(8,), max_context=64,
          quiet=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def copy(space, tmp_path):
    """A private copy of the model and artifact: (workdir, model, artifact)."""
    work = Path(tempfile.mkdtemp(prefix="case-", dir=space))
    work.chmod(0o755)
    shutil.copytree(space / "pristine" / "model", work / "model")
    shutil.copytree(space / "pristine" / "artifact", work / "artifact")
    yield work, work / "model", work / "artifact"
    shutil.rmtree(work, ignore_errors=True)


def generate(work, model, artifact, prompt="Hello", tokens=4, **kw):
    return cli("runtime.generate", model, prompt, tokens, "--artifact", artifact, cwd=work, **kw)


@pytest.fixture(scope="module")
def pristine_run(space):
    result = generate(space, space / "pristine" / "model", space / "pristine" / "artifact")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.decode().splitlines()[-1])["generated_token_ids"]


def _corrupt(path: Path, how: str, space: Path) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(bytes(range(256)) * 7)
    elif how == "foreign":
        kind = "artifact" if path.parent.name == "artifact" else "model"
        shutil.copy(space / "foreign" / kind / path.name, path)
    elif how == "unreadable":
        path.chmod(0)


MODEL_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
ARTIFACT_FILES = [MANIFEST, "model.so", "ir.json"]
HOW = ["truncate", "empty", "garbage", "foreign", "unreadable"]


@pytest.mark.parametrize("name", MODEL_FILES + ARTIFACT_FILES)
def test_a_damaged_file_is_a_clear_error_or_a_correct_run(space, pristine_run, name):
    """Each way of damaging the file (truncated, empty, garbage, another checkpoint's, unreadable), in a copy each."""
    cases = []
    for how in HOW:
        work = Path(tempfile.mkdtemp(prefix=f"{how}-", dir=space))
        work.chmod(0o755)
        model, artifact = work / "model", work / "artifact"
        shutil.copytree(space / "pristine" / "model", model)
        shutil.copytree(space / "pristine" / "artifact", artifact)
        target = (artifact if name in ARTIFACT_FILES else model) / name
        _corrupt(target, how, space)
        cases.append((how, target, snapshot(model, artifact), model, artifact, work))
    results = cli_all([("runtime.generate", m, "Hello", 4, "--artifact", a) for _, _, _, m, a, _ in cases], space)
    for (how, target, before, model, artifact, work), result in zip(cases, results):
        if result.returncode == 0:  # only a file the run does not read, or a foreign one that happens to fit
            assert name == "ir.json" or how == "foreign", (how, result.stderr)
            if how != "foreign":
                assert json.loads(result.stdout.decode().splitlines()[-1])["generated_token_ids"] == pristine_run
        else:
            line = assert_user_error(result)
            if how != "foreign":  # the message names the damaged file (a foreign one may be refused for what it is)
                assert name in line or (name == "model.so" and "checksum" in line), (how, line)
        target.chmod(0o644)
        assert snapshot(model, artifact) == before, how  # nothing was rewritten or removed
        shutil.rmtree(work)


def test_truncated_module_is_refused_and_rebuilt_not_reused(copy):
    work, model, artifact = copy
    so = artifact / "model.so"
    so.write_bytes(so.read_bytes()[:4096])
    line = assert_user_error(generate(work, model, artifact), 5, "model.so is damaged", "rebuild: ")
    rebuild = cli(*_hint(line), cwd=work)  # the hint, run as given
    assert rebuild.returncode == 0 and json.loads(rebuild.stdout)["reused"] is False, rebuild.stderr
    assert generate(work, model, artifact).returncode == 0


@pytest.mark.parametrize("manifest", [
    {"kind": "ruda-artifact", "format": FORMAT},
    "WRONG",
    {"kind": "ruda-artifact", "format": FORMAT, "model_type": 7},
])
def test_manifest_of_the_wrong_shape(copy, manifest):
    work, model, artifact = copy
    good = json.loads((artifact / MANIFEST).read_text())
    if isinstance(manifest, dict) and len(manifest) > 2:
        manifest = {**good, **manifest}
    (artifact / MANIFEST).write_text(json.dumps(manifest))
    assert_user_error(generate(work, model, artifact), 5, "manifest.json", "rebuild: python -m compiler build")


def _hint(line: str) -> list[str]:
    """The command a message tells the user to run, as argv for `python -m`."""
    command = re.search(r"(python -m compiler build .*)$", line).group(1)
    return shlex.split(command)[2:]


@pytest.mark.parametrize("damage", ["config", "missing", "tvm_version", "target", "manifest"])
def test_rebuild_hints_are_the_commands_that_fix_it(copy, damage):
    work, model, artifact = copy
    if damage == "manifest":  # no longer says it is ours: still replaced, since the folder holds only what builds write
        (artifact / MANIFEST).write_bytes(b"\x00garbage")
    elif damage == "config":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    elif damage == "missing":
        shutil.rmtree(artifact)
    else:
        manifest = json.loads((artifact / MANIFEST).read_text())
        manifest[damage] = "0.0.1" if damage == "tvm_version" else {"kind": "cuda", "arch": "sm_90",
                                                                     "cuda_compiler": "ptx", "ptx_version": None}
        (artifact / MANIFEST).write_text(json.dumps(manifest))
    line = assert_user_error(generate(work, model, artifact), 5)
    if damage == "target":
        assert "--device cuda" in line
    fixed = cli(*_hint(line), cwd=work)
    assert fixed.returncode == 0, fixed.stderr
    assert generate(work, model, artifact).returncode == 0


@pytest.mark.parametrize("where", ["model", "file"])
def test_artifact_that_is_not_one(copy, where):
    """--artifact naming the model directory or a file is refused for what it is, with no hint to build there."""
    work, model, _ = copy
    path = model if where == "model" else model / "config.json"
    line = assert_user_error(generate(work, model, path), 5, "not" if where == "model" else "is a file")
    assert "compiler build" in line and "--out" not in line


@pytest.mark.parametrize("out", ["model", "userdata", "file", "file/below", "."])
def test_out_never_replaces_user_data(copy, out):
    work, model, _ = copy
    (work / "userdata").mkdir()
    (work / "userdata" / "notes.txt").write_text("mine")
    (work / "file").write_text("mine too")
    before = snapshot(work)
    result = cli("compiler", "build", model, "--out", work / out, *BUCKETS, cwd=work)
    assert_user_error(result, 6, "--out")
    assert snapshot(work) == before
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


def test_stale_temporaries_of_killed_builds_are_removed(copy):
    work, model, artifact = copy
    for stale in (".artifact.tmp-999999", ".artifact.old-999998"):
        (work / stale).mkdir()
        (work / stale / "model.so").write_bytes(b"half")
    result = cli("compiler", "build", model, "--out", artifact, *BUCKETS, "--force", cwd=work)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in work.iterdir()) == ["artifact", "model"]


def test_two_builds_of_one_output_never_race(copy):
    work, model, artifact = copy
    with open(work / ".artifact.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = cli("compiler", "build", model, "--out", artifact, *BUCKETS, "--force", cwd=work)
    assert_user_error(result, 6, "another build is writing")
    assert generate(work, model, artifact).returncode == 0


def start(*args, cwd, env=None) -> subprocess.Popen:
    """Start `python -m ARGS` with its output piped back."""
    command, full_env = _command(args, env)
    return subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _start_build(work, model, out, tmpdir):
    return start("compiler", "build", model, "--out", out, *BUCKETS, "--force", cwd=work, env={"TMPDIR": str(tmpdir)})


@pytest.mark.parametrize("sig,delay", [(signal.SIGINT, 1.0), (signal.SIGINT, 3.5), (signal.SIGKILL, 1.0),
                                       (signal.SIGKILL, 2.5), (signal.SIGKILL, 4.0)])
def test_killed_build_leaves_the_old_artifact_and_nothing_else(copy, delay, sig):
    """Killed while loading, scheduling, compiling or writing: the previous artifact stays as it was (or, killed
    just after the swap, the new one is whole)."""
    work, model, artifact = copy
    systemp = work / "systemp"
    systemp.mkdir()
    before = snapshot(artifact)
    proc = _start_build(work, model, artifact, systemp)
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    if proc.returncode == 0:
        pytest.skip(f"the build finished within {delay} s")
    after = snapshot(artifact)
    if after != before:  # the signal came just after the new artifact was moved into place: it must be whole
        assert after.keys() == before.keys() and generate(work, model, artifact).returncode == 0, err
    assert not list(systemp.iterdir())  # no temporaries of the compiler's tools outside its own folder
    if sig == signal.SIGINT:  # it cleaned up after itself
        assert proc.returncode == 130 and err.decode().strip().splitlines()[-1] == "interrupted", err
        assert sorted(p.name for p in work.iterdir()) == ["artifact", "model", "systemp"]
        return
    rebuilt = cli("compiler", "build", model, "--out", artifact, *BUCKETS, "--force", cwd=work,
                  env={"TMPDIR": str(systemp)})
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert sorted(p.name for p in work.iterdir()) == ["artifact", "model", "systemp"] and not list(systemp.iterdir())


INTERRUPTED_MAINS = {
    # a build interrupted while lowering a step function frees a half-built TVM block builder, which logs a warning
    "tvm-builder": ("from tvm import relax\n"
                    "def main(argv):\n"
                    "    bb = relax.BlockBuilder()\n"
                    "    with bb.function('f', [relax.Var('x', relax.TensorType([2], 'float32'))]):\n"
                    "        raise KeyboardInterrupt()\n"),
    # one interrupted inside exec() of a string (dataclasses make their methods so while a module imports) is
    # marked unhandled to CPython, which would end a `python -m` process by SIGINT, not with status 130
    "exec": "def main(argv):\n    exec('raise KeyboardInterrupt()')\n",
}


@pytest.mark.parametrize("case", INTERRUPTED_MAINS)
def test_an_interrupt_anywhere_ends_with_our_line_and_status_130(tmp_path, case):
    """Ctrl-C wherever it lands: exit status 130 and `interrupted` the last line on stderr (whatever TVM logs as the
    interrupted work is freed comes before it)."""
    (tmp_path / "interrupted_cli.py").write_text(f"from ir.errors import exit_cli\n{INTERRUPTED_MAINS[case]}"
                                                 "exit_cli(main)\n")
    result = subprocess.run([sys.executable, "-m", "interrupted_cli"], capture_output=True, cwd=tmp_path, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (NO_TORCH, tmp_path, ROOT)))})
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 130 and lines[-1] == "interrupted", (result.returncode, result.stderr)
    if case == "tvm-builder":
        assert any("BlockBuilder destroyed" in line for line in lines[:-1])  # the builder's warning did come, first


def test_killed_first_build_leaves_no_artifact(copy):
    work, model, _ = copy
    proc = _start_build(work, model, work / "fresh", work)
    time.sleep(2.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (work / "fresh").exists()
    assert_user_error(generate(work, model, work / "fresh"), 5, "no compiled artifact")


def test_full_disk_during_a_build(copy):
    work, model, artifact = copy
    before = snapshot(artifact)
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # noqa: E731
    result = cli("compiler", "build", model, "--out", artifact, *BUCKETS, "--force", cwd=work, preexec=limit)
    assert_user_error(result, 8, str(artifact), "free disk space")
    assert snapshot(artifact) == before
    assert sorted(p.name for p in work.iterdir()) == ["artifact", "model"]
    first = cli("compiler", "build", model, "--out", work / "new", *BUCKETS, cwd=work, preexec=limit)
    assert_user_error(first, 8)
    assert sorted(p.name for p in work.iterdir()) == ["artifact", "model"]


def test_unwritable_output_is_reported_before_compiling(copy):
    work, model, _ = copy
    locked = work / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    start = time.perf_counter()
    result = cli("compiler", "build", model, "--out", locked / "artifact", *BUCKETS, cwd=work)
    assert_user_error(result, 8, "permission denied", str(locked))
    assert time.perf_counter() - start < 30 and "scheduling kernels" not in result.stderr.decode()


def test_invalid_utf8_prompt_and_batch_file(copy):
    work, model, artifact = copy
    command, env = _command(["runtime.generate", model, "PROMPT", "--artifact", artifact], None)
    command[command.index("PROMPT")] = b"caf\xe9 \xff"  # as a shell passes bytes that are not UTF-8
    result = subprocess.run(command, cwd=work, capture_output=True, env=env)
    assert_user_error(result, 2, "PROMPT is not valid UTF-8")
    (work / "prompts.txt").write_bytes(b"good\n\xc3\x28 bad\n")
    result = cli("runtime.generate", model, "--batch", work / "prompts.txt", "--artifact", artifact, cwd=work)
    assert_user_error(result, 2, "not valid UTF-8")


def test_closed_output_pipe_stops_quietly(copy):
    work, model, artifact = copy
    proc = start("runtime.generate", model, "Hi", 8, 20, "--artifact", artifact, cwd=work)
    assert json.loads(proc.stdout.readline())["event"] == "load"
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err
    assert err.strip().splitlines() == ["error: output closed early (broken pipe); stopped"]


def test_ctrl_c_during_generation(copy):
    work, model, artifact = copy
    proc = start("runtime.generate", model, "Hi", 8, 100000, "--artifact", artifact, cwd=work)
    proc.stdout.readline()
    proc.stdout.readline()  # a run has finished: the loop is going
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.decode().strip() == "interrupted"


def test_batch_mode_refuses_what_single_mode_refuses(copy):
    work, model, artifact = copy
    (work / "prompts.txt").write_text("short\n" + "word " * 300 + "\n")
    single = generate(work, model, artifact, "word " * 300, 30)
    batch = cli("runtime.generate", model, "--batch", work / "prompts.txt", "--max-new-tokens", 30,
                "--artifact", artifact, cwd=work)
    assert_user_error(single, 7, "exceed the artifact's --max-context 256")
    assert_user_error(batch, 7, "--batch prompt 2", "exceed the artifact's --max-context 256")


def test_chat_refuses_sampling_options_without_temperature(copy):
    work, model, artifact = copy
    result = cli("runtime.chat", model, "--artifact", artifact, "--top-p", "5", cwd=work, stdin=b"")
    assert_user_error(result, 2, "--top-p only apply when sampling")
    result = cli("runtime.chat", model, "--artifact", artifact, "--temperature", "1", "--top-p", "5", cwd=work,
                 stdin=b"")
    assert_user_error(result, 7, "top_p must be in (0, 1]")
    result = cli("runtime.chat", model, "--artifact", artifact, "--max-new-tokens", "0", cwd=work, stdin=b"")
    assert_user_error(result, 2, "--max-new-tokens must be an integer > 0")


def test_chat_refuses_a_system_prompt_that_fills_the_context(copy):
    work, model, artifact = copy
    result = cli("runtime.chat", model, "--artifact", artifact, "--system", "x " * 5000, cwd=work, stdin=b"hi\n")
    assert_user_error(result, 2, "--system is too long", "context of 256 tokens")


def test_chat_survives_bad_lines_and_a_full_context(copy):
    work, model, artifact = copy
    lines = b"caf\xe9\n" + b"".join(b"tell me more about " + str(i).encode() + b" things\n" for i in range(6))
    result = cli("runtime.chat", model, "--artifact", artifact, "--max-new-tokens", "8", cwd=work, stdin=lines)
    out = result.stdout.decode()
    assert result.returncode == 0 and "Traceback" not in result.stderr.decode(), result.stderr
    assert "not valid UTF-8" in out and "oldest turn(s) are dropped" in out
    assert out.count("> ") == 8  # every line got its turn, then EOF ended the session


def test_checkpoint_must_match_config_exactly(copy, space):
    from safetensors.numpy import load_file, save_file
    work, model, artifact = copy
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] - 1}))
    assert_user_error(generate(work, model, artifact), 4, "holds layers 1..1 that config.json does not have")
    (model / "config.json").write_text(json.dumps(config))
    weights = load_file(model / "model.safetensors")
    save_file({**weights, "extra.weight": weights["model.norm.weight"]}, model / "model.safetensors")
    assert_user_error(generate(work, model, artifact), 4, "tensors config.json does not describe (extra.weight)")


def test_index_entries_must_stay_inside_the_model_directory(copy):
    work, model, artifact = copy
    (work / "outside.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    names = json.loads((model / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (model / "model.safetensors").read_bytes()[:8], "little")])
    (model / "model.safetensors").unlink()
    index = {"weight_map": {name: "../outside.safetensors" for name in names if name != "__metadata__"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_user_error(generate(work, model, artifact), 4, "lies outside the model directory")


def test_non_finite_weights_give_a_warning(copy):
    from safetensors.numpy import load_file, save_file
    import numpy as np
    work, model, artifact = copy
    weights = load_file(model / "model.safetensors")
    norm = weights["model.norm.weight"].copy()
    norm[3] = np.nan
    save_file({**weights, "model.norm.weight": norm}, model / "model.safetensors")
    result = generate(work, model, artifact)
    err = result.stderr.decode()
    assert result.returncode == 0 and "Traceback" not in err
    assert "warning: " in err and "'model.norm.weight' holds 1 NaN or infinite values" in err


# Property-based: random mutations of config.json and of the safetensors header are a clear error or a run.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 1 << 40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.lists(st.one_of(st.integers(-2, 300), st.text(max_size=3)), max_size=4),
    st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "rope_theta", "quant_method", "x"]),
                    st.one_of(st.integers(-2, 9), st.floats(-2, 9), st.text(max_size=6)), max_size=3))
DELETE = object()
MUTATION = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load_or_clear_error(model: Path, artifact: Path) -> None:
    """What a user of the library meets: the compiler's front half, then loading and a short run."""
    import models
    from ir.errors import RudaError
    from runtime import GreedyGenerationConfig, load_pipeline
    try:
        models.load_checkpoint_program(model)
        load_pipeline(model, artifact).generate_text("Hi", GreedyGenerationConfig(2))
    except RudaError as e:
        assert str(e) and "\n" not in str(e)


@MUTATION
@given(field=st.sampled_from(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                              "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "torch_dtype",
                              "eos_token_id", "bos_token_id", "model_type", "hidden_act", "quantization_config",
                              "use_sliding_window", "partial_rotary_factor", "unknown_field"]),
       value=st.one_of(st.just(DELETE), JSON_VALUES))
def test_mutated_config_is_a_clear_error_or_a_run(space, tmp_path_factory, field, value):
    work = tmp_path_factory.mktemp("config")
    model = shutil.copytree(space / "pristine" / "model", work / "model")
    config = json.loads((model / "config.json").read_text())
    if value is DELETE:
        config.pop(field, None)
    else:
        config[field] = value
    (model / "config.json").write_text(json.dumps(config))
    _load_or_clear_error(model, space / "pristine" / "artifact")


@MUTATION
@given(data=st.data())
def test_mutated_safetensors_header_is_a_clear_error_or_a_run(space, tmp_path_factory, data):
    work = tmp_path_factory.mktemp("header")
    model = shutil.copytree(space / "pristine" / "model", work / "model")
    raw = (model / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    kind = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "delete", "add", "length", "bytes"]))
    name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    if kind in ("dtype", "shape", "data_offsets"):
        header[name][kind] = data.draw(st.one_of(JSON_VALUES, st.sampled_from(["F16", "BF16", "I8", "F64"]),
                                                 st.lists(st.integers(-1, 1 << 20), max_size=3)))
    elif kind == "delete":
        del header[name]
    elif kind == "add":
        header[data.draw(st.text(max_size=12))] = data.draw(JSON_VALUES)
    text = json.dumps(header).encode()
    if kind == "length":
        n = data.draw(st.integers(0, 1 << 63))
    elif kind == "bytes":
        at = data.draw(st.integers(0, len(text) - 1))
        text = text[:at] + bytes([data.draw(st.integers(0, 255))]) + text[at + 1:]
    if kind != "length":
        n = len(text)
    (model / "model.safetensors").write_bytes(n.to_bytes(8, "little") + text + body)
    _load_or_clear_error(model, space / "pristine" / "artifact")


def test_python_api_raises_typed_errors(space):
    from ir.errors import RudaError
    from runtime import GreedyGenerationConfig, SamplingConfig, load_pipeline
    model, artifact = space / "pristine" / "model", space / "pristine" / "artifact"
    pipeline = load_pipeline(model, artifact)
    calls = [lambda: pipeline.encode(123), lambda: pipeline.encode("x", add_special_tokens="yes"),
             lambda: pipeline.encode("caf\udce9"), lambda: pipeline.decode("abc"), lambda: pipeline.decode([-1]),
             lambda: pipeline.generate_text(None), lambda: pipeline.generate_text("x", 3),
             lambda: pipeline.render_chat("hi"), lambda: pipeline.render_chat([{"role": "robot", "content": "x"}]),
             lambda: load_pipeline(42), lambda: load_pipeline(model, artifact=3),
             lambda: load_pipeline(model, artifact, device=None),
             lambda: GreedyGenerationConfig(max_new_tokens="3"), lambda: SamplingConfig(top_p=5)]
    for call in calls:
        with pytest.raises(RudaError):
            call()
