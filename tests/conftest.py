"""Test setup: pin the CuTe DSL target before anything imports cutlass; skip GPU tests on CPU
(and fail any other skip, see skip_guard.py); session fixtures shared by the test files."""
import atexit
import collections
import os
import shutil
import tempfile

# CuTe DSL reads these once, when `import cutlass` builds its singleton: without a GPU it
# would silently target sm_100a. It writes the kept PTX only into a folder that exists (else
# `artifacts.PTX` holds a path, not the text), so each run gets a fresh one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_KEEP", "ptx")
if "CUTE_DSL_DUMP_DIR" not in os.environ:
    _dump_dir = tempfile.mkdtemp(prefix="dsv4_cute_dump_")
    atexit.register(shutil.rmtree, _dump_dir, ignore_errors=True)
    os.environ["CUTE_DSL_DUMP_DIR"] = _dump_dir
# The kept PTX is named after the launcher and its argument types, not its static config:
# two xdist workers compiling variants of the same signature at once would read each
# other's file, so each worker keeps its own (the controller's folder, then its id).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["CUTE_DSL_DUMP_DIR"] = os.path.join(os.environ["CUTE_DSL_DUMP_DIR"],
                                                   os.environ["PYTEST_XDIST_WORKER"])
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)
# No persistent compilation cache in tests: a run must cost what it costs on a fresh machine
# (measured: sharing programs between tests through it saved nothing -- 13 hits in 2254
# compilations). The test of the CLI's cache sets its own folder.
os.environ.setdefault("DSV4_COMPILATION_CACHE", "off")
# Eight simulated CPU devices for the sharding tests (single-device tests use device 0).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import dsv4_jax  # noqa: E402,F401  (sets XLA_FLAGS before jax creates its backends)
import jax  # noqa: E402
import pytest  # noqa: E402

from skip_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401

jax.config.update("jax_threefry_partitionable", True)
pytest_plugins = ["pytester"]


def _has_cuda() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_cuda()


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one process per core, at most two (the CPU suite is compile-bound and the
    session fixtures are built once per process); one process when the GPU tests run, since
    they share the one device."""
    if HAS_GPU or "gpu" in (config.getoption("markexpr", "") or ""):
        return 0
    return max(1, min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------- shared fixtures
# Every implementation of an op: the op test files' shared bodies run once per entry, "cute"
# (the Hopper kernel) only where the GPU tests run.
IMPLEMENTATIONS = ["xla", pytest.param("cute", marks=pytest.mark.gpu)]


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request):
    """The ``implementation=`` an op test body passes: ``"xla"`` or ``"cute"``."""
    return request.param


# Built once per run: every test file that needs a tiny model, its parameters or a tiny
# official checkpoint takes them from here, so the same programs are not traced and compiled
# again in each file.
HFCheckpoint = collections.namedtuple("HFCheckpoint", "path params config")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A tiny official-format (FP8/FP4) checkpoint: three layers keep every structural
    feature (SWA + hash routing, CSA + indexer, HCA, MTP) and compile faster than four."""
    from dsv4_jax.checkpoints.testing import tiny_config, write_tiny_checkpoint
    cfg = tiny_config(n_layers=3, compress_ratios=(0, 4, 128, 0))
    path = str(tmp_path_factory.mktemp("hf") / "tiny")
    params = write_tiny_checkpoint(path, cfg, seed=0, shards=3)
    # committed like loaded arrays, so jitted calls share one compilation
    return HFCheckpoint(path, jax.device_put(params, jax.devices()[0]), cfg)
