"""The build information's old home: it moved to clef_protocol.build_info, which the worker can
import without the front; this name stays for the scripts that still read it here."""

from clef_protocol.build_info import BUILD_COMMIT, PACKAGE, commit, git_commit, recorded_commit

__all__ = ["BUILD_COMMIT", "PACKAGE", "commit", "git_commit", "recorded_commit"]
