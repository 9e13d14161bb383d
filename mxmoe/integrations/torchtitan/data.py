"""A local text dataset for torchtitan's dataloader, for machines without network.

`python -m mxmoe.integrations.torchtitan.data OUT_DIR` writes OUT_DIR/data.json: one JSON object
`{"text": ...}` per line (the layout of torchtitan's `c4_test` dataset, read by
`datasets.load_dataset(OUT_DIR, split="train")`), one line per source file of the Python standard
library (the corpus mxmoe's own trainer uses, `mxmoe.train.data`), or of `--path`. Train on it with
`--dataloader.dataset c4_test --dataloader.dataset_path OUT_DIR`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", help="folder to write data.json into")
    ap.add_argument("--path", default="", help="text file or folder (default: the Python standard library)")
    ap.add_argument("--ext", default=".py", help="comma-separated file endings to take (default .py)")
    args = ap.parse_args(argv)
    n = write_text_dataset(args.out_dir, args.path, tuple(e for e in args.ext.split(",") if e))
    print(f"wrote {n} records to {Path(args.out_dir) / 'data.json'}")


if __name__ == "__main__":
    main()
