"""Training rows in the wordings a user would plausibly send (TrainConfig.prompt_variants, on by default).

A skill trained on one instruction template copies wording from a paraphrased prompt instead of answering
with its label. `with_variants` shows a seeded share of the training rows in another wording, instead of as
uploaded or (`added`) as an extra row beside the uploaded one, so the block learns the task rather than the
template:

  input_only   the input alone, as one user turn
  system       the instruction as a system message, the input as the user turn
  joined       the instruction and the input in one user turn (a row uploaded with a system message)
  input_first  the input, then the instruction, in one user turn
  reworded     a rule-based rewording of the instruction: another stem, and for a label task the label set
               as spelled in the training answers, listed in another order and format

Only the prompt changes: the answer, `route_text` and `route_input` stay the uploaded row's, so the router's
keys, the replay samples and the quality gate see the rows as uploaded. Every variant comes from the row itself
and the training split's answers, never from test rows or the paraphrase sets.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Literal

from .config import MAX_VARIANT_COPIES
from .records import Example
from .scoring import is_classification

Kind = Literal["uploaded", "input_only", "system", "joined", "input_first", "reworded"]
KINDS: tuple[Kind, ...] = ("input_only", "system", "joined", "input_first", "reworded")
MAX_LABELS = 20

# "Option: a, b, c." / "Options: a or b" at the end of an instruction (the Long Sequence tasks' form)
_OPTION_LIST = re.compile(r"\s*(?:Choose one from the options?\.\s*)?Options?\s*:\s*[^\n]*$", re.IGNORECASE)
_STEMS = (
    "{s}",
    "Please {l}",
    "Task: {s}",
    "{s} Be brief.",
    "Here is a task for you. {s}",
    "Can you help with this? {s}",
    "Instructions: {s}",
    "{s} Thanks!",
)
_LABEL_LINES = (
    "Answer with one of: {L}.",
    "Reply with just the label ({L}).",
    "Options: {L}.",
    "Choose from {L} and answer with the label only.",
    "Possible answers: {L}.",
    "Respond with exactly one of these: {L}.",
)
_JOINERS = (", ", " / ", " or ", " | ", "; ")


def split_prompt(ex: Example) -> tuple[str, str] | None:
    """(instruction, input) of a row whose prompt separates them, else None (such a row stays as uploaded).

    An instruction row is one user turn "instruction\\ninput" with `route_input` the input (trainer/datasets.py);
    a chat row separates them when it is one system message and one user turn."""
    msgs = ex["messages"]
    if len(msgs) == 2 and [m["role"] for m in msgs] == ["system", "user"]:
        instruction, inp = msgs[0]["content"], msgs[1]["content"]
    elif len(msgs) == 1 and msgs[0]["role"] == "user":
        text, inp = msgs[0]["content"], str(ex.get("route_input", ""))
        if not inp or text == inp or not text.endswith("\n" + inp):
            return None
        instruction = text[: -len(inp) - 1]
    else:
        return None
    if not (instruction.strip() and inp.strip()):
        return None
    return instruction, inp


def label_set(answers: Sequence[str]) -> list[str]:
    """The distinct answers as spelled in the training rows when they look like a label task, else []."""
    labels = sorted({a.strip() for a in answers if a.strip()})
    if not (2 <= len(labels) <= MAX_LABELS and len(labels) < len(answers) and is_classification(labels)):
        return []
    return labels


def _respell(text: str, labels: Sequence[str], rng: random.Random) -> str:
    """The labels the stem mentions in another case ("POS" → "pos"), so the skill answers in its own spelling
    when the prompt spells them otherwise; the answer keeps the training spelling."""
    how = rng.choice((str.lower, str.title, str.upper))
    for label in sorted(labels, key=len, reverse=True):
        text = re.sub(rf"(?<!\w){re.escape(label)}(?!\w)", how(label), text)
    return text


def reword(instruction: str, labels: Sequence[str], rng: random.Random) -> str:
    """A rule-based rewording of `instruction` that keeps its task and, for a label task, its label set."""
    stem = instruction.strip()
    listed = _OPTION_LIST.search(stem)
    if labels and listed:  # the instruction's own option list is replaced by the training labels' list
        stem = stem[: listed.start()].rstrip()
    if labels and rng.random() < 0.5:
        stem = _respell(stem, labels, rng)
    template = rng.choice(_STEMS if labels else _STEMS[1:])  # without a label line "{s}" would change nothing
    stem = template.format(s=stem, l=stem[:1].lower() + stem[1:])
    if not labels:
        return stem
    shown = list(labels)
    rng.shuffle(shown)
    line = rng.choice(_LABEL_LINES).format(L=rng.choice(_JOINERS).join(shown))
    return f"{line}\n{stem}" if rng.random() < 0.3 else f"{stem}\n{line}"


def variant(ex: Example, kind: Kind, labels: Sequence[str], rng: random.Random) -> Example:
    """`ex` with its prompt in the wording `kind` (the row itself when its prompt does not separate the parts)."""
    parts = split_prompt(ex)
    if kind == "uploaded" or parts is None:
        return ex
    instruction, inp = parts
    if kind == "input_only":
        msgs = [{"role": "user", "content": inp}]
    elif kind == "system":
        msgs = [{"role": "system", "content": instruction}, {"role": "user", "content": inp}]
    elif kind == "joined":
        msgs = [{"role": "user", "content": f"{instruction}\n{inp}"}]
    elif kind == "input_first":
        msgs = [{"role": "user", "content": f"{inp}\n{instruction}"}]
    else:
        msgs = [{"role": "user", "content": f"{reword(instruction, labels, rng)}\n{inp}"}]
    out = dict(ex)
    out["messages"] = msgs
    return out  # type: ignore[return-value]  # the same keys as `ex`, only the prompt replaced


def _worded(ex: Example, kind: Kind, labels: Sequence[str], rng: random.Random) -> Example:
    """`variant`, reworded instead where `kind` gives the uploaded prompt back (`system` for a row uploaded so)."""
    picked = variant(ex, kind, labels, rng)
    return variant(ex, "reworded", labels, rng) if picked["messages"] == ex["messages"] else picked


def with_variants(
    train: list[Example], fraction: float, seed: int, added: bool = False, copies: int = 1
) -> list[Example]:
    """`train` with round(fraction × the rows that separate instruction and input) of them in another wording.

    Replacing (the default): same rows, same order, same answers, so the number of steps is unchanged. `added`:
    every uploaded row stays and each chosen row's variant follows it as one more row (the loop shuffles), so
    the uploaded wording loses no training and the steps grow by that share. `copies` > 1 (with `added` only):
    each chosen row is followed by that many variants of different kinds, the first drawn as with one copy.
    fraction 0 returns `train` itself. Deterministic given `seed`."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"prompt_variants must be in [0, 1], got {fraction!r}")
    if not 1 <= copies <= MAX_VARIANT_COPIES or (copies > 1 and not added):
        raise ValueError(f"prompt_variant_copies must be in [1, {MAX_VARIANT_COPIES}] and > 1 only when added")
    if fraction == 0 or not train:
        return train
    rng = random.Random(f"prompt_variants:{seed}")  # a str seed hashes the same in every process
    labels = label_set([e["answer"] for e in train])
    eligible = [i for i, e in enumerate(train) if split_prompt(e) is not None]
    chosen = set(rng.sample(eligible, round(fraction * len(eligible))))
    out: list[Example] = []
    for i, ex in enumerate(train):
        if added or i not in chosen:
            out.append(ex)
        if i not in chosen:
            continue
        first = rng.choice(KINDS)
        out.append(_worded(ex, first, labels, rng))
        # drawn after the first variant, so the first is what one copy gives
        for kind in rng.sample([k for k in KINDS if k != first], copies - 1):  # k=0 draws nothing
            out.append(_worded(ex, kind, labels, rng))
    return out
