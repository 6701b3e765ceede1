"""Start an installed `clef-serve --model demo` and send it the README's request.

CI runs this with the python of a fresh virtual environment that holds only the built wheel (and
its requirements), from outside the checkout, so what answers is the package as users get it.
Standard library only: nothing of the repository is importable there.

    python serve_readme_request.py README.md EXPECTED_COMMIT

Exit 0 when `clef-serve --version` names the version and EXPECTED_COMMIT (pass "" to skip that
check), the server comes up, and the README's request gets a 200 whose answers follow its
questions; otherwise exit 1 with what went wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

STARTUP_SECONDS = 300
LISTENING = re.compile(r"listening on http://[^:\s]+:(\d+)")


def readme_request(readme: Path) -> dict[str, object]:
    """The body of the README's `curl ... /v1/systemone ... -d '{...}'` example."""
    match = re.search(r"/v1/systemone[^\n]*-d '(\{.*?\})'", readme.read_text(encoding="utf-8"),
                      re.DOTALL)
    if match is None:
        sys.exit(f"no `curl .../v1/systemone -d '{{...}}'` example in {readme}")
    body: dict[str, object] = json.loads(match.group(1))
    return body


def check_version(clef_serve: str, expected_commit: str) -> None:
    line = subprocess.run([clef_serve, "--version"], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()
    print(line)
    if not re.fullmatch(r"clef-serve \d+\.\d+\.\d+\S*( \(commit [0-9a-f]{40}(\+dirty)?\))?",
                        line):
        sys.exit(f"unexpected --version line: {line!r}")
    if expected_commit and f"(commit {expected_commit})" not in line:
        sys.exit(f"--version does not name the commit the wheel was built from, "
                 f"{expected_commit}: {line!r}")


def serve_and_ask(clef_serve: str, body: dict[str, object]) -> None:
    server = subprocess.Popen([clef_serve, "--model", "demo", "--host", "127.0.0.1",
                               "--port", "0"], stderr=subprocess.PIPE, text=True)
    # A server that neither listens nor exits is killed, which ends the read loop below.
    watchdog = threading.Timer(STARTUP_SECONDS, server.kill)
    watchdog.start()
    try:
        assert server.stderr is not None
        port = None
        for line in server.stderr:  # ends when the server exits; the timeout below bounds it
            sys.stderr.write(line)
            found = LISTENING.search(line)
            if found:
                port = int(found.group(1))
                break
        watchdog.cancel()
        # Keep reading the log, so a chatty server never blocks on a full pipe.
        threading.Thread(target=lambda: sys.stderr.writelines(server.stderr or ()),
                         daemon=True).start()
        if port is None:
            sys.exit(f"clef-serve exited ({server.wait()}) before listening "
                     f"(killed after {STARTUP_SECONDS} s if it hung)")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/systemone", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, answer = reply.status, json.loads(reply.read())
        print(status, json.dumps(answer))
        questions = body["questions"]
        assert isinstance(questions, dict)
        if status != 200 or list(answer.get("answers", {})) != list(questions):
            sys.exit(f"the README's request was not answered as it asks: {status} {answer}")
        for qid, question in questions.items():
            if answer["answers"][qid].get("type") != question["type"]:
                sys.exit(f"answer {qid!r} has the wrong type: {answer['answers'][qid]}")
    finally:
        watchdog.cancel()
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    readme, expected_commit = Path(sys.argv[1]), sys.argv[2]
    clef_serve = shutil.which("clef-serve", path=os.path.dirname(sys.executable))
    if clef_serve is None:
        sys.exit(f"no clef-serve beside {sys.executable}: is the wheel installed?")
    check_version(clef_serve, expected_commit)
    serve_and_ask(clef_serve, readme_request(readme))
    print("the installed wheel serves the README's request")


if __name__ == "__main__":
    main()
