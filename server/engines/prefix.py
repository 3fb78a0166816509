"""Prefix caching for the hf engine (vLLM's automatic prefix caching, in blocks of `BLOCK` tokens).

Prompts often share a long start: the chat template's system prompt, a task's instruction before each
input. The KV of a prompt's full blocks is kept after its prefill; a later prompt that starts with the
same blocks, under the same mix, reuses them and prefills only the rest. On a CPU prefill is
compute-bound, so every reused token is time saved for everyone's next token.

The cache is a trie per mix: a node is one block of token ids, its KV (every layer, one row) and its
children. Keys are the token ids themselves, not hashes, so two prompts never share KV by collision.
The mix is part of the key because a LoRA on any projection changes every later layer's keys and values;
it carries each skill's resident version, so a retrained skill never reuses its old version's KV.
Memory is bounded by `max_tokens`: the least recently used leaves leave first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from skillpool.lora.mix import Mix

BLOCK = 16  # tokens per cached block (vLLM's default block size)

Layers = list[tuple[Tensor, Tensor]]  # per layer: keys, values of shape (1, heads, tokens, head_dim)


@dataclass(eq=False)
class _Node:
    id: int
    mix: Mix
    siblings: dict[tuple[int, ...], _Node]  # the dict that holds it: its parent's children or its mix's roots
    tokens: tuple[int, ...]
    kv: Layers
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_blocks = max_tokens // BLOCK
        self._roots: dict[Mix, dict[tuple[int, ...], _Node]] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # every node, least recently used first
        self._ids = itertools.count()
        self.hit_tokens = 0  # prompt tokens whose prefill was skipped, since start

    @property
    def cached_tokens(self) -> int:
        return len(self._lru) * BLOCK

    def lookup(self, mix: Mix, prompt: Sequence[int]) -> tuple[int, Layers]:
        """The longest cached prefix of whole blocks, at most len(prompt) - 1 tokens (the last one must be
        computed for its logits): its length and its KV concatenated per layer (empty when none)."""
        path: list[_Node] = []
        children = self._roots.get(mix, {})
        for j in range((len(prompt) - 1) // BLOCK):
            node = children.get(tuple(prompt[j * BLOCK : (j + 1) * BLOCK]))
            if node is None:
                break
            path.append(node)
            children = node.children
        if not path:
            return 0, []
        for node in path:  # parents before children: a leaf stays more recent than its ancestors
            self._lru.move_to_end(node.id)
        self.hit_tokens += len(path) * BLOCK
        layers = [
            (torch.cat([n.kv[i][0] for n in path], dim=2), torch.cat([n.kv[i][1] for n in path], dim=2))
            for i in range(len(path[0].kv))
        ]
        return len(path) * BLOCK, layers

    def would_keep(self, prompt_len: int, cached: int) -> bool:
        """Whether a prompt of this length, `cached` tokens of it found here, has whole blocks to insert (a
        caller then extracts its KV; with the cache off or nothing new it need not)."""
        return self.max_blocks > 0 and prompt_len // BLOCK > cached // BLOCK

    def insert(self, mix: Mix, prompt: Sequence[int], kv: Layers) -> None:
        """Keep the KV of the prompt's whole blocks; `kv` holds (1, heads, >= len(prompt), head_dim) per layer,
        the prompt's positions first and without padding."""
        if self.max_blocks == 0:
            return
        parent: _Node | None = None
        children = self._roots.setdefault(mix, {})
        for j in range(len(prompt) // BLOCK):
            tokens = tuple(prompt[j * BLOCK : (j + 1) * BLOCK])
            node = children.get(tokens)
            if node is None:
                if len(self._lru) >= self.max_blocks:
                    if not self._evict(keep=parent):
                        return
                    if parent is None:  # the eviction may have dropped this mix's (then empty) roots
                        children = self._roots.setdefault(mix, children)
                s = slice(j * BLOCK, (j + 1) * BLOCK)
                block = [(k[:, :, s].clone(), v[:, :, s].clone()) for k, v in kv]
                node = _Node(next(self._ids), mix, children, tokens, block)
                children[tokens] = node
            self._lru[node.id] = node
            self._lru.move_to_end(node.id)
            parent, children = node, node.children

    def _evict(self, keep: _Node | None) -> bool:
        """Drop the least recently used leaf (never `keep`, the node about to get a child)."""
        for node in self._lru.values():
            if not node.children and node is not keep:
                del node.siblings[node.tokens], self._lru[node.id]
                if not node.siblings and self._roots.get(node.mix) is node.siblings:
                    del self._roots[node.mix]  # the mix has no block left
                return True
        return False
