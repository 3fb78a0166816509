"""The router: one decision per request, `[(skill, weight)]` + score + reason.

Modes (a server setting; every skill stores the tensors of all key-based modes, so switching is free):
  dtkr      grouped sub-keys trained per skill (SLM); slot score = mean over groups of chunk cosines,
            taken in a whitened query space (below)
  centroid  nearest k-means centroid of the skill's input embeddings (the baseline)
  sapt      a learned query projector over the base model's token embeddings (router.sapt)
For dtkr and centroid, all skills' keys live in one FAISS inner-product index over unit vectors. A
request takes the top-k slots over all skills; a temperature softmax over their scores, summed per
skill, gives the mix (JARe, router.mix_policy). If the best score is below the best skill's calibrated
threshold the request goes to the base model and counts as a fallback. SAPT's softmax has no "none of
these", so in sapt mode the same calibrated centroid-key test is the open-set gate and the SAPT
attention is the mix.

Whitening (dtkr, `whiten`, built with the indexes in router.index): MiniLM embeddings of different tasks
share a few dominant directions (template words, length), so raw cosines separate look-alike tasks badly
(amazon vs yelp, mnli vs cb). Every skill stores the covariance of its own input embeddings; the router
pools them (the within-skill covariance, shrunk towards a multiple of I) and maps queries and keys
through W = Σ^-½ before grouping. No skill ever sees another skill's data. The open-set gate is taken in
the same space: W changes as skills arrive, so each skill keeps a sample of its own input embeddings, the
fold each was held out of and the keys fitted without each fold; its threshold (a low percentile of the
sample's best whitened score against the keys that did not see it, minus a margin) is recomputed whenever
W is. Held-out scores are what the skill's new requests score, so each skill's threshold follows its own
spread (a tight skill such as sst-2 turns away yelp's longer reviews) with one small margin for all. Skills
stored without fold keys are calibrated in-sample with a wider margin. W is estimated from the skills' own
inputs, so only skills learned from enough inputs (`white_gate_min_inputs`) get the whitened gate; others
are gated on their held-out raw-score threshold.

Format gate (router.formats, every mode): input similarity cannot reject an unseen task whose inputs
look like a seen sibling's (yelp vs amazon), but the prompt's fixed text (instruction, label options,
field names) differs. The owners of a request's top slots are checked against their own format model
first; slots of skills whose format the request lacks are dropped, and if none is left the request
goes to the base model (reason `format_mismatch`). The similarity gate and the mix then use the
remaining slots.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .demand import FallbackClusters
from .embedder import Embedder, embed_checked
from .formats import accepts_each
from .index import KeyIndex, build_index, white_rows
from .mix_policy import sapt_decision, slot_weights, top_mix
from .modes import RouterMode, mode_for
from .needs import fields_accept_each, labels_accept_each, option_ids, request_grams
from .prepare import skill_tensors
from .sapt import SAPTState, TokenPooler
from .types import CENTROID, DTKR, MODES, Decision, Features, RouterSettings, _SkillKeys, whitening

__all__ = ["CENTROID", "DTKR", "MODES", "Decision", "Features", "Router", "RouterSettings", "whitening"]


@dataclass
class Router:
    embedder: Embedder
    settings: RouterSettings = field(default_factory=RouterSettings)
    pooler: TokenPooler | None = None  # the base model's token embeddings; sapt mode only

    def __post_init__(self) -> None:
        self.mode: RouterMode = mode_for(self.settings)  # chosen once; the rest asks it, not its name
        if self.mode.learns_projector and self.pooler is None:
            raise ValueError("router mode sapt needs the base model's token embeddings (a TokenPooler)")
        self._keys: KeyIndex  # swapped whole by _rebuild
        self._skills: dict[str, _SkillKeys] = {}
        self._dirty = False
        self._sapt_tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._sapt_attention: dict[str, dict[str, float]] = {}
        self._sapt: SAPTState | None = None
        self._lock = threading.RLock()
        self.demand = FallbackClusters(self.settings.demand)
        self._rebuild()

    # --- keys ---------------------------------------------------------------------------------
    def prepare_keys(
        self,
        texts: Sequence[str],
        inputs: Sequence[str] | None = None,
        answers: Sequence[str] | None = None,
        check_stop: Callable[[], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """A skill's router tensors from its training prompts: keys and thresholds for every mode.

        inputs: each prompt without its instruction (instruction rows: `input`; chat: the last user turn);
        answers: the training answers. With them the format gate asks for what the skill needs (input
        fields, label set, router.needs) instead of its instruction's words. check_stop: called between
        embedding chunks and fitting stages; it raises to stop (a trainer's cancel)."""
        emb = embed_checked(self.embedder, texts, check_stop)
        return self.prepare_keys_from_embeddings(emb, texts, inputs, answers, check_stop)

    def prepare_keys_from_embeddings(
        self,
        emb: np.ndarray,
        texts: Sequence[str] | None = None,
        inputs: Sequence[str] | None = None,
        answers: Sequence[str] | None = None,
        check_stop: Callable[[], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """As prepare_keys, from the prompts' embeddings; without the texts the skill gets no format model."""
        if inputs is not None and (texts is None or len(inputs) != len(texts) or len(texts) != len(emb)):
            raise ValueError("inputs need the texts, one input per text and per embedding")
        bare = [i for i, (t, x) in enumerate(zip(texts or [], inputs or [])) if x.strip() and x != t]
        if self.settings.augment_inputs and bare:
            assert inputs is not None
            emb = np.concatenate([emb, embed_checked(self.embedder, [inputs[i] for i in bare], check_stop)])
        return skill_tensors(emb, texts, inputs, answers, self.settings, check_stop)

    def prepare_sapt(
        self,
        name: str,
        train: Sequence[str],
        held: Sequence[str],
        replay: Mapping[str, Sequence[str]],
        check_stop: Callable[[], None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Learn skill `name` into a copy of the registered SAPT state: (its router tensors, its ā by block).

        train/held: the skill's inputs; replay: replay (or pseudo) inputs of earlier skills, by name.
        Nothing live changes until the skill is registered with add_skill.
        """
        assert self.pooler is not None
        pool = self.pooler
        pooled_replay = {n: pool(list(t)) for n, t in replay.items() if t}
        return self.sapt_state().learn(name, pool(train), pool(held), pooled_replay, check_stop).learned(name)

    def sapt_state(self) -> SAPTState:
        """The shared SAPT state of the registered skills (what the next skill learns on top of)."""
        if self.pooler is None:
            raise ValueError("no TokenPooler: the router was built without the base model's token embeddings")
        with self._lock:
            if self._sapt is None:
                self._sapt = SAPTState.from_skills(
                    self.pooler.dim, self.settings.sapt, list(self._sapt_tensors.items()), self._sapt_attention
                )
            return self._sapt

    def _rebuild(self) -> None:
        """New indexes from all skills (under the lock); a concurrent route keeps the old ones."""
        self._keys = build_index(self._skills, self.embedder.dim, self.mode)
        self._dirty = False

    def add_skill(
        self, name: str, tensors: dict[str, torch.Tensor], sapt_attention: dict[str, float] | None = None
    ) -> None:
        """Register (or replace) a skill's keys; `sapt_attention` is its stored mean attention ā (sapt)."""
        sk = self.mode.search_keys(tensors)
        with self._lock:
            if "sapt_key" in tensors:
                self._sapt_tensors.pop(name, None)
                self._sapt_tensors[name] = tensors
                self._sapt = None
            if sapt_attention is not None:
                self._sapt_attention[name] = sapt_attention
            self._skills[name] = sk
            self._dirty = True  # rebuilt on the next route: adding 1,000 skills costs one rebuild

    def remove_skill(self, name: str) -> None:
        with self._lock:
            if self._sapt_tensors.pop(name, None) is not None:
                self._sapt = None
            self._sapt_attention.pop(name, None)
            if self._skills.pop(name, None) is not None:
                self._dirty = True

    @property
    def skills(self) -> list[str]:
        return list(self._skills)

    def whitening_matrix(self) -> np.ndarray | None:
        """The W that dtkr maps queries and keys through now (None: not whitened, or no skills)."""
        with self._lock:
            if self._dirty:
                self._rebuild()
            return self._keys.white

    # --- routing ------------------------------------------------------------------------------
    def features(self, texts: Sequence[str]) -> Features:
        """Everything routing needs from a batch of texts, computed in one batch."""
        pooled = self.pooler(texts) if self.mode.learns_projector and self.pooler is not None else None
        grams = [request_grams(t) for t in texts] if self.settings.format.enabled else None
        options = [option_ids(t) for t in texts] if self.settings.format.enabled else None
        return Features(self.embedder.embed(texts), pooled, grams, options)

    def route(self, texts: Sequence[str], open_set: bool = True) -> list[Decision]:
        """One decision per text; all texts are embedded in one batch. open_set=False: see route_features."""
        if not texts:
            return []
        return self.route_features(self.features(texts), open_set)

    def route_traffic(self, texts: Sequence[str]) -> list[Decision]:
        """route() for live requests: the ones that fall back feed the demand clusters (self.demand)."""
        if not texts:
            return []
        if not self._skills:  # nothing to route to, and no_skills fallbacks do not feed demand: skip MiniLM
            return [Decision(route=[], reason="no_skills") for _ in texts]
        f = self.features(texts)
        ds = self.route_features(f)
        fell = [i for i, d in enumerate(ds) if not d.route and d.reason != "no_skills"]
        if fell:
            self.demand.add(f.emb[fell], [texts[i] for i in fell])
        return ds

    def nearest_skills(self, emb: np.ndarray, n: int = 3) -> list[list[tuple[str, float]]]:
        """The n skills whose keys are nearest to each embedding, with their best raw key score."""
        with self._lock:
            if self._dirty:
                self._rebuild()
            index, owners = self._keys.index, self._keys.owners
        if not owners or not len(emb):
            return [[] for _ in range(len(emb))]
        scores, ids = index.search(self.mode.query_vectors(np.ascontiguousarray(emb, dtype=np.float32)), len(owners))
        out = []
        for sc, ix in zip(scores, ids):
            best: dict[str, float] = {}
            for v, j in zip(sc, ix):
                if j >= 0 and owners[j] not in best:
                    best[owners[j]] = float(v)
                if len(best) >= n:
                    break
            out.append(list(best.items()))
        return out

    def route_embeddings(self, emb: np.ndarray, pooled: torch.Tensor | None = None) -> list[Decision]:
        """Route precomputed embeddings; without the texts there is no format gate."""
        return self.route_features(Features(emb, pooled))

    def route_features(self, f: Features, open_set: bool = True) -> list[Decision]:
        """open_set=False: the mix of the nearest skills with neither gate, never the base model. That asks
        which skills a text is most like (what kif starts a new task's block from: a new task's inputs are
        unseen by definition, and the gates send them to the base model), not which skill should serve it."""
        with self._lock:
            if self._dirty:
                self._rebuild()
            keys, skills = self._keys, dict(self._skills)
        index, mix_index, white, owners = keys.index, keys.mix_index, keys.white, keys.owners
        white_thr, label_index, known_fields = keys.white_thr, keys.labels, keys.known_fields
        n = len(f.emb)
        if not owners:
            return [Decision(route=[], reason="no_skills") for _ in range(n)]
        s = self.settings
        k = min(s.top_k, len(owners))
        sapt = self.mode.learns_projector
        if sapt and f.pooled is None:
            raise ValueError("router mode sapt routes on pooled token embeddings: use features()/route()")
        grams = f.grams if s.format.enabled and open_set else None
        depth = (
            min(len(owners), max(k, s.format.candidates)) if grams is not None else k
        )  # slots whose owners are checked
        emb = np.ascontiguousarray(f.emb, dtype=np.float32)
        # raw key scores: the gate, and also the mix unless whitened scores or SAPT attention make it
        raw_depth = depth if grams is not None or (mix_index is None and not sapt) else 1
        scores, ids = index.search(self.mode.query_vectors(emb), raw_depth)
        m_scores, m_ids = (
            mix_index.search(white_rows(emb, white, s.dtkr.groups), depth)
            if mix_index is not None and white is not None
            else (scores, ids)
        )
        state = self.sapt_state() if sapt else None
        attention = state.attention(f.pooled).numpy() if state is not None and f.pooled is not None else None

        def gate(
            i: int, mj: int, rj: int
        ) -> tuple[float, float]:  # (score, threshold) of request i's slots at these ranks
            owner = owners[m_ids[i][mj]]
            if owner in white_thr:  # gate in the whitened space, threshold re-derived with W
                return float(m_scores[i][mj]), white_thr[owner]
            return float(scores[i][rj]), skills[owners[ids[i][rj]]].threshold  # raw score, held-out threshold

        out = []
        for i in range(n):
            best, threshold = gate(i, 0, 0)
            keep = list(range(k))
            rejected: set[str] = set()
            if (
                grams is not None and best >= threshold
            ):  # resembles some skill: drop the slots of skills whose prompt text it lacks
                cands = list(dict.fromkeys(owners[sid] for sid in (*m_ids[i], *ids[i]) if sid >= 0))
                ok = accepts_each(grams[i], [skills[c].fmt for c in cands])
                opts = f.options[i] if f.options is not None else None
                ok &= labels_accept_each(grams[i], [skills[c].labels for c in cands], label_index, opts)
                ok &= fields_accept_each(grams[i], [skills[c].fields for c in cands], known_fields)
                rejected = {c for c, good in zip(cands, ok) if not good}
                keep = [j for j, sid in enumerate(m_ids[i]) if sid >= 0 and owners[sid] not in rejected]
                raw = [j for j, sid in enumerate(ids[i]) if sid >= 0 and owners[sid] not in rejected]
                if not keep or not raw:
                    out.append(Decision(route=[], reason="format_mismatch", score=best))
                    continue
                best, threshold = gate(i, keep[0], raw[0])
            if open_set and best < threshold:
                out.append(Decision(route=[], reason="below_threshold", score=best))
            elif state is not None and attention is not None:
                out.append(sapt_decision(state.names, attention[i], best, rejected, s))
            else:
                top = keep[:k]
                out.append(
                    Decision(
                        route=top_mix(slot_weights(m_scores[i][top], m_ids[i][top], owners, s.temperature), s),
                        reason="matched",
                        score=best,
                    )
                )
        return out
