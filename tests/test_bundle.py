"""Deploy bundles (`python -m compiler bundle`): a CPU artifact's bundle runs under another Python that has no TVM and
gives the tokens the full install gives; a CUDA artifact's bundle loads up to the first GPU call (with a stand-in
driver) and stops there with the error that names what is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_BUCKETS
from cuda_standin import DEVICES_ENV, VERSION_ENV, tvm_cuda_loader, write_standin

from compiler.build import build
from ir.contract import CUDA_RUNTIME_LIBRARY, ArtifactError
from models.tiny import write_tiny_checkpoint
from runtime import GreedyGenerationConfig, load_pipeline

ROOT = Path(__file__).resolve().parent.parent
TARGET_PYTHON = "3.12"  # the GPU machine's Python
PROMPT = "The bundle runs"


def other_python() -> str | None:
    """An interpreter of TARGET_PYTHON that really runs: pyenv's, uv's, or python3.12 on PATH."""
    candidates = []
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(str(p) for p in Path(root).glob(f"versions/{TARGET_PYTHON}*/bin/python{TARGET_PYTHON}"))
    except OSError:
        pass
    try:
        candidates.append(subprocess.run(["uv", "python", "find", TARGET_PYTHON], capture_output=True,
                                         text=True).stdout.strip())
    except OSError:
        pass
    candidates.append(shutil.which(f"python{TARGET_PYTHON}"))
    for candidate in filter(None, candidates):
        version = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True)
        if version.returncode == 0 and version.stdout.strip() == TARGET_PYTHON:
            return candidate
    return None


PYTHON = other_python()
pytestmark = pytest.mark.skipif(PYTHON is None, reason=f"no Python {TARGET_PYTHON} interpreter on this machine "
                                                       "(pyenv, uv or python3.12 on PATH)")


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def make_bundle(artifact: Path, out: Path, *options: str) -> dict:
    result = cli("compiler", "bundle", str(artifact), str(out), "--python", TARGET_PYTHON, *options)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def run_bundle(bundle: Path, *args: str, env: dict | None = None, stdin: str | None = None,
               python: str | None = None) -> subprocess.CompletedProcess:
    """`bundle/run ARGS` as a user on a machine without TVM runs it: another Python, a foreign working directory."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TVM_"))}
    environ.update(RUDA_PYTHON=python or PYTHON, **(env or {}))
    return subprocess.run([str(bundle / "run"), *args], cwd=bundle.parent, env=environ, input=stdin,
                          capture_output=True, text=True, timeout=600)


def test_the_other_python_has_no_tvm():
    """The premise of the tests below: what the bundle runs on has none of the compiled packages it carries."""
    result = subprocess.run([PYTHON, "-c", "import tvm"], capture_output=True, text=True)
    assert result.returncode != 0 and "No module named 'tvm'" in result.stderr


@pytest.fixture(scope="module")
def cpu_bundle(tiny_factory, tmp_path_factory):
    model_dir, artifact = tiny_factory(arch="qwen2")
    out = tmp_path_factory.mktemp("bundle") / "qwen2"
    made = make_bundle(artifact, out)
    return model_dir, out, made


def test_cpu_bundle_gives_the_tokens_of_the_full_install(cpu_bundle):
    model_dir, out, made = cpu_bundle
    result = run_bundle(out, "generate", PROMPT, "12")
    assert result.returncode == 0, result.stderr
    load, run = (json.loads(line) for line in result.stdout.splitlines())
    assert load["artifact"] == str(out / "artifact") and load["model"] == str(out / "model")
    want = load_pipeline(model_dir, out / "artifact").generate_text(PROMPT, GreedyGenerationConfig(12), add_special_tokens=True,
                                                  skip_special_tokens=True)
    assert run["generated_token_ids"] == want.generated_token_ids and run["generated_text"] == want.generated_text


def test_cpu_bundle_holds_a_runtime_only_environment(cpu_bundle):
    _, out, made = cpu_bundle
    info = json.loads((out / "bundle.json").read_text())
    assert info["python"] == TARGET_PYTHON and info["device"] == "cpu" and info["weights"]
    site = out / "python"
    assert (site / "tvm" / "lib" / "libtvm_runtime.so").is_file()
    assert not list(site.rglob("libtvm_compiler*")) and not list(site.rglob("libcudart*"))
    assert list((site / "tvm_ffi").glob("core.cpython-312-*.so")) and not list(site.rglob("*cpython-311*"))
    assert {"ir", "models", "runtime", "numpy", "ml_dtypes", "tokenizers", "jinja2"} <= {p.name for p in site.iterdir()}
    assert not (site / "PIL").exists()  # a text model needs no image library
    assert made["bytes"] < 100 * 2**20


