"""The host side (request, block manager, scheduler, buckets, sampling params) must not import jax.

It runs every step on the CPU beside the accelerator and is unit-tested as plain Python, so pulling
in jax (seconds of import, device discovery) would be a bug. Checked in a fresh interpreter.
"""

import importlib.util
import os
import subprocess
import sys

HOST_MODULES = ["request", "block_manager", "scheduler", "buckets", "sampling_params", "generation_config", "prompts",
                "bad_words", "structured_output", "penalty_window"]

_PROBE = """
import importlib, sys, types
if {bypass_package_init}:
    pkg = types.ModuleType("jengine")
    pkg.__path__ = [{pkg_dir!r}]
    sys.modules["jengine"] = pkg
for name in {modules!r}:
    importlib.import_module(name)
print(",".join(sorted({{m.split(".")[0] for m in sys.modules}} & {{"jax", "jaxlib", "flax", "torch"}})))
"""


def _pkg_dir():
    return importlib.util.find_spec("jengine").submodule_search_locations[0]


def _heavy_imports(bypass_package_init):
    pkg_dir = _pkg_dir()
    modules = [f"jengine.{m}" for m in HOST_MODULES if os.path.exists(os.path.join(pkg_dir, f"{m}.py"))]
    code = _PROBE.format(bypass_package_init=bypass_package_init, pkg_dir=pkg_dir, modules=modules)
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""


def test_host_modules_import_no_jax():
    assert _heavy_imports(bypass_package_init=True) == ""


def test_importing_host_modules_through_the_package_imports_no_jax():
    heavy = _heavy_imports(bypass_package_init=False)
    assert heavy == "", (
        f"`import jengine.scheduler` pulled in {heavy}: jengine/__init__.py must import its device-side "
        "exports (LLM, ...) lazily, e.g. with a module-level __getattr__"
    )
