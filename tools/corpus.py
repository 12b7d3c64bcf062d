"""The built-in model's training text, rebuilt on demand from the Python standard library on this machine.

Why this source: the app must start with no download, and the weights must be reproducible by anyone who
has the repo and a Python. Every CPython ships hundreds of English docstrings and the Sphinx-rendered
language reference in ``pydoc_data.topics``; together they are about 2 MB of real English prose about
programming. Nothing here is committed: the corpus is read from the interpreter running the script.

The text depends on the Python version (docstrings change between releases). The shipped weights were
trained on the corpus of CPython 3.11.7; :func:`corpus_fingerprint` names the exact text so a mismatch is
visible.

Rules that keep it deterministic and English:
- stdlib ``.py`` files are parsed with :mod:`ast` (never imported, so no side effects) in sorted path order;
  test packages, ``site-packages`` and build configuration are skipped;
- one document per module: its module docstring, then its class and function docstrings in source order,
  separated by blank lines; one document per ``pydoc_data.topics`` entry, in sorted key order;
- a docstring is kept only if it is mostly ASCII letters, spaces and punctuation (drops byte tables,
  generated data and non-English text) and has a few words;
- whole documents go to the held-out split when a stable hash (SHA-256) of their name falls in a fixed
  residue class, so the evaluation text comes from modules the model never saw.
"""
from __future__ import annotations

import ast
import hashlib
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

BOS_ID = 256  # ByteTokenizer's begin-of-sequence id
EOS_ID = 257  # ByteTokenizer's end-of-sequence id
HELD_OUT_MODULUS = 16  # one document in 16 (by hash of its name) is held out for evaluation
_SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "__phello__"})
_WORD_RE = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Document:
    """One training or evaluation unit: the docstrings of a module, or one documentation topic."""

    name: str  # dotted module name, or "pydoc_data.topics:<key>"
    text: str  # the document's text, without BOS/EOS

    @property
    def held_out(self) -> bool:
        """Whether this document belongs to the evaluation split (fixed by its name alone)."""
        digest = hashlib.sha256(self.name.encode("utf-8")).digest()
        return int.from_bytes(digest[:4], "big") % HELD_OUT_MODULUS == 0


def stdlib_root() -> Path:
    """The directory of the standard library of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_english_text(text: str) -> bool:
    """Heuristic filter: mostly ASCII prose with several words (no byte tables, no foreign scripts)."""
    if len(text) < 16:
        return False
    non_ascii = sum(1 for ch in text if ord(ch) > 127)
    if non_ascii > 0.01 * len(text):
        return False
    letters = sum(1 for ch in text if ch.isalpha() or ch == " ")
    if letters < 0.7 * len(text):
        return False
    return len(_WORD_RE.findall(text)) >= 4


def _docstrings(tree: ast.Module) -> list[str]:
    """Module docstring first, then class/function docstrings in source order."""
    nodes = [tree]
    out: list[str] = []
    while nodes:
        node = nodes.pop(0)
        doc = ast.get_docstring(node, clean=True)
        if doc and is_english_text(doc):
            out.append(doc.strip())
        children = [
            child
            for child in ast.iter_child_nodes(node)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        ]
        nodes[0:0] = children  # depth-first, source order
    return out


def module_documents(root: Path | None = None) -> list[Document]:
    """One document per stdlib module that has at least one English docstring, sorted by path."""
    root = root or stdlib_root()
    docs: list[Document] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        if rel.as_posix() == "pydoc_data/topics.py":
            continue  # its text is added topic by topic below
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue  # lib2to3 grammar fixtures and the like
        parts = _docstrings(tree)
        if parts:
            docs.append(Document(_module_name(rel), "\n\n".join(parts)))
    return docs


def topic_documents() -> list[Document]:
    """The language reference topics that ``help()`` shows, one document per topic, sorted by key."""
    from pydoc_data import topics  # plain data module: a dict of strings

    docs = []
    for key in sorted(topics.topics):
        text = topics.topics[key].strip()
        if is_english_text(text):
            docs.append(Document(f"pydoc_data.topics:{key}", text))
    return docs


def all_documents() -> list[Document]:
    """Every document, modules first then topics, in a fixed order."""
    return module_documents() + topic_documents()


def split_documents() -> tuple[list[Document], list[Document]]:
    """(training documents, held-out documents)."""
    docs = all_documents()
    return [d for d in docs if not d.held_out], [d for d in docs if d.held_out]


def to_token_stream(docs: list[Document]) -> list[int]:
    """Byte-level ids of the documents as one stream: BOS, UTF-8 bytes, EOS per document."""
    ids: list[int] = []
    for doc in docs:
        ids.append(BOS_ID)
        ids.extend(doc.text.encode("utf-8"))
        ids.append(EOS_ID)
    return ids


def corpus_words(docs: list[Document]) -> set[str]:
    """The lower-cased alphabetic words of the documents (the vocabulary the quality figure checks against)."""
    words: set[str] = set()
    for doc in docs:
        words.update(w.lower() for w in _WORD_RE.findall(doc.text))
    return words


def alphabetic_words(text: str) -> list[str]:
    """Maximal runs of ASCII letters, as the word-in-corpus figure counts them."""
    return _WORD_RE.findall(text)


def corpus_fingerprint(docs: list[Document]) -> str:
    """Short SHA-256 of the exact corpus text, printed next to the Python version that produced it."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.name.encode("utf-8") + b"\0" + doc.text.encode("utf-8") + b"\0")
    return h.hexdigest()[:16]


def python_version() -> str:
    """The interpreter the corpus came from, e.g. 'CPython 3.11.7'."""
    return f"{sys.implementation.name.replace('cpython', 'CPython')} {sys.version.split()[0]}"


if __name__ == "__main__":
    train, held = split_documents()
    n_train = sum(len(d.text.encode()) for d in train)
    n_held = sum(len(d.text.encode()) for d in held)
    print(f"{python_version()}: {len(train)} training documents ({n_train} bytes), "
          f"{len(held)} held out ({n_held} bytes), fingerprint {corpus_fingerprint(train + held)}")
