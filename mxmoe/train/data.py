"""Byte-level language-model data that needs no download.

Default corpus: the Python standard library's own source files, found from the running
interpreter (`sysconfig.get_paths()["stdlib"]`, site-/dist-packages excluded). `--data.path` takes
any text file or folder instead. Files are split train/validation by a hash of their relative path
(deterministic on every machine and rank), concatenated as bytes with a 0 byte after each file, and
packed into windows of seq_len + 1 tokens (input = window[:-1], target = window[1:]).

`ShardedSampler` visits the train windows in a seeded random order, one epoch after another; each
step takes `batch_size * world_size` consecutive indices of the permutation and rank r takes its
`batch_size` slice. Its position (epoch, step in epoch) is checkpointed.

Validation (`eval_windows`) uses a fixed sample of windows spread evenly over the whole validation
stream (every file, not its first few KiB), the same at every evaluation; the whole set when it has
no more windows than the sample.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

VOCAB_SIZE = 256
EOS = 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(path: str, extensions: list[str]) -> tuple[Path, list[Path]]:
    """(root, files sorted by relative path). path "" = the stdlib (without site-packages)."""
    root = stdlib_dir() if not path else Path(path).expanduser()
    if root.is_file():
        return root.parent, [root]
    if not root.is_dir():
        raise ValueError(f"data.path={path!r} is neither a file nor a folder")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for fn in filenames:
            if not extensions or any(fn.endswith(e) for e in extensions):
                files.append(Path(dirpath) / fn)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ValueError(f"data.path={str(root)!r} holds no files ending in {extensions}")
    return root, files


def file_hash(rel: str) -> float:
    """A number in [0, 1) from the relative path: the same on every machine and run."""
    return int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big") / 2**64


def split_files(root: Path, files: list[Path], val_fraction: float, max_files: int = 0):
    """(train files, val files), each ordered by hash. A single file is split by bytes instead
    (see `load_tokens`), so both lists hold it."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction!r}: expected 0 <= value < 1")
    if len(files) == 1:
        return files, files
    keyed = sorted(((file_hash(f.relative_to(root).as_posix()), f) for f in files), key=lambda t: t[0])
    train = [f for h, f in keyed if h >= val_fraction]
    val = [f for h, f in keyed if h < val_fraction]
    if max_files > 0:
        n_val = max(1, round(max_files * val_fraction)) if val_fraction > 0 else 0
        train, val = train[: max(1, max_files - n_val)], val[:n_val]
    if not val and val_fraction > 0:
        val = train[-1:]
        train = train[:-1] or val
    return train, val


def _read(files: list[Path]) -> Tensor:
    chunks = []
    for f in files:
        chunks.append(f.read_bytes())
        chunks.append(bytes([EOS]))
    buf = bytearray(b"".join(chunks))
    return torch.frombuffer(buf, dtype=torch.uint8).clone() if buf else torch.zeros(0, dtype=torch.uint8)


def load_tokens(
    path: str, val_fraction: float, max_files: int, extensions: list[str]
) -> tuple[Tensor, Tensor]:
    """(train, val) uint8 token streams (1D)."""
    root, files = list_files(path, extensions)
    train_files, val_files = split_files(root, files, val_fraction, max_files)
    if len(files) == 1:  # one text file: the last val_fraction of its bytes is validation
        data = _read(files)
        cut = int(len(data) * (1 - val_fraction))
        return data[:cut], data[cut:]
    return _read(train_files), _read(val_files)


class PackedDataset:
    """Non-overlapping windows of seq_len + 1 tokens over a token stream (uint8 (N,))."""

    def __init__(self, tokens: Tensor, seq_len: int):
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens, fewer than training.seq_len + 1 = {seq_len + 1}"
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