def test_bundle_ignores_the_host_python_packages(cpu_bundle, tmp_path):
    """A host's torch (which tvm_ffi imports when it can) is neither in the bundle's site-packages nor on PYTHONPATH:
    the launcher runs Python with -E -S, so a torch that raises on import in both places changes nothing."""
    _, out, _ = cpu_bundle
    venv = tmp_path / "host"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site, = venv.glob("lib/python3*/site-packages")
    for folder in (site, tmp_path / "path"):
        (folder / "torch").mkdir(parents=True)
        (folder / "torch" / "__init__.py").write_text(f"raise RuntimeError('the host torch in {folder} was imported')")
    result = run_bundle(out, "generate", PROMPT, "4", env={"PYTHONPATH": str(tmp_path / "path")},
                        python=str(venv / "bin" / "python"))
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.splitlines()[-1])["generated_token_ids"]) == 4


def test_cpu_bundle_chats_as_the_chat_command(cpu_bundle):
    model_dir, out, _ = cpu_bundle
    lines = "hello there\nand again\n"
    result = run_bundle(out, "chat", "--max-new-tokens", "6", stdin=lines)
    assert result.returncode == 0, result.stderr
    direct = subprocess.run([sys.executable, "-m", "runtime.chat", str(model_dir), "--max-new-tokens", "6",
                             "--artifact", str(out / "artifact")], cwd=ROOT, input=lines, capture_output=True,
                            text=True, timeout=600)
    assert direct.returncode == 0, direct.stderr
    assert result.stdout == direct.stdout and result.stdout.strip()


def test_bundle_without_weights_runs_on_a_checkpoint_given_at_run_time(cpu_bundle, tmp_path):
    model_dir, _, made = cpu_bundle
    out = tmp_path / "light"
    light = make_bundle(made["bundle"] + "/artifact", out, "--model", str(model_dir), "--no-weights")
    assert not light["weights"] and not list(out.rglob("*.safetensors")) and light["bytes"] < made["bytes"]
    result = run_bundle(out, "generate", PROMPT, "4")
    assert result.returncode == 4 and "model.safetensors" in result.stderr  # no weights: the checkpoint error
    result = run_bundle(out, "generate", PROMPT, "4", "--model", str(model_dir))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[0])["model"] == str(model_dir)


def test_bundle_refuses_another_python_and_bad_commands(cpu_bundle):
    _, out, _ = cpu_bundle
    result = run_bundle(out, "generate", PROMPT, python=sys.executable)
    assert result.returncode == 2
    assert f"packages are for Python {TARGET_PYTHON}" in result.stderr and "RUDA_PYTHON" in result.stderr
    result = run_bundle(out, "serve")
    assert result.returncode == 2 and "one of: generate, chat" in result.stderr
    result = run_bundle(out, "generate", PROMPT, python="no-such-python")
    assert result.returncode == 2 and "set RUDA_PYTHON" in result.stderr


def test_bundle_command_errors(cpu_bundle, tmp_path):
    model_dir, out, made = cpu_bundle
    artifact = out / "artifact"
    result = cli("compiler", "bundle", str(artifact), str(tmp_path / "b"), "--python", "three")
    assert result.returncode == 6 and "--python 'three' is not a Python version" in result.stderr
    result = cli("compiler", "bundle", str(tmp_path), str(tmp_path / "b"))
    assert result.returncode == 5 and "no compiled artifact" in result.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = cli("compiler", "bundle", str(artifact), str(tmp_path / "mine"), "--model", str(model_dir))
    assert result.returncode == 6 and "refusing to replace it" in result.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    other = write_tiny_checkpoint(tmp_path / "other", arch="llama")
    result = cli("compiler", "bundle", str(artifact), str(tmp_path / "b"), "--model", str(other))
    assert result.returncode == 5 and "was built for another model or config.json" in result.stderr
    result = cli("compiler", "bundle", str(artifact), str(tmp_path / "b"))  # the model: the manifest's built_from
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob(".b.*"))  # nothing half-written is left beside it


@pytest.fixture(scope="module")
def cuda_bundle(tiny_factory, tmp_path_factory):
    model_dir, _ = tiny_factory(arch="qwen2")
    root = tmp_path_factory.mktemp("cuda-bundle")
    artifact = build(model_dir, target="cuda", out=root / "artifact", prefill_buckets=TEST_BUCKETS["prefill_tokens"],
                     max_context=TEST_BUCKETS["max_context"], quiet=True).path
    make_bundle(artifact, root / "bundle")
    return root / "bundle", write_standin(root / "driver", tvm_cuda_loader()).parent


def test_cuda_bundle_carries_the_cuda_runtime(cuda_bundle):
    bundle, _ = cuda_bundle
    info = json.loads((bundle / "bundle.json").read_text())
    assert info["device"] == "cuda" and info["cuda_runtime"] == CUDA_RUNTIME_LIBRARY
    assert (bundle / "python" / "tvm" / "lib" / CUDA_RUNTIME_LIBRARY).is_file()


