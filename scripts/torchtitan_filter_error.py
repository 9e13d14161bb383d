"""How far each `--mx.filter_fqns` choice puts torchtitan 0.2's MoE debug models from fp32 (CPU).

For each model, builds torchtitan's model twice from the same seed, one plain (fp32, the for-loop
experts) and one through mxmoe's "mxmoe" converter, and prints the relative error
||logits_mx - logits_fp32|| / ||logits_fp32|| on batch x seq random tokens for three module sets:
  all       filter_fqns output,router            every Linear but the head and router gates + experts
  default   filter_fqns output,router,attention  feed-forward, shared experts and routed experts
  experts   filter_fqns output,router,attention,feed_forward,shared_expert   routed experts only

    PYTHONPATH=<torchtitan 0.2 site>:. python scripts/torchtitan_filter_error.py [--seq 128] [--batch 2]

torchtitan 0.2's router counts tokens with torch.histc on int64, which only CUDA implements; on
CPU this script counts them as floats (a patch of torch.histc inside this process).
"""

from __future__ import annotations

import argparse
import copy
import importlib

import torch

FILTERS = {
    "all": ["output", "router"],
    "default": ["output", "router", "attention"],
    "experts": ["output", "router", "attention", "feed_forward", "shared_expert"],
}
MODELS = [("deepseek_v3", "debugmodel"), ("llama4", "debugmodel"), ("qwen3", "debugmodel_moe")]


def _cpu_histc():
    histc = torch.histc

    def cpu(x, *args, **kwargs):
        if x.is_floating_point():
            return histc(x, *args, **kwargs)
        return histc(x.float(), *args, **kwargs).to(x.dtype)

    torch.histc = cpu


def build(name: str, flavor: str, seq: int, filter_fqns: list[str] | None) -> tuple[torch.nn.Module, int]:
    from torchtitan.config import JobConfig

    from mxmoe.integrations.torchtitan import MX, MXMoEConverter

    spec = importlib.import_module(f"torchtitan.models.{name}").get_train_spec()
    args = copy.deepcopy(spec.model_args[flavor])
    jc = JobConfig()
    jc.training.seq_len = seq
    args.update_from_config(jc)
    args.moe_args.use_grouped_mm = False  # CPU: torchtitan's for-loop experts (the fp32 reference)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if filter_fqns is not None:
        jc.mx = MX(filter_fqns=filter_fqns)
        MXMoEConverter(jc, parallel_dims=None).convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, args.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    _cpu_histc()
    for name, flavor in MODELS:
        ref, vocab = build(name, flavor, args.seq, None)
        torch.manual_seed(1)
        tokens = torch.randint(0, vocab, (args.batch, args.seq))
        with torch.no_grad():
            want = ref(tokens)
            errs = {}
            for label, ff in FILTERS.items():
                got = build(name, flavor, args.seq, ff)[0](tokens)
                errs[label] = ((got - want).norm() / want.norm()).item()
        print(f"{name} {flavor}: " + ", ".join(f"{k} {100 * v:.2f} %" for k, v in errs.items()), flush=True)


if __name__ == "__main__":
    main()
