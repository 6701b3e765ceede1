"""The two ways a request body is refused, shared by every protocol module.

`BadRequestBody` is a 400 (not an acceptable JSON object), `RequestInvalid` a 422 (well-formed
but unanswerable). Owned here, below `body`, `validation` and `media`, so those modules import
the errors rather than each other.
"""

from __future__ import annotations


class BadRequestBody(ValueError):
    """The body is not an acceptable JSON object; str(exc) is the 400 detail."""


class RequestInvalid(ValueError):
    """The request is well-formed JSON but cannot be answered; str(exc) is the 422 detail."""
