"""Where an eager step's host time goes: cProfile over eager decode steps of a whole model.

    python benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --prompt 512 --steps 8

Prints the functions taking the most host time of their own (tottime) and in all (cumtime). An eager step
that the device finishes in ~1.5 ms but the host needs ~20 ms for is launch-bound: this says which calls.
"""

import argparse
import cProfile
import pstats

import torch
from fnattn.models.registry import Model, _with_dtype, family_named, random_checkpoint

from fnattn.bench.model import config_for, decode_state, time_decode
from fnattn.model_attention import ModelAttention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fam = family_named(a.family)
    cfg = _with_dtype(fam.adapt(config_for(a.family, a.shape)), dtype)
    model = Model(fam, cfg, fam.load(cfg, random_checkpoint(fam, cfg, dtype=dtype, device=dev)))
    ma = ModelAttention(model.specs, device=dev)
    st = decode_state(model, dev, a.batch, a.prompt, page_size=16, room=2 * a.steps + 8)
    _, st = time_decode(model, ma, st, a.batch, 2)  # compile and warm up outside the profile
    prof = cProfile.Profile()
    prof.enable()
    times, st = time_decode(model, ma, st, a.batch, a.steps, warmup=0)
    prof.disable()
    print(f"{a.family} {a.shape} B{a.batch} ctx{a.prompt}: eager step {sum(times) / len(times) * 1e3:.2f} ms "
          f"under cProfile, {a.steps} steps")
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof).sort_stats(key).print_stats(a.rows)


if __name__ == "__main__":
    main()
