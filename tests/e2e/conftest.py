"""One disaggregated cluster (1 PE + 1 CE on the embedded model) shared by the e2e modules
that only send traffic, for as long as this package's tests run; modules that resize or
break a cluster start their own serve process, joining this cluster's Ray."""

import pytest

from tests.helpers.cluster import SMALL_ENGINE, ServeProcess


@pytest.fixture(scope="package")
def cluster():
    serve = ServeProcess(*SMALL_ENGINE)
    yield serve
    serve.stop()
