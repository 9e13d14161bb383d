"""A tiny Hugging Face MoE model (tests/integrations/hf_models.py, no download) trained in bf16 and
converted by mxmoe.convert, side by side on one batch: the conversion's log line and both losses
per step (docs/huggingface.md).

    python scripts/hf_bf16_vs_mx.py qwen3_moe [--steps 20] [--device cuda]  # or mixtral, deepseek_v3, gpt_oss
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from hf_models import TINY, tiny_model, tokens  # noqa: E402

import mxmoe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(TINY))
    ap.add_argument("--steps", type=int, default=20, help="AdamW steps (default 20)")
    ap.add_argument("--device", default="cpu", help="where the models run (default cpu)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("mxmoe.ops.gemm_backend").setLevel(logging.WARNING)
    ref = tiny_model(args.family, dtype=torch.bfloat16).to(args.device)
    mx = mxmoe.convert(copy.deepcopy(ref), mxmoe.MXOptions())
    models = {"bf16": ref, "mx": mx}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=3e-3) for k, m in models.items()}
    ids = tokens(8, 64, seed=0).to(args.device)  # one batch: a loss that falls
    for step in range(1, args.steps + 1):
        losses = {}
        for k, m in models.items():
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            optims[k].step()
            optims[k].zero_grad()
            losses[k] = loss.item()
        diff = 100 * (losses["mx"] - losses["bf16"]) / losses["bf16"]
        print(f"step {step}: bf16 {losses['bf16']:.5f}  mx {losses['mx']:.5f}  ({diff:+.3f} %)")


if __name__ == "__main__":
    main()
