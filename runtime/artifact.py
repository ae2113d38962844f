"""Opening a model directory's artifact: the manifest's checks (device, model, weights, model code, TVM, CPU
features, GPU arch, AMX), the module files' checksums, then the compiled step functions."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tvm
from tvm.runtime.vm import VirtualMachine

from ir.contract import (
    MODULE,
    ArtifactError,
    Manifest,
    build_command,
    check_built_for,
    default_artifact_dir,
    read_manifest,
    verify_files,
)
from ir.cpu_features import missing_host_features

from .cpu import enable_amx

TARGETS = {"cpu": "llvm", "cuda": "cuda"}  # --device -> the artifact's target


@dataclass
class OpenedArtifact:
    """A checked artifact: where it is, its manifest, and its loaded module."""

    path: Path
    manifest: Manifest
    executable: tvm.runtime.Module

    def functions(self, device) -> dict[str, Callable]:
        """The VM functions by name, of a virtual machine of their own (its CUDA graphs, captured at each function's
        first call, are its own too)."""
        vm = VirtualMachine(self.executable, device)
        return {name: vm[name] for name in self.manifest.functions}


def open_artifact(model_dir: Path, artifact, target: str, device, checkpoint: tuple) -> OpenedArtifact:
    """The artifact at `artifact` (default: the default place) for the checkpoint (raw config.json, parsed config,
    tensor dtypes) of `model_dir`, checked and loaded on `device`, or an ArtifactError with the rebuild command."""
    if artifact is not None and not isinstance(artifact, (str, os.PathLike)):
        raise ArtifactError(f"artifact must be a path, got {type(artifact).__name__}")
    path = Path(artifact) if artifact is not None else default_artifact_dir(model_dir, target)
    manifest = read_manifest(path, build_command(model_dir, target, artifact))
    _check_target(manifest, model_dir, path, artifact, target)
    rebuild = build_command(model_dir, target, artifact, manifest.build_options)
    _check_manifest(manifest, model_dir, path, target, device, checkpoint, rebuild)
    verify_files(path, manifest, rebuild)
    try:
        opened = OpenedArtifact(path, manifest, tvm.runtime.load_module(str(path / MODULE)))
        opened.functions(device)  # a module whose functions the VM cannot set up fails here, not at the first step
        return opened
    except Exception as e:  # TVM raises bare errors for a module it cannot load
        raise ArtifactError(f"{path / MODULE} cannot be loaded ({last_line(e)}); rebuild: {rebuild}") from None


def _check_target(manifest: Manifest, model_dir: Path, path: Path, artifact, target: str) -> None:
    """The artifact must be for this device; else say which device runs it and how to build for this one."""
    kind = manifest.target.kind
    if kind == target:
        return
    device = next(d for d, t in TARGETS.items() if t == kind)
    raise ArtifactError(f"{path} was built for --target {kind}: run it with --device {device}, or build one for "
                        f"this device: {build_command(model_dir, target, artifact)}")


def _check_manifest(m: Manifest, model_dir: Path, path: Path, target: str, device, checkpoint: tuple,
                    rebuild: str) -> None:
    """The artifact must be built from this checkpoint and model code with this TVM, for this machine."""
    check_built_for(m, path, checkpoint, tvm.__version__, rebuild)
    if target == "cuda":
        arch = int(m.target.arch.removeprefix("sm_"))
        here = int(device.compute_version.replace(".", ""))
        if arch > here:
            rebuild_here = build_command(model_dir, target, path,
                                         _without(m.build_options, "--arch") + ("--arch", f"sm_{here}"))
            raise ArtifactError(f"{path} holds PTX for {m.target.arch}, which this GPU (sm_{here}) "
                                f"cannot run; rebuild: {rebuild_here}")
    missing = missing_host_features(list(m.target.features))
    if missing:
        rebuild_here = build_command(model_dir, target, path,
                                     _without(m.build_options, "--mcpu", "--matmul-precision"))
        raise ArtifactError(f"{path} was compiled for CPU {m.target.mcpu!r}, which uses {missing} "
                            f"that this machine lacks; rebuild here: {rebuild_here}")
    if "amx-tile" in m.target.features:
        try:
            enable_amx()
        except OSError as e:
            rebuild_plain = build_command(model_dir, target, path,
                                          _without(m.build_options, "--matmul-precision"))
            raise ArtifactError(f"{path} runs its prefill products on AMX tiles, but {e.strerror}; "
                                f"rebuild without them: {rebuild_plain}") from None


def _without(options: tuple[str, ...], *flags: str) -> tuple[str, ...]:
    """Build options with these flags (and their values) left out."""
    out, skip = [], False
    for option in options:
        if skip:
            skip = False
        elif option in flags:
            skip = True
        else:
            out.append(option)
    return tuple(out)


def last_line(error: Exception) -> str:
    """The last non-empty line of an error's message (TVM's errors end with the one that says what failed)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
