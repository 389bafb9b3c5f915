"""The whole Qwen3.5-0.8B decode step both ways of one switch, in one process: which is faster where it
counts (a kernel that wins alone can lose in a step, and the other way round). From the repository root
on a GPU machine:

    python benchmarks/model_ab.py --toggle add_norm_epilogue --out ab.json [--batch 1 8] [--steps 32]

Switches:

- ``one_launch``: skinny_linear's split-K partials summed in the GEMV's own launch (on, the default) or by
  a second reduce kernel (`SkinnyConfig.one_launch`).
- ``pdl``: fnattn's decode kernels launched with programmatic dependent launch (`fnattn.kernels.pdl`): each
  may start while the launch before it finishes (a GEMV loads its first weight tile), or after it ends (off,
  the default).
- ``add_norm_epilogue``: each residual add + RMSNorm in the output projection's launch
  (`models.fused.add_norm_epilogue`) or FlashInfer's fused add + RMSNorm after it (off, the default).
- ``qk_one_launch``: attention's q / k norms, rope and v's copy in one launch (`models.fused.qk_one_launch`)
  or FlashInfer's norms and rope (off, the default).
"""

import argparse

import fnattn.kernels.skinny_linear as skinny
from fnattn.models import fused

from fnattn import kernels
from fnattn.bench import write_json
from fnattn.bench.model import run_model_bench


def one_launch(on: bool):
    return skinny.configured(one_launch=on)


TOGGLES = {
    "one_launch": (one_launch, {True: "split-K sums in the GEMV's launch", False: "a second reduce kernel"}),
    "pdl": (kernels.pdl, {True: "kernels launched with PDL", False: "each kernel launched after the last ends"}),
    "add_norm_epilogue": (fused.add_norm_epilogue, {True: "add + norm in the projection's launch",
                                                    False: "FlashInfer's add + norm after the projection"}),
    "qk_one_launch": (fused.qk_one_launch, {True: "q/k norms, rope, v copy in one launch",
                                            False: "q norm, k norm, rope (+ copies above 1 row)"}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toggle", choices=sorted(TOGGLES), required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    switch, labels = TOGGLES[args.toggle]
    out = []
    for on in (True, False):
        with switch(on):
            records = run_model_bench(family="qwen3_5", shape="0.8b", batches=args.batch, prompts=[512],
                                      steps=args.steps, transformers=False, prefill_tokens=0, log=lambda line: None)
        for r in records:
            if r.get("backend") == "fnattn graph":
                r[args.toggle] = labels[on]
                print(f"{r['case']:<28}{labels[on]:<48}{r['time_us']:9.1f} us")
                out.append(r)
    write_json(out, args.out, command="python benchmarks/model_ab.py " + " ".join(
        ["--toggle", args.toggle, "--batch", *map(str, args.batch), "--steps", str(args.steps), "--out", args.out]))


if __name__ == "__main__":
    main()
