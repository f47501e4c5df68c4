"""The runnable examples of docs/backends.md run as written (one per backend: host memory, RocksDB,
Redis), against a private redis-server and a temporary directory instead of the docs' addresses."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.storage.conftest import redis_factory, redis_server  # noqa: F401 (fixtures)

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def examples(name: str) -> list[str]:
    """The self-contained ```python blocks (those that import tieredemb) of a docs file."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), re.S)
    return [b for b in blocks if "import tieredemb as te" in b]


def test_backends_doc_has_an_example_per_backend() -> None:
    text = "\n".join(examples("backends.md"))
    for spec in ("te.storage.HostMemory(", "te.storage.RocksDB(", "te.storage.Redis("):
        assert spec in text, f"docs/backends.md has no runnable example using {spec}"


@pytest.mark.parametrize("block", range(2))
def test_backends_doc_examples_run(block: int, request, tmp_path, capsys) -> None:
    redis_url = request.getfixturevalue("redis_server")
    blocks = examples("backends.md")
    assert len(blocks) == 2, "docs/backends.md examples changed: update this test"
    code = blocks[block]
    code = code.replace("redis://127.0.0.1:6379/0", redis_url)
    code = re.sub(r'"/tmp/(emb[\w-]*)"', lambda m: repr(str(tmp_path / m.group(1))), code)
    assert '"/tmp/' not in code and "6379" not in code  # nothing outside the test's own resources
    exec(compile(code, f"docs/backends.md example {block}", "exec"), {})  # noqa: S102
    if block == 1:
        out = capsys.readouterr().out
        assert "[" in out and "torch.Size" in out  # the scan printed its chunks
