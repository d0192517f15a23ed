import pytest
from tiering_rig import Rig


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(**kw):
        r = Rig(tmp_path, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()
