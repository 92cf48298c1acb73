import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from standalone import System  # noqa: E402


@pytest.fixture(scope="session")
def system():
    s = System()
    yield s
    s.stop()
