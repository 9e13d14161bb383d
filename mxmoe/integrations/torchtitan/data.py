"""A local text dataset for torchtitan's dataloader, for machines without network.

`python -m mxmoe.integrations.torchtitan.data OUT_DIR` writes OUT_DIR/data.json: one JSON object
`{"text": ...}` per line (the layout of torchtitan's `c4_test` dataset, read by
`datasets.load_dataset(OUT_DIR, split="train")`), one line per source file of the Python standard
library (the corpus mxmoe's own trainer uses, `mxmoe.train.data`), or of `--path`. Train on it with
`--dataloader.dataset c4_test --dataloader.dataset_path OUT_DIR` (torchtitan 0.3) or
`--training.dataset c4_test --training.dataset_path OUT_DIR` (0.2).

`--tokenizer TOK_DIR` also writes a byte-level tokenizer (`write_byte_tokenizer`: one token per
byte, as mxmoe's own trainer, plus BOS / EOS; nothing learned, so every machine writes the same
one) for `--model.hf_assets_path TOK_DIR`, for machines without torchtitan's test tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from mxmoe.cli import ArgumentParser
from mxmoe.train.data import list_files


def write_text_dataset(out_dir: str | Path, path: str = "", extensions: tuple[str, ...] = (".py",)) -> int:
    """Write out_dir/data.json from the files under `path` ("" = the Python standard library)
    ending in one of `extensions`; returns the number of records written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _, files = list_files(path, list(extensions))
    n = 0
    with open(out / "data.json", "w", encoding="utf-8") as f:
        for p in files:
            text = p.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
                n += 1
    return n


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_byte_tokenizer(out_dir: str | Path) -> int:
    """Write out_dir/tokenizer.json and tokenizer_config.json (what torchtitan's
    HuggingFaceTokenizer reads): a byte-level BPE without merges, ids 0-255 the bytes (in GPT-2's
    byte-to-unicode order), 256 BOS and 257 EOS, which torchtitan adds around each document.
    Returns the vocabulary size (258; the debug models' 2048-row embeddings cover it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte stand-ins
    byte_order = sorted(alphabet, key=_byte_of)
    vocab = {ch: i for i, ch in enumerate(byte_order)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return tok.get_vocab_size()


def _byte_of(ch: str) -> int:
    # GPT-2's byte-to-unicode map: printable bytes stand for themselves, the others are shifted
    # to 256 + n in order
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    c = ord(ch)
    if c in printable:
        return c
    others = [b for b in range(256) if b not in printable]
    return others[c - 256]


def main(argv: list[str] | None = None) -> None:
    prog = "python -m mxmoe.integrations.torchtitan.data"
    ap = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", help="folder to write data.json into")
    ap.add_argument("--path", default="", help="text file or folder (default: the Python standard library)")
    ap.add_argument("--ext", default=".py", help="comma-separated file endings to take (default .py)")
    ap.add_argument("--tokenizer", default="", help="also write a byte-level tokenizer into this folder")
    args = ap.parse_args(argv)
    from mxmoe.cli import check_out_folder

    try:  # before anything is read or written: one line naming the argument
        check_out_folder(args.out_dir, "out_dir")
        if args.tokenizer:
            check_out_folder(args.tokenizer, "--tokenizer")
        n = write_text_dataset(args.out_dir, args.path, tuple(e for e in args.ext.split(",") if e))
    except ValueError as e:  # the trainer's data.path is this tool's --path
        msg = str(e)
        ap.error("--path=" + msg[len("data.path=") :] if msg.startswith("data.path=") else msg)
    if n == 0:  # an empty data.json would be a dataset torchtitan reads no batch from
        (Path(args.out_dir) / "data.json").unlink()
        ap.error(f"--path={args.path!r}: every file it names is empty or blank; no record was written")
    print(f"wrote {n} records to {Path(args.out_dir) / 'data.json'}")
    if args.tokenizer:
        try:
            v = write_byte_tokenizer(args.tokenizer)
        except ImportError:
            ap.exit(2, f"{ap.prog}: --tokenizer needs the tokenizers package: pip install tokenizers\n")
        print(f"wrote a byte-level tokenizer (vocabulary {v}) to {args.tokenizer}")


if __name__ == "__main__":
    main()
