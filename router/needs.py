"""What a skill needs from a request, not how its uploader phrased the instruction.

The format gate (router.formats) fitted on whole training prompts requires the instruction's own words,
so a request that asks for the same task in other words ("Classify this news article: World, Sports, …")
falls back every time. A paraphrase keeps two things a skill really depends on:
  - the input's fixed fields ("Title:", "sentence 1:", the trailing "Answer:"), which the user pastes as
    they are: the format model is fitted on the skill's inputs without the instruction;
  - the label set, when the skill is a classifier (answers from a short list): a request that names
    some of the skill's labels but not all of them asks for another label set (rte's "entailment,
    contradiction" sent to mnli's three-way skill). A skill's own inputs name labels by chance too
    ("a bad film"), so the share of labels that may be named without all of them is calibrated on
    those inputs; a request naming every label, or no more than inputs do by chance, passes.
Both models are stored per skill as hashed grams; skills stored before (whole-prompt format model, no
label model) load and are gated as they were.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from .formats import gram_ids

_FIELD = re.compile(r"^[ \t]*([A-Za-z][A-Za-z0-9 _-]{0,30}?)[ \t]*:", re.M)


def field_ids(text: str) -> np.ndarray:
    """Sorted unique hashes of the text's line-initial field names ("Title:", "sentence 1:"), salted so they
    never equal a word gram: they can join a request's gram set, where extra ids cost a format model nothing."""
    names = {m.lower().strip() for m in _FIELD.findall(text)}
    if not names:
        return np.zeros(0, dtype=np.int64)
    raw = b"".join(hashlib.blake2b(f"\x00field {n}".encode(), digest_size=8).digest() for n in names)
    return np.unique(np.frombuffer(raw, dtype="<i8"))


def request_grams(text: str) -> np.ndarray:
    """What the gates look at in a request: its word grams and its field names."""
    return np.union1d(gram_ids(text), field_ids(text))


@dataclass(frozen=True)
class FieldModel:
    """The input fields a skill has seen. A request that fills in a field typical of some other skill
    (sst-2's "Text:" sent to imdb, whose inputs have no field) asks for that skill's input, not this one's."""

    seen: np.ndarray  # field ids in at least `seen_df` of the skill's inputs
    typical: np.ndarray  # field ids in at least half of them (what marks a request as another skill's)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"fields_seen": torch.from_numpy(self.seen), "fields_typical": torch.from_numpy(self.typical)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> FieldModel | None:
        if "fields_seen" not in tensors:
            return None
        return cls(tensors["fields_seen"].numpy().astype(np.int64), tensors["fields_typical"].numpy().astype(np.int64))


def fit_fields(inputs: Sequence[str], seen_df: float = 0.01) -> FieldModel:
    sets = [field_ids(t) for t in inputs]
    ids, counts = np.unique(np.concatenate(sets) if sets else np.zeros(0, np.int64), return_counts=True)
    n = max(1, len(sets))
    return FieldModel(ids[counts >= max(1, seen_df * n)], ids[counts >= 0.5 * n])


def fields_accept_each(request: np.ndarray, models: Sequence[FieldModel | None], known: np.ndarray) -> np.ndarray:
    """known: every registered skill's typical fields. A skill (None: stored without, passes) is turned
    down when the request carries a known field its own inputs never had."""
    foreign = np.intersect1d(request, known, assume_unique=True)
    return np.array([m is None or not len(np.setdiff1d(foreign, m.seen)) for m in models], dtype=bool)


@dataclass(frozen=True)
class LabelSettings:
    enabled: bool = True
    max_labels: int = 50  # more distinct answers than this: a generation skill, no label set
    min_share: float = 0.9  # the labels (answers seen at least twice) must cover this share of the answers
    percentile: float = 99.0  # of the skill's own inputs' chance label coverage
    min_foreign: int = 3  # a request naming another skill's whole label set of at least this many labels (0: off)

    def __post_init__(self) -> None:
        if self.max_labels < 2 or not 0 < self.min_share <= 1 or not 0 <= self.percentile <= 100:
            raise ValueError("labels: max_labels >= 2, min_share in (0, 1], percentile in [0, 100]")


def _label_grams(label: str) -> np.ndarray:
    return gram_ids(label)


def _stem(word: str) -> str:
    return re.sub(r"[^0-9a-z]", "", word.lower())[:3]


