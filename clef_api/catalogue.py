"""The names this server answers to, and `GET /v1/models`, answered from memory.

`--served-model-name NAME [NAME ...]`: the first name is the model's served name, the others
are aliases (as in vLLM). The default is the variant, `clef-flash` or `clef`, which is what the
published Clef clients put in their URLs (`@cf/cloudflare/<name>`).

`/v1/models` lists every name in one body that two kinds of clients read: the OpenAI list shape
(`object`, `data` with `id`, `created`, `owned_by`), which OpenAI-style SDKs read before their
first call, and the Clef shape (`models` with `name`, `description`, `release_date`), which the
typesafe Clef SDK and jevcompat read. Each reads its own keys and ignores the other's.

With fine-tuned variants the catalogue follows the workers (`live`): a variant is listed and
admitted while a ready worker serves it; one that a worker served at its last start but no
ready worker serves now (they are restarting) is answered 503 with `Retry-After`; one that no
worker serves at all (its checkpoint was removed and every worker restarted) is 404 `unknown
model`, like any name never served. `--finetune` given (`finetune`) says that variants are
served at all (a body's `model` then chooses the model), even while none is: a directory of
checkpoints may be empty at start and filled before a roll.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from clef_api import responses
from clef_api.responses import Reply, error
from clef_protocol.finetune import MODEL_NAME as _NAME

OWNER = "cloudflare"


def served_name(value: str) -> str:
    """argparse type: a name that fits one URL path segment as sent."""
    if not _NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a usable model name: letters, digits, '.', '_', ':' and '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return value


@dataclass(frozen=True)
class Catalogue:
    """The served name first, then its aliases; `created` is when this server started.
    `variants` are the fine-tuned variants' names (`--finetune`, docs/finetune.md): each is a
    model of its own, listed after the names, served over the same snapshot."""

    names: tuple[str, ...]
    created: int = field(default_factory=lambda: int(time.time()))
    variants: tuple[str, ...] = ()
    # The variants as the workers serve them now: (served by a ready worker, served by any
    # worker at its last start); None: the configured `variants` are all served (clef-batch).
    live: Callable[[], tuple[tuple[str, ...], tuple[str, ...]]] | None = None
    retry_after: int = 1  # the Retry-After of a 503 for a variant no ready worker serves
    # `--finetune` was given: a body's `model` chooses the model even while no variant is
    # served (a directory left empty serves the base alone until a checkpoint is added).
    finetune: bool = False

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("at least one served model name is required")

    @property
    def chooses_model(self) -> bool:
        """Whether a body's `model` chooses what scores it (variants configured), rather than
        being echoed whatever it is."""
        return self.finetune or bool(self.variants)

    @property
    def served(self) -> str:
        return self.names[0]

    def _variants(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(variants served now, variants known), from the workers when `live` is set."""
        if self.live is None:
            return self.variants, self.variants
        return self.live()

    def serving(self) -> tuple[str, ...]:
        """The variants served now, in the workers' order."""
        return self._variants()[0]

    def knows(self, name: str) -> bool:
        return name in self.names or name in self._variants()[1]

    @property
    def every_name(self) -> tuple[str, ...]:
        return self.names + self.serving()

    def model_of(self, name: object) -> str:
        """The model a body's `model` asks for: a variant's name, or "" for the base (any
        other name, which the checks have refused with variants served)."""
        return name if isinstance(name, str) and name in self._variants()[1] else ""

    def description(self, name: str) -> str:
        if name == self.served:
            return "Clef decision model: scores a state against typed questions (/v1/systemone)"
        if name in self.serving():
            return f"fine-tuned variant of {self.served} (clef-finetune LoRA and head)"
        return f"alias of {self.served}"

    def check_body_model(self, model: object, path_model: str | None = None) -> Reply | None:
        """With variants served, a body's `model` chooses what scores it, so it must be a name
        this server serves (404 `unknown model`, naming it as sent); on the Workers-AI route,
        where the path names the model, a variant named on one side must be named on the other
        (422), since the worker scores by the body's `model`. A variant known to the workers but
        served by no ready worker now is 503 with Retry-After. Without variants any name is
        accepted and echoed, as the reference does."""
        if not self.chooses_model or not isinstance(model, str):
            return None
        serving, known = self._variants()
        if model not in self.names and model not in serving:
            if model in known:
                return responses.unavailable(
                    f"model {model!r}: no ready worker serves it now (its workers are "
                    "restarting)", self.retry_after)
            return error(404, f"unknown model {model!r}; this server runs "
                              f"{', '.join(self.names + serving)}")
        if path_model is not None and path_model != model and (
                model in known or path_model in known):
            return error(422, f"model: the body names {model!r} but the path runs "
                              f"{path_model!r}; a fine-tuned variant is chosen by both")
        return None

    def document(self) -> dict[str, Any]:
        """The model list in both shapes clients read (see the module docstring).

        `release_date` is the day this server began serving the model (the date of `created`,
        ISO 8601), since a snapshot carries no release date of its own.
        """
        served_since = datetime.fromtimestamp(self.created, UTC).date().isoformat()
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": self.created, "owned_by": OWNER,
                 "root": self.served}
                for name in self.every_name
            ],
            "models": [
                {"name": name, "description": self.description(name),
                 "release_date": served_since}
                for name in self.every_name
            ],
        }

    def reply(self) -> Reply:
        return responses.document(200, self.document())
