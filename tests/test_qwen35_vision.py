"""Qwen3.5 image + text against transformers' Qwen3_5ForConditionalGeneration on a tiny random checkpoint with a
vision tower: image embeddings, prefill and decode logits, greedy tokens for prompts with one image, two images of
different aspect ratios (PNG and JPEG), and text only; chunked prefill across image boundaries; the API's errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from runtime import GenerationError, GreedyGenerationConfig, RgbImage, load_pipeline
from runtime.multimodal import MultimodalPipeline, load_huggingface_qwen35_multimodal, load_huggingface_qwen35_vision

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL = dict(arch="qwen3_5", vision=True, seed=3, num_hidden_layers=4, partial_rotary_factor=1.0,
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
STEPS = 12


def write_images(folder) -> dict[str, object]:
    """A wide PNG, a tall JPEG and a small square PNG of smooth random colours (JPEG keeps them close)."""
    rng = np.random.default_rng(11)
    paths = {}
    for name, (height, width) in {"wide.png": (40, 100), "tall.jpg": (90, 50), "small.png": (20, 20)}.items():
        base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        image = Image.fromarray(base).resize((width, height), Image.BILINEAR)
        paths[name] = folder / name
        image.save(paths[name], quality=95) if name.endswith(".jpg") else image.save(paths[name])
    return paths


@pytest.fixture(scope="module")
def setup(tiny_factory, tmp_path_factory):
    model_dir, artifact = tiny_factory(**MODEL)
    pipeline = load_pipeline(model_dir, artifact)
    config = json.loads((model_dir / "config.json").read_text())
    hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(**config)).float().eval()
    weights = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in load_file(model_dir / "model.safetensors").items()}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not missing and not unexpected
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    return pipeline, hf, processor, write_images(tmp_path_factory.mktemp("images"))


def prompt_with(pipeline, images: int) -> list[int]:
    """A prompt holding `images` image placeholders between pieces of text."""
    ids = []
    for i in range(images):
        ids += pipeline.encode(f"look {i}:") + pipeline.encode("<|vision_start|><|image_pad|><|vision_end|>")
    return ids + pipeline.encode(" and say what you see")


def reference_inputs(pipeline, processor, prompt: list[int], paths) -> dict:
    """transformers' inputs: its own preprocessing, the placeholders expanded as its processor does."""
    v = pipeline.model.vision
    if not paths:
        return {"input_ids": torch.tensor([prompt])}
    pixels = processor([Image.open(p) for p in paths], return_tensors="pt")
    tokens = (pixels["image_grid_thw"].prod(-1) // v.merge_unit).tolist()
    ids, k = [], 0
    for t in prompt:
        ids += [t] * (tokens[k] if t == v.image_token_id else 1)
        k += t == v.image_token_id
    ids = torch.tensor([ids])
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": (ids == v.image_token_id).int()}


def test_image_embeddings_match(setup):
    pipeline, hf, processor, paths = setup
    files = [paths["wide.png"], paths["tall.jpg"]]
    ours = pipeline.vision.encode_files(files)
    inputs = reference_inputs(pipeline, processor, prompt_with(pipeline, 2), files)
    with torch.no_grad():
        theirs = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert [len(e) for e in ours] == [len(t) for t in theirs] and len(ours[0]) != len(ours[1])
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-4 * float(np.abs(want.numpy()).max()))


def test_prefill_and_decode_logits_match(setup):
    pipeline, hf, processor, paths = setup
    files = [paths["tall.jpg"], paths["wide.png"]]
    prompt = pipeline.image_prompt(prompt_with(pipeline, 2), pipeline.image_processor.preprocess_files(files))
    inputs = reference_inputs(pipeline, processor, prompt_with(pipeline, 2), files)
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    model = pipeline.model
    cache = model.new_cache()
    ours = model.forward(prompt.token_ids, cache, prompt)
    with torch.no_grad():
        out = hf(**inputs, use_cache=True)
        for step in range(6):
            want = out.logits[0, -1].numpy()
            np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))
            token = int(want.argmax())
            ours = model.forward([token], cache)
            out = hf(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True,
                     mm_token_type_ids=torch.zeros((1, 1), dtype=torch.int))


@pytest.mark.parametrize("images", [["wide.png"], ["wide.png", "tall.jpg"], ["small.png", "tall.jpg", "wide.png"], []])
def test_greedy_tokens_identical(setup, images):
    pipeline, hf, processor, paths = setup
    files = [paths[name] for name in images]
    prompt = prompt_with(pipeline, len(files))
    config = GreedyGenerationConfig(STEPS, eos_token_ids=[])
    ours = (pipeline.generate_image_files_greedy(prompt, files, config=config) if files else
            pipeline.generate_text(pipeline.decode(prompt), config, add_special_tokens=False))
    inputs = reference_inputs(pipeline, processor, prompt, files)
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.generated_token_ids == want[0, inputs["input_ids"].shape[1]:].tolist()
    assert ours.prompt_token_ids == prompt  # the prompt's own ids: placeholders not expanded


