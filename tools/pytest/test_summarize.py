"""summarize.py counts this run's pytest results only."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import summarize  # noqa: E402

_XML = ('<testsuites><testsuite tests="{t}" failures="{f}" errors="0" skipped="{s}">'
        '</testsuite></testsuites>')


def _target(root, name, tests, failures=0, skipped=0, age=0.0):
    folder = os.path.join(root, "pkg", name)
    os.makedirs(folder)
    path = os.path.join(folder, "test.xml")
    with open(path, "w") as f:
        f.write(_XML.format(t=tests, f=failures, s=skipped))
    if age:
        old = time.time() - age
        os.utime(path, (old, old))


def test_counts_fresh_and_cached_results_and_not_leftovers(tmp_path, capsys):
    logs = str(tmp_path / "testlogs")
    _target(logs, "fresh", 5, failures=1, skipped=1)
    _target(logs, "cached", 3, age=3600)
    _target(logs, "broken", 11, age=3600)  # an earlier run's XML: not this run's verdict
    log = tmp_path / "bazel.log"
    log.write_text("//pkg:fresh    FAILED in 2.0s\n"
                   "//pkg:cached   (cached) PASSED in 1.0s\n"
                   "//pkg:broken   FAILED TO BUILD\n")
    summarize.main(str(log), logs, time.time() - 60)
    assert capsys.readouterr().out.strip() == "6 passed, 2 failed, 1 skipped"
