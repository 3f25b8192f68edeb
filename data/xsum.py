"""XSUM summarization data: raw text, tokenizers and token arrays for T5.

The training loop gathers batches from the token arrays on the device, in the order of the
task's ``batch_order`` (models/tasks.py: one definition of epoch order for every task).

Sources (``load_xsum(source=...)``):
  * ``"hf"`` (the default): Hugging Face ``datasets`` (``EdinburghNLP/xsum``, read from the
    Hub's Parquet export since ``datasets`` no longer runs its loading script; ``path`` =
    optional cache dir).
  * ``"tfds"``: TensorFlow Datasets' ``xsum`` (needs tensorflow-datasets and XSUM's manual
    download; ``path`` = ``data_dir``). Imported lazily: not installed by default.
  * ``"local"``: ``path`` is a folder with ``train.jsonl`` / ``validation.jsonl`` / ``test.jsonl``,
    or one ``.jsonl`` file split deterministically in file order: the first 90% is ``train`` and
    the last 10% ``validation`` (no ``test``). Each line is an object with ``document`` and
    ``summary``.
  * ``"demo"``: a small synthetic corpus built here (fictional towns, teams and firms; each
    one-sentence summary restates facts found in its document, so it is learnable by a tiny model
    in minutes on a CPU). Deterministic, offline, no files.

A source that cannot be had raises ``DatasetUnavailableError`` (within seconds when offline:
hub reachability is probed for at most 2 s and ``datasets`` is then forced into offline mode);
there is never a silent fallback to other data.

Tokenizers (``load_tokenizer``): the T5 SentencePiece tokenizer through ``transformers`` from a
local directory or the hub, a SentencePiece ``.model`` file, or ``"demo"``: a SentencePiece model
(BPE, see ``train_sentencepiece``) trained on the demo corpus on the fly (pad=0, eos=1, unk=2 like
T5) and cached on disk.

Caches (tokenizers, token arrays) live in ``data.cache.cache_root()``: ``$GINGER_CACHE_DIR``,
else ``$XDG_CACHE_HOME/ginger``, else ``~/.cache/ginger``, or in an explicit ``cache_dir``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data import hub
from data.cache import atomic_write, cache_root, load_arrays, save_arrays
from data.images import DatasetUnavailableError

SOURCES = ("hf", "tfds", "local", "demo")
SPLITS = ("train", "validation", "test")
HF_REPO = "EdinburghNLP/xsum"
LOCAL_VALIDATION_FRACTION = 0.1
DEMO_SIZES = {"train": 512, "validation": 64, "test": 64}
DEMO_VOCAB_SIZE = 800
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
_CACHE_VERSION = "1"

Example = dict[str, str]


class TokenizerUnavailableError(DatasetUnavailableError):
  """The requested tokenizer cannot be loaded here; the message says how to provide it."""


class MissingInputsError(DatasetUnavailableError):
  """Several inputs of a run (tokenizer, data, weights) cannot be had here; the message lists
  each with how to provide it."""


def load_inputs(
  loads: Mapping[str, Callable[[], Any]], unavailable: tuple[type[Exception], ...] = ()
) -> dict[str, Any]:
  """Runs every load, also after one failed, so that one message lists everything missing.

  Offline, a run needs its tokenizer, its data and its weights; failing on the first missing
  piece would make the user fix them one rerun at a time.

  Args:
    loads: name -> zero-argument loader, e.g. ``{"tokenizer": ..., "data": ..., "weights": ...}``.
    unavailable: error classes that mean "cannot be had here" besides
      ``DatasetUnavailableError`` (e.g. the model's ``ModelUnavailableError``); anything else
      is a bug and raises at once.

  Raises:
    The loader's own error when exactly one input is missing, else :class:`MissingInputsError`.
  """
  results, failed = {}, {}
  for name, load in loads.items():
    try:
      results[name] = load()
    except (DatasetUnavailableError, *unavailable) as e:
      failed[name] = e
  if len(failed) == 1:
    raise next(iter(failed.values()))
  if failed:
    lines = "\n".join(f"  - {name}: {e}" for name, e in failed.items())
    raise MissingInputsError(
      f"{len(failed)} inputs of this run are not available here ({', '.join(failed)}):\n{lines}"
    )
  return results


# ------------------------------------------------------------------------------- raw text


def load_xsum(
  source: str = "hf",
  path: str | os.PathLike | None = None,
  *,
  splits: Sequence[str] = ("train", "validation"),
  limit: int | None = None,
) -> dict[str, list[Example]]:
  """split -> list of {"document", "summary"}; ``limit`` keeps the first examples of each."""
  bad = [s for s in splits if s not in SPLITS]
  if bad:
    raise ValueError(f"unknown splits {bad}; allowed: {list(SPLITS)}")
  loaders = {"hf": _load_hf, "tfds": _load_tfds, "local": _load_local, "demo": _load_demo}
  if source not in loaders:
    raise ValueError(f"unknown XSUM source {source!r}; allowed: {list(SOURCES)}")
  data = loaders[source](path, tuple(splits))
  return {s: data[s][:limit] if limit is not None else data[s] for s in splits}


def _how_to_get() -> str:
  return (
    "Provide XSUM as jsonl (objects with 'document' and 'summary') via data.source=local "
    "data.path=<folder with train.jsonl/validation.jsonl/test.jsonl, or one .jsonl file>, "
    "or use data.source=demo for the built-in synthetic corpus."
  )


def _example(row: dict[str, Any], where: str) -> Example:
  try:
    return {"document": str(row["document"]), "summary": str(row["summary"])}
  except (KeyError, TypeError):
    raise DatasetUnavailableError(
      f"{where}: expected an object with 'document' and 'summary', got {_preview(row)}"
    ) from None


def _preview(value: Any, width: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= width else text[: width - 3] + "..."


def read_jsonl(file: str | os.PathLike) -> list[Example]:
  """Examples of a jsonl file (blank lines skipped).

  Raises:
    DatasetUnavailableError: naming the file (and line) when it is not UTF-8 text, a line is
      not a JSON object with ``document`` and ``summary``, or it holds no examples.
  """
  out = []
  with open(file, encoding="utf-8") as f:
    i = 0
    try:
      for i, line in enumerate(f, 1):  # noqa: B007 - i names the line of a decoding error
        if line.strip():
          out.append(_example(_json_line(line, f"{file}:{i}"), f"{file}:{i}"))
    except UnicodeDecodeError as e:
      raise DatasetUnavailableError(
        f"{file}: not UTF-8 text near line {i + 1} ({e.reason}); a jsonl file is UTF-8 text "
        "with one JSON object per line"
      ) from None
  if not out:
    raise DatasetUnavailableError(
      f"{file} holds no examples (the file is empty or blank). {_how_to_get()}"
    )
  return out


def _json_line(line: str, where: str) -> Any:
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    raise DatasetUnavailableError(
      f"{where}: not valid JSON ({e.msg} at column {e.colno}): {_preview(line.strip())}; each "
      "line must be an object with 'document' and 'summary'"
    ) from None


def _load_local(path: str | os.PathLike | None, splits: tuple[str, ...]) -> dict:
  if path is None:
    raise DatasetUnavailableError(f"data.source=local needs data.path. {_how_to_get()}")
  root = Path(path).expanduser()
  if root.is_file():
    if "test" in splits:
      raise DatasetUnavailableError(
        f"{root} is a single file: it provides train (first 90%) and validation (last "
        "10%) only; put a test.jsonl in a folder for a test split."
      )
    rows = read_jsonl(root)
    n_val = int(round(len(rows) * LOCAL_VALIDATION_FRACTION))
    if "validation" in splits and n_val == 0:
      raise DatasetUnavailableError(
        f"{root} holds {len(rows)} example(s): its last 10% (the validation split) is empty. "
        "Give more examples, or a folder with train.jsonl and validation.jsonl."
      )
    return {"train": rows[: len(rows) - n_val], "validation": rows[len(rows) - n_val :]}
  if root.is_dir():
    missing = [s for s in splits if not (root / f"{s}.jsonl").is_file()]
    if missing:
      raise DatasetUnavailableError(
        f"{root} has no {', '.join(s + '.jsonl' for s in missing)}. {_how_to_get()}"
      )
    return {s: read_jsonl(root / f"{s}.jsonl") for s in splits}
  raise DatasetUnavailableError(f"local XSUM path {str(root)!r} does not exist. {_how_to_get()}")


def _load_hf(path: str | os.PathLike | None, splits: tuple[str, ...]) -> dict:
  try:
    ds = hub.load_dataset(HF_REPO, path)
  except hub.HubLoadError as e:
    raise DatasetUnavailableError(f"{e}. {_how_to_get()}") from e
  return {s: [_example(r, f"{HF_REPO}[{s}]") for r in ds[s]] for s in splits}


def _load_tfds(path: str | os.PathLike | None, splits: tuple[str, ...]) -> dict:
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise DatasetUnavailableError(
      "data.source=tfds needs tensorflow-datasets and TensorFlow (not pinned here: `pip "
      "install tensorflow-datasets tensorflow`) and XSUM's manual download in "
      "<data_dir>/downloads/manual. " + _how_to_get()
    ) from e
  out = {}
  try:
    for s in splits:
      ds = tfds.as_numpy(tfds.load("xsum", split=s, data_dir=None if path is None else path))
      out[s] = [{"document": r["document"].decode(), "summary": r["summary"].decode()} for r in ds]
  except Exception as e:  # noqa: BLE001 - tfds raises many types (manual download missing...)
    raise DatasetUnavailableError(f"tfds could not load xsum: {e}. {_how_to_get()}") from e
  return out


# ---------------------------------------------------------------------------- demo corpus

_PREFIXES = [
  "Ash",
  "Bram",
  "Cold",
  "Dun",
  "Elm",
  "Fern",
  "Glen",
  "Hol",
  "Iron",
  "Kings",
  "Lark",
  "Marsh",
  "North",
  "Oak",
  "Pen",
  "Raven",
  "Stone",
  "Thorn",
  "West",
  "Wil",
]
_SUFFIXES = ["ford", "bridge", "wick", "by", "ham", "moor", "stead", "field", "ton", "mouth"]
_MASCOTS = ["Rovers", "United", "Athletic", "Town", "Wanderers", "Rangers", "City", "Albion"]
_FIRST = [
  "Anna",
  "Ben",
  "Clara",
  "David",
  "Ella",
  "Farid",
  "Grace",
  "Hugo",
  "Isla",
  "Jamal",
  "Kate",
  "Liam",
  "Maya",
  "Noah",
  "Olga",
  "Priya",
  "Ravi",
  "Sara",
  "Tom",
  "Zoe",
]
_LAST = [
  "Adams",
  "Baker",
  "Carter",
  "Dixon",
  "Evans",
  "Foster",
  "Grant",
  "Hughes",
  "Irwin",
  "Jones",
  "Khan",
  "Lewis",
  "Morgan",
  "Nash",
  "Owen",
  "Patel",
  "Reid",
  "Shaw",
  "Turner",
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_FACILITIES = ["library", "swimming pool", "bus station", "sports centre", "bridge", "school"]
_INDUSTRIES = ["software", "engineering", "food", "energy", "textile", "shipping"]
_FESTIVALS = ["music", "food", "film", "book", "lantern", "cheese"]
_WEATHER = ["rain", "snow", "wind", "hail"]


def _person(r: random.Random) -> str:
  return f"{r.choice(_FIRST)} {r.choice(_LAST)}"


def _town(r: random.Random) -> str:
  return r.choice(_PREFIXES) + r.choice(_SUFFIXES)


def _football(r: random.Random) -> Example:
  town, away_town = _town(r), _town(r)
  home, away = f"{town} {r.choice(_MASCOTS)}", f"{away_town} {r.choice(_MASCOTS)}"
  hs, as_ = r.randint(0, 4), r.randint(0, 4)
  scorer, manager, day = _person(r), _person(r), r.choice(_DAYS)
  body = [
    f"{scorer} opened the scoring after {r.randint(3, 85)} minutes with a low shot.",
    f"Manager {manager} said the players had shown great spirit.",
    f"A crowd of {r.randint(2, 30) * 500} watched the match.",
    f"{away} had chances before the break but could not take them.",
  ]
  r.shuffle(body)
  doc = [f"{home} hosted {away} in {town} on {day}.", *body, f"The final score was {hs}-{as_}."]
  if hs > as_:
    summary = f"{home} beat {away} {hs}-{as_} in {town} on {day}."
  elif hs < as_:
    summary = f"{away} won {as_}-{hs} away at {home} on {day}."
  else:
    summary = f"{home} and {away} drew {hs}-{as_} in {town} on {day}."
  return {"document": " ".join(doc), "summary": summary}


def _council(r: random.Random) -> Example:
  town, facility, person = _town(r), r.choice(_FACILITIES), _person(r)
  cost, yes, no = r.randint(2, 40), r.randint(3, 20), r.randint(3, 20)
  doc = [
    f"Councillors in {town} have voted on plans for a new {facility}.",
    f"The {facility} would cost about {cost} million pounds.",
    f"Local resident {person} said the {facility} was long overdue.",
    f"In the end {yes} members voted in favour and {no} against.",
  ]
  verb = "approved" if yes > no else "rejected"
  summary = f"Councillors in {town} have {verb} plans for a {cost} million pound {facility}."
  return {"document": " ".join(doc), "summary": summary}


def _business(r: random.Random) -> Example:
  town, company, industry = (
    _town(r),
    f"{_town(r)} {r.choice(['Group', 'Works', 'Labs'])}",
    r.choice(_INDUSTRIES),
  )
  jobs, boss = r.randint(2, 60) * 10, _person(r)
  doc = [
    f"{company}, a {industry} firm, is expanding.",
    f"Chief executive {boss} said demand had grown strongly this year.",
    f"The company will open a new site in {town} next year.",
    f"It expects to create {jobs} jobs there.",
  ]
  summary = f"The {industry} firm {company} is to create {jobs} jobs at a new site in {town}."
  return {"document": " ".join(doc), "summary": summary}


def _festival(r: random.Random) -> Example:
  town, kind, visitors = _town(r), r.choice(_FESTIVALS), r.randint(2, 90) * 1000
  organiser, weather = _person(r), r.choice(_WEATHER)
  doc = [
    f"The {town} {kind} festival ended on {r.choice(_DAYS)}.",
    f"Organiser {organiser} said about {visitors} people attended over three days.",
    f"Some events were moved indoors because of {weather}.",
    "Local businesses said it had been a good weekend.",
  ]
  summary = f"About {visitors} people attended the {kind} festival in {town} despite {weather}."
  return {"document": " ".join(doc), "summary": summary}


_GENERATORS = (_football, _council, _business, _festival)


def demo_corpus(split: str, n: int | None = None) -> list[Example]:
  """The deterministic synthetic corpus of one split (distinct seeds per split)."""
  r = random.Random(f"ginger-xsum-demo-{split}")
  count = DEMO_SIZES[split] if n is None else n
  return [_GENERATORS[i % len(_GENERATORS)](r) for i in range(count)]


def _load_demo(path: str | os.PathLike | None, splits: tuple[str, ...]) -> dict:
  return {s: demo_corpus(s) for s in splits}


# ------------------------------------------------------------------------------ tokenizers


class SentencePieceTokenizer:
  """A SentencePiece model with T5's conventions (pad=0, eos=1); EOS is added by the caller."""

  def __init__(self, model_file: str | os.PathLike):
    import sentencepiece as spm

    proto = Path(model_file).read_bytes()
    self.sp = spm.SentencePieceProcessor(model_proto=proto)
    self.fingerprint = "spm:" + hashlib.sha256(proto).hexdigest()[:16]
    self.vocab_size = int(self.sp.get_piece_size())
    self.pad_id, self.eos_id = int(self.sp.pad_id()), int(self.sp.eos_id())

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    return self.sp.encode(list(texts))

  def decode(self, ids: Iterable[int]) -> str:
    return self.sp.decode(_until_eos(ids, self.eos_id, self.pad_id))

  def batch_decode(self, batch: Iterable[Iterable[int]]) -> list[str]:
    return [self.decode(ids) for ids in batch]


class HFTokenizer:
  """A ``transformers`` tokenizer (the T5 one) behind the same small interface."""

  def __init__(self, tokenizer: Any):
    self.tok = tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab()))
    self.fingerprint = "hf:" + hashlib.sha256(spec.encode()).hexdigest()[:16]
    self.vocab_size = len(tokenizer)
    self.pad_id, self.eos_id = int(tokenizer.pad_token_id), int(tokenizer.eos_token_id)

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    return self.tok(list(texts), add_special_tokens=False)["input_ids"]

  def decode(self, ids: Iterable[int]) -> str:
    return self.tok.decode(_until_eos(ids, self.eos_id, self.pad_id), skip_special_tokens=True)

  def batch_decode(self, batch: Iterable[Iterable[int]]) -> list[str]:
    return [self.decode(ids) for ids in batch]


