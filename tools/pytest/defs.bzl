"""py_pytest: one pytest file as one py_test per platform.

`py_pytest(name = "test_x", srcs = ["tests/test_x.py"], platforms = ["cpu", "gpu"])` makes
`test_x_cpu` (tag cpu, runs the tests not marked gpu/tpu) and `test_x_gpu` (tag gpu, runs
`pytest -m gpu`). A gpu or tpu target runs only where that accelerator is present (select it
with --config=gpu|tpu); its tests skip cleanly elsewhere (conftest.py).
"""

load("@rules_python//python:defs.bzl", "py_test")

_RUNNER = "//tools/pytest:pytest_runner.py"

_MARKS = {
    "cpu": "not gpu and not tpu",
    "gpu": "gpu",
    "tpu": "tpu",
}

_EXEC_PROPERTIES = {
    "cpu": {},
    "gpu": {"accelerator": "gpu"},
    "tpu": {"accelerator": "tpu"},
}

def py_pytest(name, srcs, deps = [], args = [], data = [], platforms = ["cpu"], size = "medium", **kwargs):
    """`size` is the cpu target's, from its measured run time on a 2-core machine: "small"
    under about 25 s, "medium" above, "large" from about 200 s (medium's 300 s limit
    would leave too little margin on a loaded machine). Files that take 30-60 s stay
    medium (small's 60 s limit would leave no margin), so Bazel's note "specified size
    is too big" lists them.
    The gpu and tpu targets run whole parity grids and are "large"."""
    for platform in platforms:
        py_test(
            name = "%s_%s" % (name, platform),
            srcs = srcs + [_RUNNER],
            main = _RUNNER,
            args = args + ["-m", "'%s'" % _MARKS[platform]] + ["$(location %s)" % s for s in srcs],
            deps = deps + ["@pallasite_pypi//pytest"],
            # Bazel does not see the venv: re-run tests when the pinned requirements change.
            data = data + ["//:requirements_lock.txt", "//:conftest.py", "//:pyproject.toml"],
            # An accelerator test holds its device alone (no two share one GPU's memory).
            tags = [platform] + ([] if platform == "cpu" else ["exclusive"]),
            exec_properties = _EXEC_PROPERTIES[platform],
            size = size if platform == "cpu" else "large",
            **kwargs
        )
