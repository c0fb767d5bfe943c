"""What a teacher is asked: the prompts (with their reference answers) and how to sample.

Kept apart from the backends (`teacher` for transformers, `ollama` for the HTTP API) so that
each backend can use them without importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from smolforge.errors import SmolforgeError


@dataclass
class GenSettings:
    """Teacher sampling settings; temperature 0 means greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    samples_per_prompt: int = 1
    top_k: int = 32  # logits kept per response token
    batch_size: int = 8
    seed: int = 0
    # "generate": the teacher writes the responses (and scores its own tokens).
    # "reference": the teacher scores the dataset's reference answers, teacher-forced (word-level KD
    # on ground truth): the student gets correct tokens *and* the teacher's soft distribution.
    responses: str = "generate"

    def check(self) -> None:
        if self.responses not in ("generate", "reference"):
            raise SmolforgeError(f"unknown teacher responses {self.responses!r}",
                                 fix="use generate (the teacher answers) or reference (it scores the dataset's answers)",
                                 field=("responses",))
        if self.responses == "reference" and self.samples_per_prompt > 1:
            raise SmolforgeError("samples_per_prompt > 1 with reference responses gives identical samples",
                                 fix="use samples_per_prompt 1, or --teacher-responses generate",
                                 field=("samples_per_prompt",))
        if self.samples_per_prompt > 1 and self.temperature <= 0:
            raise SmolforgeError("samples_per_prompt > 1 with greedy decoding gives identical samples",
                                 fix="set a temperature > 0 (e.g. 0.8) or samples_per_prompt 1",
                                 field=("samples_per_prompt",))
        if not 0 < self.top_p <= 1:
            raise SmolforgeError(f"top_p must be in (0, 1], got {self.top_p}", fix="use e.g. top_p 0.95", field=("top_p",))
        low = [key for key in ("top_k", "max_new_tokens", "batch_size") if getattr(self, key) < 1]
        if low:
            raise SmolforgeError("top_k, max_new_tokens and batch_size must be ≥ 1", fix="check the teacher settings",
                                 fields=tuple((key,) for key in low))


@dataclass
class PromptItem:
    """A prompt to answer: its index in the dataset, the chat turns, and the reference answer if any."""

    example_id: int
    prompt_messages: list[dict[str, str]]
    answer: str | None = None
