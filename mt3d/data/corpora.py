"""Built-in corpora that need no download, built on first use and cached.

* ``builtin``: real English text every Python installation carries: the documentation strings of
  the standard library's modules, classes and functions, plus the reference-manual topics in
  ``pydoc_data``. Read with ``ast`` (nothing is imported), tokenized with a byte-level BPE trained
  on it. Deterministic for a given Python installation.
* ``synthetic``: text from a random first-order stochastic (regular) grammar over pseudo-words,
  where ``<|endoftext|>`` is one of the states. The token stream is exactly a Markov chain, so the
  best achievable loss per token is its entropy rate, which is computed exactly.

Each corpus is a directory with an HF tokenizer (``tokenizer/``) and an indexed dataset
(``data.bin`` / ``data.idx``); concurrent builders (several ranks) serialise on a file lock.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .indexed import IndexedWriter, dtype_for_vocab
from .tokenizer import EOS, load_tokenizer, train_bpe, word_level

CORPUS_VERSION = 1
SKIP_DIRS = {
    "test",
    "tests",
    "site-packages",
    "idlelib",
    "__pycache__",
    "lib2to3",
    "turtledemo",
    "dist-packages",
}


@dataclass
class Corpus:
    """A ready corpus: its indexed-dataset prefix, tokenizer directory and facts about it."""

    prefix: Path
    tokenizer_dir: Path
    info: dict


def cache_root(explicit: str | None = None) -> Path:
    """``explicit``, else $MT3D_CACHE, else ~/.cache/mt3d."""
    return Path(explicit or os.environ.get("MT3D_CACHE") or Path.home() / ".cache" / "mt3d")


@contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_build(directory: Path, build: Callable[[Path], dict]) -> Corpus:
    """Build into ``directory`` once (under a lock, via a temporary directory), then reuse it."""
    done = directory / "corpus.json"
    if not done.is_file():
        with _lock(directory.with_suffix(".lock")):
            if not done.is_file():
                tmp = directory.with_name(directory.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                info = build(tmp)
                (tmp / "corpus.json").write_text(json.dumps(info, indent=1))
                shutil.rmtree(directory, ignore_errors=True)
                os.replace(tmp, directory)
    return Corpus(directory / "data", directory / "tokenizer", json.loads(done.read_text()))


# --- builtin: standard-library documentation -------------------------------------------------
def stdlib_documents() -> Iterator[str]:
    """Docstrings of the standard library and the pydoc reference topics, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            if name == "topics.py" and Path(dirpath).name == "pydoc_data":
                yield from _topics(tree)
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 40:
                        yield doc


