"""Data: stdlib corpus, the python-env corpus, regular files only, deterministic split, packing, the
sharded seeded sampler."""

import os
import sysconfig

import pytest
import torch

from mxmoe.train.data import (
    EOS,
    PackedDataset,
    ShardedSampler,
    list_files,
    load_corpus,
    load_tokens,
    split_files,
    stdlib_dir,
)


def _corpus(tmp_path, n=40):
    tmp_path.mkdir(exist_ok=True)
    for i in range(n):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i}.py").write_text(f"# file {i}\n" + "x = 1\n" * (i + 1))
    (tmp_path / "skip.bin").write_bytes(b"\x01\x02")
    return tmp_path


def test_default_corpus_is_the_stdlib():
    root, files = list_files("", [".py"])
    assert root == stdlib_dir() and len(files) > 100
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    assert (root / "os.py") in files


def test_split_is_deterministic_disjoint_and_order_free(tmp_path):
    root, files = list_files(str(_corpus(tmp_path)), [".py"])
    assert all(f.suffix == ".py" for f in files) and len(files) == 40
    tr1, va1 = split_files(root, files, 0.25)
    tr2, va2 = split_files(root, list(reversed(files)), 0.25)
    assert tr1 == tr2 and va1 == va2
    assert not set(tr1) & set(va1) and set(tr1) | set(va1) == set(files)
    assert 0 < len(va1) < 20
    tr3, va3 = split_files(root, files, 0.25, max_files=10)
    assert len(tr3) + len(va3) == 10 and set(va3) <= set(va1)


def test_tokens_and_packing(tmp_path):
    train, val = load_tokens(str(_corpus(tmp_path)), 0.25, 0, [".py"])
    assert train.dtype == torch.uint8 and (train == EOS).sum() + (val == EOS).sum() == 40
    ds = PackedDataset(train, seq_len=8)
    x, y = ds.batch(torch.tensor([0, 2]))
    assert x.shape == y.shape == (2, 8) and x.dtype == torch.int64
    assert torch.equal(x[0], train[:8].long()) and torch.equal(y[0], train[1:9].long())
    assert torch.equal(x[1], train[16:24].long())


def test_single_file_split_by_bytes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"abcdefghij" * 10)
    train, val = load_tokens(str(f), 0.1, 0, [])
    assert train.numel() == 90 and val.numel() == 11  # + the EOS byte


def test_sampler_shards_and_resumes():
    n, b = 50, 3
    ranks = [ShardedSampler(n, b, r, 2, seed=5) for r in range(2)]
    seen = []
    for _ in range(ranks[0].steps_per_epoch):
        a, c = (s.next_indices() for s in ranks)
        assert not set(a.tolist()) & set(c.tolist())
        seen += a.tolist() + c.tolist()
    assert len(set(seen)) == len(seen) == 48  # one epoch: no repeats
    # restore mid-run: same continuation
    s = ShardedSampler(n, b, 0, 2, seed=5)
    for _ in range(11):
        s.next_indices()
    state = s.state_dict()
    want = [s.next_indices().tolist() for _ in range(5)]
    s2 = ShardedSampler(n, b, 0, 2, seed=5)
    s2.load_state_dict(state)
    assert [s2.next_indices().tolist() for _ in range(5)] == want
    other = ShardedSampler(n, b, 0, 2, seed=6)
    other_first = other.next_indices().tolist()
    assert ShardedSampler(n, b, 0, 2, seed=5).next_indices().tolist() != other_first


def test_validation_sample_spreads_over_the_whole_set_and_is_split_evenly():
    from mxmoe.train.data import eval_windows

    idx = eval_windows(1000, 8, world=2)
    assert idx.shape == (2, 4) and idx.dtype == torch.int64
    flat = sorted(idx.flatten().tolist())
    assert flat == [62, 187, 312, 437, 562, 687, 812, 937]  # floor((i + 1/2) * 1000 / 8)
    assert torch.equal(idx, eval_windows(1000, 8, world=2))  # fixed across evaluations
    # a small set is used whole (rounded down to a multiple of the ranks)
    assert sorted(eval_windows(7, 100, world=1).flatten().tolist()) == list(range(7))
    assert eval_windows(7, 100, world=2).shape == (2, 3)
    assert eval_windows(7, 1, world=2).shape == (2, 1)  # at least one window per rank


