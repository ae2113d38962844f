"""`python -m compiler bundle ARTIFACT_DIR OUT`: an artifact with its model and a runtime-only Python environment in
one folder, which runs on a machine with that Python but no TVM, no compiler and no network.

    OUT/run generate PROMPT [MAX_NEW_TOKENS] [RUNS]     as `python -m runtime.generate`
    OUT/run chat                                      as `python -m runtime.chat`
    OUT/bundle.json     what the bundle holds: target, Python version, packages, sizes
    OUT/artifact/       the artifact, as built
    OUT/model/          config, tokenizer and generation files, and the weights (unless --no-weights)
    OUT/python/         ir/, models/, runtime/ (ours, as source); TVM without its compiler library; tvm_ffi,
                        ml_dtypes, numpy, tokenizers, jinja2 (and pillow for image models) for the target Python;
                        libcudart for CUDA artifacts, beside TVM's CUDA loader

Wheels for the target Python are fetched once with pip into a cache (--wheel-cache) and unpacked from there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import tvm

import models
from ir.contract import (CUDA_LIBRARY_FOLDERS, CUDA_RUNTIME_LIBRARY, Manifest, build_command, check_built_for,
                         read_manifest, verify_files)
from ir.errors import RudaError
from models.gguf import gguf_file

from .cuda import cuda_toolkit_root
from .output import locked_output

BUNDLE_FILE = "bundle.json"
BUNDLE_KIND = "ruda-bundle"
BUNDLE_FORMAT = 1
OUR_PACKAGES = ("ir", "models", "runtime")  # the runtime and what it imports: the model code its checks hash
RUNTIME_DISTRIBUTIONS = ("numpy", "ml_dtypes", "apache-tvm-ffi", "typing_extensions", "tokenizers", "jinja2",
                         "markupsafe")
IMAGE_DISTRIBUTIONS = ("pillow",)  # an image-text model's preprocessing
TVM_COMPILER_LIBRARY = "libtvm_compiler.so"
# Folders no runtime imports: tests, C/C++ sources and headers, caches of another Python, TVM's web runtime.
PRUNED = {"__pycache__", "tests", "3rdparty", "include", "src", "web", "cython", "share"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
METADATA_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")  # config, tokenizer, templates, generation
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
WHEEL_CACHE_ENV = "RUDA_WHEEL_CACHE"
LAUNCHER = """#!/bin/sh
# Runs this deploy bundle (see bundle.json):  ./run generate PROMPT [MAX_NEW_TOKENS] [RUNS]  |  ./run chat
# The interpreter: $RUDA_PYTHON, else python3 on PATH; it must be Python {python}.
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd) || exit 1
python=${{RUDA_PYTHON:-python3}}
if ! command -v "$python" >/dev/null 2>&1; then
    echo "error: no Python interpreter '$python' on PATH; set RUDA_PYTHON to a Python {python} interpreter" >&2
    exit 2
fi
TVM_USE_RUNTIME_LIB=1 exec "$python" {flags} "$here/python/{start}" "$here" "$@"
"""
# The bundle's Python sees its own packages alone: no site-packages, user site or PYTHON* variables of the host (a
# host's torch, say, would be imported by tvm_ffi and cost seconds per start).
ISOLATED = "-E -S"
START = "bundle_start.py"  # run as a script, so that its folder (the bundle's packages) and not the cwd leads sys.path
START_SCRIPT = """import sys

from runtime.bundled import main

sys.exit(main(sys.argv[1:]))
"""


class BundleError(RudaError):
    """A bundle cannot be made: a bad option, no wheels for the target Python, no CUDA runtime to carry."""

    exit_code = 6


@dataclass(frozen=True)
class BundleResult:
    """Where the bundle went and how big it is."""

    path: Path
    bytes: int
    weights: bool


def default_wheel_cache() -> Path:
    """Where the target Python's wheels are kept: $RUDA_WHEEL_CACHE, else ~/.cache/ruda/wheels."""
    return Path(os.environ.get(WHEEL_CACHE_ENV) or Path.home() / ".cache" / "ruda" / "wheels")


