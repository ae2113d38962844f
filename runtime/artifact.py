"""The artifact format shared by the compiler (writer) and the runtime (reader).

An artifact is a directory: `manifest.json`, `model.so` (the compiled Relax VM module),
`ir.json` and `ir.txt` (the program, for inspection). Its default place is derived from the
model directory and target, so `runtime.generate` finds what `compiler build` wrote.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ir.errors import RudaError

FORMAT = 1
MANIFEST = "manifest.json"
MODULE = "model.so"
DEFAULT_ROOT = Path("build")


class ArtifactError(RudaError):
    """The artifact is missing, incomplete, or was built for something else."""


def default_artifact_dir(model_dir: str | Path, target: str) -> Path:
    """Where `python -m compiler build MODEL_DIR --target T` writes by default (relative to the cwd)."""
    model_dir = Path(model_dir).resolve()
    tag = hashlib.sha256(str(model_dir).encode()).hexdigest()[:8]
    return DEFAULT_ROOT / f"{model_dir.name}-{tag}.{target}"


def config_hash(raw_config: dict) -> str:
    """Hash of a config.json's content (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(raw_config, sort_keys=True).encode()).hexdigest()


def build_command(model_dir: str | Path, target: str) -> str:
    """The command that (re)builds the default artifact."""
    return f"python -m compiler build {model_dir} --target {target}"


def read_manifest(artifact_dir: str | Path, model_dir: str | Path, target: str) -> dict:
    """The manifest of a complete artifact, or an ArtifactError saying how to build it."""
    artifact_dir = Path(artifact_dir)
    path = artifact_dir / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"no compiled artifact at {artifact_dir}; build it first: {build_command(model_dir, target)}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ArtifactError(f"{path} is corrupt; rebuild: {build_command(model_dir, target)} --force") from None
    if manifest.get("format") != FORMAT or not (artifact_dir / MODULE).is_file():
        raise ArtifactError(f"{artifact_dir} is incomplete or from another version; rebuild: "
                            f"{build_command(model_dir, target)} --force")
    return manifest
