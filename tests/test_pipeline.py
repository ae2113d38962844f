"""The application API: loaders, chat templates vs transformers, greedy/sampled/streamed generation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from models import ModelConfigError
from runtime import (
    ChatMessage,
    ChatTemplateError,
    GenerationConfigError,
    GreedyGenerationConfig,
    SamplingConfig,
    SamplingGenerationConfig,
    load_huggingface_llama_pipeline,
    load_huggingface_qwen2_pipeline,
    load_pipeline,
)

ROOT = Path(__file__).resolve().parent.parent
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Ünïcødé ✓ 你好\nnew line"}],
    [{"role": "user", "content": "  spaces  "}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def qwen2(tiny_factory):
    return load_huggingface_qwen2_pipeline(*tiny_factory(arch="qwen2"))


@pytest.fixture(scope="module")
def llama(tiny_factory):
    return load_huggingface_llama_pipeline(*tiny_factory(arch="llama", dtype="float16", seed=2))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(request, arch, add_generation_prompt, conversation):
    transformers = pytest.importorskip("transformers")
    pipeline = request.getfixturevalue(arch)
    hf = transformers.AutoTokenizer.from_pretrained(pipeline.model.model_dir)
    messages = CONVERSATIONS[conversation]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert pipeline.render_chat(messages, add_generation_prompt) == want


def test_chatml_shape_and_message_dataclass(qwen2):
    text = qwen2.render_chat([ChatMessage("user", "Hi")])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert qwen2.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith("<|im_end|>\n")


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "tool", "content": "42"}], "tool messages"),
    ([{"role": "assistant", "content": "", "tool_calls": []}], "tool messages"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system message may only come first"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": "x", "name": "bob"}], "unsupported fields"),
    (["just text"], "must be a dict"),
])
def test_render_chat_rejects_bad_messages(qwen2, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        qwen2.render_chat(messages)


def test_checkpoint_without_template(tmp_path, tiny_factory):
    import shutil
    model_dir, artifact = tiny_factory(arch="qwen2")
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        load_pipeline(copy, artifact).render_chat([{"role": "user", "content": "x"}])


def test_loaders_dispatch_and_refuse_other_architectures(tiny_factory):
    qwen_dir, qwen_artifact = tiny_factory(arch="qwen2")
    assert load_pipeline(qwen_dir, qwen_artifact).config.model_type == "qwen2"
    with pytest.raises(ModelConfigError, match="use load_huggingface_qwen2_pipeline"):
        load_huggingface_llama_pipeline(qwen_dir, qwen_artifact)


def test_default_eos_from_generation_config(qwen2, llama):
    assert qwen2.default_eos_token_ids == json.loads((qwen2.model.model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert llama.default_eos_token_ids == json.loads((llama.model.model_dir / "generation_config.json").read_text())["eos_token_id"]


def test_rendered_llama_prompt_gets_one_bos(llama):
    prompt = llama.render_chat([{"role": "user", "content": "Hi"}])
    bos = llama.config.bos_token_id
    assert prompt.startswith("<|begin_of_text|>")
    for add in (True, False):
        ids = llama.encode(prompt, add_special_tokens=add)
        assert ids[0] == bos and ids[1] != bos
    assert llama.encode("Hi", add_special_tokens=True)[0] == bos
    assert bos not in llama.encode("Hi", add_special_tokens=False)


def test_generate_text_greedy(qwen2):
    prompt = qwen2.render_chat([{"role": "user", "content": "Tell me a story"}])
    result = qwen2.generate_text(prompt, GreedyGenerationConfig(16, eos_token_ids=[]), add_special_tokens=False)
    assert len(result.generated_token_ids) == 16 and not result.stopped_on_eos and result.finish_reason == "length"
    assert result.generated_text == qwen2.decode(result.generated_token_ids, skip_special_tokens=True)
    assert result.text == prompt + result.generated_text
    assert result.prompt_token_ids == qwen2.encode(prompt, add_special_tokens=False)
    cache = qwen2.model.new_cache(len(result.prompt_token_ids))
    first = int(np.argmax(qwen2.model.forward(result.prompt_token_ids, cache)))
    assert result.generated_token_ids[0] == first


def test_eos_ends_generation_and_is_kept(qwen2):
    free = qwen2.generate_text("abc", GreedyGenerationConfig(10, eos_token_ids=[]))
    eos = free.generated_token_ids[3]
    cut = free.generated_token_ids.index(eos) + 1
    stopped = qwen2.generate_text("abc", GreedyGenerationConfig(10, eos_token_ids=[eos]), skip_special_tokens=False)
    assert stopped.generated_token_ids == free.generated_token_ids[:cut]
    assert stopped.stopped_on_eos and stopped.finish_reason == "eos"


def test_sampled_generation_is_seeded(qwen2):
    def sample(seed, temperature=1.5):
        cfg = SamplingGenerationConfig(24, eos_token_ids=[], sampling=SamplingConfig(temperature, 0, 1.0, seed))
        return qwen2.generate_text_sampled("Once upon", cfg).generated_token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    greedy = qwen2.generate_text("Once upon", GreedyGenerationConfig(24, eos_token_ids=[])).generated_token_ids
    tiny_t = SamplingGenerationConfig(24, eos_token_ids=[], sampling=SamplingConfig(1e-4, 0, 1.0, 5))
    assert qwen2.generate_text_sampled("Once upon", tiny_t).generated_token_ids == greedy
    top1 = SamplingGenerationConfig(24, eos_token_ids=[], sampling=SamplingConfig(2.0, 1, 1.0, 9))
    assert qwen2.generate_text_sampled("Once upon", top1).generated_token_ids == greedy


@pytest.mark.parametrize("sampled", [False, True])
def test_streaming_deltas_join_to_the_full_text(qwen2, sampled):
    if sampled:
        cfg = SamplingGenerationConfig(20, eos_token_ids=[], sampling=SamplingConfig(1.2, 50, 0.95, 3))
        stream, full = qwen2.stream_text_sampled("Hi", cfg), qwen2.generate_text_sampled("Hi", cfg)
    else:
        cfg = GreedyGenerationConfig(20, eos_token_ids=[])
        stream, full = qwen2.stream_text("Hi", cfg), qwen2.generate_text("Hi", cfg)
    deltas = list(stream)
    assert "".join(deltas) == full.generated_text == stream.result.generated_text
    assert stream.result.generated_token_ids == full.generated_token_ids


class ScriptedModel:
    """Stands in for a compiled model: its logits always pick the next token of a script."""

    max_context = 1024

    def __init__(self, script, vocab):
        self.script, self.vocab, self.step = list(script), vocab, 0

    def check_request(self, prompt_tokens, max_new_tokens):
        pass

    def new_cache(self, tokens):
        return SimpleNamespace(release=lambda: None)

    def forward(self, ids, cache, images=None):
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[self.script[min(self.step, len(self.script) - 1)]] = 1.0
        self.step += 1
        return logits


def test_streaming_never_splits_a_multibyte_character(qwen2):
    raw = HFTokenizer.from_file(str(qwen2.model.model_dir / "tokenizer.json"))
    byte_tokens = [raw.token_to_id(c) for c in ("Ã", "©", "â", "ľ", "ĵ")]  # byte-level spellings of é (2 bytes), ✓ (3)
    assert None not in byte_tokens
    real_model = qwen2.model
    try:
        qwen2.model = ScriptedModel(byte_tokens, qwen2.config.vocab_size)
        deltas = list(qwen2.stream_text("x", GreedyGenerationConfig(5, eos_token_ids=[])))
    finally:
        qwen2.model = real_model
    assert deltas == ["é", "✓"]


def test_stop_strings(qwen2):
    free = qwen2.generate_text("abc", GreedyGenerationConfig(12, eos_token_ids=[]))
    stop = free.generated_text[2:4]
    result = qwen2.generate_text("abc", GreedyGenerationConfig(12, eos_token_ids=[], stop_strings=[stop]))
    assert result.finish_reason == "stop_string" and not result.stopped_on_eos
    assert stop in result.generated_text and free.generated_text.startswith(result.generated_text)
    assert stop not in qwen2.decode(result.generated_token_ids[:-1], skip_special_tokens=True)


def test_wrong_config_kind_is_rejected(qwen2):
    with pytest.raises(GenerationConfigError, match="SamplingGenerationConfig"):
        qwen2.generate_text_sampled("x", GreedyGenerationConfig(3))
    with pytest.raises(GenerationConfigError, match="GreedyGenerationConfig"):
        qwen2.generate_text("x", SamplingGenerationConfig(3))


def _chat_process(model_dir, artifact, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "runtime.chat", str(model_dir), "--artifact", str(artifact),
                             "--max-new-tokens", "6", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_chat_cli_keeps_the_conversation_and_exits_on_eof(tiny_factory, qwen2):
    model_dir, artifact = tiny_factory(arch="qwen2")
    proc = _chat_process(model_dir, artifact, "--system", "Be brief.")
    out, err = proc.communicate("Hello\nAnd again\n", timeout=300)
    assert proc.returncode == 0, err
    assert out.count("> ") == 3 and "Traceback" not in err
    first = qwen2.generate_text(qwen2.render_chat([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hello"}]),
                                GreedyGenerationConfig(6), add_special_tokens=False)
    assert out.startswith("> " + first.generated_text + "\n> ")


def test_chat_cli_exits_cleanly_on_ctrl_c(tiny_factory):
    model_dir, artifact = tiny_factory(arch="qwen2")
    proc = _chat_process(model_dir, artifact)
    time.sleep(8)  # let it load and wait at the prompt
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err


def test_chat_cli_rejects_bad_sampling_values(tiny_factory):
    model_dir, artifact = tiny_factory(arch="qwen2")
    proc = _chat_process(model_dir, artifact, "--temperature", "0")
    out, err = proc.communicate("", timeout=120)
    assert proc.returncode == 7 and "temperature must be finite and > 0" in err


@pytest.mark.parametrize("content,match", [
    ("{not json", "not a valid JSON object"),
    ("[1, 2]", "not a valid JSON object"),
    ('{"eos_token_id": "two"}', "field 'eos_token_id' must be a token id \\(a non-negative integer\\) or a list of them"),
    ('{"eos_token_id": [1, -2]}', "field 'eos_token_id' must be a token id \\(a non-negative integer\\) or a list of them"),
])
def test_bad_generation_config(tmp_path, content, match):
    from ir.errors import RudaError
    from runtime import default_eos_token_ids
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(RudaError, match=match):
        default_eos_token_ids(tmp_path, (1,))


def test_generation_config_without_eos_falls_back_to_config(tmp_path):
    from runtime import default_eos_token_ids
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 3}')
    assert default_eos_token_ids(tmp_path, (7, 8)) == [7, 8]


def test_missing_or_broken_tokenizer(tmp_path):
    from runtime import Tokenizer, TokenizerError
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        Tokenizer(tmp_path)


def test_incremental_detokenizer_decodes_a_bounded_window(qwen2):
    """Streaming cost per token does not grow with the reply: each step decodes only the last few tokens."""
    from runtime.request import IncrementalDetokenizer

    ids = qwen2.encode("The quick brown fox jumps over the lazy dog. " * 8, add_special_tokens=False)
    widths = []

    def decode(part, skip_special_tokens):
        widths.append(len(part))
        return qwen2.decode(part, skip_special_tokens)

    detok = IncrementalDetokenizer(decode, skip_special_tokens=True)
    text = "".join(detok.step(ids[:n]) for n in range(1, len(ids) + 1)) + detok.flush(ids)
    assert text == qwen2.decode(ids) and len(ids) > 40 and max(widths) <= 4


def test_a_request_is_a_batch_of_one_that_gives_its_pages_back(qwen2):
    """Single requests run on the paged arena; a finished request, and one whose stream is abandoned, return
    their pages."""
    qwen2.generate_text("Hi", GreedyGenerationConfig(20, eos_token_ids=[]))
    arena, pages = qwen2.model._arena, qwen2.model.buckets.kv_pages
    assert len(arena.free_pages) == pages
    tokens = iter(qwen2.stream_text("Hello there", GreedyGenerationConfig(40, eos_token_ids=[])))
    next(tokens)
    assert len(arena.free_pages) < pages  # the open stream holds its pages
    tokens.close()
    assert len(arena.free_pages) == pages and qwen2.model._arena is arena
