"""A Redis password never shows: not in the repr of a store spec (or of a StorageConfig holding one),
not in an error, wherever the URL carries it (``user:password@`` or redis-py's ``?password=``).
Against a real redis-server that requires the password, so the URLs tested are ones that work."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tieredemb.storage.errors import BackendError, ExistingRowsError

SECRET = "s3cret-Pw"
W = 3
CPU = torch.device("cpu")


def urls(port: int) -> dict[str, str]:
    """The ways a URL carries the password (redis-py reads each of them)."""
    return {"userinfo": f"redis://:{SECRET}@127.0.0.1:{port}/0",
            "user and password": f"redis://default:{SECRET}@127.0.0.1:{port}/0",
            "query": f"redis://127.0.0.1:{port}/0?password={SECRET}",
            "query among others": f"redis://127.0.0.1:{port}/0?socket_keepalive=1&password={SECRET}"}


FORMS = list(urls(0))


@pytest.mark.parametrize("form", FORMS)
def test_a_password_never_shows_in_the_repr_of_a_spec(form):
    spec = te.storage.Redis(urls(6379)[form], password=SECRET)
    for text in (repr(spec), str(spec), repr(te.StorageConfig(hbm_budget=1, backing=spec))):
        assert SECRET not in text
        assert "127.0.0.1:6379" in text  # the rest of the URL still says where the store is
    assert spec.url == urls(6379)[form]  # the spec itself keeps it: it connects with it


@pytest.mark.parametrize("form", FORMS)
def test_a_password_never_shows_in_errors(form, redis_factory):
    server = redis_factory("--requirepass", SECRET)
    url = urls(server.port)[form]
    backend = te.storage.Redis(url).open("user", W, CPU)  # the URL's password is the one used
    backend.set(torch.tensor([1]), torch.ones(1, W))
    backend.close()
    with pytest.raises(ExistingRowsError) as existing:
        te.storage.Redis(url).open("user", W, CPU)
    server.stop()
    with pytest.raises(BackendError) as down:
        te.storage.Redis(url, retries=0, timeout_s=0.2).open("user", W, CPU)
    # hybrid mode refuses a Redis backing, naming it
    with pytest.raises(ValueError) as hybrid:
        te.EmbeddingBagCollection([te.TableConfig("t", W, ["f"])], storage=te.StorageConfig(
            hbm_budget=1, caching=False, backing=te.storage.Redis(url)))
    for error in (existing.value, down.value, hybrid.value):
        assert SECRET not in str(error)
        assert f"127.0.0.1:{server.port}" in str(error)