def test_chunked_prefill_across_image_boundaries_equals_whole(setup):
    """Prefill chunks of 8 and 16 tokens cut through the images; the logits are those of a cut anywhere else."""
    pipeline, _, _, paths = setup
    model = pipeline.model
    prompt = pipeline.image_prompt(prompt_with(pipeline, 2), pipeline.image_processor.preprocess_files(
        [paths["small.png"], paths["wide.png"]]))
    whole = model.forward(prompt.token_ids, model.new_cache(), prompt)
    cache = model.new_cache()
    cuts = [0, 3, 5, 17, 30, len(prompt.token_ids)]
    for a, b in zip(cuts, cuts[1:]):  # the images come with the first piece; the cache keeps them
        parts = model.forward(prompt.token_ids[a:b], cache, prompt if a == 0 else None)
    np.testing.assert_allclose(parts, whole, rtol=0, atol=1e-4 * max(1.0, float(np.abs(whole).max())))


def test_rgb_images_equal_their_files(setup):
    pipeline, _, _, paths = setup
    pixels = np.asarray(Image.open(paths["wide.png"]).convert("RGB"))
    rgb = RgbImage(pixels.tobytes(), *pixels.shape[:2])
    prompt = prompt_with(pipeline, 1)
    config = GreedyGenerationConfig(6, eos_token_ids=[])
    assert pipeline.generate_rgb_greedy(prompt, [rgb], config=config).generated_token_ids == \
        pipeline.generate_image_files_greedy(prompt, [paths["wide.png"]], config=config).generated_token_ids


def test_loaders(setup, tiny_factory):
    pipeline, _, _, paths = setup
    assert isinstance(pipeline, MultimodalPipeline)
    model_dir, artifact = pipeline.model.model_dir, pipeline.model.artifact
    encoder = load_huggingface_qwen35_vision(model_dir, artifact)
    np.testing.assert_array_equal(encoder.encode_files([paths["small.png"]])[0],
                                  pipeline.vision.encode_files([paths["small.png"]])[0])
    assert isinstance(load_huggingface_qwen35_multimodal(model_dir, artifact), MultimodalPipeline)
    text_dir, text_artifact = tiny_factory(arch="qwen3_5", num_hidden_layers=2)
    with pytest.raises(GenerationError, match="has no vision encoder"):
        load_huggingface_qwen35_multimodal(text_dir, text_artifact)
    assert not isinstance(load_pipeline(text_dir, text_artifact), MultimodalPipeline)


def test_prompt_and_image_errors(setup, tmp_path):
    pipeline, _, _, paths = setup
    v = pipeline.model.vision
    one = prompt_with(pipeline, 1)
    with pytest.raises(GenerationError, match="holds 1 image placeholders .* but 2 images were given"):
        pipeline.generate_image_files_greedy(one, [paths["wide.png"], paths["tall.jpg"]])
    with pytest.raises(GenerationError, match="holds 0 image placeholders"):
        pipeline.generate_image_files_greedy(pipeline.encode("no image here"), [paths["wide.png"]])
    with pytest.raises(GenerationError, match="video placeholder"):
        pipeline.generate_image_files_greedy(one + [v.video_token_id], [paths["wide.png"]])
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    with pytest.raises(Exception, match="notes.png"):
        pipeline.generate_image_files_greedy(one, [not_image])
    with pytest.raises(GenerationError, match="prompt_ids must be a non-empty list"):
        pipeline.generate_image_files_greedy([], [paths["wide.png"]])


def test_generate_cli_with_images_matches_transformers(setup):
    from test_cli import run

    pipeline, hf, processor, paths = setup
    model = pipeline.model
    text = "look: <|vision_start|><|image_pad|><|vision_end|> then <|vision_start|><|image_pad|><|vision_end|> say"
    result = run("runtime.generate", str(model.model_dir), text, "8", "--artifact", str(model.artifact),
                 "--image", str(paths["wide.png"]), "--image", str(paths["tall.jpg"]), cwd=model.model_dir.parent)
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.splitlines()[-1])
    prompt = pipeline.encode(text)
    assert line["prompt_token_ids"] == prompt and prompt.count(model.vision.image_token_id) == 2
    inputs = reference_inputs(pipeline, processor, prompt, [paths["wide.png"], paths["tall.jpg"]])
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert line["generated_token_ids"] == want[0, inputs["input_ids"].shape[1]:].tolist()[:len(line["generated_token_ids"])]
    assert line["finish_reason"] in ("eos", "length")


