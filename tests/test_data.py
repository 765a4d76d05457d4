"""nsp.train.data: byte tokenizer, the stdlib default corpus and its cache, token files, split, batches."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from nsp.train import data as D
from nsp.train import token_cache
from nsp.train.data import Batcher, ByteTokenizer, DataError, load_tokens, split


@pytest.fixture(autouse=True)
def _no_home_cache(tmp_path, monkeypatch):
    """Never touch the real ~/.cache: HOME and NSP_CACHE_DIR point into the test's tmp dir."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(D.CACHE_ENV, str(tmp_path / "env-cache"))


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    """The default corpus, built once per module into a tmp cache: (cache_dir, TokenData, seconds)."""
    cache = tmp_path_factory.mktemp("stdlib-cache")
    t0 = time.perf_counter()
    tokens = load_tokens(None, cache_dir=cache)
    return cache, tokens, time.perf_counter() - t0


def _cache_files(cache):
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# --- tokenizer -------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    ids = tok.encode("héllo\n")
    assert ids.dtype == np.uint8
    assert ids.tolist() == list("héllo\n".encode())
    assert tok.decode(ids) == "héllo\n"
    assert tok.encode(b"\x00\xff").tolist() == [0, 255]
    assert tok.decode(np.array([104, 0xFF, 105], dtype=np.int32)) == "h\ufffdi"  # errors="replace"
    with pytest.raises(ValueError):
        tok.decode([300])
    with pytest.raises(TypeError):
        tok.encode(123)


# --- default corpus --------------------------------------------------------------------------------