Tokenizer = SentencePieceTokenizer | HFTokenizer


def _until_eos(ids: Iterable[int], eos: int, pad: int) -> list[int]:
  out = []
  for i in (int(x) for x in ids):
    if i == eos:
      break
    if i != pad:
      out.append(i)
  return out


def train_sentencepiece(
  texts: Iterable[str],
  *,
  vocab_size: int = DEMO_VOCAB_SIZE,
  model_type: str = "bpe",
  cache_dir: str | os.PathLike | None = None,
) -> Path:
  """Train (or reuse from the cache) a SentencePiece model with pad=0, eos=1, unk=2, no BOS.

  BPE by default: on the small templated demo corpus the unigram trainer degenerates (its seed
  vocabulary caps at ~545 pieces and frequent words such as "United" end up spelled letter by
  letter, doubling sequence lengths), while BPE learns whole words. ``model_type="unigram"``
  (T5's own kind) is there for larger corpora. ``hard_vocab_limit=False`` lets a small corpus
  end with fewer pieces than asked rather than fail; ``vocab_size`` of the tokenizer reports
  what was learned.
  """
  import sentencepiece as spm

  lines = [line for t in texts for line in t.splitlines() if line.strip()]
  digest = hashlib.sha256(f"{_CACHE_VERSION}|{vocab_size}|{model_type}|".encode())
  for line in lines:
    digest.update(line.encode() + b"\n")
  path = cache_root(cache_dir) / "spm" / f"{digest.hexdigest()[:20]}.model"
  if path.exists():
    return path
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines),
    model_writer=buf,
    vocab_size=vocab_size,
    model_type=model_type,
    pad_id=PAD_ID,
    eos_id=EOS_ID,
    unk_id=UNK_ID,
    bos_id=-1,
    hard_vocab_limit=False,
    character_coverage=1.0,
    num_threads=2,
    minloglevel=2,
  )
  if not atomic_write(path, buf.getvalue()):
    raise OSError(f"cannot write the SentencePiece model to {path} (set GINGER_CACHE_DIR)")
  return path


