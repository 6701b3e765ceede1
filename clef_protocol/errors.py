"""The protocol's errors, shared by every protocol module.

`BadRequestBody` is a 400 (not an acceptable JSON object), `RequestInvalid` a 422 (well-formed
but unanswerable): the two ways a request body is refused. `ProtocolError` is the other kind: a
peer (the front or the worker) sent a frame that breaks the contract, so nothing after it on
that pipe can be trusted. Owned here, below `body`, `validation`, `media`, `frames` and
`messages`, so those modules import the errors rather than each other.
"""

from __future__ import annotations


class BadRequestBody(ValueError):
    """The body is not an acceptable JSON object; str(exc) is the 400 detail."""


class RequestInvalid(ValueError):
    """The request is well-formed JSON but cannot be answered; str(exc) is the 422 detail."""


class UnknownModel(ValueError):
    """The request's `model` names no model this worker serves (a fine-tuned variant it does not
    have, say after its checkpoint was removed): refused with 404 `unknown model`, never scored
    by another model; str(exc) is the detail."""


class ProtocolError(ValueError):
    """A frame that breaks the contract: not a frame (`frames.FrameError`), an unknown kind, or
    a field missing or of the wrong type (`messages`); str(exc) says which, for the log."""
