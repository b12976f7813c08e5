from __future__ import annotations

import pytest

from tests.helpers import load_zoo


@pytest.fixture(scope="module", params=["kda-tiny", "gdn-tiny"])
def zoo(request):
    return load_zoo(request.param)
