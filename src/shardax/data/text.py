"""Byte-level text corpora for language models: an embedded default, or the user's files.

The default corpus needs no download: it is the Python standard library's own ``.py``
sources, found through ``sysconfig``, in sorted order, so every machine with the same
Python has the same bytes. Files, not bytes, are held out: every ``val_every``-th file
goes to the validation split.

>>> corpus = load_corpus(max_bytes=200_000)
>>> corpus.train.dtype, len(corpus.val) > 0
(dtype('uint8'), True)
>>> batch = lm_batch(corpus.train, batch_size=4, seq_len=32, seed=0, step=1)
>>> batch["inputs"].shape, batch["targets"].shape
((4, 32), (4, 32))
>>> packed = lm_batch(corpus.train, batch_size=4, seq_len=32, seed=0, step=1, pack=True)
>>> sorted(packed), int(packed["positions"][0, 0]), int(packed["segment_ids"][0, 0])
(['inputs', 'positions', 'segment_ids', 'targets'], 0, 0)
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path

import jax
import numpy as np

from shardax.checks import as_count
from shardax.parallel.context import zigzag, zigzag_layout

DEFAULT_MAX_BYTES = 2 * 2**20


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation bytes, and where they came from.

    Attributes:
        train: uint8 array of the training bytes.
        val: uint8 array of the held-out bytes.
        source: a description of the files read.
        files: number of files read.
    """

    train: np.ndarray
    val: np.ndarray
    source: str
    files: int

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/byte) on ``val`` of the train split's byte frequencies
        (add-one smoothed): the loss of the best model that ignores context."""
        counts = np.bincount(self.train, minlength=256).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.val].mean())


_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted path order; tests, IDLE and
    site-packages left out."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    raise ValueError(f"--data {path}: no such file or directory")


def load_corpus(
    path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES, val_every: int = 10
) -> Corpus:
    """The corpus at ``path`` (a text file, or a directory of them, read recursively), or
    the standard library's sources when ``path`` is None, up to ``max_bytes`` bytes.

    Files that are not UTF-8 text (binary files) are skipped. Raises ``ValueError`` naming
    ``path`` when it holds no text, or too little for both splits.
    """
    files = stdlib_files() if path is None else _text_files(Path(path))
    source = (
        f"Python stdlib sources ({sysconfig.get_paths()['stdlib']})" if path is None else str(path)
    )
    train: list[bytes] = []
    val: list[bytes] = []
    total = used = 0
    for file in files:
        if total >= max_bytes:
            break
        try:
            data = file.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not data.strip():
            continue
        data = data[: max_bytes - total]
        (val if used % val_every == val_every - 1 else train).append(data)
        total += len(data)
        used += 1
    if total == 0:
        raise ValueError(
            f"--data {path}: no text found ({len(files)} file(s), none non-empty UTF-8 text)"
        )
    if not val:  # one or a few files: hold out the tail of the text instead
        joined = b"".join(train)
        cut = len(joined) - max(len(joined) // val_every, 1)
        train, val = [joined[:cut]], [joined[cut:]]
    as_array = lambda parts: np.frombuffer(b"".join(parts), np.uint8)  # noqa: E731
    return Corpus(as_array(train), as_array(val), source, used)


def lm_batch(
    data: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int, pack: bool = False
) -> dict[str, np.ndarray]:
    """``batch_size`` random windows of ``data``: ``inputs`` and the next bytes,
    ``targets``, both int32 (batch, seq_len). A function of ``(seed, step)`` only, so a
    resumed run sees the same batches.

    With ``pack``, each row joins several documents instead (``pack_row``), and the
    batch also has ``segment_ids`` (0, 1, ... per document in the row) and ``positions``
    (restarting at 0 in each document), both int32 (batch, seq_len).
    """
    if len(data) < seq_len + 1:
        raise ValueError(
            f"--seq-len {seq_len}: the text has {len(data)} bytes, fewer than seq_len + 1"
        )
    rng = np.random.default_rng((seed, step))
    if pack:
        rows = [pack_row(data, seq_len, rng) for _ in range(batch_size)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    start = rng.integers(0, len(data) - seq_len, size=batch_size)
    windows = data[start[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def pack_row(data: np.ndarray, seq_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One packed row of ``seq_len`` tokens: documents joined end to end until the row is
    full (the last one cut). A document is an excerpt of ``data`` at a random place, of a
    random length from ``max(seq_len // 8, 1)`` to ``seq_len`` tokens (the corpus is a few
    files much longer than a row, so its own file boundaries would rarely fall inside
    one); its targets are its own next bytes, so no target crosses a document boundary.
    """
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("inputs", "targets", "positions")}
    parts["segment_ids"] = []
    filled = doc = 0
    while filled < seq_len:
        length = min(int(rng.integers(max(seq_len // 8, 1), seq_len + 1)), seq_len - filled)
        start = int(rng.integers(0, len(data) - length))
        window = data[start : start + length + 1].astype(np.int32)
        parts["inputs"].append(window[:-1])
        parts["targets"].append(window[1:])
        parts["positions"].append(np.arange(length, dtype=np.int32))
        parts["segment_ids"].append(np.full(length, doc, np.int32))
        filled, doc = filled + length, doc + 1
    return {k: np.concatenate(v) for k, v in parts.items()}


def lm_eval_batch(data: np.ndarray, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """A fixed validation batch: ``batch_size`` windows evenly spaced over ``data``."""
    if len(data) < seq_len + 1:
        raise ValueError(
            f"--seq-len {seq_len}: the validation text has {len(data)} bytes, fewer than "
            "seq_len + 1"
        )
    start = np.linspace(0, len(data) - seq_len - 1, batch_size).astype(np.int64)
    windows = data[start[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


class LMBatches:
    """An endless iterator of ``lm_batch`` batches from step ``1``: each process gets
    its rows of every global batch. ``get_state()`` / ``set_state()`` give the position
    (``{"step": steps done}``), for checkpoints.

    ``pack``: packed rows with segment ids and positions (``pack_row``).
    ``context``: the size of the mesh's context axis; > 1 reorders every batch zig-zag
    (``sx.parallel.zigzag``: device i of the axis holds chunks i and 2C-1-i of each row,
    so that causal attention's work is even) and adds the true ``positions``. ``layout``
    is the batches' layout to attend with: ``"zigzag:C"`` (``"contiguous"`` for 1).
    """

    def __init__(
        self,
        data: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int,
        pack: bool = False,
        context: int = 1,
    ) -> None:
        processes, index = jax.process_count(), jax.process_index()
        if batch_size % processes:
            raise ValueError(
                f"--batch-size {batch_size} is not divisible by the process count {processes}"
            )
        local = batch_size // processes
        self._rows = slice(index * local, (index + 1) * local)
        self.data, self.batch_size, self.seq_len, self.seed = data, batch_size, seq_len, seed
        self.pack, self.context = pack, context
        self.layout = batch_layout(context)
        if context > 1 and seq_len % (2 * context):
            raise ValueError(
                f"--seq-len {seq_len} is not divisible by 2 × the context axis size "
                f"{context} = {2 * context} (each device holds two chunks of a row, zig-zag)"
            )
        self.step = 0
        lm_batch(data, 1, seq_len, seed, 0)  # checks the text is long enough

    def __iter__(self) -> LMBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        self.step += 1
        batch = lm_batch(self.data, self.batch_size, self.seq_len, self.seed, self.step, self.pack)
        batch = {k: v[self._rows] for k, v in batch.items()}
        return zigzag_batch(batch, self.context)

    def get_state(self) -> dict[str, int]:
        return {
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "pack": int(self.pack),
        }

    def set_state(self, state: dict[str, int]) -> None:
        """Moves to ``state``; a state saved with other batches (another batch size,
        sequence length, seed or packing) raises ``ValueError`` naming the option."""
        mine = self.get_state()
        for key in ("batch_size", "seq_len", "seed", "pack"):
            if key in state and int(state[key]) != mine[key]:
                option = "--" + key.replace("_", "-")
                raise ValueError(
                    f"the checkpoint was saved with {option} {state[key]}, but this run has "
                    f"{option} {mine[key]}: its step {state['step']} would not continue the "
                    f"same batches. Resume with {option} {state[key]}, or start from a new "
                    "--checkpoint-dir"
                )
        self.step = as_count("state['step']", state["step"], minimum=0)


def batch_layout(context: int) -> str:
    """The layout of ``zigzag_batch``'s batches for ``context`` devices, to attend
    with: ``"zigzag:C"`` (``sx.parallel.zigzag_layout``), ``"contiguous"`` for 1.

    >>> batch_layout(4), batch_layout(1)
    ('zigzag:4', 'contiguous')
    """
    return zigzag_layout(context) if context > 1 else "contiguous"


def zigzag_batch(batch: dict[str, np.ndarray], context: int) -> dict[str, np.ndarray]:
    """``batch`` reordered zig-zag along the sequence for ``context`` devices
    (``sx.parallel.zigzag``), with ``positions`` (the true position of each token, or
    the packed rows' own positions, reordered alike); unchanged when ``context`` is 1.
    Attend with ``layout=batch_layout(context)`` (``"zigzag:C"``).

    >>> zigzag_batch({"inputs": np.arange(8)[None]}, 2)["positions"].tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    if context <= 1:
        return batch

    rows, length = batch["inputs"].shape
    if "positions" not in batch:
        batch = {**batch, "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1))}
    return zigzag(batch, context)[0]