def _demo_tokenizer(cache_dir: str | os.PathLike | None, vocab_size: int) -> Tokenizer:
  texts = ["summarize: "]
  for ex in demo_corpus("train"):
    texts += [ex["document"], ex["summary"]]
  return SentencePieceTokenizer(
    train_sentencepiece(texts, vocab_size=vocab_size, cache_dir=cache_dir)
  )


def _tokenizer_unavailable(name: str, why: str) -> TokenizerUnavailableError:
  return TokenizerUnavailableError(
    f"tokenizer {name!r} is not available: {why}. Pass a local directory saved with "
    "`AutoTokenizer.from_pretrained(name).save_pretrained(dir)` (data.tokenizer=<dir>; a "
    "model directory with its tokenizer files works), a SentencePiece .model file, or "
    "'demo' for the on-the-fly tokenizer of the demo corpus."
  )


def load_tokenizer(
  name_or_path: str,
  *,
  cache_dir: str | os.PathLike | None = None,
  vocab_size: int = DEMO_VOCAB_SIZE,
) -> Tokenizer:
  """ "demo", a SentencePiece .model file, a local tokenizer dir, or a hub name ("t5-small")."""
  if name_or_path == "demo":
    return _demo_tokenizer(cache_dir, vocab_size)
  path = Path(name_or_path).expanduser()
  if path.is_file() and path.suffix == ".model":
    return SentencePieceTokenizer(path)
  from transformers import AutoTokenizer

  if path.is_dir():
    try:
      return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    except Exception as e:  # noqa: BLE001
      raise _tokenizer_unavailable(name_or_path, f"{type(e).__name__}: {e}") from e
  if path.is_absolute() or name_or_path.startswith((".", "~")) or path.exists():
    raise _tokenizer_unavailable(name_or_path, f"{path} is not a directory or .model file")
  try:
    return HFTokenizer(AutoTokenizer.from_pretrained(name_or_path, local_files_only=True))
  except Exception:  # noqa: BLE001 - not cached: try the network if there is one
    pass
  if not hub.hub_reachable():
    raise _tokenizer_unavailable(name_or_path, "offline and not in the local HF cache")
  try:
    return HFTokenizer(AutoTokenizer.from_pretrained(name_or_path))
  except Exception as e:  # noqa: BLE001
    raise _tokenizer_unavailable(name_or_path, f"{type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------- token arrays


def _pad_with_eos(
  seqs: list[list[int]], max_len: int, eos: int, pad: int, pad_to_longest: bool
) -> tuple[np.ndarray, np.ndarray]:
  """Truncate to max_len - 1, append EOS (as T5's tokenizer does), pad; ids and mask, int32."""
  clipped = [s[: max_len - 1] + [eos] for s in seqs]
  width = max((len(s) for s in clipped), default=1) if pad_to_longest else max_len
  ids = np.full((len(clipped), width), pad, np.int32)
  mask = np.zeros((len(clipped), width), np.int32)
  for i, s in enumerate(clipped):
    ids[i, : len(s)] = s
    mask[i, : len(s)] = 1
  return ids, mask


def _tokens_key(
  examples: Sequence[Example],
  tokenizer: Tokenizer,
  prefix: str,
  lengths: tuple[int, int],
  pad_to_longest: bool,
) -> str:
  digest = hashlib.sha256(
    f"{_CACHE_VERSION}|{tokenizer.fingerprint}|{prefix!r}|{lengths}|{pad_to_longest}|"
    f"{len(examples)}|".encode()
  )
  for ex in examples:
    digest.update(ex["document"].encode() + b"\0" + ex["summary"].encode() + b"\0")
  return digest.hexdigest()[:24]


def tokenize_split(
  examples: Sequence[Example],
  tokenizer: Tokenizer,
  *,
  prefix: str = "summarize: ",
  max_source_len: int = 512,
  max_target_len: int = 128,
  pad_to_longest: bool = False,
  cache: bool = True,
  cache_dir: str | os.PathLike | None = None,
) -> dict[str, np.ndarray]:
  """int32 arrays ``input_ids``, ``attention_mask`` (N, S) and ``labels``,
  ``decoder_attention_mask`` (N, T).

  Sources are ``prefix + document``; both sides are truncated to leave room for EOS. Label
  padding is ``pad`` (0), not -100: ``decoder_attention_mask`` is the label mask (1 on real
  tokens including EOS), which the loss uses and which is also a valid decoder mask for
  teacher forcing. Widths are the max lengths (static shapes), or the longest row with
  ``pad_to_longest``. Results are cached on disk, keyed by a hash of the examples' text,
  tokenizer, prefix and lengths, so a second run skips tokenization.
  """
  key = _tokens_key(examples, tokenizer, prefix, (max_source_len, max_target_len), pad_to_longest)
  file = cache_root(cache_dir) / "tokens" / f"xsum-{key}.npz"
  cached = load_arrays(file) if cache else None
  if cached is not None:
    return cached
  src = tokenizer.encode([prefix + ex["document"] for ex in examples])
  tgt = tokenizer.encode([ex["summary"] for ex in examples])
  eos, pad = tokenizer.eos_id, tokenizer.pad_id
  input_ids, attention_mask = _pad_with_eos(src, max_source_len, eos, pad, pad_to_longest)
  labels, label_mask = _pad_with_eos(tgt, max_target_len, eos, pad, pad_to_longest)
  arrays = {
    "input_ids": input_ids,
    "attention_mask": attention_mask,
    "labels": labels,
    "decoder_attention_mask": label_mask,
  }
  if cache:
    save_arrays(file, arrays)  # an unwritable cache only costs the next run the tokenizing
  return arrays


__all__ = [
  "DEMO_SIZES",
  "SOURCES",
  "DatasetUnavailableError",
  "HFTokenizer",
  "MissingInputsError",
  "SentencePieceTokenizer",
  "TokenizerUnavailableError",
  "cache_root",
  "demo_corpus",
  "load_inputs",
  "load_tokenizer",
  "load_xsum",
  "read_jsonl",
  "tokenize_split",
  "train_sentencepiece",
]