def _stem_id(stem: str) -> int:
    # salted so a stem id never equals a word gram or a field id
    return int(np.frombuffer(hashlib.blake2b(f"\x00stem {stem}".encode(), digest_size=8).digest(), dtype="<i8")[0])


def stem_ids(words: Sequence[str]) -> np.ndarray:
    """Sorted unique ids of the words' first three letters or digits: "POS", "Positive" and "positive" share one.
    Two label sets with the same stems are one output space spelled two ways (SuperNI's POS/NEG
    against positive/negative); a user who writes the other spelling asks the same task."""
    stems = {_stem(w) for w in words} - {""}
    return np.unique(np.array([_stem_id(t) for t in stems], dtype=np.int64))


@dataclass(frozen=True)
class LabelModel:
    grams: np.ndarray  # (m,) int64: every label's gram ids, concatenated
    offsets: np.ndarray  # (L + 1,) int64: label i owns grams[offsets[i]:offsets[i + 1]]
    max_partial: float  # the most of the labels a request may name without naming all
    stems: np.ndarray | None = None  # (L,) int64: each label's stem id (None: stored before stems)

    def coverage(self, request: np.ndarray) -> float:
        """Share of the labels whose every gram the request (sorted gram ids) contains."""
        n = len(self.offsets) - 1
        if n <= 0 or not len(request):
            return 0.0
        present = request[np.minimum(np.searchsorted(request, self.grams), len(request) - 1)] == self.grams
        lengths = np.diff(self.offsets)
        named = np.add.reduceat(present.astype(np.int64), self.offsets[:-1]) == lengths
        return float(named.mean())

    def respelled_in(self, ids: np.ndarray) -> bool:
        """Do `ids` (sorted; stem ids among them) hold every label's stem: the labels in another spelling?"""
        if self.stem_key is None or not len(ids):
            return False
        assert self.stems is not None  # stem_key is None without them
        return bool(np.isin(self.stems, ids).all())

    @cached_property
    def stem_key(self) -> bytes | None:
        """The label set up to spelling: equal for POS, NEG and positive, negative. Computed once: the label
        check asks it for every candidate skill of every request."""
        if self.stems is None or len(np.unique(self.stems)) != len(self.stems):  # they must tell the labels apart
            return None
        return np.sort(self.stems).tobytes()

    def accepts(self, request: np.ndarray, options: np.ndarray | None = None) -> bool:
        """options: gram (and stem) ids of the option list the request spells out ("Options: a, b, c"), if any;
        a list that names neither all of the skill's labels nor all of their stems asks for another output space."""
        if options is not None and len(options) and self.coverage(options) < 1.0 and not self.respelled_in(options):
            return False
        c = self.coverage(request)
        return c >= 1.0 or c <= self.max_partial + 1e-6

    def label_keys(self) -> frozenset[bytes]:
        """The label set as comparable keys (each label's gram ids)."""
        return frozenset(self.grams[a:b].tobytes() for a, b in itertools.pairwise(self.offsets))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "label_grams": torch.from_numpy(self.grams.astype(np.int64)),
            "label_offsets": torch.from_numpy(self.offsets.astype(np.int64)),
            "label_max_partial": torch.tensor([self.max_partial], dtype=torch.float32),
        }
        if self.stems is not None:
            out["label_stems"] = torch.from_numpy(self.stems.astype(np.int64))
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> LabelModel | None:
        """None for a skill stored without a label model (no label check)."""
        if "label_grams" not in tensors:
            return None
        stems = tensors.get("label_stems")
        return cls(
            tensors["label_grams"].numpy().astype(np.int64),
            tensors["label_offsets"].numpy().astype(np.int64),
            float(tensors["label_max_partial"][0]),
            None if stems is None else stems.numpy().astype(np.int64),
        )


# an explicit option list: a label-list word followed by a colon ("Option: a, b.", "one of these categories: …")
_OPTIONS = re.compile(
    r"\b(?:options?|labels?|categories|choices|answers|one of(?: these| the following)?(?: \w+)?)\s*(?:are)?\s*:([^\n]*)",
    re.I,
)


def option_ids(text: str) -> np.ndarray:
    """Gram ids and word stem ids of the option lists a request spells out (empty: none)."""
    found = " ; ".join(_OPTIONS.findall(text))
    if not found:
        return np.zeros(0, dtype=np.int64)
    return np.union1d(gram_ids(found), stem_ids(re.findall(r"\w+", found)))


