import pytest

from tests.distributed import close_pools


@pytest.fixture(scope="session", autouse=True)
def _distributed_worker_pools():
    yield
    close_pools()
