"""What a fresh clone needs: nothing outside the repository, the CuTe dump folder created,
no silent skips (skip_guard.py), the README's test figure kept honest."""
import os
import pathlib
import re

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_cute_dump_folder_exists():
    """CuTe DSL writes no PTX into a missing folder: conftest must create it."""
    assert os.path.isdir(os.environ["CUTE_DSL_DUMP_DIR"])


def test_reference_vectors_are_in_the_repository():
    vectors = REPO / "tests" / "data" / "reference_vectors.npz"
    with np.load(vectors) as data:
        assert data["act_quant_x"].shape == (64, 512) and data["act_quant_x"].dtype == np.uint16
        assert data["act_quant_q_e4m3"].dtype == np.uint8


def test_no_test_reads_outside_the_repository():
    outside = re.compile(r"\.\./shared|parents\[[2-9]\]|\"shared\"\s*/")
    offenders = [f"{p.name}:{i + 1}" for p in (REPO / "tests").glob("*.py")
                 for i, line in enumerate(p.read_text().splitlines())
                 if outside.search(line) and p.name != "test_fresh_clone.py"]
    assert not offenders, offenders


GUARDED = """
import pytest
from skip_guard import pytest_make_collect_report, pytest_runtest_makereport

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU")
"""


def test_a_skipped_ordinary_test_fails_but_a_gpu_test_may_skip(pytester):
    pytester.makeconftest(GUARDED)
    pytester.syspathinsert(pathlib.Path(__file__).parent)
    pytester.makepyfile(test_x="""
        import pytest

        def test_plain_skip():
            pytest.skip("data not found")

        @pytest.mark.gpu
        def test_gpu_skip():
            pytest.skip("needs a CUDA GPU")

        @pytest.mark.xfail(reason="known")
        def test_expected_failure():
            assert False

        def test_passes():
            assert True
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(["*test_plain_skip skipped (data not found)*only `gpu`*"])


def test_a_module_skipped_at_collection_fails(pytester):
    pytester.makeconftest(GUARDED)
    pytester.syspathinsert(pathlib.Path(__file__).parent)
    pytester.makepyfile(test_y="""
        import pytest
        pytest.importorskip("a_package_that_does_not_exist")

        def test_never_runs():
            pass
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped at collection*a_package_that_does_not_exist*"])