@pytest.mark.parametrize("driver, message", [
    ({}, "the NVIDIA driver library libcuda.so.1 cannot be loaded"),
    ({VERSION_ENV: "12080"}, "this NVIDIA driver supports CUDA 12.8; the artifact's kernels need CUDA 13.0, which "
                             "needs driver >= 580"),
    ({VERSION_ENV: "13000"}, "no CUDA GPU is visible on this machine"),
])
def test_cuda_bundle_stops_at_the_gpu_with_a_clear_error(cuda_bundle, driver, message):
    bundle, standin = cuda_bundle
    env = {**driver, "LD_LIBRARY_PATH": str(standin)} if driver else {"LD_LIBRARY_PATH": ""}
    result = run_bundle(bundle, "generate", PROMPT, "4", env=env)
    assert result.returncode == 7 and message in result.stderr and "internal error" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_cuda_artifact_loads_in_the_bundle_up_to_the_gpu(cuda_bundle):
    """TVM's runtime-only mode never loads its CUDA loader; runtime.cuda does, so the artifact's kernels load."""
    bundle, standin = cuda_bundle
    script = ("import sys, tvm\n"
              "from runtime.cuda import load_cuda_libraries\n"
              "if sys.argv[1] == 'ours':\n"
              "    load_cuda_libraries()\n"
              f"module = tvm.runtime.load_module({str(bundle / 'artifact' / 'model.so')!r})\n"
              "kinds = lambda m: [m.kind] + [k for i in m.imports for k in kinds(i)]\n"
              "print(kinds(module))\n")
    env = {"LD_LIBRARY_PATH": str(standin), "PYTHONPATH": str(bundle / "python"), "TVM_USE_RUNTIME_LIB": "1",
           DEVICES_ENV: "1", "PATH": os.environ["PATH"]}
    result = subprocess.run([PYTHON, "-c", script, "ours"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "'cuda'" in result.stdout
    result = subprocess.run([PYTHON, "-c", script, "tvm"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "a loader of that name is not registered" in result.stderr


def test_missing_cuda_runtime_names_where_it_looked(monkeypatch, tmp_path):
    import ctypes

    from runtime import cuda

    monkeypatch.setattr(cuda, "_tvm_library_dir", lambda: tmp_path / "tvm-lib")
    monkeypatch.setattr(cuda, "TOOLKIT_ROOTS", ())
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "toolkit"))
    monkeypatch.delenv(cuda.CUDART_DIR_ENV, raising=False)
    real = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: (_ for _ in ()).throw(OSError(name))
                        if name == cuda.CUDART else real(name, *a, **k))
    with pytest.raises(cuda.CudaUnavailable, match=f"the CUDA runtime {CUDA_RUNTIME_LIBRARY} is not in "
                                                   f"{tmp_path / 'tvm-lib'}, {tmp_path / 'toolkit' / 'lib64'}"):
        cuda._find_cudart()
    (tmp_path / "cudart").mkdir()
    (tmp_path / "cudart" / CUDA_RUNTIME_LIBRARY).write_bytes(b"")
    monkeypatch.setenv(cuda.CUDART_DIR_ENV, str(tmp_path / "cudart"))
    assert cuda._find_cudart() == str(tmp_path / "cudart" / CUDA_RUNTIME_LIBRARY)


def test_bundle_of_a_damaged_artifact_is_refused(cpu_bundle, tmp_path):
    model_dir, out, _ = cpu_bundle
    damaged = tmp_path / "artifact"
    shutil.copytree(out / "artifact", damaged)
    with (damaged / "model.so").open("ab") as f:
        f.write(b"x")
    from compiler.bundle import bundle

    with pytest.raises(ArtifactError, match="is damaged"):
        bundle(damaged, tmp_path / "b", model_dir=model_dir, python=TARGET_PYTHON)


def test_image_text_bundle_carries_pillow_and_reads_images(tiny_factory, tmp_path):
    """An image-text model's bundle has the image library, and an image prompt gives the full install's tokens."""
    from test_qwen35_vision import MODEL, write_images

    model_dir, artifact = tiny_factory(**MODEL)
    out = tmp_path / "vision"
    make_bundle(artifact, out)
    assert (out / "python" / "PIL").is_dir()
    image = write_images(tmp_path)["wide.png"]
    pipeline = load_pipeline(model_dir, artifact)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>what is it"
    want = pipeline.generate_image_files_greedy(pipeline.encode(prompt), [image], config=GreedyGenerationConfig(6))
    result = run_bundle(out, "generate", prompt, "6", "--image", str(image))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["generated_token_ids"] == want.generated_token_ids
