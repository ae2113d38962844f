"""The end-to-end CPU benchmark's harness: engines take turns (prefills in a rotating order, decode steps in interleaved
slices), and a failing one is reported."""

from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager

import pytest

from benchmarks import cpu_generate
from benchmarks.compare_artifacts import same_round_ratios
from benchmarks.host import cpu_description


def engine(name: str, calls: list[str], fail_on: int | None = None, steps: list[str] | None = None):
    """A fake peer whose prefills log `name` (the one numbered `fail_on` fails) and whose decode steps log it in
    `steps`."""
    @contextmanager
    def peer(source, args, prompt, threads):
        def prefill():
            calls.append(name)
            if fail_on is not None and calls.count(name) == fail_on:
                raise RuntimeError(f"{name} broke")
            return 0

        def decode(state):
            (steps if steps is not None else []).append(name)
            return state

        yield f"{name} engine", prefill, decode
    return peer


def test_engines_take_turns_in_a_rotating_order_and_a_failure_stops_only_its_engine(monkeypatch):
    monkeypatch.setattr(cpu_generate, "PAUSE_S", 0)
    calls: list[str] = []
    with ExitStack() as stack:
        opened = [cpu_generate.open_engine(stack, engine(name, calls, fail), "source", None, [1, 2], 1, name)
                  for name, fail in (("a", None), ("b", 3), ("c", None))]
        rows = cpu_generate.run_rounds(opened, tokens=4, rounds=3)
    # a turn: an untimed prefill, then the timed one; each round starts one engine later; b stops at its failure
    assert calls == ["a", "a", "b", "b", "c", "c", "b", "c", "c", "a", "a", "a", "a", "c", "c"]
    assert [r["engine"] for r in rows] == ["a engine", "b engine", "c engine"]
    assert rows[1] == {"engine": "b engine", "error": "RuntimeError: b broke"}
    assert rows[0]["prefill_tokens_per_s"] > 0 and rows[2]["decode_tokens_per_s"] > 0


def test_an_engine_that_cannot_open_is_a_row_with_the_reason():
    @contextmanager
    def missing(source, args, prompt, threads):
        raise ImportError("No module named 'llama_cpp'")
        yield

    with ExitStack() as stack:
        rows = cpu_generate.run_rounds([
            cpu_generate.open_engine(stack, missing, "source", None, [1], 1, "llama.cpp"),
            cpu_generate.open_engine(stack, missing, ValueError("no GGUF"), None, [1], 1, "llama.cpp (GGUF F16)"),
        ], tokens=2, rounds=2)
    assert rows[0] == {"engine": "llama.cpp",
                       "error": "not installed (No module named 'llama_cpp'); pip install -e .[test,bench]"}
    assert rows[1] == {"engine": "llama.cpp (GGUF F16)", "error": "ValueError: no GGUF"}


def test_the_cpu_description_names_the_simd_width_and_the_bf16_path():
    text = cpu_description()
    assert "LLVM mcpu" in text and "float32 lanes" in text and "bfloat16 products:" in text
    assert "AWQ decode products: vpdpwssd)" in text or "AWQ decode products: pmaddwd)" in text


@pytest.mark.parametrize("rounds", [1, 3])
def test_every_engine_gets_every_round(monkeypatch, rounds):
    monkeypatch.setattr(cpu_generate, "PAUSE_S", 0)
    calls: list[str] = []
    with ExitStack() as stack:
        opened = [cpu_generate.open_engine(stack, engine(n, calls), "s", None, [1], 1, n) for n in "xy"]
        cpu_generate.run_rounds(opened, tokens=2, rounds=rounds)
    assert calls == ["x", "x", "y", "y", "y", "y", "x", "x", "x", "x", "y", "y"][:4 * rounds]


def test_decode_steps_interleave_in_slices_across_engines(monkeypatch):
    """A round's decode steps are not one engine's run after another's: each engine decodes a slice in turn."""
    monkeypatch.setattr(cpu_generate, "PAUSE_S", 0)
    monkeypatch.setattr(cpu_generate, "DECODE_SLICES", 3)
    steps: list[str] = []
    with ExitStack() as stack:
        opened = [cpu_generate.open_engine(stack, engine(n, [], steps=steps), "s", None, [1], 1, n) for n in "xy"]
        rows = cpu_generate.run_rounds(opened, tokens=7, rounds=1)
    assert steps == ["x", "x", "y", "y"] * 3  # 6 decode steps each, in 3 slices of 2, taken in turn
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)


