import os
import sysconfig

import pytest

from andrea_jax.data import DataError, local_files


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
    assert [texts[i]["text"] for i in range(3)] == ["first é😀", "second \ufffd\ufffd not utf-8", "print('third')\n"]


def test_fingerprint_changes_with_the_files(tmp_path):
    a = write(tmp_path / "a.txt", "one")
    before = local_files.fingerprint(str(tmp_path), [str(a)])
    assert before == local_files.fingerprint(str(tmp_path), [str(a)])
    write(tmp_path / "a.txt", "one more")
    assert local_files.fingerprint(str(tmp_path), [str(a)]) != before
