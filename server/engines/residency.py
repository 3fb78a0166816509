"""Which version of each skill serves new requests, and whose weights are resident in the engine.

A skill's weights are kept under a version key (name#n): a request admitted before the skill was
replaced keeps the weights it started with, while new requests get the new version. Only `max_loaded`
versions are resident; the others are read from the store again on their next use. Idle versions leave in
segmented-LRU order (slru.py): those used once since they came in before those used again. A retired version
(replaced or removed) leaves as soon as no running row uses it. With `host` (host_adapters.py) a version is read
off the loop: `prefetch` starts the read when a request is submitted, and `ensure` uploads it once it is on the
host, the request waiting meanwhile; without one, `ensure` reads it in place.
"""

from __future__ import annotations

from collections.abc import Iterable

from skillpool.lora.bank import LoRABank

from .host_adapters import HostAdapters
from .protocol import AdapterLoader, Mix
from .slru import SegmentedLRU


class SkillResidency:
    def __init__(self, bank: LoRABank, max_loaded: int | None, host: HostAdapters | None = None) -> None:
        self.bank, self.max_loaded, self.host = bank, max_loaded, host
        self._current: dict[str, str] = {}  # skill name -> its version key
        self._loaders: dict[str, AdapterLoader] = {}  # live version key -> reads the weights
        self._generation = 0
        self._order: SegmentedLRU[str] = SegmentedLRU(max_loaded)  # resident version keys, the next to leave first
        self.loads = 0  # adapters read into the bank so far: first uses and reloads after an eviction
        self.hits = 0  # adapters an admitted request needed and found resident

    @property
    def known(self) -> int:
        return len(self._current)

    def add(self, name: str, load: AdapterLoader, in_use: set[str]) -> None:
        self._generation += 1
        old, self._current[name] = self._current.get(name), f"{name}#{self._generation}"
        self._loaders[self._current[name]] = load
        self._retire(old, in_use)

    def remove(self, name: str, in_use: set[str]) -> None:
        self._retire(self._current.pop(name, None), in_use)

    def resolve(self, mix: Mix) -> Mix:
        """The mix with each skill's current version key; KeyError for a skill this engine does not serve."""
        return mix.renamed(self._key)

    def _key(self, name: str) -> str:
        key = self._current.get(name)
        if key is None:
            raise KeyError(f"skill {name!r} is not served by this engine (retired or never added)")
        return key

    def prefetch(self, mix: Mix) -> None:
        """Start reading the mix's versions that are not resident (on the host's reading thread); thread-safe:
        called by whoever submits a request. Skills this engine does not serve are left to admission's error."""
        if self.host is None:
            return
        for name, _ in mix:
            key = self._current.get(name)
            if key is None or key in self.bank:
                continue
            load = self._loaders.get(key)
            if load is not None:
                self.host.fetch(key, load, ahead=True)

    def ensure(self, keys: Iterable[str], keep: set[str]) -> bool:
        """Make these versions resident, evicting idle ones not in `keep` in segmented-LRU order. False: the
        request waits, because no slot can be freed now (every resident version is in use) or a version is still
        being read. A version is read before anything is evicted for it: a read that fails (the adapter store is
        down) raises and leaves every resident version in place."""
        keys, hits = list(keys), []
        if self.max_loaded is not None and len(keys) > self.max_loaded:
            raise ValueError(f"the mix needs {len(keys)} skills, more than max_loaded_skills ({self.max_loaded})")
        if self.host is not None:  # every missing version's read starts now, even if the first one must wait
            for key in keys:
                if key not in self.bank:
                    self.host.fetch(key, self._loaders[key])
        for key in keys:
            if key in self.bank:
                hits.append(key)
                continue
            victims = [n for n in self._order if n not in keep] if self.max_loaded is not None else []
            if self.max_loaded is not None and len(self.bank) - len(victims) >= self.max_loaded:
                return False
            if self.host is None:
                adapter = self._loaders[key]()
            elif (ready := self.host.take(key)) is None:
                return False
            else:
                adapter = ready
            while self.max_loaded is not None and len(self.bank) >= self.max_loaded:
                self._evict(victims.pop(0))
            self.bank.add(key, adapter)
            self._order.touch(key)
            self.loads += 1
        for key in hits:  # a use counts once the request is admitted: a waiting one calls again
            self._order.touch(key)
        self.hits += len(hits)
        return True

    def sweep(self, in_use: set[str]) -> None:
        """Drop retired versions that no row uses any more."""
        for key in [k for k in self._order if k not in self._loaders and k not in in_use]:
            self._evict(key)

    def _retire(self, key: str | None, in_use: set[str]) -> None:
        if key is None:
            return
        self._loaders.pop(key, None)
        if self.host is not None:
            self.host.drop(key)
        if key in self.bank and key not in in_use:
            self._evict(key)

    def _evict(self, key: str) -> None:
        self.bank.remove(key)
        self._order.discard(key)
