"""Build hooks the declarative pyproject.toml cannot express: record the commit being built.

The sdist gets a `BUILD_COMMIT` file at its root, and the wheel one inside `clef_protocol`, so
`clef-serve --version` of an installed wheel can name its commit (clef_protocol/build_info.py,
loaded here by path: nothing is installed yet when this runs). Everything else is in
pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_clef_build_info",
                                               ROOT / "clef_protocol" / "build_info.py")
assert _spec is not None and _spec.loader is not None
build_info = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_info)


def _commit() -> str | None:
    """Git's answer in a checkout; in an unpacked sdist, the commit the sdist recorded."""
    return build_info.git_commit(ROOT) or build_info.recorded_commit(ROOT)


class BuildPyWithCommit(build_py):
    def run(self) -> None:
        super().run()
        commit = _commit()
        if commit and not self.editable_mode:  # an editable install asks git at run time
            target = Path(self.build_lib) / "clef_protocol" / build_info.BUILD_COMMIT
            target.write_text(commit + "\n", encoding="ascii")


class SdistWithCommit(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        commit = _commit()
        if commit:
            (Path(base_dir) / build_info.BUILD_COMMIT).write_text(commit + "\n", encoding="ascii")


setup(cmdclass={"build_py": BuildPyWithCommit, "sdist": SdistWithCommit})
