#!/usr/bin/env bash
# GPU checks and timings in device calls that each fit the 10-minute limit, writing results
# under $OUT (or ./gpu-out). From the repository root on the GPU machine:
#   source .gpu/install.sh; FNATTN_COMMIT=<commit> bash benchmarks/gpu_session.sh parity
#   source .gpu/install.sh; FNATTN_COMMIT=<commit> bash benchmarks/gpu_session.sh bench   (bench-kda: KDA prefill)
#   ... graphs | model | profile | model-long | prefill | fused | fused-more | mla: captured steps, the whole model,
#   its profile, fla_direct's check and prefill A/B,
#   the fused paths, the MLA fast paths (mla-bench: their timings); linear: the decode GEMV and its folds; ab: the whole step with each
#   switch flipped (benchmarks/model_ab.py); switches: the decode switches flipped from their defaults, checked and timed in
#   one call; model-moe: DeepSeek-V3.2 / Kimi Linear layers; decode-sweep: the paged decode kernel's tiles;
#   epilogues: SwiGLU in the gate / up GEMV, the fused GDN decode's narrow tiles; early: wider first GEMV loads;
#   merge: attention's splits merged in its own launch (merge-state: with the GDN decode's state_first);
#   fused-now: the whole model fused against unfused at today's defaults; gates: the output gates in the GEMVs; conv: the GDN prefill
#   (qkv_apart, interior tiles; conv-sweep: the conv's launch shapes); gdn-prefill: one GDN layer against fla-core;
#   indexer-sweep: the DSA indexer's tiles; radix: sgl_kernel's radix select for the indexer's top-k;
#   moe-grouped: the MoE families' captured routed experts as grouped GEMMs (moe-now: with it on, then model-moe);
#   kimi-profile: Kimi Linear's eager step; gdn-prefill-profile: the GDN prefill's pieces against fla-core;
#   gemv-chain: the decode GEMVs alone, each launch option; conv-chunks: the GDN conv tiled by chunks;
#   conv-even: the chunk tiles with first chunks apart (conv-default, conv-default-parity: on by default);
#   conv-apart: the packed conv tiles as two launches;
#   gemv-stages: the step's GEMVs at 3 pipeline stages / 2 early K tiles; split-norm (split-norm-parity):
#   each residual add + RMSNorm split between the GEMVs on either side; overhead-graph: the framework over the same
#   kernels, eager and replayed; mla-tiles: the MLA absorption kernels' tile sweep and the dense layer;
#   mla-defaults: the MLA parity and layers at today's absorption defaults; mla-merge-layers: the merge kernel's
#   tiles inside the layers; indexer-topk: the indexer's selection in each form torch and sgl_kernel offer;
#   indexer-unsorted: the sparse paths with the indexer's unsorted selection; lse-weights: the merge kernels'
#   shared LSE weights
# Each part has its own time limit, so one slow compile cannot take the rest down.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export FNATTN_CHECKS=0
# Every part's whole output goes to $out/session.log (a call returns only the end of what it prints); the
# last lines of each are printed. A part past its limit gets SIGTERM, then SIGKILL 20 s later.
part() {
  local limit=$1; shift
  echo "== $*" | tee -a "$out/session.log"
  timeout -k 20 "$limit" "$@" > "$out/part.log" 2>&1
  cat "$out/part.log" >> "$out/session.log"; tail -25 "$out/part.log"; rm -f "$out/part.log"
}
case "${1:-}" in
  parity)  # FlashInfer compiles each kernel variant on first use: most of this time
    part 330 env FNATTN_GPU_RESULTS="$out/full_attention_parity.json" python -m pytest -q -p no:warnings \
        --tb=line tests/gpu/test_full_backends_gpu.py
    part 240 env FNATTN_GPU_RESULTS="$out/recurrent_parity.json" python -m pytest -q -p no:warnings \
        --tb=line tests/gpu/test_recurrent_backends_gpu.py tests/gpu/test_speculative_gpu.py
    ;;
  bench)
    part 150 python -m fnattn bench decode --batch 1 8 64 --layers 1 8 --out "$out/bench_decode_layers.json"
    part 80 python -m fnattn bench gdn-decode --out "$out/bench_gdn_decode.json"
    part 70 python -m fnattn bench gdn-decode-sweep --out "$out/bench_gdn_decode_sweep.json"
    part 90 python -m fnattn bench prefill --tokens 16384 --out "$out/bench_prefill.json"
    part 120 python -m fnattn bench gdn-prefill --out "$out/bench_gdn_prefill.json"
    ;;
  bench-kda)
    part 90 python -m fnattn bench kda-prefill --out "$out/bench_kda_prefill.json"
    ;;
  graphs)  # captured steps: graph == capture-free for every family, MTP through the verify graph
    rec="python benchmarks/gpu_pytest_record.py"
    part 200 env FNATTN_GPU_RESULTS="$out/graph_cases.json" $rec "$out/graph_gpu.json" -- tests/gpu/test_graph_gpu.py
    part 60 env FNATTN_GPU_RESULTS="$out/dsv4_flashmla_cases.json" $rec "$out/dsv4_flashmla_gpu.json" -- \
        tests/gpu/test_dsv4_flashmla_gpu.py
    ;;
  model)  # the whole Qwen3.5-0.8B shape, eager and graph, next to transformers; the framework's overhead
    part 400 python -m fnattn bench model --family qwen3_5 --shape 0.8b --batch 1 8 32 128 --prompt 512 --profile 4 \
        --out "$out/bench_model_qwen3_5_0.8b_p512.json" --png "$out/bench_model_qwen3_5_0.8b_p512.png"
    part 200 python -m fnattn bench overhead --family qwen3_5 --shape 0.8b --batch 1 8 32 128 --prompt 512 \
        --steps 32 --device cuda --out "$out/bench_overhead_qwen3_5_0.8b.json"
    ;;
  profile)  # where the decode step's time goes: kernels per step (eager and replayed), then eager host time
    part 300 python -m fnattn bench model --family qwen3_5 --shape 0.8b --batch 1 32 --prompt 512 --steps 16 \
        --no-transformers --profile 4 --out "$out/bench_model_qwen3_5_0.8b_profile.json"
    part 120 python benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --prompt 512 --steps 8 --rows 25
    ;;
  ab)  # the whole step with each switch flipped, every variant's steps interleaved on one model
    part 300 python benchmarks/model_ab.py --toggle prefetch output_gates own_norm_act gating_epilogue \
        prefetch+output_gates+own_norm_act+gating_epilogue pdl --batch 1 8 \
        --out "$out/bench_switches_ab.json"
    ;;
  ab-large)  # the own small-op kernels at the larger decode batches (timed at batch 1 and 8 when turned on)
    part 400 python benchmarks/model_ab.py --toggle output_gates own_norm_act output_gates+own_norm_act \
        --batch 32 128 --out "$out/bench_switches_ab_large.json"
    ;;
  switches)  # every switch not yet on by default, in one call: the A/B, parity, graph replays under PDL
    rec="python benchmarks/gpu_pytest_record.py"
    part 200 python benchmarks/model_ab.py --toggle prefetch output_gates own_norm_act gating_epilogue \
        prefetch+output_gates+own_norm_act+gating_epilogue pdl --batch 1 8 --out "$out/bench_switches_ab.json"
    part 250 env FNATTN_GPU_RESULTS="$out/switches_fused_cases.json" $rec "$out/switches_fused_gpu.json" -- \
        tests/gpu/test_fused_gpu.py -k "pdl or output_gates or norm_act or gating_epilogue or whole_model"
    part 130 env FNATTN_GPU_RESULTS="$out/switches_graph_cases.json" $rec "$out/switches_graph_gpu.json" -- \
        tests/gpu/test_graph_gpu.py -k pdl
    ;;
  epilogues)  # SwiGLU in the gate / up GEMV and the fused GDN decode's narrow tiles: parity, tiles, the step A/B
    rec="python benchmarks/gpu_pytest_record.py"
    part 330 env FNATTN_GPU_RESULTS="$out/epilogues_cases.json" $rec "$out/epilogues_gpu.json" -- \
        tests/gpu/test_fused_gpu.py tests/gpu/test_gdn_decode_fused_gpu.py -k "swiglu or fill"
    part 120 python -m fnattn bench gdn-decode-sweep --batch 1 8 --out "$out/bench_gdn_decode_sweep_b1_8.json"
    part 250 python benchmarks/model_ab.py --toggle swiglu_epilogue fill_device swiglu_epilogue+fill_device \
        --batch 1 8 --out "$out/bench_epilogues_ab.json"
    ;;
  early)  # the GEMVs' first load wider (SkinnyConfig.early): the step A/B, then the whole model against unfused
    rec="python benchmarks/gpu_pytest_record.py"
    part 250 python benchmarks/model_ab.py --toggle early2 early4 --batch 1 8 --out "$out/bench_early_ab.json"
    part 250 env FNATTN_GPU_RESULTS="$out/early_cases.json" $rec "$out/early_gpu.json" -- \
        tests/gpu/test_fused_gpu.py tests/gpu/test_gdn_decode_fused_gpu.py -k "early or fill_device"
    ;;
  merge)  # attention's splits merged in the decode's own launch: parity against the merge kernel, the step A/B
    rec="python benchmarks/gpu_pytest_record.py"
    part 120 env FNATTN_GPU_RESULTS="$out/paged_merge_cases.json" $rec "$out/paged_merge_gpu.json" -- \
        tests/gpu/test_paged_merge_gpu.py
    part 250 python benchmarks/model_ab.py --toggle merge_in_launch --batch 1 8 --out "$out/bench_merge_ab.json"
    ;;
  merge-state)  # `merge` and the fused GDN decode's state_first in one call: their parity, then one A/B of both
    rec="python benchmarks/gpu_pytest_record.py"
    part 120 env FNATTN_GPU_RESULTS="$out/paged_merge_cases.json" $rec "$out/paged_merge_gpu.json" -- \
        tests/gpu/test_paged_merge_gpu.py
    part 150 env FNATTN_GPU_RESULTS="$out/state_first_cases.json" $rec "$out/state_first_gpu.json" -- \
        tests/gpu/test_gdn_decode_fused_gpu.py tests/gpu/test_fused_gpu.py \
        -k "state_first or (whole_model and (merge or first or default))"
    part 280 python benchmarks/model_ab.py --toggle merge_in_launch state_first merge_in_launch+state_first \
        --batch 1 8 --out "$out/bench_merge_state_ab.json"
    ;;
  fused-now)  # the whole model against the unfused one with today's defaults (tiny, 0.8b slice), widened logits
    part 240 env FNATTN_GPU_RESULTS="$out/fused_now_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/fused_now_gpu.json" -- tests/gpu/test_fused_gpu.py -k "widen or (whole_model and (default or first))"
    ;;
  fused-slice)  # the 0.8b slice of fused-now (its first run compiles for the 0.8b shapes), then state_first at
    # batch 32 / 128 beside the own small-op kernels there
    part 270 env FNATTN_GPU_RESULTS="$out/fused_slice_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/fused_slice_gpu.json" -- tests/gpu/test_fused_gpu.py -k "whole_model and 0.8b and (default or first)"
    part 290 python benchmarks/model_ab.py --toggle state_first output_gates+own_norm_act --batch 32 128 \
        --out "$out/bench_state_first_large_ab.json"
    ;;
  gates)  # the output gates in the output projections' GEMVs: the kernel and the whole model, then the step A/B
    part 270 env FNATTN_GPU_RESULTS="$out/gate_prologue_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/gate_prologue_gpu.json" -- tests/gpu/test_fused_gpu.py -k "gate_prologue or (whole_model and prologue)"
    part 290 python benchmarks/model_ab.py --toggle gate_prologue --batch 1 8 --out "$out/bench_gate_prologue_ab.json"
    # the fused GDN decode's switch tests read each way's states right after it (the record before predates that)
    part 150 env FNATTN_GPU_RESULTS="$out/state_first_rerun_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/state_first_rerun_gpu.json" -- tests/gpu/test_gdn_decode_fused_gpu.py -k "state_first or fill_device"
    ;;
  conv)  # the GDN prefill: parity of q / k / v written apart (qkv_apart) and of the fla provider's prefill (its
    # initial states' rows from the plan), then the 8192-token prefill A/B of interior_tiles and qkv_apart
    # (`conv-sweep`: the conv's launch shapes with and without interior tiles)
    part 300 env FNATTN_GPU_RESULTS="$out/gdn_prefill_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/gdn_prefill_gpu.json" -- tests/gpu/test_recurrent_backends_gpu.py -k "qkv_apart or prefill or fla_direct"
    part 280 python benchmarks/model_ab.py --toggle interior_tiles qkv_apart --prefill 8192 --batch 1 --steps 16 \
        --out "$out/bench_conv_ab.json"
    ;;
  conv-sweep)
    part 200 python benchmarks/conv_sweep.py --out "$out/conv_sweep.json"
    ;;
  gdn-prefill)  # one GDN layer's prefill against fla-core's conv + chunk (the 1.0x target), q / k / v apart too
    part 200 python -m fnattn bench gdn-prefill --out "$out/bench_gdn_prefill.json"
    ;;
  gdn-prefill-profile)  # where the provider's prefill goes against fla-core's conv + chunk: times, kernels, pieces
    part 300 python benchmarks/gdn_prefill_profile.py --out "$out/gdn_prefill_profile.json"
    ;;
  conv-chunks)  # the GDN conv tiled by the plan's chunks: its kernel tests on the GPU, its sweeps, the layer profile
    part 200 python benchmarks/gpu_pytest_record.py "$out/conv_chunks_gpu.json" -- tests/kernels/test_gated_delta.py \
        -k "conv"
    part 150 python benchmarks/conv_sweep.py --split --out "$out/conv_sweep_chunks_0.8b.json"
    part 150 python benchmarks/conv_sweep.py --requests 16 --tokens 4096 --channels 8192 --split \
        --out "$out/conv_sweep_chunks_16x4096.json"
    part 200 python benchmarks/gdn_prefill_profile.py --chunk-tiles on --out "$out/gdn_prefill_profile_chunks.json"
    ;;
  conv-even)  # the GDN conv's chunk tiles with their first chunks apart, even channels: tests, sweeps, the layer
    part 150 python benchmarks/gpu_pytest_record.py "$out/conv_even_gpu.json" -- tests/kernels/test_gated_delta.py \
        -k "conv"
    part 150 python benchmarks/conv_sweep.py --split --out "$out/conv_sweep_even_0.8b.json"
    part 150 python benchmarks/conv_sweep.py --requests 16 --tokens 4096 --channels 8192 --split \
        --out "$out/conv_sweep_even_16x4096.json"
    part 200 python benchmarks/gdn_prefill_profile.py --chunk-tiles on --chunk-launch 128 16 \
        --out "$out/gdn_prefill_profile_even.json"
    ;;
  conv-default)  # the chunk tiles on by default: one GDN layer against fla-core, then the 8192-token prefill A/B
    part 150 python -m fnattn bench gdn-prefill --out "$out/bench_gdn_prefill.json"
    part 200 python benchmarks/gdn_prefill_profile.py --out "$out/gdn_prefill_profile_chunks.json"
    part 240 python benchmarks/model_ab.py --toggle chunk_tiles --prefill 8192 --batch 1 --steps 16 \
        --out "$out/bench_chunk_tiles_ab.json"
    ;;
  conv-default-parity)  # the GDN / KDA prefill parity with the chunk tiles on by default
    part 400 env FNATTN_GPU_RESULTS="$out/chunk_tiles_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/chunk_tiles_gpu.json" -- tests/gpu/test_recurrent_backends_gpu.py \
        -k "qkv_apart or prefill or fla_direct or chunk_tiles"
    ;;
  conv-apart)  # the packed conv tiles as two launches (interior_apart): kernel tests, the sweep, the 8192 prefill
    part 150 python benchmarks/gpu_pytest_record.py "$out/conv_apart_gpu.json" -- tests/kernels/test_gated_delta.py \
        -k "conv"
    part 150 python benchmarks/conv_sweep.py --split --out "$out/conv_sweep_apart_0.8b.json"
    part 240 python benchmarks/model_ab.py --toggle interior_apart --prefill 8192 --batch 1 --steps 16 \
        --out "$out/bench_interior_apart_ab.json"
    ;;
  split-norm)  # each add + RMSNorm split between the GEMVs on either side: the step A/B, then the kernel tests
    part 300 python benchmarks/model_ab.py --toggle split_norm --batch 1 8 --steps 64 \
        --out "$out/bench_split_norm_ab.json"
    part 150 python benchmarks/gpu_pytest_record.py "$out/split_norm_kernels_gpu.json" -- \
        tests/kernels/test_skinny_split_norm.py
    ;;
  split-norm-parity)  # the whole model against the unfused one with split_norm on (tiny, the 0.8b slice)
    part 300 env FNATTN_GPU_RESULTS="$out/split_norm_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/split_norm_gpu.json" -- tests/gpu/test_fused_gpu.py -k "whole_model and split"
    ;;
  overhead-graph)  # the framework over the same kernels, eager and replayed (the direct graph way)
    part 150 python benchmarks/gpu_pytest_record.py "$out/overhead_ways_gpu.json" -- tests/gpu/test_overhead_gpu.py
    part 300 python -m fnattn bench overhead --family qwen3_5 --shape 0.8b --batch 1 8 --prompt 512 --steps 32 \
        --device cuda --out "$out/bench_overhead_qwen3_5_0.8b.json"
    ;;
  gemv-stages)  # the whole decode step with the GEMVs at 3 pipeline stages and / or 2 early K tiles
    part 300 python benchmarks/model_ab.py --toggle stages3 early2 stages3+early2 --batch 1 8 --steps 64 \
        --out "$out/bench_gemv_stages_ab.json"
    ;;
  gemv-chain)  # the 0.8B's 96 decode GEMVs alone in one graph, each launch option and a side stream filling L2
    part 240 python benchmarks/gemv_chain.py --rows 1 8 --out "$out/gemv_chain.json"
    ;;
  prefill)  # fla-core's GDN prefill with fla_direct (the default): bitwise against the public function, then timed
    # (on a fresh machine the tests' fla-core autotuning took 184 s; the A/B's first prefill compiles more)
    part 240 env FNATTN_GPU_RESULTS="$out/fla_prefill_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/fla_prefill_gpu.json" -- tests/gpu/test_recurrent_backends_gpu.py -k "prefill or fla_direct"
    part 300 python benchmarks/model_ab.py --toggle fla_direct --prefill 8192 --batch 1 --steps 24 \
        --out "$out/bench_prefill_ab.json"
    ;;
  model-long)  # 8192-token prompts (prefill >= 150k tok/s at batch 1 is a target)
    part 300 python -m fnattn bench model --family qwen3_5 --shape 0.8b --batch 1 --prompt 8192 --steps 16 \
        --profile 1 --out "$out/bench_model_qwen3_5_0.8b_p8192.json"
    ;;
  model-moe)  # DeepSeek-V3.2 and Kimi Linear at their released layer shapes (fewer layers), no transformers peer
    part 280 python -m fnattn bench model --family deepseek_v32 --shape 2-layer --batch 1 8 32 --prompt 2048 \
        --no-transformers --out "$out/bench_model_deepseek_v32_2-layer.json"
    part 280 python -m fnattn bench model --family kimi_linear --shape 4-layer --batch 1 8 32 --prompt 2048 \
        --no-transformers --out "$out/bench_model_kimi_linear_4-layer.json"
    ;;
  moe-grouped)  # the routed experts of a captured step as grouped GEMMs (fused.grouped_experts, off): parity, then A/B
    part 240 env FNATTN_GPU_RESULTS="$out/grouped_experts_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/grouped_experts_gpu.json" -- tests/gpu/test_grouped_experts_gpu.py
    part 300 python benchmarks/model_ab.py --family deepseek_v32 --shape 2-layer --ctx 2048 --batch 1 8 32 \
        --steps 16 --toggle grouped_experts --out "$out/bench_grouped_experts_ab.json"
    ;;
  moe-now)  # grouped_experts on (the default): its parity, eager and captured, then the MoE families' model bench
    part 200 env FNATTN_GPU_RESULTS="$out/grouped_experts_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/grouped_experts_gpu.json" -- tests/gpu/test_grouped_experts_gpu.py
    part 170 python -m fnattn bench model --family deepseek_v32 --shape 2-layer --batch 1 8 32 --prompt 2048 \
        --no-transformers --out "$out/bench_model_deepseek_v32_2-layer.json"
    part 200 python -m fnattn bench model --family kimi_linear --shape 4-layer --batch 1 8 32 --prompt 2048 \
        --no-transformers --out "$out/bench_model_kimi_linear_4-layer.json"
    ;;
  kimi-profile)  # where Kimi Linear's eager batch-1 step goes (28.7 ms for 4 layers at 435f10f): kernels, then host
    part 300 python -m fnattn bench model --family kimi_linear --shape 4-layer --batch 1 --prompt 2048 --steps 8 \
        --no-transformers --profile 2 --out "$out/bench_model_kimi_linear_4-layer_profile.json"
    part 200 python benchmarks/host_profile.py --family kimi_linear --shape 4-layer --batch 1 --prompt 2048 \
        --steps 4 --rows 30
    ;;
  linear)  # the skinny GEMV against cuBLAS, its folds (residual add, RMSNorm) against FlashInfer's add + RMSNorm
    part 300 python -m fnattn bench linear --batch 1 --out "$out/bench_linear_b1.json"
    part 200 python -m fnattn bench linear --batch 8 16 --no-sweep --out "$out/bench_linear_b8_16.json"
    ;;
  decode-sweep-small)  # the same tiles and the split counts at batch 1 and 8, where every attention layer is split
    part 240 python benchmarks/decode_sweep.py --batch 1 8 --ctx 512 --hq 8 --hkv 2 --dim 256 --block-n 32 64 \
        --warps 4 8 --stages 2 3 --out "$out/decode_sweep_d256_small.json"
    ;;
  decode-sweep)  # the paged decode kernel's tiles at the Qwen3.5 attention shape (d256), against FlashInfer's decodes
    part 240 python benchmarks/decode_sweep.py --batch 32 128 --ctx 512 --hq 8 --hkv 2 --dim 256 --block-n 32 64 \
        --warps 4 8 --stages 2 3 --out "$out/decode_sweep_d256.json"
    ;;
  radix)  # sgl_kernel's radix select for the top-k 2048 (radix_select): its sets and the sparse layer, then timed
    part 150 env FNATTN_GPU_RESULTS="$out/radix_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/radix_gpu.json" -- tests/gpu/test_mla_backends_gpu.py -k radix
    part 120 python -m fnattn bench indexer --batch 64 --ctx 32768 --out "$out/bench_mla_sparse_indexer.json"
    ;;
  indexer)  # the indexer's kernel tests and every sparse MLA case on the GPU, then the indexer's timing
    part 200 env FNATTN_GPU_RESULTS="$out/indexer_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/indexer_gpu.json" -- tests/gpu/test_mla_backends_gpu.py tests/kernels/test_indexer.py \
        -k "sparse or radix or test_indexer"
    part 120 python -m fnattn bench indexer --batch 64 --ctx 32768 --out "$out/bench_mla_sparse_indexer.json"
    ;;
  indexer-sweep)  # the DSA indexer's scores kernel over its tiles, and torch.topk's share of the indexer's time
    part 240 python benchmarks/indexer_sweep.py --batch 64 --ctx 32768 --out "$out/indexer_sweep.json"
    part 240 python benchmarks/indexer_sweep.py --batch 64 --ctx 32768 --keys fp8 --out "$out/indexer_sweep_fp8.json"
    ;;
  mla)  # MLA / sparse MLA fast paths against the references
    part 200 env FNATTN_GPU_RESULTS="$out/mla_parity_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/mla_parity.json" -- tests/gpu/test_mla_backends_gpu.py
    ;;
  mla-bench)  # MLA decode, sparse MLA (both slot translations) and the indexer against raw FlashMLA, one run each
    part 120 python -m fnattn bench mla-sparse --batch 64 --ctx 32768 --out "$out/bench_mla_sparse.json"
    part 120 python -m fnattn bench indexer --batch 64 --ctx 32768 --out "$out/bench_mla_sparse_indexer.json"
    part 90 python -m fnattn bench mla-decode --batch 64 --ctx 4096 --out "$out/bench_mla_decode_b64.json"
    ;;
  mla-absorb)  # MLA's absorbed query / own-row merge + W_UV in one launch: kernel tests and parity, tiles, the layers
    rec="python benchmarks/gpu_pytest_record.py"
    part 240 env FNATTN_GPU_RESULTS="$out/mla_absorb_cases.json" $rec "$out/mla_absorb_gpu.json" -- \
        tests/kernels/test_latent_absorb.py tests/gpu/test_mla_backends_gpu.py -k "absorb"
    part 90 python benchmarks/mla_absorb_sweep.py --out "$out/mla_absorb_sweep.json"
    part 90 python -m fnattn bench mla-decode --batch 64 --ctx 4096 --out "$out/bench_mla_decode_b64.json"
    ;;
  mla-tiles)  # the absorption kernels' tiles (token runs, pipelined weight steps, Dv tiles) and the dense layer
    rec="python benchmarks/gpu_pytest_record.py"
    part 120 $rec "$out/latent_absorb_gpu.json" -- tests/kernels/test_latent_absorb.py
    part 330 python benchmarks/mla_absorb_sweep.py --out "$out/mla_absorb_sweep.json"
    part 90 python -m fnattn bench mla-decode --batch 64 --ctx 4096 --out "$out/bench_mla_decode_b64.json"
    ;;
  mla-defaults)  # the MLA parity matrix with today's absorption defaults, then the dense and sparse layers
    part 260 env FNATTN_GPU_RESULTS="$out/mla_parity_cases.json" python benchmarks/gpu_pytest_record.py \
        "$out/mla_parity.json" -- tests/kernels/test_latent_absorb.py tests/gpu/test_mla_backends_gpu.py
    part 90 python -m fnattn bench mla-decode --batch 64 --ctx 4096 --out "$out/bench_mla_decode_b64.json"
    part 120 python -m fnattn bench mla-sparse --batch 64 --ctx 32768 --out "$out/bench_mla_sparse.json"
    ;;
  mla-merge-layers)  # the own-row merge + W_UV kernel's tiles inside the dense and sparse layers, then the whole step
    part 240 python benchmarks/mla_merge_layers.py --batch 8 64 --out "$out/mla_merge_layers.json"
    part 240 python benchmarks/model_ab.py --family deepseek_v32 --shape 2-layer --ctx 2048 --batch 8 32 \
        --steps 16 --toggle merge_values_kernel --out "$out/bench_merge_values_ab.json"
    ;;
  indexer-topk)  # the indexer's selection over its scores: torch.topk sorted or not, torch.sort, the radix select
    part 120 python benchmarks/indexer_topk_forms.py --out "$out/indexer_topk_forms.json"
    ;;
  indexer-unsorted)  # the indexer's unsorted selection: sparse MLA parity, captured steps, the indexer's time
    rec="python benchmarks/gpu_pytest_record.py"
    part 240 env FNATTN_GPU_RESULTS="$out/indexer_unsorted_cases.json" $rec "$out/indexer_unsorted_gpu.json" -- \
        tests/kernels/test_indexer.py tests/gpu/test_mla_backends_gpu.py -k "sparse or indexer or topk or radix"
    part 150 $rec "$out/indexer_unsorted_graph_gpu.json" -- tests/gpu/test_graph_gpu.py -k "v32 or glm5"
    part 120 python -m fnattn bench indexer --batch 64 --ctx 32768 --out "$out/bench_mla_sparse_indexer.json"
    ;;
  lse-weights)  # the own-row merges' shared LSE weights: both merge kernels' tests and the MLA paths through them
    rec="python benchmarks/gpu_pytest_record.py"
    part 200 env FNATTN_GPU_RESULTS="$out/lse_weights_cases.json" $rec "$out/lse_weights_gpu.json" -- \
        tests/kernels/test_latent_absorb.py tests/kernels/test_merge_scatter.py tests/gpu/test_mla_backends_gpu.py \
        -k "absorb or merge or real"
    ;;
  mla-absorb-layers)  # the sparse layer and the whole DeepSeek-V3.2 step with and without absorb_kernel
    part 120 python -m fnattn bench mla-sparse --batch 64 --ctx 32768 --out "$out/bench_mla_sparse.json"
    part 300 python benchmarks/model_ab.py --family deepseek_v32 --shape 2-layer --ctx 2048 --batch 1 8 32 \
        --steps 16 --toggle absorb_kernel merge_values_kernel --out "$out/bench_absorb_kernel_ab.json"
    ;;
  fused)  # the fused pieces: Qwen3.5 fused ops and own kernels, the skinny GEMV, whole models with each switch
    rec="python benchmarks/gpu_pytest_record.py"
    part 420 env FNATTN_GPU_RESULTS="$out/fused_cases.json" $rec "$out/fused_gpu.json" -- tests/gpu/test_fused_gpu.py
    part 60 env FNATTN_GPU_RESULTS="$out/gdn_gating_cases.json" $rec "$out/gdn_gating_gpu.json" -- \
        tests/gpu/test_gdn_gating_gpu.py
    ;;
  fused-more)  # FlashInfer tensor cores, the fused GDN decode, its bench
    rec="python benchmarks/gpu_pytest_record.py"
    part 200 env FNATTN_GPU_RESULTS="$out/flashinfer_tc_cases.json" $rec "$out/flashinfer_tc_gpu.json" -- \
        tests/gpu/test_flashinfer_tc_gpu.py
    part 150 env FNATTN_GPU_RESULTS="$out/gdn_decode_fused_cases.json" $rec "$out/gdn_decode_fused_gpu.json" -- \
        tests/gpu/test_gdn_decode_fused_gpu.py
    part 120 python -m fnattn bench gdn-decode --out "$out/bench_gdn_decode.json"
    ;;
  *)
    parts=$(sed -n 's/^  \([a-z0-9-]*\))  *.*$/\1/p; s/^  \([a-z0-9-]*\))$/\1/p' "$0" | paste -sd '|')
    echo "usage: gpu_session.sh $parts" >&2
    exit 2
    ;;
esac
