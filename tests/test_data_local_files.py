import os
import sysconfig

import pytest

from andrea_jax.config import base_config
from andrea_jax.data import DataError, local_files, pipeline


def write(path, content: bytes | str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_directory_gives_sorted_text_and_code_files_only(tmp_path):
    write(tmp_path / "b.md", "# b")
    write(tmp_path / "a.txt", "a")
    write(tmp_path / "sub" / "c.py", "c = 1")
    write(tmp_path / "image.png", b"\x89PNG\0\0")
    write(tmp_path / "binary.txt", b"\0\1\2")
    write(tmp_path / ".git" / "config.txt", "hidden")
    root, files = local_files.list_text_files(str(tmp_path))
    assert root == str(tmp_path)
    assert [os.path.relpath(f, root) for f in files] == ["a.txt", "b.md", os.path.join("sub", "c.py")]


def test_glob_and_single_file(tmp_path):
    for name in ("x1.log", "x2.log", "y.txt"):
        write(tmp_path / "logs" / name, name)
    _, files = local_files.list_text_files(str(tmp_path / "logs" / "x*.log"))
    assert [os.path.basename(f) for f in files] == ["x1.log", "x2.log"]
    root, files = local_files.list_text_files(str(tmp_path / "logs" / "y.txt"))
    assert (root, files) == (str(tmp_path / "logs"), [str(tmp_path / "logs" / "y.txt")])


def test_bad_corpora_fail_with_the_fix(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        local_files.list_text_files(str(tmp_path / "nothing*.txt"))
    write(tmp_path / "empty" / "a.txt", b"")
    write(tmp_path / "empty" / "b.txt", b"")
    with pytest.raises(DataError, match="empty corpus"):
        local_files.list_text_files(str(tmp_path / "empty"))
    write(tmp_path / "binary" / "a.txt", b"\x00\x01data")
    with pytest.raises(DataError, match="no readable text"):
        local_files.list_text_files(str(tmp_path / "binary"))


def test_stdlib_listing_leaves_out_tests_and_installed_packages():
    root, files = local_files.list_stdlib_files()
    assert root == sysconfig.get_paths()["stdlib"]
    relative = [os.path.relpath(f, root).replace(os.sep, "/") for f in files]
    assert relative == sorted(relative, key=lambda r: os.path.join(root, r))
    assert "os.py" in relative and "json/decoder.py" in relative
    assert len(files) > 300
    parts = {p for r in relative for p in r.split("/")[:-1]}
    assert not parts & {"test", "tests", "idle_test", "site-packages", "dist-packages"}


def test_each_file_is_a_document_in_sorted_order(tmp_path):
    corpus = tmp_path / "corpus"
    contents = {"b.txt": b"second \xff\xfe not utf-8", "a.txt": "first é😀".encode(),
                "c/d.py": b"print('third')\n"}
    for name, content in contents.items():
        write(corpus / name, content)
    root, files = local_files.list_text_files(str(corpus))
    assert [os.path.relpath(f, root) for f in files] == ["a.txt", "b.txt", os.path.join("c", "d.py")]
    texts = local_files.FileTexts(files)
    assert len(texts) == 3
    assert [r["text"] for r in texts.__getitems__([0, 1, 2])] == [
        "first é😀", "second \ufffd\ufffd not utf-8", "print('third')\n"]


def test_fingerprint_changes_with_the_files(tmp_path):
    a = write(tmp_path / "a.txt", "one")
    before = local_files.fingerprint(str(tmp_path), [str(a)])
    assert before == local_files.fingerprint(str(tmp_path), [str(a)])
    write(tmp_path / "a.txt", "one more")
    assert local_files.fingerprint(str(tmp_path), [str(a)]) != before


@pytest.fixture
def served(tmp_path):
    """A local HTTP server over tmp_path/site: (its base URL, the paths it was asked for)."""
    import functools
    import http.server
    import threading

    asked = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    (tmp_path / "site").mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(tmp_path / "site")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    server.server_close()


def test_a_url_is_downloaded_once_into_the_cache(tmp_path, served):
    base, asked = served
    write(tmp_path / "site" / "input.txt", "First Citizen:\nBefore we proceed any further, hear me speak.\n")
    cache = str(tmp_path / "cache")
    path = local_files.download(f"{base}/input.txt", cache)
    assert path.startswith(os.path.join(cache, "downloads") + os.sep) and os.path.basename(path) == "input.txt"
    assert open(path).read() == (tmp_path / "site" / "input.txt").read_text()
    assert os.listdir(os.path.dirname(path)) == ["input.txt"]  # no temporary file left beside it
    assert local_files.download(f"{base}/input.txt", cache) == path
    assert asked == ["/input.txt"]  # the second call read the cached copy
    # As data.source: the downloaded file is the one document, split 90/10 by position.
    data = base_config().data
    data.update(dict(source=f"url:{base}/input.txt", cache_dir=cache, val_fraction=0.1))
    splits = pipeline.open_source(data)
    assert "".join(splits.train.read(0, 1) + splits.val.read(0, 1)) == open(path).read()
    assert splits.identity["source"] == f"url:{base}/input.txt" and asked == ["/input.txt"]


def test_a_url_that_cannot_be_fetched_is_one_line_naming_a_local_file(tmp_path, served):
    import socket
    base, _ = served
    with socket.socket() as probe:  # a port nothing listens on: what an offline machine gives
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    for url in (f"http://127.0.0.1:{closed}/input.txt", f"{base}/missing.txt"):
        with pytest.raises(DataError, match=r"^cannot download .*--config\.data\.source=text:PATH$") as error:
            local_files.download(url, str(tmp_path / "cache"))
        assert "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "cache" / "downloads")
