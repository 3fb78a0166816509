"""Building a router from its settings (the server and the worker both do)."""

from __future__ import annotations

from skillpool.router import RouterSettings


def test_a_router_embeds_on_the_device_it_was_given(tiny_base) -> None:  # type: ignore[no-untyped-def]
    from skillpool.router.build import make_router

    router = make_router(RouterSettings(), tiny_base, device="cpu:0")  # not the default spelling: it was passed on
    assert router.embedder.device == "cpu:0"  # type: ignore[attr-defined]
    assert router.route(["hello"])[0].reason == "no_skills"