def test_a_long_prompt_runs_as_many_decode_steps_as_asked_in_a_context_that_holds_them(monkeypatch):
    """--decode-tokens: a 9-token prompt with 3 generated tokens is 2 decode steps a round, and decode tok/s counts
    those steps; every engine's context holds the prompt and the generated tokens."""
    monkeypatch.setattr(cpu_generate, "PAUSE_S", 0)
    clock = iter(range(0, 1000, 2))  # each reading of the benchmark's clock 2 s after the last
    monkeypatch.setattr(cpu_generate, "time", type("Clock", (), {"perf_counter": clock.__next__,
                                                                 "sleep": staticmethod(lambda s: None)}))
    steps: list[str] = []
    with ExitStack() as stack:
        opened = [cpu_generate.open_engine(stack, engine("x", [], steps=steps), "s", None, [1] * 9, 1, "x")]
        rows = cpu_generate.run_rounds(opened, tokens=9, rounds=1, steps=2)
    assert steps == ["x", "x"]
    assert rows[0]["prefill_tokens_per_s"] == 9 / 2 and rows[0]["decode_tokens_per_s"] == 2 / 4  # 2 slices, 2 s each
    args = type("Args", (), {"tokens": 2048, "decode_tokens": 32})()
    assert cpu_generate.context(args) == 2080
    assert cpu_generate.llama_options(2048, 2080, 2)["n_ctx"] == 2080


@pytest.mark.parametrize("flags", [["--decode-tokens", "1"], ["--tokens", "0"]])
def test_a_benchmark_without_a_decode_step_or_a_prompt_is_refused(monkeypatch, capsys, tmp_path, flags):
    monkeypatch.setattr("sys.argv", ["cpu_generate", "--work", str(tmp_path), *flags])
    with pytest.raises(SystemExit) as stopped:
        cpu_generate.main()
    assert stopped.value.code == 2
    assert "--tokens must be at least 1 and --decode-tokens at least 2" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any checkpoint or artifact was made


def test_the_kernel_profiler_times_every_kernel_of_a_packed_model(tmp_path, monkeypatch, capsys):
    """benchmarks.profile_kernels passes a packed weight's parts (it once passed the packed type as one array)."""
    from benchmarks import profile_kernels
    from models.tiny import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "model", arch="qwen2", awq_group_size=32)
    monkeypatch.setattr("sys.argv", ["profile_kernels", "--model-dir", str(model_dir), "--tokens", "1"])
    profile_kernels.main()
    table = capsys.readouterr().out
    assert "awq_int4_pairs(g32)" in table and "total (step, 1 token(s)" in table


def test_the_kernel_profiler_quantises_a_shape_for_awq_and_refuses_other_dtypes(tmp_path, monkeypatch, capsys):
    from benchmarks import checkpoints, profile_kernels

    monkeypatch.setitem(checkpoints.SHAPES, "tiny", dict(arch="qwen2", hidden_size=128, num_hidden_layers=1,
                                                         num_attention_heads=4, num_key_value_heads=2,
                                                         intermediate_size=256, vocab_size=256))
    monkeypatch.setattr("sys.argv", ["profile_kernels", "--shape", "tiny", "--dtype", "awq", "--work", str(tmp_path)])
    profile_kernels.main()
    assert "awq_int4_pairs(g128)" in capsys.readouterr().out
    assert (tmp_path / "tiny-float16-awq-g128" / "config.json").is_file()
    monkeypatch.setattr("sys.argv", ["profile_kernels", "--shape", "tiny", "--dtype", "int8", "--work", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        profile_kernels.main()
    assert stopped.value.code == 2 and "argument --dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_the_decode_roofline_is_an_engine_that_takes_turns_with_the_others(monkeypatch):
    """The roofline is measured in the same rounds and slices as the engines, not once before them."""
    monkeypatch.setattr(cpu_generate, "PAUSE_S", 0)
    reads: list[int] = []
    monkeypatch.setattr(cpu_generate.np, "max", lambda part: reads.append(part.nbytes))
    with ExitStack() as stack:
        opened = [cpu_generate.open_engine(stack, engine("x", []), "s", None, [1], 1, "x"),
                  cpu_generate.open_engine(stack, cpu_generate.memory_read, 8 << 20, None, [1], 2, "roofline")]
        rows = cpu_generate.run_rounds(opened, tokens=5, rounds=2)
    assert rows[1]["engine"] == cpu_generate.ROOFLINE and rows[1]["decode_tokens_per_s"] > 0
    # per step, each of 2 threads reads its half of 8 MiB; a round: 2 prefills (one untimed) and 4 decode steps
    assert reads == [4 << 20] * 2 * 6 * 2


def test_decode_products_time_each_kernel_with_and_without_prefetches():
    from benchmarks.decode_products import variants
    from compiler.target import cpu_target
    from schedules.avx512_bf16 import DOT

    found = variants(64, 4864)  # rows longer than a page: dot products in a bfloat16 build on every CPU with them
    dots = cpu_target(None, "auto").for_weights("bfloat16").bf16_products == "avx512bf16"
    assert ("bfloat16 build" in found) == dots  # the dot-product kernel where this CPU has it
    for precision in ("float32", "bfloat16") if dots else ("float32",):
        assert "llvm.prefetch" in found[f"{precision}, prefetch on"].script()
        assert "llvm.prefetch" not in found[f"{precision}, prefetch off"].script()
    if dots:
        assert DOT in found["bfloat16 build"].script()


def test_decode_products_of_float16_weights_time_the_widening_kernel_only():
    from benchmarks.decode_products import variants

    found = variants(64, 2048, dtype="float16")  # no dot-product form for float16: both builds widen the weights
    assert sorted(found) == ["float32 build", "float32, prefetch off", "float32, prefetch on"]
    assert all("(64, 2048), \"float16\"" in f.script() for f in found.values())


def test_decode_products_refuse_a_weight_dtype_without_a_16_bit_kernel(monkeypatch, capsys):
    from benchmarks import decode_products

    monkeypatch.setattr("sys.argv", ["decode_products", "--dtype", "float32", "--shapes", "64x128"])
    with pytest.raises(SystemExit) as exit_info:
        decode_products.main()
    assert exit_info.value.code == 2 and "--dtype: invalid choice: 'float32'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--shapes", "64x100"], ["--rows", "17", "--shapes", "64x128"],
                                  ["--shapes", "64by128"]])
