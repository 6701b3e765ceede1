"""The names a server with fine-tuned variants answers to (`Catalogue.check_body_model`), in
the front and in clef-batch's screening: no worker, no model."""

from __future__ import annotations

import json

from clef_api.catalogue import Catalogue
from clef_api.checks import RequestRules
from clef_protocol.options import RequestLimits
from clef_tools.batch_input import Job
from clef_tools.screening import Screen

SERVED = Catalogue(("clef-flash", "flash"), created=0, variants=("triage", "billing"))
BODY = {"state": "s", "questions": {"q": {"type": "noul"}}}


def _detail(reply: object) -> str:
    return json.loads(reply.body)["detail"]  # type: ignore[attr-defined]


def test_served_names_aliases_and_variants_pass() -> None:
    for name in ("clef-flash", "flash", "triage", "billing"):
        assert SERVED.check_body_model(name) is None
    assert SERVED.knows("triage") and not SERVED.knows("gamma")


def test_any_other_name_is_404_as_sent() -> None:
    reply = SERVED.check_body_model("Triage ")
    assert reply is not None and reply.status == 404
    assert _detail(reply) == ("unknown model 'Triage '; this server runs clef-flash, flash, "
                              "triage, billing")


def test_without_variants_any_name_is_accepted() -> None:
    assert Catalogue(("clef-flash",)).check_body_model("jev-latest") is None


def test_the_workers_ai_path_and_the_body_agree_on_a_variant() -> None:
    assert SERVED.check_body_model("triage", "triage") is None
    assert SERVED.check_body_model("flash", "clef-flash") is None  # base names: either
    for body, path in (("clef-flash", "triage"), ("triage", "clef-flash"),
                       ("billing", "triage")):
        reply = SERVED.check_body_model(body, path)
        assert reply is not None and reply.status == 422, (body, path)


def test_models_lists_variants_after_the_names() -> None:
    document = SERVED.document()
    assert [entry["id"] for entry in document["data"]] == ["clef-flash", "flash", "triage",
                                                           "billing"]
    assert document["models"][2]["description"] == (
        "fine-tuned variant of clef-flash (clef-finetune LoRA and head)")


def test_clef_batch_screens_the_same_names() -> None:
    screen = Screen(RequestRules(RequestLimits(), SERVED))

    def job(model: str, target: bytes = b"/v1/systemone") -> Job:
        return Job(1, "c", target, json.dumps(dict(BODY, model=model)).encode())

    assert screen.refuse(job("triage")) is None
    refused = screen.refuse(job("gamma"))
    assert refused is not None and refused.status == 404
    mismatch = screen.refuse(job("clef-flash", b"/accounts/a/ai/run/@cf/cloudflare/triage"))
    assert mismatch is not None and mismatch.status == 422
