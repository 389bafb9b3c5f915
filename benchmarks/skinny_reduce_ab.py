"""The whole-model decode step with skinny_linear's split-K partials summed in the GEMV's own launch (the
default, ``SkinnyConfig.one_launch``) and by a second reduce kernel, in one process: which is faster where
it counts. From the repository root on a GPU machine:

    python benchmarks/skinny_reduce_ab.py --out ab.json [--batch 1 8] [--steps 32]
"""

import argparse
import dataclasses

import fnattn.kernels.skinny_linear as skinny

from fnattn.bench import write_json
from fnattn.bench.model import run_model_bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    table = skinny.pick_config
    out = []
    for one_launch in (True, False):
        skinny.pick_config = lambda *a, one_launch=one_launch, **k: dataclasses.replace(table(*a, **k),
                                                                                        one_launch=one_launch)
        records = run_model_bench(family="qwen3_5", shape="0.8b", batches=args.batch, prompts=[512],
                                  steps=args.steps, transformers=False, prefill_tokens=0, log=lambda line: None)
        for r in records:
            if r.get("backend") == "fnattn graph":
                r["split_k_sum"] = "in the GEMV's launch" if one_launch else "second reduce kernel"
                print(f"{r['case']:<28}{r['split_k_sum']:<24}{r['time_us']:9.1f} us")
                out.append(r)
    skinny.pick_config = table
    write_json(out, args.out, command="python benchmarks/skinny_reduce_ab.py " + " ".join(
        ["--batch", *map(str, args.batch), "--steps", str(args.steps), "--out", args.out]))


if __name__ == "__main__":
    main()