def bundle(artifact: str | Path, out: str | Path, *, model_dir: str | Path | None = None, python: str | None = None,
           weights: bool = True, wheel_cache: str | Path | None = None) -> BundleResult:
    """Write the bundle of `artifact` (for the checkpoint at `model_dir`, default: the one it was built from) to `out`,
    for Python `python` (default: this one)."""
    artifact, out = Path(artifact), Path(out)
    python = python or f"{sys.version_info.major}.{sys.version_info.minor}"
    if not re.fullmatch(r"3\.\d+", python):
        raise BundleError(f"--python {python!r} is not a Python version; give MAJOR.MINOR, e.g. 3.12")
    manifest = read_manifest(artifact, f"python -m compiler build MODEL_DIR --out {artifact}")
    model_dir = Path(model_dir) if model_dir is not None else Path(manifest.built_from)
    _check_artifact(manifest, artifact, model_dir)
    cache = Path(wheel_cache) if wheel_cache is not None else default_wheel_cache()
    distributions = RUNTIME_DISTRIBUTIONS + (IMAGE_DISTRIBUTIONS if "encode_image" in manifest.inputs else ())
    wheels = fetch_wheels(distributions, python, cache)
    cudart = _cuda_runtime() if manifest.target.kind == "cuda" else None
    with locked_output(out, model_dir, is_bundle, BUNDLE_FILE) as output:
        output.commit(lambda tmp: _write(tmp, manifest, artifact, model_dir, python, weights, wheels, cudart))
    return BundleResult(out, folder_bytes(out), weights)


def _check_artifact(manifest: Manifest, artifact: Path, model_dir: Path) -> None:
    """The artifact must be whole and built from this checkpoint and model code with this TVM."""
    rebuild = build_command(model_dir, manifest.target.kind, artifact, manifest.build_options)
    if not (model_dir / "config.json").is_file() and gguf_file(model_dir) is None:
        raise BundleError(f"{artifact} was built from {model_dir}, which has no config.json (or GGUF file) any more; "
                          "pass the model directory with --model")
    raw, config, _, dtypes = models.load_checkpoint(model_dir)
    check_built_for(manifest, artifact, (raw, config, dtypes), tvm.__version__, rebuild)
    verify_files(artifact, manifest, rebuild)


def is_bundle(directory: Path) -> bool:
    """Whether `directory` holds a bundle written by this command (which a new one may replace)."""
    try:
        return json.loads((directory / BUNDLE_FILE).read_bytes()).get("kind") == BUNDLE_KIND
    except (OSError, ValueError, AttributeError):
        return False


def fetch_wheels(distributions: tuple[str, ...], python: str, cache: Path) -> list[Path]:
    """The wheels of `distributions`, at the versions installed here, for CPython `python` on x86-64 Linux: from the
    cache, the missing ones fetched into it with pip (once; later bundles need no network)."""
    tag = "cp" + python.replace(".", "")
    folder = cache / tag
    wanted = {_normalise(d): _installed_version(d) for d in distributions}
    missing = [d for d, v in wanted.items() if _cached_wheel(folder, d, v, tag) is None]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--python-version", python, "--implementation", "cp", "--abi", tag, "--abi", "abi3",
                   "--abi", "none", *[a for p in PLATFORMS for a in ("--platform", p)], "--dest", str(folder),
                   *[f"{d}=={wanted[d]}" for d in missing]]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise BundleError(f"cannot fetch the Python {python} wheels of {', '.join(missing)} into {folder} "
                              f"({reason}); this needs pip and the network once, or put those wheels there yourself")
    wheels = [_cached_wheel(folder, d, v, tag) for d, v in wanted.items()]
    absent = [d for d, w in zip(wanted, wheels) if w is None]
    if absent:
        raise BundleError(f"no wheel of {', '.join(absent)} for Python {python} on x86-64 Linux in {folder}; "
                          f"put one there, or bundle for another --python")
    return wheels


def _normalise(distribution: str) -> str:
    """A distribution's name as wheel file names spell it."""
    return re.sub(r"[-_.]+", "_", distribution).lower()


def _installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise BundleError(f"{distribution} is not installed here; the bundle carries the versions this build "
                          "environment runs: install the project (scripts/venv.sh)") from None


