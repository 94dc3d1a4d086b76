"""The docstore's lookups by many ids, keys and token lists (sent in pieces SQLite accepts)."""

from __future__ import annotations

import numpy as np

from ragfuse.docstore import SQL_VARIABLES, DocStore, NewChunk


def test_lookups_longer_than_one_statement_find_every_match(tmp_path):
    docs = DocStore(tmp_path / "docstore.sqlite")
    n = 2 * SQL_VARIABLES + 3
    head = tuple(range(100, 116))  # 16 tokens: the length of the index on token lists' heads
    tokens = [(*head, i) for i in range(n)]  # all alike in their heads, different whole
    chunks = [NewChunk("s", f"t{i}", t, f"key-{i}", np.zeros(4, np.float32)) for i, t in enumerate(tokens)]
    _, ids = docs.replace_file("/docs/a.txt", "h", chunks)
    assert sorted(docs.chunks([*ids, 10**9])) == sorted(ids)
    assert docs.kv_keys_in_use([f"key-{i}" for i in range(n + 5)]) == {f"key-{i}" for i in range(n)}
    asked = [*tokens[::2], (*head, n), (*head,), (1, 2)]
    assert docs.token_ids_in_use(asked) == set(tokens[::2])
    docs.remove_files(["/docs/a.txt"])
    assert docs.token_ids_in_use(tokens) == set() and docs.kv_keys_in_use(["key-1"]) == set()
    docs.close()


def test_own_commits_are_told_from_another_connection_s(tmp_path):
    """An index kept up to date by one writer is current only while no other writer committed."""
    mine, theirs = DocStore(tmp_path / "docstore.sqlite"), DocStore(tmp_path / "docstore.sqlite")
    chunk = NewChunk("s", "t", (1,), None, np.zeros(4, np.float32))
    mine.replace_file("/docs/a.txt", "h", [chunk])
    assert mine.changed_only_here(0, mine.generation) and mine.generation == 1
    theirs.replace_file("/docs/b.txt", "h", [chunk])
    mine.replace_file("/docs/c.txt", "h", [chunk])
    assert not mine.changed_only_here(0, 3) and mine.changed_only_here(2, 3) and theirs.changed_only_here(1, 2)
    assert mine.all_embeddings(4)[0] == 3
    mine.close()
    theirs.close()
