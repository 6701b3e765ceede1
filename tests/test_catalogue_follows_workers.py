"""The names a server with fine-tuned variants admits follow what its workers serve
(`Catalogue.live`, the dispatcher's `variant_names`): a variant a ready worker serves is listed
and admitted; one known from a worker's last start but served by no ready worker is 503 with
Retry-After (its workers are restarting); one no worker has is 404 and unlisted."""

from __future__ import annotations

from clef_api.catalogue import Catalogue


def _catalogue(ready: tuple[str, ...], known: tuple[str, ...]) -> Catalogue:
    return Catalogue(("clef-flash", "clef"), variants=("tiny-alpha", "tiny-beta"),
                     live=lambda: (ready, known), retry_after=7)


def test_a_variant_served_by_a_ready_worker_is_listed_and_admitted() -> None:
    catalogue = _catalogue(("tiny-alpha",), ("tiny-alpha", "tiny-beta"))
    assert catalogue.every_name == ("clef-flash", "clef", "tiny-alpha")
    assert [entry["id"] for entry in catalogue.document()["data"]] == [
        "clef-flash", "clef", "tiny-alpha"]
    assert catalogue.check_body_model("tiny-alpha") is None
    assert catalogue.check_body_model("clef") is None  # an alias: the base
    assert catalogue.model_of("tiny-alpha") == "tiny-alpha"
    assert catalogue.model_of("clef") == ""


def test_a_variant_whose_workers_are_restarting_is_503_with_retry_after() -> None:
    catalogue = _catalogue(("tiny-alpha",), ("tiny-alpha", "tiny-beta"))
    refused = catalogue.check_body_model("tiny-beta")
    assert refused is not None and refused.status == 503 and refused.retry_after == 7
    assert refused.detail == ("model 'tiny-beta': no ready worker serves it now (its workers "
                              "are restarting)")
    assert catalogue.knows("tiny-beta")  # the Workers-AI path passes on to this 503
    assert catalogue.model_of("tiny-beta") == "tiny-beta"


def test_a_variant_no_worker_has_is_404_and_unlisted() -> None:
    catalogue = _catalogue(("tiny-alpha",), ("tiny-alpha",))
    refused = catalogue.check_body_model("tiny-beta")
    assert refused is not None and refused.status == 404
    assert refused.detail == "unknown model 'tiny-beta'; this server runs clef-flash, clef, " \
        "tiny-alpha"
    assert not catalogue.knows("tiny-beta")
    # The path and the body must agree where either names a variant.
    mismatch = catalogue.check_body_model("clef-flash", path_model="tiny-alpha")
    assert mismatch is not None and mismatch.status == 422