def test_validation_uses_the_documented_number_of_tokens(tmp_path):
    import json

    from mxmoe.train import trainer

    text = tmp_path / "data.txt"
    text.write_bytes(bytes(range(256)) * 12)  # 3072 bytes; the last 20% (614) are validation
    args = ["--model.name=debug_dense", "--model.dim=32", "--model.n_heads=2", "--model.n_layers=1"]
    args += ["--training.seq_len=32", "--training.local_batch_size=2", "--training.steps=2"]
    args += ["--validation.freq=1", f"--data.path={text}", "--data.val_fraction=0.2"]
    args += ["--training.cpu_threads=1"]
    for val_batches, tokens in ((1, 2 * 32), (100, (613 // 32) * 32)):  # a sample; the whole set
        run = tmp_path / f"run{val_batches}"
        assert trainer.main(args + [f"--validation.steps={val_batches}", f"--job.dump_folder={run}"]) == 0
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["val_tokens"] for r in recs] == [tokens, tokens]
        assert all(r["val_loss"] > 0 for r in recs)


def _odd_entries(folder) -> None:
    """Entries named like data files that are not regular files: reading them would hang (a FIFO),
    never end (a link to /dev/zero) or raise (dangling and looping links)."""
    os.mkfifo(folder / "fifo.py")
    (folder / "zero.py").symlink_to("/dev/zero")
    (folder / "dangling.py").symlink_to(folder / "nowhere.py")
    (folder / "loop.py").symlink_to(folder / "loop.py")


def test_only_regular_files_are_read_and_the_others_are_counted(tmp_path, capsys):
    from mxmoe.train import trainer

    data = _corpus(tmp_path / "data")
    _odd_entries(data)
    (data / "linked.py").symlink_to(data / "d0" / "f0.py")  # a link to a regular file is read
    c = load_corpus(str(data), 0.25, 0, [".py"])
    sizes = sum(f.stat().st_size for f in data.rglob("f*.py")) + (data / "d0" / "f0.py").stat().st_size
    assert c.identity["files"] == 41 and c.train.numel() + c.val.numel() == sizes + 41
    assert c.identity["skipped"] == {"FIFO": 1, "character device": 1, "broken or looping link": 2}
    args = ["--model.name=debug_dense", "--model.dim=32", "--model.n_heads=2", "--model.n_layers=1"]
    args += ["--training.seq_len=32", "--training.local_batch_size=2", "--training.steps=1"]
    args += [f"--data.path={data}", f"--job.dump_folder={tmp_path / 'run'}", "--training.cpu_threads=1"]
    assert trainer.main(args) == 0
    out = capsys.readouterr().out
    assert "skipped 4 not regular files (FIFO 1, broken or looping link 2, character device 1)" in out, out


def test_a_file_over_the_size_limit_is_an_error_naming_it(tmp_path):
    data = _corpus(tmp_path)
    big = data / "d1" / "big.py"
    big.write_text("y = 2\n" * 100)
    limit = "data.max_file_bytes=599: raise the limit"
    with pytest.raises(ValueError, match=rf"data file {big} has 600 bytes, more than {limit}"):
        load_corpus(str(data), 0.25, 0, [".py"], max_file_bytes=599)
    with pytest.raises(ValueError, match="data.path='/dev/zero' is a character device, neither a regular"):
        load_corpus("/dev/zero", 0.25, 0, [])


def test_the_python_env_corpus_is_every_python_file_of_the_environment_once(tmp_path, monkeypatch):
    from mxmoe.train.data import PYTHON_ENV, corpus_roots, find_files

    roots = dict(corpus_roots(PYTHON_ENV))
    assert roots["stdlib"] == stdlib_dir() and (roots["purelib"] / "torch" / "__init__.py").is_file()
    # the folders as sysconfig names them, here made small: stdlib == platstdlib, purelib == platlib,
    # a package file linked into the stdlib, a stdlib copy of site-packages left out
    std, pkgs = tmp_path / "lib", tmp_path / "site"
    (std / "json").mkdir(parents=True)
    (std / "os.py").write_text("import sys\n")
    (std / "json" / "__init__.py").write_text("x = 1\n")
    (std / "site-packages").mkdir()
    (std / "site-packages" / "inner.py").write_text("y = 2\n")
    (pkgs / "pkg").mkdir(parents=True)
    (pkgs / "pkg" / "mod.py").write_text("z = 3\n")
    (std / "zz_link.py").symlink_to(pkgs / "pkg" / "mod.py")
    paths = {"stdlib": str(std), "platstdlib": str(std), "purelib": str(pkgs), "platlib": str(pkgs)}
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    c = find_files(PYTHON_ENV, [".py"])
    assert c.source == PYTHON_ENV
    assert c.names == ["purelib/pkg/mod.py", "stdlib/json/__init__.py", "stdlib/os.py"]
    assert find_files(PYTHON_ENV, [".py"]).names == c.names  # deterministic
    c2 = load_corpus(PYTHON_ENV, 0.0, 0, [".py"])
    assert c2.identity["files"] == 3 and c2.identity["source"] == PYTHON_ENV
    assert c2.train.numel() == sum(len(p.read_bytes()) + 1 for p in c.paths)


def test_the_corpus_identity_follows_the_files_names_and_sizes(tmp_path):
    data = _corpus(tmp_path)
    a = load_corpus(str(data), 0.25, 0, [".py"]).identity
    assert load_corpus(str(data), 0.25, 0, [".py"]).identity == a
    (data / "d0" / "f0.py").write_text("# longer than before\n" * 3)
    b = load_corpus(str(data), 0.25, 0, [".py"]).identity
    assert b["sha256"] != a["sha256"] and b["files"] == a["files"] == 40


def test_the_run_says_how_many_epochs_it_reads_and_warns_past_one(tmp_path, capsys):
    import json

    from mxmoe.train import trainer

    text = tmp_path / "data.txt"
    text.write_bytes(bytes(range(256)) * 8)  # 2048 bytes + EOS; 10 % validation: 1844 train tokens
    args = ["--model.name=debug_dense", "--model.dim=32", "--model.n_heads=2", "--model.n_layers=1"]
    args += ["--training.seq_len=32", "--training.local_batch_size=2", "--validation.freq=0"]
    args += [f"--data.path={text}", "--data.val_fraction=0.1", "--training.cpu_threads=1"]
    for steps, epochs in ((10, 640 / 1824), (30, 1920 / 1824)):  # 57 windows of 32 tokens per epoch
        run = tmp_path / f"run{steps}"
        capsys.readouterr()
        assert trainer.main(args + [f"--training.steps={steps}", f"--job.dump_folder={run}"]) == 0
        out, err = capsys.readouterr()
        what = (f"the run reads {steps * 64:,} tokens (training.steps x global batch x seq_len = {steps} x "
                f"2 x 32), {epochs:.2f} epochs of the train split's 1,824 tokens")
        recorded = json.loads((run / "config.json").read_text())
        assert recorded["epochs"] == {"steps": steps, "global_batch": 2, "seq_len": 32,
                                      "tokens_per_epoch": 1824, "run_tokens": steps * 64, "epochs": epochs}
        assert recorded["corpus"]["files"] == 1 and recorded["corpus"]["train_tokens"] == 1844
        if epochs > 1:
            assert f"mxmoe WARNING: {what}: its training data repeats" in err, err
        else:
            assert what in out and "repeats" not in err, (out, err)
