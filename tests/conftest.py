"""Shared fixtures: tiny generated checkpoints and their compiled artifacts, made once per session."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from compiler.build import build  # noqa: E402
from models.tiny import write_tiny_checkpoint  # noqa: E402

# Small buckets keep the suite fast; the 24-token prompts of the tests span two prefill chunks. A tiny vision tower's
# images have 16..256 patches (models.tiny.TINY_PREPROCESSOR).
TEST_BUCKETS = {"prefill_tokens": (8, 16), "max_context": 128}
TEST_IMAGE_PATCHES = (64, 256)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """Make (and cache) a tiny checkpoint + artifact for a set of generator options."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(**options) -> tuple[Path, Path]:
        key = json.dumps(options, sort_keys=True)
        if key not in made:
            root = tmp_path_factory.mktemp("tiny")
            model_dir = write_tiny_checkpoint(root / "model", **options)
            result = build(model_dir, out=root / "artifact", prefill_buckets=TEST_BUCKETS["prefill_tokens"],
                           max_context=TEST_BUCKETS["max_context"], quiet=True,
                           image_patches=TEST_IMAGE_PATCHES if options.get("vision") else None)
            made[key] = (model_dir, result.path)
        return made[key]

    return make


@pytest.fixture(params=["fused", "legacy"])
def attention_path(request, monkeypatch):
    """Run the test with each batched attention path (RUDA_PAGED_ATTENTION, read when a batch cache is made)."""
    monkeypatch.setenv("RUDA_PAGED_ATTENTION", request.param)
    return request.param
