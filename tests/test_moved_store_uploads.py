"""A server store moved to another folder keeps its uploads: listed as uploads, replaced in place by a
new upload of the same name, and deleted from the new folder."""

import shutil

import httpx

from tests.server_helpers import KEY, serve_lighthouses

AUTH = {"Authorization": f"Bearer {KEY}"}


def test_uploads_follow_a_moved_store(tmp_path, llm):
    """Uploads are recorded by absolute path. Moved, a store listed its uploads as not uploaded, kept
    a second record (and second chunks) for an upload of the same name, and its delete left the
    file behind. The docstore now records which folder its uploads' paths name, and a server
    opening the store elsewhere moves those records with it."""
    with serve_lighthouses(tmp_path / "a", llm):
        pass
    shutil.move(tmp_path / "a", tmp_path / "b")
    with serve_lighthouses(tmp_path / "b", llm) as srv:  # uploads lighthouses.md again
        listed = httpx.get(f"{srv.url}/v1/documents", headers=AUTH).json()["data"]
        assert [(d["name"], d["uploaded"]) for d in listed] == [("lighthouses.md", True)], listed
        chunks = listed[0]["chunks"]
        assert srv.backend.pipeline.store.docs.counts()["chunks"] == chunks
        for path, _ in srv.backend.pipeline.store.docs.files():
            assert path.startswith(str((tmp_path / "b").resolve())), path
        r = httpx.delete(f"{srv.url}/v1/documents/{listed[0]['id']}", headers=AUTH)
        assert r.status_code == 200, r.text
        assert not (tmp_path / "b" / "uploads" / "lighthouses.md").exists()
        assert httpx.get(f"{srv.url}/v1/documents", headers=AUTH).json()["data"] == []


def test_an_upload_recorded_at_both_places_keeps_the_record_made_in_the_new_one(tmp_path, llm):
    """A moved store whose upload was recorded again at its new place (an ingest of the file there,
    or a server from before the records followed the store) keeps one record: the new place's."""
    from ragfuse.cli import main

    with serve_lighthouses(tmp_path / "a", llm):
        pass
    shutil.move(tmp_path / "a", tmp_path / "b")
    upload = (tmp_path / "b" / "uploads" / "lighthouses.md").resolve()
    assert main(["ingest", str(upload), "--store", str(tmp_path / "b"), "--device", "cpu"]) == 0
    with serve_lighthouses(tmp_path / "b", llm) as srv:
        docs = srv.backend.pipeline.store.docs
        assert [p for p, _ in docs.files()] == [str(upload)]
        assert docs.counts()["chunks"] == docs.files()[0][1]
        hits = srv.backend.pipeline.retriever.search("Who was the last keeper of the Hollowpoint lighthouse?", 5)
        assert {h.source for h in hits} == {str(upload)}, hits


def test_a_moved_read_only_store_lists_its_uploads_as_uploads(tmp_path, llm, request):
    """A read-only store cannot move its records; its listing reads them where they were recorded."""
    from ragfuse.connectors.server.library import DocumentLibrary
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import StoreConfig

    with serve_lighthouses(tmp_path / "a", llm):
        pass
    shutil.move(tmp_path / "a", tmp_path / "b")
    request.getfixturevalue("read_only_fs")  # from here on
    store = RagStore(tmp_path / "b", StoreConfig.load(tmp_path / "b"))
    try:
        assert store.read_only
        listed = DocumentLibrary(store, ingestor=None).list()  # a read-only library ingests nothing
        assert [(d["name"], d["uploaded"]) for d in listed] == [("lighthouses.md", True)], listed
    finally:
        store.close()
