"""`python -m runtime.chat MODEL_DIR`: an interactive terminal chat that streams the reply as it is generated.

Type a message and press Enter; `/reset` starts a new conversation; `/image PATH` (an image-text model)
attaches an image to your next message; EOF (Ctrl-D) or Ctrl-C at the prompt exits, Ctrl-C during a
reply stops that reply. Greedy by default; give --temperature (and optionally
--top-k, --top-p, --seed) to sample. When the conversation outgrows the model's context, the oldest
turns are dropped (and the chat says so).
"""

from __future__ import annotations

import argparse
import io
import sys
from typing import TYPE_CHECKING

from ir.errors import RudaError, UsageError, add_debug_flag, exit_cli, positive_int

if TYPE_CHECKING:
    from .images import PreprocessedImages

SAMPLING_OPTIONS = ("top_k", "top_p", "seed")


def _config(args):
    """The generation config the options ask for; sampling options without --temperature are an error."""
    from .sampling import GreedyGenerationConfig, SamplingConfig, SamplingGenerationConfig

    if args.temperature is None:
        given = [f"--{name.replace('_', '-')}" for name in SAMPLING_OPTIONS if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply when sampling; add --temperature T (greedy otherwise)")
        return GreedyGenerationConfig(args.max_new_tokens, repetition_penalty=args.repetition_penalty)
    sampling = SamplingConfig(args.temperature, args.top_k or 0, 1.0 if args.top_p is None else args.top_p, args.seed)
    return SamplingGenerationConfig(args.max_new_tokens, repetition_penalty=args.repetition_penalty, sampling=sampling)


def fit_conversation(pipeline, history: list[dict], message: str, max_new_tokens: int,
                     image_tokens=lambda prompt: 0) -> tuple[str, int, list[dict]]:
    """(prompt, new tokens, history kept): the conversation rendered with `message`, without as many of the oldest
    user/assistant turns as it takes to leave room for a reply within the context, and the reply's length capped
    by the room left (`image_tokens(prompt)`: the tokens its image placeholders add). A message too long on its own
    is an error."""
    limit = pipeline.model.max_context
    first = 1 if history and history[0]["role"] == "system" else 0
    kept = list(history)
    while True:
        prompt = pipeline.render_chat(kept + [{"role": "user", "content": message}], add_generation_prompt=True)
        tokens = len(pipeline.encode(prompt, add_special_tokens=False)) + image_tokens(prompt)
        if tokens + max_new_tokens <= limit or len(kept) <= first:
            break
        del kept[first:first + 2]  # the oldest user message and its reply
    if tokens >= limit:
        raise UsageError(f"this message needs {tokens} tokens with the chat template, more than the model's context "
                         f"of {limit}; send a shorter one (or /reset)")
    return prompt, min(max_new_tokens, limit - tokens), kept


class Attachments:
    """The images of a conversation, in order: each message holds one placeholder per image it came with."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.images: list[tuple[PreprocessedImages, int]] = []  # each image preprocessed once, its tokens
        self.pending = 0  # images attached to the next message
        vision = pipeline.model.vision if hasattr(pipeline, "stream_images") else None
        self.placeholder = pipeline.decode([vision.vision_start_token_id, vision.image_token_id,
                                            vision.vision_end_token_id]) if vision else None

    def attach(self, path: str) -> str:
        """Attach an image to the next message (checked now); what to tell the user."""
        if self.placeholder is None:
            return "[this model takes text only: /image needs a Qwen3.5 image-text model]"
        image = self.pipeline.image_processor.preprocess_files([path])
        tokens = image.patch_counts[0] // self.pipeline.model.vision.merge_unit
        self.images.append((image, tokens))
        self.pending += 1
        return f"(image {path} attached: {tokens} tokens; it goes with your next message)"

    def message(self, line: str) -> str:
        """The next user message's content: a placeholder per pending image, then the text."""
        content = (self.placeholder or "") * self.pending + line
        self.pending = 0
        return content

    def in_prompt(self, prompt: str) -> list[tuple[PreprocessedImages, int]]:
        """The images a rendered prompt holds: the newest ones (older turns are dropped first)."""
        count = prompt.count(self.placeholder) if self.placeholder else 0
        return self.images[len(self.images) - count:] if count else []

    def reset(self) -> None:
        """Forget every image."""
        self.images, self.pending = [], 0

    @staticmethod
    def joined(images: list[tuple[PreprocessedImages, int]]) -> PreprocessedImages:
        """A prompt's images (from in_prompt) as one batch (the image library is loaded only for image chats)."""
        from .images import PreprocessedImages

        return PreprocessedImages.concatenate([image for image, _ in images])


def chat(pipeline, config, system: str | None, read=input, write=sys.stdout.write) -> None:
    """Run the conversation loop until EOF or Ctrl-C at the prompt."""
    from dataclasses import replace

    from .sampling import SamplingGenerationConfig

    history = [{"role": "system", "content": system}] if system else []
    stream_text = pipeline.stream_text_sampled if isinstance(config, SamplingGenerationConfig) else pipeline.stream_text
    attachments = Attachments(pipeline)
    image_tokens = lambda prompt: sum(tokens - 1 for _, tokens in attachments.in_prompt(prompt))  # noqa: E731
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            write("[that line is not valid UTF-8 text; type it again]\n")
            continue
        if line.strip() == "/reset":
            history = history[:1] if system else []
            attachments.reset()
            write("(new conversation)\n")
            continue
        if line.split(maxsplit=1)[:1] == ["/image"]:
            try:
                write(attachments.attach(line.strip()[len("/image"):].strip()) + "\n")
            except RudaError as e:
                write(f"[{e}]\n")
            continue
        if not line.strip():
            continue
        message = attachments.message(line)
        try:
            prompt, new_tokens, kept = fit_conversation(pipeline, history, message, config.max_new_tokens, image_tokens)
        except RudaError as e:
            write(f"[{e}]\n")
            continue
        if len(kept) < len(history):
            write(f"(the conversation outgrew the context: its {(len(history) - len(kept)) // 2} oldest turn(s) are "
                  "dropped; /reset starts over)\n")
            history = kept
        config_now = replace(config, max_new_tokens=new_tokens)
        images = attachments.in_prompt(prompt)
        try:
            stream = pipeline.stream_images(pipeline.encode(prompt, add_special_tokens=False),
                                            Attachments.joined(images),
                                            config_now) if images else \
                stream_text(prompt, config_now, add_special_tokens=False)
            for delta in stream:
                write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            write("\n(reply stopped)\n")
            continue
        except RudaError as e:
            write(f"\n[{e}; /reset starts a new conversation]\n")
            continue
        write("\n")
        history += [{"role": "user", "content": message},
                    {"role": "assistant", "content": stream.result.generated_text}]


def main(argv: list[str]) -> int:
    """Run the chat CLI on `argv`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m runtime.chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("--artifact", help="artifact directory (default: where `compiler build MODEL_DIR` writes)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="run the llvm artifact on the CPU (default) or the cuda artifact on the GPU")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=256)
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    parser.add_argument("--top-k", type=int, help="sampling: keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, help="sampling: nucleus probability in (0, 1] (1: all)")
    parser.add_argument("--seed", type=int, help="sampling: seed of the draws (default: random)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.system is not None:
        try:
            args.system.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("--system is not valid UTF-8 text; pass UTF-8 text") from None
    config = _config(args)
    from .pipeline import load_pipeline  # after the arguments are checked: loads TVM

    pipeline = load_pipeline(args.model_dir, args.artifact, args.device)
    if args.system:
        try:
            fit_conversation(pipeline, [{"role": "system", "content": args.system}], "", 1)
        except UsageError:
            raise UsageError(f"--system is too long: with the chat template it leaves no room for a message in the "
                             f"model's context of {pipeline.model.max_context} tokens; shorten it") from None
    if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable input reaches chat() as lone surrogates, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    chat(pipeline, config, args.system)
    return 0


if __name__ == "__main__":
    exit_cli(main)
