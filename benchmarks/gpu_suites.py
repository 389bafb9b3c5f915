"""The GPU suites: each one device call (under 10 minutes) that rewrites the repository's current records.

On the GPU machine, from the repository root:

    source .gpu/install.sh; FNATTN_COMMIT=<commit> bash benchmarks/gpu_suites.sh parity
    bash benchmarks/gpu_suites.sh --list          # the suites, their time limits and the records each writes
    FNATTN_CALL_S=580 bash benchmarks/gpu_suites.sh A B   # several suites in one call: limits cut to what is left
    bash benchmarks/gpu_suites.sh --place DIR     # copy the records found in DIR to their places in the repository

Every record lands in $OUT (or ./gpu-out) under its own name; `--place` puts it where the committed one lives
(`tests/gpu_results/` for test runs, `benchmarks/results/` for timings), so a re-run replaces the record it
measures again. A suite is a list of parts; each part has its own time limit (SIGTERM, then SIGKILL 20 s later)
so one slow compile cannot take the rest down, and a pytest part still writes the cases that finished. Every
part's whole output goes to $OUT/session.log (a device call returns only the end of what it prints).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_RESULTS = "tests/gpu_results"  # pytest runs: outcomes per test, or the cases a test compared
RESULTS = "benchmarks/results"  # timings: `fnattn bench ...` with its peers
DEVICE_LIMIT_S = 600  # one device call
GRACE_S = 20  # between SIGTERM and SIGKILL: a pytest run writes its finished cases in this time
TAIL_LINES = 25

# A record no committed copy exists of yet; drop the mark once its first run is committed.
NEW = {"tp_gpu.json", "bound_launches_gpu.json", "bench_invariance_qwen3_5_0.8b_256.json",
       "bench_invariance_qwen3_5_0.8b_p4096.json", "bench_invariance_deepseek_v32_2-layer_p4096.json"}

RECORD = "python benchmarks/gpu_pytest_record.py"  # one row per test: passed, failed, skipped, and why
PYTEST = "python -m pytest -q -p no:warnings --tb=line"  # with FNATTN_GPU_RESULTS: one row per compared case
BENCH = "python -m fnattn bench"


@dataclass(frozen=True)
class Part:
    limit_s: int
    command: str  # `{out}` is the output folder
    env: dict[str, str] = field(default_factory=dict)

    def records(self) -> list[str]:
        """The files this part writes: every `{out}/NAME` in its command or environment."""
        text = " ".join([self.command, *self.env.values()])
        return re.findall(r"\{out\}/([\w.+-]+)", text)

    def folder(self) -> str:
        return GPU_RESULTS if "pytest" in self.command else RESULTS


@dataclass(frozen=True)
class Suite:
    about: str
    parts: tuple[Part, ...]
    gpus: int = 1

    def limit_s(self) -> int:
        return sum(p.limit_s for p in self.parts)


def tests(limit_s: int, record: str, args: str) -> Part:
    return Part(limit_s, f"{RECORD} {{out}}/{record} -- {args}")


def bench(limit_s: int, args: str, record: str, **env: str) -> Part:
    return Part(limit_s, f"{BENCH} {args} --out {{out}}/{record}", env)


# The tiny CPU records are timed on one thread, without CUDA, wherever they run.
CPU = {"CUDA_VISIBLE_DEVICES": "", "FNATTN_THREADS": "1"}
TINY = "--shape tiny --batch 1 8 --prompt 512 --device cpu"

SUITES: dict[str, Suite] = {
    "parity": Suite("full attention: Triton and FlashInfer against the reference, FlashInfer's tensor-core decode", (
        Part(330, f"{PYTEST} tests/gpu/test_full_backends_gpu.py",  # FlashInfer compiles each variant: most of it
             {"FNATTN_GPU_RESULTS": "{out}/full_attention_parity.json"}),
        tests(200, "flashinfer_tc_gpu.json", "tests/gpu/test_flashinfer_tc_gpu.py"),
    )),
    "parity-recurrent": Suite("GDN / KDA backends and speculative decoding against the reference; the prefill paths", (
        Part(240, f"{PYTEST} tests/gpu/test_recurrent_backends_gpu.py tests/gpu/test_speculative_gpu.py",
             {"FNATTN_GPU_RESULTS": "{out}/recurrent_parity.json"}),
        # fla-core autotunes its prefill on a fresh machine (184 s once)
        tests(300, "chunk_tiles_gpu.json", "tests/gpu/test_recurrent_backends_gpu.py "
              "-k 'qkv_apart or prefill or fla_direct or chunk_tiles'"),
    )),
    "parity-mla": Suite("MLA, sparse MLA and the DSA indexer, DeepSeek-V4's FlashMLA, the merges' shared LSE weights", (
        tests(270, "sparse_indexer_gpu.json", "tests/gpu/test_mla_backends_gpu.py tests/kernels/test_indexer.py "
              "-k 'sparse or indexer or ties'"),
        tests(200, "lse_weights_gpu.json", "tests/kernels/test_latent_absorb.py tests/kernels/test_merge_scatter.py "
              "tests/gpu/test_mla_backends_gpu.py -k 'absorb or merge or real'"),
        tests(90, "dsv4_flashmla_gpu.json", "tests/test_indexer_drops.py tests/gpu/test_dsv4_flashmla_gpu.py -m gpu"),
    )),
    "graphs": Suite("captured steps: replay == the capture-free step for every family, the framework's overhead "
                    "ways, the verify bug classes and padded lanes under capture", (
        tests(270, "graph_gpu.json", "tests/gpu/test_graph_gpu.py tests/gpu/test_overhead_gpu.py"),
        tests(240, "bug_classes_gpu.json", "tests/gpu/test_verify_bug_classes_gpu.py "
              "tests/gpu/test_padded_lanes_gpu.py tests/test_indexer_drops.py -m gpu"),
    )),
    "kernels": Suite("GDN gating and fused decode, FlashInfer sampling, grouped experts, transfer between devices", (
        tests(120, "gdn_pdl_gpu.json", "tests/gpu/test_gdn_gating_gpu.py tests/gpu/test_gdn_decode_fused_gpu.py"),
        tests(150, "sampling_gpu.json", "tests/gpu/test_sampling_gpu.py"),
        tests(150, "grouped_experts_gpu.json", "tests/gpu/test_grouped_experts_gpu.py"),
        tests(60, "transfer_gpu.json", "tests/test_transfer.py tests/test_transfer_dist.py -m gpu"),
    )),
    "kernels-fused": Suite("the fused Qwen3.5 paths: the fused kernels and the whole model, split norms, the "
                           "fused GDN decode's switches, the workspace's events", (
        tests(240, "fused_gpu.json", "tests/gpu/test_fused_gpu.py tests/gpu/test_workspace_gpu.py "
              "-k 'not (whole_model and split)'"),
        tests(270, "split_norm_gpu.json", "tests/gpu/test_fused_gpu.py -k 'whole_model and split'"),
        tests(60, "state_first_rerun_gpu.json", "tests/gpu/test_gdn_decode_fused_gpu.py "
              "-k 'state_first or fill_device'"),
    )),
    "tp": Suite("tensor parallelism over NCCL: tp=2 against tp=1 (two GPUs: nvidia-h200-x2)", (
        tests(300, "tp_gpu.json", "tests/gpu/test_tp_gpu.py"),
    ), gpus=2),
    "bench": Suite("`fnattn bench`: the paged decode, the GDN decode and prefill, the full-attention prefill", (
        bench(150, "decode --batch 1 8 64 --layers 1", "bench_decode_layers.json"),
        bench(80, "gdn-decode", "bench_gdn_decode.json"),
        bench(90, "prefill --tokens 16384", "bench_prefill.json"),
        bench(150, "gdn-prefill", "bench_gdn_prefill.json"),
    )),
    "bench-linear": Suite("`fnattn bench linear`: the skinny GEMV and its folds against cuBLAS and FlashInfer; at one "
                          "row the config sweep its table is tuned from", (
        Part(300, "python benchmarks/linear_sweep.py --batch 1 --out {out}/bench_linear_b1.json"),
        bench(200, "linear --batch 8 16 --no-sweep", "bench_linear_b8_16.json"),
    )),
    "bench-mla": Suite("`fnattn bench`: dense and sparse MLA decode and the DSA indexer against raw FlashMLA; the "
                       "indexer's tile sweep", (
        bench(90, "mla-decode --batch 64 --ctx 4096", "bench_mla_decode_b64.json"),
        bench(90, "mla-decode --batch 128 --ctx 8192", "bench_mla_decode_b128.json"),
        bench(120, "mla-sparse --batch 64 --ctx 32768", "bench_mla_sparse.json"),
        bench(120, "indexer --batch 64 --ctx 32768", "bench_mla_sparse_indexer.json"),
        # the scores kernel's tiles and where the indexer's time goes (FP8 keys): `_DEFAULT_TILE` is picked from it
        Part(150, "python benchmarks/indexer_sweep.py --keys fp8 --out {out}/indexer_sweep_fp8.json"),
    )),
    "model": Suite("the whole Qwen3.5-0.8B shape at 512 tokens, eager and replayed, then beside transformers", (
        Part(300, f"{BENCH} model --family qwen3_5 --shape 0.8b --batch 1 8 32 128 --prompt 512 --no-transformers "
             "--out {out}/bench_model_qwen3_5_0.8b_p512.json --png {out}/bench_model_qwen3_5_0.8b_p512.png"),
        bench(270, "model --family qwen3_5 --shape 0.8b --batch 1 32 --prompt 512",
              "bench_model_qwen3_5_0.8b_p512_hf.json"),
    )),
    "model-long": Suite("Qwen3.5-0.8B with 8192-token prompts; the framework's overhead over the same kernels", (
        bench(300, "model --family qwen3_5 --shape 0.8b --batch 1 --prompt 8192 --steps 16 --profile 1",
              "bench_model_qwen3_5_0.8b_p8192.json"),
        bench(250, "overhead --family qwen3_5 --shape 0.8b --batch 1 8 --prompt 512 --steps 32 --device cuda",
              "bench_overhead_qwen3_5_0.8b.json"),
    )),
    "model-moe": Suite("DeepSeek-V3.2 and Kimi Linear at their released layer shapes (fewer layers)", (
        bench(280, "model --family deepseek_v32 --shape 2-layer --batch 1 8 32 --prompt 2048 --no-transformers",
              "bench_model_deepseek_v32_2-layer.json"),
        bench(280, "model --family kimi_linear --shape 4-layer --batch 1 8 32 --prompt 2048 --no-transformers",
              "bench_model_kimi_linear_4-layer.json"),
    )),
    "profile": Suite("where the Qwen3.5-0.8B decode step's time goes: kernels per step (eager and replayed), each "
                     "layer's kernel time against its bytes, then eager host time (printed, in session.log); then "
                     "decode in pieces around a notebook's full-attention kind, eager and replayed", (
        bench(330, "model --family qwen3_5 --shape 0.8b --batch 1 8 32 --prompt 512 --steps 16 --no-transformers "
              "--profile 4", "bench_model_qwen3_5_0.8b_profile.json"),
        Part(120, "python benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --prompt 512 --steps 8 "
             "--rows 25"),
        bench(110, "model --family qwen3_5 --shape 0.8b --batch 1 8 --prompt 512 --steps 32 --no-transformers "
              "--prefill-tokens 0 --uncapturable full", "bench_model_qwen3_5_0.8b_pieces.json"),
    )),
    "invariance": Suite("whether a token's result depends on its phase or batch on CUDA, with the invariant mode off "
                        "and on, every family (in the mode a ModelAttention chooses only backends that honour it: "
                        "the Triton full-attention, MLA, sparse MLA, DeepSeek-V4 and GDN / KDA kernels); the "
                        "invariant kernels against their references and across their launch forms (20 family "
                        "cases took 206 s on a fresh H100, KDA's compile 85 s of it); the invariant GEMM's cost "
                        "against cuBLAS and the default GEMV", (
        # the kernels' tests: 48 of 59 in 120 s on a fresh H100 (compiles), 6 s warm; the cost table took 21 s
        tests(200, "invariant_linear_gpu.json", "tests/kernels/test_invariant_linear.py "
              "tests/kernels/test_paged_attention_invariant.py tests/kernels/test_latent_invariant.py"),
        tests(300, "invariant_gpu.json", "tests/gpu/test_invariant_gpu.py"),
        Part(60, "python benchmarks/invariant_linear_cost.py --out {out}/invariant_linear_cost.json"),
    )),
    "invariance-gemv": Suite("the decode GEMV compiled: its table's launches against their references and, in the "
                             "invariant mode, a row's bits in a call of any size (16-row tiles, K's pieces as "
                             "programs or within one)", (
        # 301 tests: 150 s fell short of a fresh compile, 57 s with a warm cache
        tests(240, "skinny_invariant_gpu.json", "tests/kernels/test_skinny_linear.py "
              "tests/kernels/test_skinny_folds.py tests/kernels/test_skinny_invariant.py"),
        # whether wider row tiles keep a 128-row product's bits (and each fold's: --folds), and the time of each
        # against cuBLAS, for the 0.8B shape's projections and its lm_head
        Part(120, "python benchmarks/gemv_row_tiles.py --rows 128 --shapes 3584x1024 1024x3584 6144x1024 "
                  "248320x1024 --folds --out {out}/gemv_row_tiles.json"),
    )),
    "invariance-bench": Suite("fnattn bench invariance over every family's tiny model: speculative greedy against "
                              "plain greedy, oracle acceptance, batch invariance, graph against eager, with the mode "
                              "off and on; then decode captured in pieces around a kind that cannot be captured, "
                              "against the capture-free step", (
        bench(420, "invariance --family all --new-tokens 32 --batch 1 8 --steps 4", "bench_invariance_tiny.json"),
        tests(150, "decode_pieces_gpu.json", "tests/gpu/test_decode_pieces_gpu.py"),  # 117 s with a fresh compile
    )),
    "invariance-mtp": Suite("speculative greedy against plain greedy over 256 tokens, oracle acceptance and batch "
                            "invariance for each family with an MTP draft (tiny models), with the mode off and on", (
        bench(180, "invariance --family qwen3_5 --new-tokens 256 --batch 1 8 32 --steps 4",
              "bench_invariance_qwen3_5_256.json"),
        bench(190, "invariance --family deepseek_v32 --new-tokens 256 --batch 1 8 32 --steps 4",
              "bench_invariance_deepseek_v32_256.json"),
        bench(190, "invariance --family deepseek_v4 --new-tokens 256 --batch 1 8 32 --steps 4",
              "bench_invariance_deepseek_v4_256.json"),
    )),
    "invariance-cost": Suite("the invariant mode's cost on the Qwen3.5-0.8B shape: its decode step, captured, mode on "
                             "over off at batch 1 / 8 / 32 / 128 (187 s on a fresh H100); then the first layer "
                             "whose decode results depend on the batch at those widths (printed, in session.log)", (
        bench(330, "invariance --family qwen3_5 --shape 0.8b --batch 1 8 32 128 --steps 8 --cost-only",
              "bench_invariance_qwen3_5_0.8b_cost.json"),
        # where a request's decode results first depend on its batch at the real widths (printed, in session.log),
        # beside 7 requests and beside 2; beside none, a difference is a run that does not repeat its own bits
        Part(80, "python benchmarks/invariance_probe.py --shape 0.8b --layers 4 --others 7 --steps 8"),
        Part(80, "python benchmarks/invariance_probe.py --shape 0.8b --layers 4 --others 2 --steps 8"),
        Part(80, "python benchmarks/invariance_probe.py --shape 0.8b --layers 4 --others 0 --steps 8"),
    )),
    "invariance-ab": Suite("the invariant mode's cost paired by round on one Qwen3.5-0.8B model (mode off, on), then "
                           "each variant's kernels by kind: where the mode's time goes (`wide_invariant_rows` and "
                           "`invariant_tiles` were each toggled too at f72d6d7: this record's history)", (
        Part(300, "python benchmarks/model_ab.py --toggle invariant --batch 1 8 32 128 --steps 32 --profile 3 "
                  "--out {out}/bench_invariance_ab.json"),
    )),
    "invariance-0.8b": Suite("the invariance properties at the Qwen3.5-0.8B shape, mode off and on: speculative greedy "
                             "against plain greedy, oracle acceptance, batch invariance at 3 / 8 / 32 / 128 requests, "
                             "graph against eager (the mode-off half once took 219 s on a fresh H100)", (
        bench(560, "invariance --family qwen3_5 --shape 0.8b --new-tokens 64 --batch 1 8 32 128 --steps 8",
              "bench_invariance_qwen3_5_0.8b.json"),
    )),
    "invariance-moe": Suite("the invariant mode's MoE on CUDA (fixed-tile grouped products over the picked experts): "
                            "the kernel's tests (a pair's row the bits of its token alone), then DeepSeek-V3.2's cost "
                            "at its released 2-layer shape, where the every-expert form took 7.7x", (
        tests(90, "invariant_moe_gpu.json", "tests/kernels/test_invariant_linear.py -k 'grouped or expert or moe'"),
        bench(280, "invariance --family deepseek_v32 --shape 2-layer --new-tokens 32 --batch 1 8 32 --steps 8",
              "bench_invariance_deepseek_v32_2-layer.json"),
    )),
    "invariance-gemv-sweep": Suite("which config the invariant mode's GEMV should take per weight shape: block_n x "
                                   "warps x stages x split, each timed at 1 / 8 / 32 / 128 rows in the mode against "
                                   "the mode-off path (cuBLAS above 16 rows), with its row bits checked", (
        Part(300, "python benchmarks/invariant_gemv_sweep.py --rows 1 8 32 128 "
                  "--out {out}/invariant_gemv_sweep.json"),
    )),
    "verify-conv": Suite("whether `short_conv_tiles` should be on: a verify step's GDN conv (1 / 8 / 32 requests of "
                         "4 tokens, 6144 channels) with its token tile as the table gives it and halved to fill the "
                         "device, timed and compared bit for bit", (
        Part(120, "python benchmarks/conv_short_tiles.py --batch 1 8 32 --out {out}/conv_short_tiles.json"),
    )),
    "invariance-gdn": Suite("whether the fused GDN / KDA decode with the usual V tile at every batch (the tile the "
                            "invariant mode keeps) gives the two-launch decode's bits, the verify path's: what "
                            "would let the mode take it", (
        tests(120, "gdn_usual_tile_gpu.json", "tests/gpu/test_gdn_decode_fused_gpu.py -k usual_tile"),
    )),
    "invariance-0.8b-256": Suite("speculative greedy against plain greedy over 256 tokens at the Qwen3.5-0.8B shape, "
                                 "mode off and on (the tiny models hold it with the mode off too: their widths do "
                                 "not discriminate)", (
        bench(560, "invariance --family qwen3_5 --shape 0.8b --new-tokens 256 --batch 1 8 --steps 2",
              "bench_invariance_qwen3_5_0.8b_256.json"),
    )),
    "invariance-cost-latent": Suite("the invariant mode's cost where MLA layers take its Triton path in place of "
                                    "FlashMLA / FlashInfer: Kimi Linear (MLA beside KDA) at its released layer "
                                    "shape, captured, mode on over off (DeepSeek-V3.2's: invariance-moe)", (
        bench(280, "invariance --family kimi_linear --shape 4-layer --new-tokens 32 --batch 1 8 32 --steps 8",
              "bench_invariance_kimi_linear_4-layer.json"),
    )),
    "invariance-cost-long": Suite("the invariant mode's cost at a 4096-token context, where its attention splits at "
                                  "fixed positions (64 keys full attention, 1024 latent) run as programs of their "
                                  "own at small batch: Qwen3.5-0.8B and DeepSeek-V3.2, captured, mode on over off", (
        bench(290, "invariance --family qwen3_5 --shape 0.8b --new-tokens 16 --batch 1 8 --steps 8 --prompt 4096",
              "bench_invariance_qwen3_5_0.8b_p4096.json"),
        bench(270, "invariance --family deepseek_v32 --shape 2-layer --new-tokens 16 --batch 1 8 --steps 8 "
              "--prompt 4096", "bench_invariance_deepseek_v32_2-layer_p4096.json"),
    )),
    "prefill-graph": Suite("prefill captured in pieces: replay == the capture-free step, every family (fla's and "
                           "Kimi's KDA kernels compile ~100 s each on a fresh machine)", (
        tests(560, "prefill_graph_gpu.json", "tests/gpu/test_prefill_graph_gpu.py"),
    )),
    "generate": Suite("the whole of generation at the Qwen3.5-0.8B shape: time to first token, the 8192-token "
                      "prefill, plain and eager decode, MTP k = 3 with every draft kept or none, the serving mix; "
                      "then where a speculative step's time goes (printed, in session.log) and its host work "
                      "alone (graphs that launch nothing)", (
        bench(370, "generate --family qwen3_5 --shape 0.8b --batch 1 8 --steps 32 --draft-vocab 32768",
              "bench_generate_qwen3_5_0.8b.json"),
        Part(140, "python -u benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --mtp 3 --batch 8 --steps 8 "
             "--rows 30"),
        Part(60, "python benchmarks/captured_host_time.py --device cuda --batch 1 8 --steps 200 "
             "--out {out}/captured_host_time_cuda.json"),
    )),
    "eager-host": Suite("where an eager decode step's host time goes on the GPU's host (Qwen3.5-0.8B, batch 1): the "
                        "step's time without the profiler, then cProfile with every launch real (printed, in "
                        "session.log)", (
        Part(100, "python -u benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --steps 8 --rows 40"),
    )),
    "bound-launches": Suite("launchers bound once (`bound_launches`): a bound launch's bits against Triton's own, a "
                            "GEMV and the fused Qwen3.5 model eager and captured; then the eager 0.8B step's time "
                            "with it on and off, paired (printed, in session.log)", (
        tests(120, "bound_launches_gpu.json", "tests/gpu/test_bound_launches_gpu.py"),
        Part(120, "python -u benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --steps 16 --rows 20 "
             "--bound"),
    )),
    "host-cpu": Suite("a captured step's host work on one CPU thread (any machine): decode and the speculative step "
                      "with graphs that launch nothing, timed and counted", (
        Part(90, "python benchmarks/captured_host_time.py --batch 1 8 --steps 300 "
             "--out {out}/captured_host_time_cpu.json", CPU),
    )),
    "cpu": Suite("every family's tiny model and the framework's overhead on one CPU thread (any machine)", (
        bench(70, f"model --family qwen3_5 {TINY} --steps 64", "bench_model_tiny_cpu.json", **CPU),
        bench(70, f"model --family deepseek_v3 {TINY}", "bench_model_deepseek_v3_tiny_cpu.json", **CPU),
        bench(70, f"model --family deepseek_v32 {TINY}", "bench_model_deepseek_v32_tiny_cpu.json", **CPU),
        bench(70, f"model --family deepseek_v4 {TINY}", "bench_model_deepseek_v4_tiny_cpu.json", **CPU),
        bench(70, f"model --family glm5 {TINY}", "bench_model_glm5_tiny_cpu.json", **CPU),
        bench(70, f"model --family kimi_linear {TINY}", "bench_model_kimi_linear_tiny_cpu.json", **CPU),
        bench(150, "overhead --family qwen3_5 --shape tiny --batch 1 8 64 --prompt 512 --steps 256 --device cpu",
              "bench_overhead_tiny_cpu.json", **CPU),
    )),
}


def records() -> dict[str, str]:
    """Every record a suite writes, by file name, with its path in the repository."""
    return {name: f"{part.folder()}/{name}" for suite in SUITES.values() for part in suite.parts
            for name in part.records()}


def listing() -> str:
    lines = []
    for name, suite in SUITES.items():
        gpus = f", {suite.gpus} GPUs" if suite.gpus > 1 else ""
        lines.append(f"{name}  ({suite.limit_s()} s{gpus}): {suite.about}")
        for part in suite.parts:
            for record in part.records():
                lines.append(f"    {part.folder()}/{record}{'  (new)' if record in NEW else ''}")
    return "\n".join(lines)


def switch_snapshot() -> dict | None:
    """`fnattn.switches.snapshot()` where the package has one: the switches in force, for the records."""
    import fnattn.switches

    snapshot = getattr(fnattn.switches, "snapshot", None)
    return snapshot() if callable(snapshot) else None


def stamp(path: Path, switches: dict | None) -> None:
    """Give a record written by a part the switch snapshot, where its writer did not."""
    if switches is None or path.suffix != ".json" or not path.exists():
        return
    doc = json.loads(path.read_text())
    if isinstance(doc, dict) and "switches" not in doc:
        doc["switches"] = switches
        path.write_text(json.dumps(doc, indent=1) + "\n")


def run_part(part: Part, out: Path, log: Path) -> int:
    command = part.command.replace("{out}", str(out))
    argv = shlex.split(command)
    if argv[0] == "python":  # the interpreter running the suites, whatever `python` names on this machine
        argv[0] = sys.executable
    env = {**os.environ, **{k: v.replace("{out}", str(out)) for k, v in part.env.items()}}
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in part.env.items())
    header = f"== [{part.limit_s} s] {shown + ' ' if shown else ''}{command}"
    print(header, flush=True)
    with log.open("a") as session:
        session.write(header + "\n")
        session.flush()
        begun = time.monotonic()
        # a session of its own, so the limit reaches the part's children (compilers, spawned ranks) too
        child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True, text=True)
        tail = _drain(child, session, part.limit_s)
        rc = child.returncode
        session.write(f"== rc {rc} after {time.monotonic() - begun:.0f} s\n")
    print("".join(tail), end="", flush=True)
    print(f"== rc {rc} after {time.monotonic() - begun:.0f} s", flush=True)
    return rc


def _drain(child: subprocess.Popen, session, limit_s: int) -> list[str]:
    """Copy the child's output into the session log until it ends or its time is up (SIGTERM, then SIGKILL)."""
    tail: list[str] = []

    def copy() -> None:
        for line in child.stdout:
            session.write(line)
            tail.append(line)
            del tail[:-TAIL_LINES]

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        child.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        note = f"== past its limit of {limit_s} s: SIGTERM\n"
        session.write(note)
        tail.append(note)
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    reader.join(timeout=5)
    return list(tail)


