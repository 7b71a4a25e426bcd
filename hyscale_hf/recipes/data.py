"""Data for long-context fine-tuning: corpora, a download-free byte tokenizer, packing.

- ``byte_tokenizer()``: Transformers' ByT5 tokenizer without extra ids (259 tokens: pad, eos, unk,
  then the 256 byte values). It is built in code, so it needs no download.
- ``stdlib_documents()``: the Python standard library's own source files, real long documents that
  ship with every interpreter (so the default run works offline).
- ``load_documents()``: a Hugging Face hub dataset or local text/json/jsonl/parquet/csv files.
- ``pack()``: tokenize, join documents with EOS, and cut fixed-length blocks (labels = inputs).
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from datasets import Dataset, load_dataset

# Files smaller than this are mostly licence headers and imports.
MIN_DOCUMENT_CHARS = 4000


def byte_tokenizer():
    """Byte-level tokenizer (ByT5, no extra ids): built offline, 259 ids, EOS appended by default."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(extra_ids=0)


def stdlib_documents(max_chars: int, seed: int = 0, min_chars: int = MIN_DOCUMENT_CHARS, min_docs: int = 2) -> list[str]:
    """Source files of this interpreter's standard library (``site-packages`` excluded), shuffled with
    ``seed``, until their total length reaches ``max_chars`` and there are ``min_docs`` of them (held-out
    text is split by document)."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size >= min_chars)
    if not files:
        raise RuntimeError(f"no Python source files of at least {min_chars} bytes under {root}")
    random.Random(seed).shuffle(files)
    docs, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text)
        if total >= max_chars and len(docs) >= min_docs:
            break
    return docs


def load_documents(
    name_or_path: str,
    *,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    max_chars: int | None = None,
) -> list[str]:
    """Texts of a hub dataset (``name_or_path`` = its id) or of local files (a file or a folder of
    ``.txt``/``.json``/``.jsonl``/``.parquet``/``.csv`` files), in order, up to ``max_chars``."""
    path = Path(name_or_path)
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        by_kind = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
        kinds = {by_kind.get(p.suffix) for p in files}
        if len(kinds) != 1 or None in kinds:
            raise ValueError(
                f"dataset path {name_or_path!r} must hold files of one kind among {sorted(by_kind)}; "
                f"found suffixes {sorted({p.suffix for p in files})}"
            )
        data = load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train")
    else:
        data = load_dataset(name_or_path, config, split=split)
    if text_column not in data.column_names:
        raise ValueError(f"dataset has no column {text_column!r}; columns: {data.column_names} (use --text_column)")
    docs, total = [], 0
    for text in data[text_column]:
        if not text:
            continue
        docs.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    if not docs:
        raise ValueError(f"dataset {name_or_path!r} has no non-empty {text_column!r} text")
    return docs


def pack(docs: list[str], tokenizer, seq_len: int, num_proc: int | None = None) -> Dataset:
    """Blocks of exactly ``seq_len`` tokens cut from the documents joined by EOS (blocks span document
    boundaries; the remainder of every 1000 documents is dropped), as a ``datasets.Dataset`` with
    ``input_ids`` and ``labels``."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id to separate packed documents")

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    def group(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // seq_len * seq_len
        blocks = [flat[i : i + seq_len] for i in range(0, n, seq_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    raw = Dataset.from_dict({"text": docs})
    tokens = raw.map(tokenize, batched=True, remove_columns=["text"], num_proc=num_proc, desc="tokenize")
    packed = tokens.map(group, batched=True, batch_size=1000, remove_columns=tokens.column_names, desc="pack")
    if len(packed) == 0:
        raise ValueError(f"the documents hold fewer than seq_len={seq_len} tokens")
    return packed
