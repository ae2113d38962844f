"""GGUF files for llama.cpp, made with the converter that llama-cpp-python's source distribution ships.

The converter (vendor/llama.cpp/convert_hf_to_gguf.py, with its own gguf-py package) is not in the
llama-cpp-python wheel, so it is taken from the sdist of the installed version: `pip download` fetches
it into the work directory once, unless --llama-cpp-src names an unpacked sdist or llama.cpp tree.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

from benchmarks.checkpoints import add_sentencepiece_tokenizer


class ConversionError(RuntimeError):
    """The converter could not be found or failed; the message says why."""


def converter_script(work: Path, source: str | None) -> Path:
    """convert_hf_to_gguf.py from `source` (an sdist or llama.cpp tree), else from the installed version's sdist."""
    if source is None:
        release = f"llama_cpp_python-{version('llama_cpp_python')}"
        root = work / release
        if not root.is_dir():
            _download_sdist(release, work)
    else:
        root = Path(source)
    for script in (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py", root / "convert_hf_to_gguf.py"):
        if script.is_file():
            return script
    raise ConversionError(f"no convert_hf_to_gguf.py under {root}")


def _download_sdist(release: str, work: Path) -> None:
    """Fetch and unpack the llama-cpp-python sdist `release` into `work` with pip."""
    spec = release.replace("llama_cpp_python-", "llama-cpp-python==")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                           "--dest", str(work), spec], check=False, capture_output=True, text=True)
    archive = work / f"{release}.tar.gz"
    if done.returncode != 0 or not archive.is_file():
        raise ConversionError(f"pip download {spec} failed: {_last_line(done.stderr)}")
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")


def gguf_file(model_dir: Path, outtype: str, work: Path, source: str | None) -> Path:
    """`model_dir` converted to GGUF with tensors in `outtype` (f32, bf16, f16), converted once and reused."""
    out = work / f"{model_dir.name}.{outtype}.gguf"
    if out.is_file():
        return out
    script = converter_script(work, source)
    try:
        add_sentencepiece_tokenizer(model_dir)
    except ImportError as e:
        raise ConversionError(f"the converter needs a tokenizer and sentencepiece is not installed ({e})") from e
    partial = out.with_suffix(".part")
    command = [sys.executable, str(script), str(model_dir), "--outtype", outtype, "--outfile", str(partial)]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ConversionError(f"convert_hf_to_gguf.py failed: {_last_line(done.stderr)}")
    partial.rename(out)
    return out


QUANT_TYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
               "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K", "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
               "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
               "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def quantized_gguf(model_dir: Path, qtype: str, work: Path, source: str | None) -> Path:
    """`model_dir` as a GGUF quantised to `qtype` (one of QUANT_TYPES) by llama.cpp's own quantiser
    (llama_model_quantize of the llama-cpp-python build that runs it) from the F16 conversion; made once and reused."""
    import llama_cpp

    out = work / f"{model_dir.name}.{qtype}.gguf"
    if out.is_file():
        return out
    base = gguf_file(model_dir, "f16", work, source)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[qtype])
    partial = out.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(base).encode(), str(partial).encode(), params) != 0:
        partial.unlink(missing_ok=True)
        raise ConversionError(f"llama_model_quantize to {qtype} failed")
    partial.rename(out)
    return out


def _last_line(text: str) -> str:
    """The last non-empty line of `text` (a traceback's error)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def llama_server_binary(work: Path, source: str | None) -> Path:
    """llama.cpp's own OpenAI-compatible server (`llama-server`, with parallel slots and continuous batching),
    built once with cmake from the vendored llama.cpp of the sdist (or `source`) for this CPU."""
    tree = converter_script(work, source).parent
    build = work / "llama-server-build"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    for command in (["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON"],
                    ["cmake", "--build", str(build), "--target", "llama-server", "-j", "2"]):
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise ConversionError(f"building llama-server failed ({' '.join(command[:2])}): {_last_line(done.stderr)}")
    return binary
