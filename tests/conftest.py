"""Shared fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread in the test process: the CI box has two cores shared by several jobs,
    and single-threaded runs keep in-process timings and float sums steady."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
