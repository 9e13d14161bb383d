"""Byte-level language-model data that needs no download.

Default corpus: the Python standard library's own source files, found from the running
interpreter (`sysconfig.get_paths()["stdlib"]`, site-/dist-packages excluded). `--data.path=python-env`
takes every Python file of the running environment instead (the standard library and the installed
packages, each file once), and any text file or folder works too. Only regular files are read, each
at most `data.max_file_bytes`. Files are split train/validation by a hash of their relative path
(deterministic on every machine and rank), concatenated as bytes with a 0 byte after each file, and
packed into windows of seq_len + 1 tokens (input = window[:-1], target = window[1:]). A corpus's
identity (`corpus_id`: a hash of its files' names and sizes, with its token counts, and
`content_id`: a hash of the bytes read) is recorded in each run and compared between ranks.

`ShardedSampler` visits the train windows in a seeded random order, one epoch after another; each
step takes `batch_size * world_size` consecutive indices of the permutation and rank r takes its
`batch_size` slice. Its position (epoch, step in epoch) is checkpointed.

Validation (`eval_windows`) uses a fixed sample of windows spread evenly over the whole validation
stream (every file, not its first few KiB), the same at every evaluation; the whole set when it has
no more windows than the sample.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import stat
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

VOCAB_SIZE = 256
EOS = 0


PYTHON_ENV = "python-env"
"""`data.path` naming every Python source file of the running environment (see `corpus_roots`)."""
MAX_FILE_BYTES = 2**28
"""Default `data.max_file_bytes`: the largest file a corpus may hold (256 MiB)."""
_PRUNED = ("site-packages", "dist-packages", "__pycache__")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_roots(path: str) -> list[tuple[str, Path]]:
    """(label, folder) of the folders a corpus is read from, labels prefixing the files' names in it:
    "" = the standard library [("", stdlib)]; "python-env" = the running interpreter's standard
    library and package folders (sysconfig's stdlib, platstdlib, purelib and platlib, each once),
    labelled by those names; otherwise the folder `path` [("", path)] (a file: its folder)."""
    if path == PYTHON_ENV:
        paths, roots, seen = sysconfig.get_paths(), [], set()
        for label in ("stdlib", "platstdlib", "purelib", "platlib"):
            root = Path(paths[label])
            if root.is_dir() and os.path.realpath(root) not in seen:
                seen.add(os.path.realpath(root))
                roots.append((label, root))
        return roots
    return [("", stdlib_dir() if not path else Path(path).expanduser())]


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISDIR, "folder"),
    ):
        if test(mode):
            return name
    return "special file"


@dataclasses.dataclass
class CorpusFiles:
    """The files of a corpus, in name order: `names[i]` (its relative path, posix, under its root's
    label for "python-env") of `paths[i]`, `sizes[i]` bytes. Only regular files (symbolic links to
    one included); `skipped` counts what else matched, by kind ("FIFO", "broken or looping link",
    ...)."""

    source: str
    names: list[str]
    paths: list[Path]
    sizes: list[int]
    skipped: dict[str, int]


def find_files(path: str, extensions: list[str], max_file_bytes: int = MAX_FILE_BYTES) -> CorpusFiles:
    """The corpus `data.path` names ("" = the stdlib, "python-env", a text file or a folder), files
    ending in one of `extensions` (all files when empty). Only regular files are taken (a FIFO
    would block the read forever, /dev/zero never ends it); every other match is skipped and counted.
    "python-env" takes each file once (a file reachable from two of its folders, or under two
    names, under its first name). ValueError naming data.path or the file when the path is not a
    regular file or folder, nothing matches, or a file is larger than `max_file_bytes`."""
    roots = corpus_roots(path)
    root = roots[0][1]
    try:
        st = os.stat(root)
    except OSError as e:
        raise ValueError(f"data.path={path!r}: {root} cannot be read ({e.strerror or e})") from None
    if stat.S_ISREG(st.st_mode):  # one text file
        _check_size(root, st.st_size, max_file_bytes)
        return CorpusFiles(str(root.resolve()), [root.name], [root], [st.st_size], {})
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"data.path={path!r} is a {_kind(st.st_mode)}, neither a regular file nor a folder")
    found: list[tuple[str, Path, int, tuple[int, int]]] = []  # (name, path, size, (device, inode))
    skipped: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    for label, top in roots:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in _PRUNED)
            for fn in filenames:
                if extensions and not any(fn.endswith(e) for e in extensions):
                    continue
                f = Path(dirpath) / fn
                try:
                    fst = os.stat(f)
                except OSError:  # a dangling or looping link, a file gone since the listing
                    skipped["broken or looping link"] = skipped.get("broken or looping link", 0) + 1
                    continue
                if not stat.S_ISREG(fst.st_mode):
                    skipped[_kind(fst.st_mode)] = skipped.get(_kind(fst.st_mode), 0) + 1
                    continue
                rel = f.relative_to(top).as_posix()
                found.append((f"{label}/{rel}" if label else rel, f, fst.st_size, (fst.st_dev, fst.st_ino)))
    found.sort(key=lambda t: t[0])
    if path == PYTHON_ENV:  # each file once, under its first name
        unique = []
        for item in found:
            if item[3] not in seen:
                seen.add(item[3])
                unique.append(item)
        found = unique
    if not found:
        where = path if path == PYTHON_ENV else str(root)
        raise ValueError(f"data.path={where!r} holds no files ending in {extensions}")
    for _, f, size, _ in found:
        _check_size(f, size, max_file_bytes)
    names, paths, sizes, _ = (list(col) for col in zip(*found, strict=True))
    source = PYTHON_ENV if path == PYTHON_ENV else str(root.resolve())
    return CorpusFiles(source, names, paths, sizes, skipped)


def _check_size(f: Path, size: int, limit: int) -> None:
    if size > limit:
        raise ValueError(
            f"data file {f} has {size} bytes, more than data.max_file_bytes={limit}: raise the limit "
            "(every byte is held in memory by each rank) or leave the file out of data.path"
        )


def list_files(path: str, extensions: list[str]) -> tuple[Path, list[Path]]:
    """(root, regular files sorted by relative path) of `find_files`; root is the folder of a
    one-folder corpus (the file's own folder for a file), None for "python-env"."""
    c = find_files(path, extensions)
    roots = corpus_roots(path)
    root = None if path == PYTHON_ENV else roots[0][1]
    if root is not None and root.is_file():
        root = root.parent
    return root, c.paths


def file_hash(rel: str) -> float:
    """A number in [0, 1) from the relative path: the same on every machine and run."""
    return int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big") / 2**64


def split_names(names: list[str], val_fraction: float, max_files: int = 0) -> tuple[list[int], list[int]]:
    """(train, val) indices into `names` (relative paths), each ordered by the hash of the name
    (`file_hash`); a corpus of one file is split by bytes instead (see `load_corpus`), so both hold it."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction!r}: expected 0 <= value < 1")
    if len(names) == 1:
        return [0], [0]
    keyed = sorted(((file_hash(n), i) for i, n in enumerate(names)), key=lambda t: t[0])
    train = [i for h, i in keyed if h >= val_fraction]
    val = [i for h, i in keyed if h < val_fraction]
    if max_files > 0:
        n_val = max(1, round(max_files * val_fraction)) if val_fraction > 0 else 0
        train, val = train[: max(1, max_files - n_val)], val[:n_val]
    if not val and val_fraction > 0:
        val = train[-1:]
        train = train[:-1] or val
    return train, val


def split_files(root: Path, files: list[Path], val_fraction: float, max_files: int = 0):
    """(train files, val files) of files under `root`, by `split_names` of their relative paths."""
    train, val = split_names([f.relative_to(root).as_posix() for f in files], val_fraction, max_files)
    return [files[i] for i in train], [files[i] for i in val]


def _read(files: list[Path], max_file_bytes: int) -> Tensor:
    """The files' bytes, each followed by EOS, as one uint8 (N,) tensor. Each file is opened without
    blocking and checked to be a regular file within the size limit as it is read (it may have
    changed since the listing)."""
    buf = bytearray()  # one copy of the corpus in memory while reading (the tensor shares it)
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise ValueError(f"data file {f} cannot be read: {e.strerror or e}") from None
        with os.fdopen(fd, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError(f"data file {f} is now a {_kind(mode)}, not a regular file: refused")
            data = fh.read(max_file_bytes + 1)
        _check_size(f, len(data), max_file_bytes)
        buf += data
        buf.append(EOS)
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.zeros(0, dtype=torch.uint8)


@dataclasses.dataclass
class Corpus:
    """A run's data: `train` and `val`, uint8 (N,) token streams, and `identity`, what the run
    records of it and ranks compare: {"source", "files", "sha256" (of the sorted list of the files
    read, with their sizes), "train_tokens", "val_tokens", "skipped", "content_sha256" (of the
    bytes of both splits)}."""

    train: Tensor
    val: Tensor
    identity: dict


def corpus_id(names: list[str], sizes: list[int]) -> str:
    """SHA-256 of the files' names and sizes, in name order: equal for the same files everywhere."""
    text = json.dumps(sorted(zip(names, sizes, strict=True)), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def content_id(train: Tensor, val: Tensor) -> str:
    """SHA-256 of the bytes of both splits: files of the same names and sizes but other contents
    differ in it (ranks compare it, `mxmoe.train.config.check_ranks_data`)."""
    h = hashlib.sha256()
    for part in (train, val):
        part = part.contiguous().cpu()
        # the tensor's bytes in place (numpy, whose buffer would do, is no dependency of mxmoe)
        h.update((ctypes.c_ubyte * (part.numel() * part.element_size())).from_address(part.data_ptr()))
        h.update(b"\xff")  # a split boundary: the same bytes split elsewhere differ
    return h.hexdigest()


def load_corpus(
    path: str,
    val_fraction: float,
    max_files: int,
    extensions: list[str],
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Corpus:
    """The corpus `data.path` names (`find_files`), split train/validation by a hash of each file's
    name (`split_names`; one text file, or one file left for both splits by max_files: its last
    val_fraction of bytes is validation) and read."""
    c = find_files(path, extensions, max_file_bytes)
    train_idx, val_idx = split_names(c.names, val_fraction, max_files)
    if len(c.paths) == 1 or (len(train_idx) == 1 and train_idx == val_idx):
        # one text file (one corpus file, or data.max_files leaving one file for both splits): the
        # last val_fraction of its bytes is validation, never the training bytes themselves
        data = _read([c.paths[train_idx[0]]], max_file_bytes)
        cut = int(len(data) * (1 - val_fraction))
        train, val = data[:cut], data[cut:]
        used = train_idx
    else:
        train = _read([c.paths[i] for i in train_idx], max_file_bytes)
        val = _read([c.paths[i] for i in val_idx], max_file_bytes)
        used = sorted(set(train_idx) | set(val_idx))
    identity = {
        "source": c.source,
        "files": len(used),
        "sha256": corpus_id([c.names[i] for i in used], [c.sizes[i] for i in used]),
        "train_tokens": train.numel(),
        "val_tokens": val.numel(),
        "skipped": c.skipped,
        "content_sha256": content_id(train, val),
    }
    return Corpus(train, val, identity)


def load_tokens(
    path: str, val_fraction: float, max_files: int, extensions: list[str]
) -> tuple[Tensor, Tensor]:
    """(train, val) uint8 token streams (1D) of `load_corpus`."""
    c = load_corpus(path, val_fraction, max_files, extensions)
    return c.train, c.val


class PackedDataset:
    """Non-overlapping windows of seq_len + 1 tokens over a token stream (uint8 (N,)); `what` names
    it in errors ("the train split")."""

    def __init__(self, tokens: Tensor, seq_len: int, what: str = "the corpus"):
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"{what} has {tokens.numel()} tokens, fewer than training.seq_len + 1 = {seq_len + 1}: use "
                "more data (data.path), a smaller training.seq_len"
                + (" or a larger data.val_fraction" if "validation" in what else "")
            )
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (tokens.numel() - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """indices (B,) int64 -> inputs, targets (B, seq_len) int64."""
        offs = indices[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        w = self.tokens[offs].long()
        return w[:, :-1], w[:, 1:]


def eval_windows(n: int, count: int, world: int) -> Tensor:
    """The validation sample: (world, per_rank) int64 window indices, row r for rank r.

    `count` windows spread evenly over range(n) (window floor((i + 1/2) n / count), i < count): a
    stratified sample of the whole set, fixed across evaluations. When count >= n, all n windows.
    The number is rounded down to a multiple of `world` (at least `world`), so every rank runs the
    same number of forward passes (expert parallelism exchanges tokens in each)."""
    if n < world:
        raise ValueError(
            f"the validation set has {n} windows, fewer than the {world} ranks: use more data, a larger "
            "data.val_fraction or a smaller training.seq_len"
        )
    k = min(count, n)
    k = max(world, k - k % world)
    idx = torch.arange(n) if k == n else ((torch.arange(k, dtype=torch.float64) + 0.5) * (n / k)).long()
    return idx.reshape(-1, world).t().contiguous()


class ShardedSampler:
    """Seeded epoch permutations of range(n); each step yields this rank's batch of indices."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.global_batch = batch_size * world_size
        if n < self.global_batch:
            raise ValueError(
                f"{n} training sequences are fewer than batch_size * world_size = {self.global_batch}; "
                "use more data, a smaller training.local_batch_size or training.seq_len"
            )
        self.n, self.batch_size, self.rank, self.seed = n, batch_size, rank, seed
        self.steps_per_epoch = n // self.global_batch
        self.epoch, self.step = 0, 0
        self._perm_epoch, self._perm = -1, None

    def _permutation(self) -> Tensor:
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), self.epoch
        return self._perm

    def next_indices(self) -> Tensor:
        """This rank's (batch_size,) int64 indices for the next step."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        start = self.step * self.global_batch + self.rank * self.batch_size
        self.step += 1
        return self._permutation()[start : start + self.batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["n"]) != self.n or int(sd["seed"]) != self.seed:
            raise ValueError(
                f"checkpointed sampler (n={sd['n']}, seed={sd['seed']}) does not match this data "
                f"(n={self.n}, seed={self.seed}): same data and debug.seed are needed to resume"
            )
        self.epoch, self.step = int(sd["epoch"]), int(sd["step"])
