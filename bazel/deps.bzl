"""pallasite_dependencies(): everything a Bazel 4 WORKSPACE needs to build and test
`@pallasite//packages/kernels` offline, in one call.

    local_repository(name = "pallasite", path = "...")   # or git_repository
    load("@pallasite//bazel:deps.bzl", "pallasite_dependencies")
    pallasite_dependencies()

It declares (each only where the workspace has not already):
  - rules_cc, rules_python, remote_coverage_tools: pallasite's local stand-ins for what
    Bazel 4's built-in WORKSPACE suffix would download;
  - rules_java: Debian's bazel-rules-java (/usr/share/bazel/rules/java);
  - pallasite_venv_python: the Python toolchain, a virtualenv holding pallasite's
    requirements_lock.txt (the main workspace's .venv, or $PROJECT_VENV), registered here;
  - pallasite_pypi: the labels pallasite's BUILD files depend on (@pallasite_pypi//jax).
Also needed, in the workspace's .bazelrc (a flag cannot be set from a macro):
    build --incompatible_default_to_explicit_init_py
(pallasite is one namespace package over four roots; Bazel's implicit __init__.py files
would hide three of them.) Bazel 7/8 users take MODULE.bazel instead (README).
"""

load("//tools/python:venv_repo.bzl", "pypi_stub", "stand_in", "venv_python")

def _maybe(rule, name, **kwargs):
    if name not in native.existing_rules():
        rule(name = name, **kwargs)

def pallasite_dependencies(rules_java_path = "/usr/share/bazel/rules/java"):
    _maybe(stand_in, "rules_cc",
           marker = Label("//third_party/bazel4_compat/rules_cc:WORKSPACE"))
    _maybe(stand_in, "rules_python",
           marker = Label("//third_party/bazel4_compat/rules_python:WORKSPACE"))
    _maybe(stand_in, "remote_coverage_tools",
           marker = Label("//third_party/bazel4_compat/remote_coverage_tools:WORKSPACE"))
    _maybe(native.local_repository, "rules_java", path = rules_java_path)
    _maybe(venv_python, "pallasite_venv_python")
    native.register_toolchains("@pallasite_venv_python//:py_toolchain")
    _maybe(pypi_stub, "pallasite_pypi", requirements = Label("//:requirements_lock.txt"))