def commit() -> str | None:
    """The commit the records will name: FNATTN_COMMIT, else git's answer where this copy has its history."""
    if os.environ.get("FNATTN_COMMIT"):
        return os.environ["FNATTN_COMMIT"]
    from fnattn.bench import commit as from_git

    return from_git()


def run(names: list[str], out: Path) -> int:
    sha = commit()
    if sha is None:
        print("gpu_suites: set FNATTN_COMMIT=<commit>: this copy has no git history, and a record names its "
              "commit", file=sys.stderr)
        return 2
    os.environ["FNATTN_COMMIT"] = sha  # every part's records name the same commit
    os.environ["FNATTN_CHECKS"] = "0"  # the checks cost host time in every timed step (the test suite runs them)
    out.mkdir(parents=True, exist_ok=True)
    switches, failed = switch_snapshot(), 0
    # several suites in one device call: each part's limit shrinks to what is left of the call, and a part with
    # under a minute left is not begun (a benchmark cut short writes no record)
    ends = time.monotonic() + float(os.environ.get("FNATTN_CALL_S", DEVICE_LIMIT_S)) - GRACE_S
    for name in names:
        for part in SUITES[name].parts:
            left = int(ends - time.monotonic())
            if left < 60:
                print(f"== skipped, {left} s left of the call: {part.command}", flush=True)
                failed += 1
                continue
            rc = run_part(replace(part, limit_s=min(part.limit_s, left)), out, out / "session.log")
            failed += rc != 0
            for record in part.records():
                stamp(out / record, switches)
    return 1 if failed else 0


def place(found: Path) -> int:
    """Copy each record found in `found` over its committed copy (or to where it will be committed)."""
    placed = 0
    for name, path in records().items():
        if (found / name).exists():
            shutil.copyfile(found / name, ROOT / path)
            print(f"{found / name} -> {path}")
            placed += 1
    print(f"{placed} records placed")
    return 0 if placed else 1


def main(argv: list[str]) -> int:
    usage = f"usage: gpu_suites.sh --list | --place DIR | SUITE... ({' '.join(SUITES)})"
    if argv == ["--list"]:
        print(listing())
        return 0
    if len(argv) == 2 and argv[0] == "--place":
        return place(Path(argv[1]))
    unknown = [name for name in argv if name not in SUITES]
    if not argv or unknown:
        print(f"gpu_suites: no suite {' '.join(unknown)}\n" if unknown else "", end="", file=sys.stderr)
        print(usage, file=sys.stderr)
        return 2
    return run(argv, Path(os.environ.get("OUT") or "gpu-out"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
