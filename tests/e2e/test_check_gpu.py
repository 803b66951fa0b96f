"""The GPU tier: scripts/check_gpu.py's checks as tests, on a machine whose
torch and DGL both have CUDA (DGL's CUDA build, docs/gpus.md); skipped
elsewhere, as here.

    python -m pytest -m gpu tests
"""
import pytest

import check_gpu

REASON = check_gpu.skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(REASON is not None, reason=str(REASON))]


@pytest.fixture(scope="module")
def gpu_dataset(tmp_path_factory):
    return check_gpu.make_dataset(str(tmp_path_factory.mktemp("gpu")))


@pytest.mark.parametrize("name", list(check_gpu.CHECKS))
def test_gpu_mode(name, gpu_dataset, tmp_path):
    try:
        check_gpu.CHECKS[name](check_gpu.default_gpus(), gpu_dataset,
                               str(tmp_path))
    except check_gpu.CheckFailed as failure:
        pytest.fail(f"{name}: {failure}")
