"""The two commands as a user runs them: `python -m compiler build` then `python -m runtime.generate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.tiny import write_tiny_checkpoint
from runtime import GreedyGenerationConfig, load_pipeline

ROOT = Path(__file__).resolve().parent.parent


def run(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A working directory holding models/tiny and its default artifact, built through the CLI."""
    cwd = tmp_path_factory.mktemp("cli")
    model_dir = write_tiny_checkpoint(cwd / "models" / "tiny", arch="qwen2")
    result = run("compiler", "build", "models/tiny", "--target", "llvm", "--prefill-buckets", "8,16",
                 "--max-context", "64", cwd=cwd)
    assert result.returncode == 0, result.stderr
    built = json.loads(result.stdout.strip().splitlines()[-1])
    assert not built["reused"] and "scheduling kernels" in result.stderr
    return cwd, model_dir, cwd / built["artifact"]


def test_build_then_generate(workdir):
    cwd, model_dir, artifact = workdir
    result = run("runtime.generate", "models/tiny", "Hello world", "12", "2", cwd=cwd)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["event"] for line in lines] == ["load", "run", "run"]
    assert lines[0]["target"] == "llvm" and Path(cwd / lines[0]["artifact"]) == artifact
    want = load_pipeline(model_dir, artifact).generate_text("Hello world", GreedyGenerationConfig(12))
    for run_line in lines[1:]:
        assert run_line["prompt_token_ids"] == want.prompt_token_ids
        assert run_line["prompt_tokens"] == len(want.prompt_token_ids)
        assert run_line["generated_token_ids"] == want.generated_token_ids
        assert run_line["stopped_on_eos"] == want.stopped_on_eos
        assert run_line["text"] == want.text == "Hello world" + want.generated_text
        assert run_line["prefill_tokens_per_s"] > 0 and run_line["decode_tokens_per_s"] > 0


def test_rebuild_reuses(workdir):
    cwd, _, _ = workdir
    result = run("compiler", "build", "models/tiny", "--target", "llvm", "--prefill-buckets", "8,16",
                 "--max-context", "64", cwd=cwd)
    assert result.returncode == 0 and json.loads(result.stdout)["reused"]


def test_explicit_artifact_path(workdir, tmp_path):
    cwd, model_dir, artifact = workdir
    result = run("runtime.generate", str(model_dir), "Hi", "3", "--artifact", str(artifact), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.splitlines()[1])["generated_token_ids"]) <= 3


@pytest.mark.parametrize("args,message", [
    (["Hi", "4", "0"], "RUNS must be an integer > 0"),
    (["Hi", "0"], "MAX_NEW_TOKENS must be an integer > 0"),
    (["Hi", "many"], "MAX_NEW_TOKENS must be an integer > 0"),
])
def test_generate_rejects_bad_numbers(workdir, args, message):
    cwd, _, _ = workdir
    result = run("runtime.generate", "models/tiny", *args, cwd=cwd)
    assert result.returncode == 2 and message in result.stderr


def test_generate_without_artifact_says_how_to_build(workdir, tmp_path):
    cwd, model_dir, _ = workdir
    result = run("runtime.generate", str(model_dir), "Hi", cwd=tmp_path)
    assert result.returncode == 5
    assert f"python -m compiler build {model_dir} --target llvm" in result.stderr


def test_generate_prompt_too_long(workdir):
    cwd, _, _ = workdir
    result = run("runtime.generate", "models/tiny", "word " * 80, "4", cwd=cwd)
    assert result.returncode == 7 and "exceed the artifact's --max-context 64" in result.stderr


def test_build_rejects_unsupported_model_type(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (model_dir / "config.json").write_text(json.dumps(config))
    result = run("compiler", "build", str(model_dir), cwd=tmp_path)
    assert result.returncode == 3
    assert "config.json: field 'model_type' is 'gpt2'; supported: llama, qwen2" in result.stderr
    assert not (tmp_path / "build").exists()


def test_build_rejects_unknown_target(tmp_path):
    result = run("compiler", "build", str(tmp_path), "--target", "metal", cwd=tmp_path)
    assert result.returncode == 2 and "invalid choice: 'metal'" in result.stderr