def test_default_corpus_builds_and_is_nontrivial(stdlib_cache):
    cache, td, _ = stdlib_cache
    assert td.info["cache_hit"] is False
    assert td.num_tokens > 1_000_000 and td.num_tokens == td.tokens.shape[0]
    assert td.vocab_size == 256 and td.tokens.dtype == np.uint8
    assert isinstance(td.tokens, np.memmap)
    assert td.info["file_count"] > 100
    assert "stdlib" in td.source
    bin_path, meta_path = td.info["cache_path"], td.info["meta_path"]
    assert os.path.getsize(bin_path) == td.num_tokens
    meta = json.loads(open(meta_path).read())
    assert meta["num_tokens"] == td.num_tokens and meta["file_count"] == td.info["file_count"]
    assert len(meta["fingerprint"]) == 64
    # Only the two cache files, no leftovers.
    assert _cache_files(cache) == sorted([os.path.basename(bin_path), os.path.basename(meta_path)])
    # A slice decodes to Python source.
    text = ByteTokenizer().decode(td.tokens[td.num_tokens // 2: td.num_tokens // 2 + 20_000])
    assert "def " in text and "return" in text and "\ufffd" not in text


def test_default_corpus_second_load_hits_cache(stdlib_cache, monkeypatch):
    cache, first, _ = stdlib_cache
    bin_path = first.info["cache_path"]
    before = os.stat(bin_path).st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cache was rebuilt")

    monkeypatch.setattr(token_cache, "_build_cache", no_rebuild)
    second = load_tokens(None, cache_dir=cache)
    assert second.info["cache_hit"] is True
    assert second.num_tokens == first.num_tokens
    assert os.stat(bin_path).st_mtime_ns == before
    assert np.array_equal(second.tokens[:1000], first.tokens[:1000])
    # "" means the default corpus too (TrainConfig.data's default), and NSP_CACHE_DIR is honoured.
    monkeypatch.setenv(D.CACHE_ENV, str(cache))
    assert D.default_cache_dir() == cache
    assert load_tokens("").info["cache_hit"] is True


def test_default_cache_dir_without_env(tmp_path, monkeypatch):
    monkeypatch.delenv(D.CACHE_ENV)
    assert D.default_cache_dir() == tmp_path / "home" / ".cache" / "nsp" / "data"


def test_stdlib_files_sorted_and_without_tests():
    files = D.stdlib_files()
    rels = [rel for rel, _ in files]
    assert rels == sorted(rels)
    assert "os.py" in rels and "json/decoder.py" in rels
    assert all(rel.endswith(".py") for rel in rels)
    for rel in rels:
        parts = rel.split("/")[:-1]
        assert not D.STDLIB_EXCLUDED_DIRS.intersection(parts), rel
    assert not any(rel.startswith(("test/", "idlelib/idle_test/", "lib2to3/tests/")) for rel in rels)


def test_stdlib_files_exclusions(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/tests/t.py", "test/x.py", "idlelib/idle_test/y.py",
                "site-packages/z.py", "notes.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert [rel for rel, _ in D.stdlib_files(tmp_path)] == ["a.py", "pkg/b.py"]


# --- batches ---------------------------------------------------------------------------------------


@pytest.fixture
def small_tokens():
    return np.arange(10_000, dtype=np.uint16) % 997


def test_batches_deterministic_by_seed_and_step(small_tokens):
    a = Batcher(small_tokens, batch_size=4, seq_len=16, seed=7)
    b = Batcher(small_tokens, batch_size=4, seq_len=16, seed=7)
    x = a.batch(3)
    assert x.shape == (4, 17) and x.dtype == np.int32
    assert np.array_equal(x, b.batch(3))
    assert np.array_equal(x, a.batch(3))  # no hidden state
    assert not np.array_equal(a.batch(3), a.batch(4))
    assert not np.array_equal(a.batch(3), Batcher(small_tokens, 4, 16, seed=8).batch(3))
    # Rows are contiguous windows of the tokens.
    for start, row in zip(a.starts(3), x):
        assert np.array_equal(row, small_tokens[start: start + 17].astype(np.int32))


def test_resume_equals_continuing(small_tokens):
    straight = Batcher(small_tokens, 2, 8, seed=1)
    stream = iter(straight)
    continued = [next(stream) for _ in range(10)]
    resumed = Batcher(small_tokens, 2, 8, seed=1, start_step=6)
    got = [batch for _, batch in zip(range(4), resumed)]
    for want, have in zip(continued[6:], got):
        assert np.array_equal(want, have)
    assert np.array_equal(next(straight.iter_from(9)), continued[9])


def test_windows_never_run_past_the_end():
    tokens = np.arange(12, dtype=np.uint8)
    exact = Batcher(tokens, 3, 11, seed=0)  # one window only
    assert all(np.array_equal(row, np.arange(12)) for row in exact.batch(5))
    b = Batcher(tokens, 64, 9, seed=0)  # starts 0, 1, 2
    starts = np.concatenate([b.starts(s) for s in range(20)])
    assert starts.min() == 0 and starts.max() == 2
    assert b.batch(0).max() <= 11
    with pytest.raises(DataError, match="window"):
        Batcher(tokens, 1, 12, seed=0)
    with pytest.raises(DataError, match="seed"):
        Batcher(tokens, 1, 4, seed=-1)


def test_batches_from_memmapped_cache(stdlib_cache):
    _, td, _ = stdlib_cache
    train, _ = split(td, 0.05, seq_len=256)
    x = Batcher(train, 8, 256, seed=0).batch(0)
    assert x.shape == (8, 257) and 0 <= x.min() and x.max() < 256


# --- split -----------------------------------------------------------------------------------------


def test_split_tail_is_held_out(small_tokens):
    train, held = split(small_tokens, 0.1, seq_len=16)
    assert len(train) == 9_000 and len(held) == 1_000
    assert np.shares_memory(train, small_tokens) and np.shares_memory(held, small_tokens)
    assert np.array_equal(np.concatenate([train, held]), small_tokens)
    with pytest.raises(DataError, match="window"):
        split(small_tokens, 0.001, seq_len=16)  # 10 held-out tokens < 17
    with pytest.raises(DataError, match="window"):
        split(small_tokens, 0.999, seq_len=16)
    with pytest.raises(DataError, match="held_out_fraction"):
        split(small_tokens, 0.0)


# --- other sources ---------------------------------------------------------------------------------


def test_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    text = "hello wörld\n" * 100
    path.write_text(text, encoding="utf-8")
    cache = tmp_path / "cache"
    td = load_tokens(str(path), cache_dir=cache, seq_len=32)
    assert td.num_tokens == len(text.encode()) and td.tokens.dtype == np.uint8
    assert isinstance(td.tokens, np.memmap) and td.vocab_size == 256
    assert ByteTokenizer().decode(td.tokens) == text
    assert td.info["cache_hit"] is False and str(path) in td.source
    assert load_tokens(path, cache_dir=cache).info["cache_hit"] is True


def test_directory_of_text_files(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_bytes(b"second")
    (root / "a.md").write_bytes(b"first")
    (root / "sub" / "c.py").write_bytes(b"third")
    (root / "blob.dat").write_bytes(b"\x00\x01binary")
    (root / "empty.txt").write_bytes(b"")
    (root / ".hidden").write_bytes(b"hidden")
    td = load_tokens(root, cache_dir=tmp_path / "cache")
    assert bytes(td.tokens) == b"first\n\nsecond\n\nthird"
    assert td.num_tokens == 5 + 2 + 6 + 2 + 5
    assert td.info["file_count"] == 3 and td.info["skipped_files"] == 1


def test_bin_token_file_is_memmapped(tmp_path):
    path = tmp_path / "tokens.bin"
    raw = np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint8)
    raw.tofile(path)
    td = load_tokens(path, cache_dir=tmp_path / "cache")
    assert isinstance(td.tokens, np.memmap) and td.tokens.dtype == np.uint8
    assert td.num_tokens == 5000 and td.vocab_size == 256
    assert np.array_equal(td.tokens, raw)
    assert not (tmp_path / "cache").exists()  # token files are used in place


def test_npy_token_files(tmp_path):
    ids = (np.arange(3000) % 1000).astype(np.uint16)
    np.save(tmp_path / "t16.npy", ids)
    td = load_tokens(tmp_path / "t16.npy")
    assert isinstance(td.tokens, np.memmap) and td.tokens.dtype == np.uint16
    assert td.num_tokens == 3000 and td.vocab_size == 1024  # 1000 rounded up to a multiple of 64
    assert np.array_equal(td.tokens, ids)
    assert load_tokens(tmp_path / "t16.npy", vocab_size=1000).vocab_size == 1000
    with pytest.raises(DataError, match="999"):
        load_tokens(tmp_path / "t16.npy", vocab_size=999)
    np.save(tmp_path / "t8.npy", ids.astype(np.uint8))
    td8 = load_tokens(tmp_path / "t8.npy")
    assert td8.tokens.dtype == np.uint8 and td8.vocab_size == 256 and isinstance(td8.tokens, np.memmap)


@pytest.mark.parametrize("case", ["missing", "empty_text", "empty_bin", "empty_npy", "binary_dir",
                                  "empty_dir", "dir_of_empty_files", "binary_file", "float_npy",
                                  "2d_npy", "too_short"])
def test_bad_inputs(tmp_path, case):
    cache = tmp_path / "cache"
    kwargs = {}
    if case == "missing":
        path, match = tmp_path / "nope.txt", "does not exist"
    elif case == "empty_text":
        path, match = tmp_path / "e.txt", "empty"
        path.write_bytes(b"")
    elif case == "empty_bin":
        path, match = tmp_path / "e.bin", "empty"
        path.write_bytes(b"")
    elif case == "empty_npy":
        path, match = tmp_path / "e.npy", "empty"
        np.save(path, np.zeros(0, np.uint16))
    elif case == "binary_dir":
        path, match = tmp_path / "bin", "no readable text files"
        path.mkdir()
        (path / "x.dat").write_bytes(b"a\x00b")
    elif case == "empty_dir":
        path, match = tmp_path / "nothing", "no regular files"
        path.mkdir()
    elif case == "dir_of_empty_files":
        path, match = tmp_path / "blank", "empty"
        path.mkdir()
        (path / "a.txt").write_bytes(b"")
    elif case == "binary_file":
        path, match = tmp_path / "model.pt", "not a text file"
        path.write_bytes(b"PK\x00\x03")
    elif case == "float_npy":
        path, match = tmp_path / "f.npy", "float32"
        np.save(path, np.zeros(100, np.float32))
    elif case == "2d_npy":
        path, match = tmp_path / "m.npy", "1-D"
        np.save(path, np.zeros((10, 10), np.uint16))
    elif case == "too_short":
        path, match = tmp_path / "short.txt", "fewer than one training window"
        path.write_bytes(b"x" * 64)
        kwargs = {"seq_len": 64}
    with pytest.raises(DataError, match=match) as info:
        load_tokens(str(path), cache_dir=cache, **kwargs)
    assert str(path) in str(info.value)
    if case != "too_short":  # a valid text that is merely short is cached; nothing else may be
        assert _cache_files(cache) == []
    assert not any(n.endswith(".tmp") for n in _cache_files(cache))


def test_short_corpus_ok_at_exact_window(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 65)
    assert load_tokens(path, cache_dir=tmp_path / "c", seq_len=64).num_tokens == 65


# --- cache integrity -------------------------------------------------------------------------------


def _corpus_dir(tmp_path, n=3):
    root = tmp_path / "corpus"
    root.mkdir(exist_ok=True)
    for i in range(n):
        (root / f"f{i}.txt").write_text(f"file {i} " * 50)
    return root


def _failing_reader(monkeypatch, fail_on_call, exc=RuntimeError("disk on fire")):
    real, calls = token_cache._read_bytes, []

    def reader(path):
        calls.append(path)
        if len(calls) == fail_on_call:
            raise exc
        return real(path)

    monkeypatch.setattr(token_cache, "_read_bytes", reader)
    return calls


def test_failed_build_leaves_no_partial_cache(tmp_path, monkeypatch):
    root, cache = _corpus_dir(tmp_path), tmp_path / "cache"
    calls = _failing_reader(monkeypatch, fail_on_call=2)
    with pytest.raises(RuntimeError, match="disk on fire"):
        load_tokens(root, cache_dir=cache)
    assert len(calls) == 2
    assert _cache_files(cache) == []  # neither a .bin, a .json nor a temp file
    monkeypatch.undo()
    td = load_tokens(root, cache_dir=tmp_path / "cache")
    assert td.info["cache_hit"] is False and td.info["file_count"] == 3


def test_failed_rebuild_keeps_old_cache(tmp_path, monkeypatch):
    root, cache = _corpus_dir(tmp_path), tmp_path / "cache"
    old = load_tokens(root, cache_dir=cache)
    old_bytes = {name: (cache / name).read_bytes() for name in _cache_files(cache)}
    (root / "f1.txt").write_text("changed and longer " * 50)
    _failing_reader(monkeypatch, fail_on_call=3, exc=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        load_tokens(root, cache_dir=cache)
    assert {name: (cache / name).read_bytes() for name in _cache_files(cache)} == old_bytes
    monkeypatch.undo()
    new = load_tokens(root, cache_dir=cache)
    assert new.info["cache_hit"] is False and new.num_tokens != old.num_tokens
    assert b"changed and longer" in bytes(new.tokens)


def test_killed_build_never_leaves_a_torn_cache(tmp_path):
    root, cache = _corpus_dir(tmp_path, n=4), tmp_path / "cache"
    script = textwrap.dedent(f"""
        import os, signal
        from nsp.train import data as D, token_cache
        real, calls = token_cache._read_bytes, []
        def reader(path):
            calls.append(path)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path)
        token_cache._read_bytes = reader
        D.load_tokens({str(root)!r}, cache_dir={str(cache)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    # At most a stale temp file: no .bin or .json under the real names.
    assert [n for n in _cache_files(cache) if not n.endswith(".tmp")] == []
    td = load_tokens(root, cache_dir=cache)
    assert td.info["cache_hit"] is False and td.info["file_count"] == 4


def test_changed_source_invalidates_cache(tmp_path):
    path, cache = tmp_path / "t.txt", tmp_path / "cache"
    path.write_bytes(b"aaaa bbbb cccc")
    first = load_tokens(path, cache_dir=cache)
    assert load_tokens(path, cache_dir=cache).info["cache_hit"] is True
    # Same size, new content and mtime.
    st = path.stat()
    path.write_bytes(b"zzzz bbbb cccc")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = load_tokens(path, cache_dir=cache)
    assert second.info["cache_hit"] is False and bytes(second.tokens) == b"zzzz bbbb cccc"
    assert second.info["fingerprint"] != first.info["fingerprint"]
    # New size.
    path.write_bytes(b"short")
    third = load_tokens(path, cache_dir=cache)
    assert third.info["cache_hit"] is False and third.num_tokens == 5
    # A new file in a directory source.
    root = _corpus_dir(tmp_path)
    assert load_tokens(root, cache_dir=cache).info["cache_hit"] is False
    assert load_tokens(root, cache_dir=cache).info["cache_hit"] is True
    (root / "zz.txt").write_text("new file")
    again = load_tokens(root, cache_dir=cache)
    assert again.info["cache_hit"] is False and again.info["file_count"] == 4
    assert bytes(again.tokens).endswith(b"\n\nnew file")


def test_truncated_cache_is_rebuilt(tmp_path):
    path, cache = tmp_path / "t.txt", tmp_path / "cache"
    path.write_bytes(b"0123456789" * 10)
    td = load_tokens(path, cache_dir=cache)
    with open(td.info["cache_path"], "r+b") as f:
        f.truncate(50)
    again = load_tokens(path, cache_dir=cache)
    assert again.info["cache_hit"] is False and again.num_tokens == 100
    assert bytes(again.tokens) == b"0123456789" * 10