def _topics(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for v in node.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and len(v.value) >= 40:
                    yield v.value


def builtin_corpus(
    vocab_size: int = 2048, cache_dir: str | None = None, tokenizer_dir: str | None = None
) -> Corpus:
    """The standard-library documentation corpus (built on first use, then cached).

    By default it comes with its own byte-level BPE of ``vocab_size``; with ``tokenizer_dir`` (e.g.
    the tokenizer of an HF model being fine-tuned) the text is tokenized with that one instead.
    """
    ident = f"{CORPUS_VERSION}|{sys.version}|{sysconfig.get_paths()['stdlib']}|{vocab_size}"
    if tokenizer_dir is not None:
        tj = Path(tokenizer_dir) / "tokenizer.json"
        ident += "|" + (
            hashlib.sha256(tj.read_bytes()).hexdigest() if tj.is_file() else str(Path(tokenizer_dir))
        )
    directory = cache_root(cache_dir) / f"builtin-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"

    def build(out: Path) -> dict:
        docs = list(stdlib_documents())
        if tokenizer_dir is not None:
            skip = shutil.ignore_patterns("*.safetensors", "*.bin", "*.pt")
            shutil.copytree(tokenizer_dir, out / "tokenizer", ignore=skip)
            tok = load_tokenizer(out / "tokenizer")
        else:
            tok = train_bpe(docs, vocab_size, out / "tokenizer")
        writer = IndexedWriter(out / "data", dtype_for_vocab(tok.vocab_size))
        try:
            for i in range(0, len(docs), 512):
                for ids in tok.encode_batch(docs[i : i + 512]):
                    writer.add(ids)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        chars = sum(len(d) for d in docs)
        return {"name": "builtin", "documents": len(docs), "characters": chars, "vocab_size": tok.vocab_size}

    return cached_build(directory, build)


# --- synthetic: a Markov grammar with a known entropy rate ------------------------------------
@dataclass(frozen=True)
class MarkovGrammar:
    """A random first-order chain over ``vocab`` states (the last is EOS) with sparse successors."""

    successors: np.ndarray  # [V, k] next-state ids
    probs: np.ndarray  # [V, k] their probabilities

    @classmethod
    def random(cls, vocab: int, seed: int, k: int = 8, alpha: float = 0.5) -> MarkovGrammar:
        """Each state gets k distinct successors (one is state+1, which keeps the chain irreducible)."""
        rng = np.random.default_rng(seed)
        succ = np.empty((vocab, k), dtype=np.int64)
        for s in range(vocab):
            others = rng.choice(vocab - 1, size=k - 1, replace=False)
            others = np.where(others >= (s + 1) % vocab, others + 1, others)  # skip state+1
            succ[s] = np.concatenate([[(s + 1) % vocab], others])
        probs = rng.dirichlet(np.full(k, alpha), size=vocab)
        return cls(succ, probs)

    @property
    def vocab(self) -> int:
        """Number of states (= tokens)."""
        return self.successors.shape[0]

    def stationary(self, iters: int = 10_000, tol: float = 1e-14) -> np.ndarray:
        """Stationary distribution by power iteration (the chain is irreducible and aperiodic)."""
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(iters):
            nxt = np.zeros_like(pi)
            np.add.at(nxt, self.successors, pi[:, None] * self.probs)
            if np.abs(nxt - pi).sum() < tol:
                return nxt
            pi = nxt
        return pi

    def entropy_rate(self) -> float:
        """Entropy per token in nats: sum_i pi_i H(P_i) (the loss floor of a perfect model)."""
        row = -(self.probs * np.log(np.where(self.probs > 0, self.probs, 1.0))).sum(axis=1)
        return float(self.stationary() @ row)

    def sample(self, tokens: int, seed: int, chains: int = 256) -> Iterator[np.ndarray]:
        """Documents (each ending with EOS) from ``chains`` parallel runs started after an EOS.

        Every document starts right after an EOS, so the concatenation of all documents is itself
        one trajectory of the chain.
        """
        rng = np.random.default_rng(seed)
        eos = self.vocab - 1
        cum = np.cumsum(self.probs, axis=1)
        steps = max(1, -(-tokens // chains))
        out = np.empty((chains, steps), dtype=np.int64)
        state = np.full(chains, eos)
        for t in range(steps):
            u = rng.random(chains)
            choice = (u[:, None] > cum[state]).sum(axis=1).clip(max=self.successors.shape[1] - 1)
            state = self.successors[state, choice]
            out[:, t] = state
        for c in range(chains):
            row = out[c]
            ends = np.flatnonzero(row == eos)
            start = 0
            for e in ends:  # the unfinished tail of each run is dropped
                yield row[start : e + 1]
                start = e + 1


def pseudo_words(n: int, seed: int) -> list[str]:
    """``n`` distinct pronounceable pseudo-words."""
    rng = np.random.default_rng(seed)
    onsets = [
        "b",
        "d",
        "f",
        "g",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "z",
        "ch",
        "sh",
        "th",
        "tr",
        "pl",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    seen: set[str] = set()
    words: list[str] = []
    while len(words) < n:
        w = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(int(rng.integers(1, 4))))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def synthetic_corpus(
    vocab_size: int = 512, seed: int = 0, tokens: int = 2_000_000, cache_dir: str | None = None
) -> Corpus:
    """The synthetic Markov-grammar corpus; ``info['entropy_floor']`` is its exact loss floor."""
    key = f"synthetic-v{CORPUS_VERSION}-V{vocab_size}-s{seed}-n{tokens}"
    directory = cache_root(cache_dir) / key

    def build(out: Path) -> dict:
        grammar = MarkovGrammar.random(vocab_size, seed)
        tok = word_level(pseudo_words(vocab_size - 1, seed), out / "tokenizer")
        if tok.eos_id != vocab_size - 1 or tok.backend.token_to_id(EOS) != vocab_size - 1:
            raise RuntimeError("word-level tokenizer ids do not match the grammar's states")
        writer = IndexedWriter(out / "data", dtype_for_vocab(vocab_size))
        try:
            for doc in grammar.sample(tokens, seed + 1):
                writer.add(doc)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        return {
            "name": "synthetic",
            "vocab_size": vocab_size,
            "requested_tokens": tokens,
            "entropy_floor": grammar.entropy_rate(),
            "seed": seed,
        }

    return cached_build(directory, build)