def _cached_wheel(folder: Path, distribution: str, version: str, tag: str) -> Path | None:
    """A wheel of `distribution` `version` in `folder` that CPython `tag` on x86-64 Linux can import."""
    for wheel in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        name, wheel_version, *_, python_tag, abi, platform = wheel.stem.split("-")
        if _normalise(name) != distribution or wheel_version != version or "x86_64" not in platform \
                and platform != "any":
            continue
        if python_tag in (tag, "py3") or (abi == "abi3" and int(python_tag[3:]) <= int(tag[3:])):
            return wheel
    return None


def _cuda_runtime() -> Path:
    """The CUDA runtime library that TVM's CUDA loader links against, from the CUDA toolkit here."""
    root = cuda_toolkit_root()
    for folder in CUDA_LIBRARY_FOLDERS:
        if (root / folder / CUDA_RUNTIME_LIBRARY).is_file():
            return (root / folder / CUDA_RUNTIME_LIBRARY).resolve()
    raise BundleError(f"the CUDA toolkit at {root} has no {CUDA_RUNTIME_LIBRARY}, which a CUDA artifact's bundle "
                      "carries; install the CUDA 13 toolkit, or set CUDA_PATH to one")


def _write(tmp: Path, manifest: Manifest, artifact: Path, model_dir: Path, python: str, weights: bool,
           wheels: list[Path], cudart: Path | None) -> None:
    """Fill the bundle folder `tmp`."""
    shutil.copytree(artifact, tmp / "artifact", ignore=shutil.ignore_patterns(".*"))
    _copy_model(model_dir, tmp / "model", weights)
    site = tmp / "python"
    root = Path(__file__).resolve().parent.parent
    for package in OUR_PACKAGES:
        shutil.copytree(root / package, site / package, ignore=lambda d, names: [
            n for n in names if not (n.endswith(".py") and (Path(d) / n).is_file())])
    _copy_tvm(site / "tvm")
    for wheel in wheels:
        _unpack(wheel, site)
    if cudart is not None:
        shutil.copy2(cudart, site / "tvm" / "lib" / cudart.name)
    (site / START).write_text(START_SCRIPT)
    (tmp / "run").write_text(LAUNCHER.format(python=python, flags=ISOLATED, start=START))
    (tmp / "run").chmod(0o755)
    info = {"kind": BUNDLE_KIND, "format": BUNDLE_FORMAT, "python": python, "target": manifest.target.kind,
            "device": "cuda" if manifest.target.kind == "cuda" else "cpu", "artifact": "artifact", "model": "model",
            "weights": weights, "model_type": manifest.model_type, "built_from": manifest.built_from,
            "tvm": tvm.__version__, "packages": {w.name.split("-")[0]: w.name.split("-")[1] for w in wheels},
            "cuda_runtime": cudart.name if cudart else None}
    (tmp / BUNDLE_FILE).write_text(json.dumps(info, indent=1) + "\n")


def _copy_model(model_dir: Path, dest: Path, weights: bool) -> None:
    """The checkpoint's config, tokenizer and generation files, and its weights when asked (a GGUF file is all of
    them: its config and tokenizer come with its weights)."""
    dest.mkdir()
    for path in sorted(model_dir.iterdir()):
        if not path.is_file():
            continue
        if path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            if weights and (path.suffix in (".safetensors", ".gguf") or path.name.endswith(".safetensors.index.json")):
                shutil.copy2(path, dest / path.name)
        elif path.suffix in METADATA_SUFFIXES:
            shutil.copy2(path, dest / path.name)


def _copy_tvm(dest: Path) -> None:
    """The TVM installed here (its Python code is the same for every Python version) without its compiler library."""
    source = Path(tvm.__file__).resolve().parent
    shutil.copytree(source, dest, ignore=lambda d, names: [n for n in names if n in PRUNED or n ==
                                                           TVM_COMPILER_LIBRARY or n.endswith(".pyc")])


def _unpack(wheel: Path, site: Path) -> None:
    """A wheel's importable files into `site` (what pip would install, less tests, sources and headers)."""
    with zipfile.ZipFile(wheel) as z:
        for member in z.infolist():
            parts = member.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if member.is_dir() or PRUNED.intersection(parts[:-1]):
                continue
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
