"""Passkey retrieval (Mohtashami & Jaggi, 2023): a number hidden at some depth of long filler text,
asked for at the end.

A prompt is ``intro + filler * n_before + needle + filler * n_after + question`` followed by the key's
digits. Scoring is teacher-forced: one forward pass over prompt + answer, and the key counts as
retrieved when the argmax at every answer position is the right token. That is exactly when greedy
decoding would print the key, without running ``generate``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
QUESTION = "What is the pass key? The pass key is"


def needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key.\n"


@dataclass
class PasskeySample:
    input_ids: list[int]  # prompt followed by the answer tokens
    answer_len: int  # the last answer_len tokens are the key
    depth: float
    key: str


class PasskeyBuilder:
    """Builds passkey prompts of at most ``length`` tokens for a tokenizer."""

    def __init__(self, tokenizer, length: int, digits: int = 5) -> None:
        if digits < 1:
            raise ValueError(f"digits must be at least 1, got {digits}")
        self.tokenizer, self.length, self.digits = tokenizer, length, digits

        def ids(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        self._ids = ids
        self.intro, self.filler = ids(INTRO), ids(FILLER)
        self.question = ids(QUESTION)
        fixed = len(self.intro) + len(ids(needle("0" * digits))) + len(self.question) + len(self._answer("0" * digits))
        self.fillers = (length - fixed) // len(self.filler)
        if self.fillers < 1:
            raise ValueError(f"passkey prompts need more than {fixed + len(self.filler)} tokens; got length={length}")

    def _answer(self, key: str) -> list[int]:
        """The key's tokens as they follow the question (checked to tokenize apart from it)."""
        joint = self._ids(QUESTION + " " + key)
        if joint[: len(self.question)] != self.question:
            raise ValueError("this tokenizer merges the passkey answer with the question; cannot score it")
        return joint[len(self.question) :]

    def sample(self, depth: float, key: str) -> PasskeySample:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        before = round(depth * self.fillers)
        answer = self._answer(key)
        ids = (
            self.intro
            + self.filler * before
            + self._ids(needle(key))
            + self.filler * (self.fillers - before)
            + self.question
            + answer
        )
        return PasskeySample(ids, len(answer), depth, key)

    def random_key(self, rng: random.Random) -> str:
        return str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))


@torch.no_grad()
def passkey_accuracy(
    model, builder: PasskeyBuilder, depths, trials: int, seed: int = 0, batch_size: int = 1, progress: bool = False,
    desc: str = "passkey",
) -> dict:
    """Retrieval accuracy per depth (fraction of keys whose every token is the argmax) and per-token
    accuracy, teacher-forced. The model's train/eval mode is left to the caller. ``progress`` shows a
    progress bar over the prompts."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    bar = tqdm(total=len(depths) * trials, desc=desc, disable=not progress)
    device = next(model.parameters()).device
    per_depth, token_hits, token_total = {}, 0, 0
    for depth in depths:
        samples = [builder.sample(depth, builder.random_key(rng)) for _ in range(trials)]
        hits = 0
        for i in range(0, len(samples), batch_size):
            chunk = samples[i : i + batch_size]
            lengths = {len(s.input_ids) for s in chunk}
            if len(lengths) != 1:
                raise RuntimeError("passkey samples of one depth must have one length")
            ids = torch.tensor([s.input_ids for s in chunk], device=device)
            n = chunk[0].answer_len
            # logits at positions -n-1 .. -2 predict the n answer tokens
            logits = model(input_ids=ids[:, :-1], logits_to_keep=n).logits
            correct = logits.argmax(-1) == ids[:, -n:]
            hits += int(correct.all(-1).sum())
            token_hits += int(correct.sum())
            token_total += correct.numel()
            bar.update(len(chunk))
        per_depth[depth] = hits / len(samples)
    bar.close()
    return {
        "per_depth": per_depth,
        "accuracy": sum(per_depth.values()) / len(per_depth),
        "token_accuracy": token_hits / max(1, token_total),
    }