def test_generate_cli_refuses_images_for_a_text_model(tiny_factory, setup):
    from test_cli import run

    _, _, _, paths = setup
    model_dir, artifact = tiny_factory(arch="qwen3_5", num_hidden_layers=2)
    result = run("runtime.generate", str(model_dir), "hi", "--artifact", str(artifact), "--image", str(paths["wide.png"]),
                 cwd=model_dir.parent)
    assert result.returncode != 0 and "is a text-only model" in result.stderr


def test_chat_attaches_images_to_the_next_message(setup):
    from runtime.chat import chat

    pipeline, _, _, paths = setup
    lines = iter(["/image " + str(paths["small.png"]), "what is it", "/image " + str(paths["small.png"] / "x")])
    out: list[str] = []

    def read(_):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    config = GreedyGenerationConfig(6, eos_token_ids=[])
    chat(pipeline, config, None, read=read, write=out.append)
    v = pipeline.model.vision
    placeholder = pipeline.decode([v.vision_start_token_id, v.image_token_id, v.vision_end_token_id])
    prompt = pipeline.render_chat([{"role": "user", "content": placeholder + "what is it"}])
    want = pipeline.generate_image_files_greedy(pipeline.encode(prompt, add_special_tokens=False), [paths["small.png"]],
                                                config=config)
    printed = "".join(out)
    assert "attached: 4 tokens" in printed and want.generated_text in printed
    assert "small.png/x" in printed.splitlines()[-2]  # the bad path is reported, the chat goes on


def test_batched_image_prompts_equal_their_solo_runs(setup, tmp_path):
    """Prompts with different images and a text-only one, served at once, each get their solo tokens."""
    from compiler.build import build
    from conftest import TEST_BUCKETS, TEST_IMAGE_PATCHES
    from runtime import BatchExecutor, ContinuousBatchConfig

    pipeline, _, _, paths = setup
    model_dir = pipeline.model.model_dir
    artifact = build(model_dir, out=tmp_path / "batched", prefill_buckets=TEST_BUCKETS["prefill_tokens"],
                     max_context=TEST_BUCKETS["max_context"], batch_rows=(1, 4), image_patches=TEST_IMAGE_PATCHES,
                     quiet=True).path
    batched = load_pipeline(model_dir, artifact)
    config = GreedyGenerationConfig(8, eos_token_ids=[])
    requests = [([paths["wide.png"]], prompt_with(pipeline, 1)), ([paths["tall.jpg"]], prompt_with(pipeline, 1)),
                ([], prompt_with(pipeline, 0)), ([paths["small.png"], paths["wide.png"]], prompt_with(pipeline, 2))]
    executor = BatchExecutor(batched.model, ContinuousBatchConfig(4, 16))
    ids = {}
    for files, prompt in requests:
        images = batched.image_prompt(prompt, batched.image_processor.preprocess_files(files)) if files else None
        ids[executor.submit(images.token_ids if images else prompt, config, images=images)] = (files, prompt)
    done = {r.request_id: r.generated_token_ids for r in executor.run()}
    assert executor.scheduler.stats.mixed_batches > 0  # image prefill rows rode beside other rows
    for request_id, (files, prompt) in ids.items():
        solo = (pipeline.generate_image_files_greedy(prompt, files, config=config) if files else
                pipeline.generate_text(pipeline.decode(prompt), config, add_special_tokens=False))
        assert done[request_id] == solo.generated_token_ids


def test_an_image_beyond_the_largest_patch_bucket_names_the_option(setup):
    from dataclasses import replace

    pipeline, _, _, paths = setup
    big = replace(pipeline.image_processor, max_pixels=16 * 16 * 256)  # up to 1024 patches; the largest bucket: 256
    with pytest.raises(GenerationError, match=r"more than the largest image bucket \(256 patches\): rebuild with a "
                                              r"larger --image-patch-buckets"):
        pipeline.generate_rgb_greedy(prompt_with(pipeline, 1), [RgbImage(bytes(3 * 200 * 300), 200, 300)], big)


def test_build_cli_checks_the_image_patch_buckets(setup, tiny_factory):
    from test_cli import run

    model_dir = setup[0].model.model_dir
    result = run("compiler", "build", str(model_dir), "--image-patch-buckets", "64,6", cwd=model_dir.parent)
    assert result.returncode == 6 and "--image-patch-buckets must be positive multiples of 4" in result.stderr
    text_dir, _ = tiny_factory(arch="qwen3_5", num_hidden_layers=2)
    result = run("compiler", "build", str(text_dir), "--image-patch-buckets", "64", cwd=text_dir.parent)
    assert result.returncode == 6 and "has no vision encoder" in result.stderr