def test_decode_products_refuse_a_shape_the_kernels_do_not_take(argv, monkeypatch, capsys):
    from benchmarks import decode_products

    monkeypatch.setattr("sys.argv", ["decode_products", *argv])
    with pytest.raises(SystemExit):
        decode_products.main()
    assert "(shapes are OUTxIN, comma-separated)" in capsys.readouterr().err


def test_artifact_comparison_ratios_pair_each_round_with_the_first_artifacts_same_round():
    """A ratio to the first artifact is taken within each round (the host's speed drifts between rounds), then the
    median over rounds: here the second engine is twice as fast in every round although the rounds differ 4x."""
    first = {"runs": [(100.0, 10.0), (400.0, 40.0), (200.0, 20.0)]}
    second = {"runs": [(200.0, 15.0), (800.0, 60.0), (400.0, 30.0)]}
    assert same_round_ratios([first, second]) == [(1.0, 1.0), (2.0, 1.5)]


def test_rounded_attention_model_is_transformers_attention_until_it_rounds(tmp_path, monkeypatch):
    """bf16_numerics' model of the AMX attention: with nothing rounded it gives transformers' eager logits (masks
    and GQA as transformers has them), with its operands rounded it moves them by bfloat16's error and no more."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from benchmarks import bf16_numerics
    from models.tiny import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "model", arch="qwen2", dtype="bfloat16", seed=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.tensor([list(range(3, 43))])
    with torch.no_grad():
        want = hf(ids).logits
        hf.set_attn_implementation(bf16_numerics._rounded_attention_name())
        rounded = hf(ids).logits
        monkeypatch.setattr(bf16_numerics, "_bf16", lambda x: x)
        exact = hf(ids).logits
    scale = float(want.abs().max())
    assert float((exact - want).abs().max()) < 1e-5 * scale
    assert 1e-4 * scale < float((rounded - want).abs().max()) < 2e-2 * scale


def test_decode_attention_times_the_kernel_a_decode_step_runs():
    from benchmarks.decode_attention import attention_kernel
    from schedules.cpu_decode_attention import PARTS

    assert re.findall(r"T\.parallel\((\d+)\)", attention_kernel(14, 2, 64, 100).script()) == [str(PARTS)]


@pytest.mark.parametrize("argv", [["--shapes", "14x3x64"], ["--shapes", "14x2"], ["--positions", "0"]])
def test_decode_attention_refuses_a_shape_or_length_it_cannot_build(argv, monkeypatch, capsys):
    from benchmarks import decode_attention

    monkeypatch.setattr("sys.argv", ["decode_attention", *argv])
    with pytest.raises(SystemExit) as exit_info:
        decode_attention.main()
    assert exit_info.value.code == 2 and "HEADSxKV_HEADSxHEAD_DIM" in capsys.readouterr().err