def label_set(answers: Sequence[str], s: LabelSettings) -> list[str]:
    """The skill's labels: its answers if they come from a short list, else none (a generation skill)."""
    counts = Counter(a.strip() for a in answers if a.strip())
    labels = [a for a, c in counts.most_common() if c >= 2 and len(gram_ids(a))]
    if len(labels) < 2 or len(labels) > s.max_labels:
        return []
    if sum(counts[a] for a in labels) < s.min_share * sum(counts.values()):
        return []
    return labels


def fit_labels(answers: Sequence[str], inputs: Sequence[str], s: LabelSettings) -> LabelModel | None:
    """The label model, its partial-naming allowance calibrated on the skill's inputs without instruction."""
    labels = label_set(answers, s) if s.enabled else []
    if not labels:
        return None
    parts = [_label_grams(lab) for lab in labels]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    model = LabelModel(np.concatenate(parts), offsets, 0.0)
    chance = [model.coverage(gram_ids(t)) for t in inputs] or [0.0]
    partial = [c for c in chance if c < 1.0] or [0.0]
    stems = np.array([_stem_id(_stem(lab)) for lab in labels], dtype=np.int64)
    return LabelModel(model.grams, offsets, float(np.percentile(partial, s.percentile)), stems)


class LabelIndex:
    """Every registered skill's label set of at least `min_labels` labels, searchable at once: which of them
    does a request name in full? A request that names another skill's whole option list ("very negative,
    negative, neutral, positive, very positive") asks for that output space, so a skill whose own labels it
    does not name in full (sst-2's Good, Bad) is not what it asks for. Two-label sets (True, False; Good,
    Bad) are left out unless their owner's inputs never name one by chance: reviews say "good" and "bad"."""

    def __init__(self, models: dict[str, LabelModel], min_labels: int = 3) -> None:
        # also smaller sets whose labels the owner's own inputs never name by chance (entailment, contradiction)
        kept = [(n, m) for n, m in models.items() if len(m.offsets) - 1 >= min_labels or m.max_partial <= 0]
        self._names = [n for n, _ in kept]
        self._grams = np.concatenate([m.grams for _, m in kept]) if kept else np.zeros(0, np.int64)
        lengths = np.concatenate([np.diff(m.offsets) for _, m in kept]) if kept else np.zeros(0, np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if kept else lengths
        self._lengths = lengths
        self._owner = (
            np.concatenate([np.full(len(m.offsets) - 1, i) for i, (_, m) in enumerate(kept)]) if kept else lengths
        )
        self._keys = [(m.label_keys(), m.stem_key) for _, m in kept]

    def named_in_full(self, request: np.ndarray) -> list[tuple[frozenset[bytes], bytes | None]]:
        """The label sets (label_keys, stem_key) of the indexed skills whose every label the request names."""
        if not len(self._names) or not len(request):
            return []
        present = request[np.minimum(np.searchsorted(request, self._grams), len(request) - 1)] == self._grams
        named = np.add.reduceat(present.astype(np.int64), self._starts) == self._lengths
        missing = np.bincount(self._owner[~named], minlength=len(self._names))
        return [self._keys[i] for i in np.flatnonzero(missing == 0)]


def labels_accept_each(
    request: np.ndarray,
    models: Sequence[LabelModel | None],
    index: LabelIndex | None = None,
    options: np.ndarray | None = None,
) -> np.ndarray:
    """Does one request pass each skill's label check (None: no label model, passes)? With an index, a
    request that names some skill's whole label set must also name the checked skill's whole set, and a
    skill whose set is a strict subset of a named one (rte's two of mnli's three) is not asked for; with
    `options` (option_ids of the request), a spelled-out option list must name all of the skill's labels.
    A named set that is the skill's own in another spelling (same stems: positive, negative for POS, NEG) asks
    for the same output space, so it turns nobody away."""
    named = index.named_in_full(request) if index is not None else []

    def ok(m: LabelModel) -> bool:
        stem = m.stem_key
        others = [keys for keys, other_stem in named if stem is None or other_stem != stem]
        if not m.accepts(request, options) or (others and m.coverage(request) < 1.0):
            return False
        own = m.label_keys()  # a set the request names in full that strictly contains this skill's: a wider task
        return not any(own < other for other in others)

    return np.array(
        [m is None or ok(m) for m in models],
        dtype=bool,
    )
