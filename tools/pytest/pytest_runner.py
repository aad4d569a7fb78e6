"""Main for py_pytest targets: runs pytest on the files given as arguments.

pytest's rootdir is the workspace root in the runfiles, so conftest.py and the settings in
pyproject.toml apply exactly as when pytest runs from a checkout. Exit 5 (no test selected
by the platform mark) is not a failure: the file has no tests for that platform.
"""

import os
import sys

import pytest

if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ["-p", "no:cacheprovider", "-q", "-rs", "--rootdir", here, "-c", os.path.join(here, "pyproject.toml")]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    rc = pytest.main(args + sys.argv[1:])
    sys.exit(0 if rc == pytest.ExitCode.NO_TESTS_COLLECTED else rc)
