"""Media over HTTP with the real worker on the shared tiny snapshot: golden answers for images
and a video, refusals answered 422 by the front (a URL reaching no listener), the body limit
first, and --max-images passed through."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from benchlib.golden import MEDIA_GOLDEN, assert_response_matches, load_cases
from clef_protocol.media import gradient_image, png_data_uri
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Response, Serve

CASES = {case["name"]: case for case in load_cases(MEDIA_GOLDEN)}
BODY_LIMIT = 200_000


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve(
        real_worker=True, startup_wait=240,
        front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu", "--max-images", "2",
                    "--body-limit", str(BODY_LIMIT)),
    ) as server:
        yield server


def _post(serve: Serve, request: dict[str, Any]) -> Response:
    return serve.post(json.dumps(request).encode())


@pytest.mark.parametrize("name", ["m_png_64x48", "m_jpeg_64x64", "m_video_frames",
                                  "m_images_empty_list"])
def test_golden_media_answers_over_http(serve: Serve, name: str) -> None:
    response = _post(serve, CASES[name]["request"])
    assert response.status == 200, response.body
    assert_response_matches(response.json(), CASES[name]["response"])


def test_undecodable_image_is_422(serve: Serve) -> None:
    response = _post(serve, CASES["m_err_not_an_image"]["request"])
    assert response.status == 422
    assert response.detail == "images[0]: the data is not a decodable PNG, JPEG, WebP or GIF image"


def test_url_is_422_and_never_fetched(serve: Serve) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        request = dict(CASES["m_png_64x48"]["request"],
                       images=[f"http://127.0.0.1:{port}/cat.png"])
        response = _post(serve, request)
        assert response.status == 422
        assert response.detail == ("images[0]: URLs are not fetched; send the image inline as "
                                   "base64 or a data URI")
        # The reply came after every check ran: a fetch would have connected by now.
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_max_images_flag_reaches_the_front(serve: Serve) -> None:
    image = png_data_uri(gradient_image(32, 32))
    request = dict(CASES["m_png_64x48"]["request"], images=[image] * 3)
    response = _post(serve, request)
    assert response.status == 422
    assert response.detail == "3 images; maximum is 2 (--max-images)"


def test_body_limit_applies_before_media_checks(serve: Serve) -> None:
    request = dict(CASES["m_png_64x48"]["request"], images=["A" * BODY_LIMIT])
    response = _post(serve, request)
    assert response.status == 413
