"""data.cache: one cache for every loader; atomic writes; a corrupt file is a miss, not a crash."""

import numpy as np

from data import cache, xsum


def test_cache_root_order(tmp_path, monkeypatch):
  monkeypatch.delenv("GINGER_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cache.cache_root() == tmp_path / "xdg" / "ginger"
  monkeypatch.setenv("GINGER_CACHE_DIR", str(tmp_path / "mine"))
  assert cache.cache_root() == tmp_path / "mine"
  assert cache.cache_root(tmp_path / "explicit") == tmp_path / "explicit"


def test_arrays_round_trip_and_corrupt_file_is_a_miss(tmp_path):
  path = tmp_path / "sub" / "a.npz"
  assert cache.load_arrays(path) is None
  assert cache.save_arrays(path, {"x": np.arange(3), "key": np.asarray("k")})
  loaded = cache.load_arrays(path)
  np.testing.assert_array_equal(loaded["x"], [0, 1, 2])
  assert str(loaded["key"]) == "k"
  path.write_bytes(path.read_bytes()[:20])  # truncated by a crash or a full disk
  assert cache.load_arrays(path) is None
  assert [p.name for p in path.parent.iterdir()] == ["a.npz"]  # no temporary files left


def test_unwritable_location_returns_false(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  assert not cache.atomic_write(blocker / "x.bin", b"data")
  assert not cache.save_arrays(blocker / "x.npz", {"x": np.zeros(1)})


def test_corrupt_token_cache_is_rebuilt(tmp_path):
  tok = xsum.load_tokenizer("demo", cache_dir=tmp_path)
  examples = xsum.demo_corpus("validation", 4)
  first = xsum.tokenize_split(examples, tok, cache_dir=tmp_path)
  (token_file,) = (tmp_path / "tokens").iterdir()
  token_file.write_bytes(b"garbage")
  again = xsum.tokenize_split(examples, tok, cache_dir=tmp_path)
  for k in first:
    np.testing.assert_array_equal(first[k], again[k])
  assert cache.load_arrays(token_file) is not None  # rewritten
