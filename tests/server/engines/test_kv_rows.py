"""The decode batch's KV rows leave and join in place: a leaver's place goes to the last row, a joiner is written
into spare rows right-aligned with zeros before it, and every row keeps exactly its own keys and values."""

from __future__ import annotations

import torch

from skillpool.server.engines.kv import ROOM, GrowingLayer, KVBatch, growing_cache

LAYERS = 2


def rows_kv(lengths: list[int], seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per row, per layer (1, 2 heads, length, 4): distinct values, so a row that moved is recognised."""
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)) for _ in range(LAYERS)]
        for n in lengths
    ]


def own(kv: KVBatch, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return kv.row(i)


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_a_leaver_is_replaced_by_the_last_row_without_copying_the_cache() -> None:
    rows = rows_kv([5, 8, 3, 6], seed=0)
    kv = KVBatch.stack(rows, spare=4)
    buffer = kv.cache.layers[0]._k  # type: ignore[attr-defined]
    kv2, order = kv.remove([2])
    assert order == [0, 1, 3] and kv2 is kv and kv.cache.layers[0]._k is buffer  # type: ignore[attr-defined]
    assert kv.mask.shape == (3, 8)
    for new, old in enumerate(order):
        assert same(own(kv, new), rows[old])
    kv3, order = kv.remove([1])  # the longest leaves: 2 columns unused, no more than ROOM: kept
    assert order == [0, 2] and kv3 is kv and kv3.mask.shape == (2, 8)
    assert same(own(kv3, 0), rows[0]) and same(own(kv3, 1), rows[3])
    rows = rows_kv([ROOM + 10, 4 * ROOM, 3], seed=8)
    kv, order = KVBatch.stack(rows, spare=4).remove([1])  # 3 * ROOM - 10 columns unused, more than ROOM: trimmed
    assert order == [0, 2] and kv.mask.shape == (2, ROOM + 10)
    assert same(own(kv, 0), rows[0]) and same(own(kv, 1), rows[2])


def test_a_joiner_fills_spare_rows_right_aligned_after_zeros() -> None:
    rows = rows_kv([6, 4, 5], seed=1)
    kv = KVBatch.stack(rows, spare=4)
    kv, _ = kv.remove([2])
    buffer = kv.cache.layers[0]._k  # type: ignore[attr-defined]
    newcomer = rows_kv([3], seed=2)
    kv = kv.merge(KVBatch.stack(newcomer, spare=4))
    assert kv.cache.layers[0]._k is buffer  # type: ignore[attr-defined]  # written into the leaver's row
    assert same(own(kv, 2), newcomer[0]) and same(own(kv, 0), rows[0]) and same(own(kv, 1), rows[1])
    assert kv.mask[2].tolist() == [0, 0, 0, 1, 1, 1]
    layer = kv.cache.layers[1]
    assert isinstance(layer, GrowingLayer) and torch.count_nonzero(layer.keys[2, :, :3]) == 0  # padding: zeros
    more = rows_kv([2, 4], seed=3)
    kv = kv.merge(KVBatch.stack(more, spare=4))  # no spare row left: the buffer grows
    assert kv.mask.shape == (5, 6) and same(own(kv, 3), more[0]) and same(own(kv, 4), more[1])
    assert same(own(kv, 2), newcomer[0])


def test_a_wider_joiner_widens_the_batch_with_room_for_the_next_one() -> None:
    rows = rows_kv([3, 2], seed=4)
    kv = KVBatch.stack(rows, spare=4)
    wide = rows_kv([5], seed=5)
    kv = kv.merge(KVBatch.stack(wide, spare=4))  # a copy, ROOM columns wider than the joiner
    assert kv.mask.shape == (3, 5 + ROOM) and kv.mask[:, :ROOM].count_nonzero() == 0
    assert kv.mask[:, ROOM:].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]
    buffer = kv.cache.layers[0]._k  # type: ignore[attr-defined]
    kv, _ = kv.remove([1])
    wider = rows_kv([5 + ROOM], seed=7)
    kv = kv.merge(KVBatch.stack(wider, spare=4))  # fits the room left: in place
    assert kv.cache.layers[0]._k is buffer  # type: ignore[attr-defined]
    assert all(same(own(kv, i), r) for i, r in enumerate([rows[0], wide[0], wider[0]]))


def test_a_decode_step_appends_one_column_to_every_row_in_place() -> None:
    rows = rows_kv([5, 2, 4], seed=6)
    kv = KVBatch.stack(rows, spare=4)
    kv, _ = kv.remove([1])  # in place: row 2 moves up, the columns stay
    cache, mask = kv.step_inputs()
    new_k, new_v = torch.ones(2, 2, 1, 4), -torch.ones(2, 2, 1, 4)
    for layer in cache.layers:
        keys, values = layer.update(new_k, new_v)
    kv.stepped(mask)
    assert keys.shape == (2, 2, 6, 4) and torch.equal(keys[:, :, -1:], new_k) and torch.equal(values[:, :, -1:], new_v)
    assert kv.mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    for i, old in enumerate([0, 2]):
        assert all(torch.equal(k[:, :, :-1], k0) for (k, _), (k0, _) in zip(own(kv, i), rows[old]))
    assert isinstance(growing_cache([(new_k, new_v)]).layers[0], GrowingLayer)
