#!/usr/bin/env bash
# One call on the GPU host: GPU tests, the CPU suite under that host's Transformers (5.17), and the
# benchmarks. Stages are named on the command line (default: all), e.g.
#   bash scripts/gpu_check.sh tests kernels        # GPU tests + kernel benchmarks
#   bash scripts/gpu_check.sh e2e                  # end-to-end benchmark only
# Extra arguments per benchmark come from E2E_ARGS, E2E_SMOLLM2_ARGS, PROFILE_ARGS, REPLAY_ARGS, HYTOPK_ARGS,
# SATTN_ARGS, LM_LOSS_ARGS, NCU_ARGS, FSDP2_ARGS, LONG_ARGS, MEMORY_ARGS, CP_ARGS, SELECTIONS_ARGS; stage time limits from E2E_S, PROFILE_S, REPLAY_S, TESTS_S, FSDP2_S, FINETUNE_S, MEMORY_S, CP_S, SELECTIONS_S
# (seconds), HYTOPK_SMALL_S, HEAD_PROBS_S, KL_S, NCU_S. Stages tests_topk, e2e_smollm2, e2e_share, long, memory, profile, cp, realmodel, selections, e2e_trained, profile_trained, hytopk_small, hytopk_stages, hytopk_presample, head_probs, kl_one_pass, ncu_hytopk, ncu_hytopk_source, ncu_mla and mla_bwd are not in the default set (name them). The cp stage needs
# several GPUs (it uses all it sees). The fsdp2 stage needs 2 GPUs
# (kind nvidia-h200-x2) and the datasets package (carried as wheels where the host lacks it). The
# realmodel stage runs the main job's GPU preset on SmolLM2-135M: it needs datasets and gguf as wheels
# and the GGUF file at /tmp/smollm2.gguf or in .gguf_parts/ (split -b 50000000, one part per call, each
# call moving its part out of the tree: README, "The real model"). The selections stage times the sparse
# attention on that run's trained indexer (/tmp/realmodel), e2e_trained and profile_trained its whole step: name them
# after realmodel, in the same call (`bash scripts/gpu_check.sh realmodel selections`) or the next one
# while the machine is warm.
# Results go to $OUT (or outputs/gpu_check): one log per stage, JSON + PNG per benchmark, and
# results.tgz with everything; a summary table is printed last.
# On the lent GPU machine only a handful of files come back from $OUT: run with OUT=/tmp/gc and
# copy /tmp/gc/results.tgz and /tmp/gc/summary.txt to the device's $OUT afterwards.
set -u
OUT=${OUT:-outputs/gpu_check}
RES="$OUT/r"
mkdir -p "$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages=${*:-"tests compat kernels replay e2e"}
summary="$OUT/summary.txt"
: >"$summary"

python3 - <<'PY' | tee "$RES/env.txt"
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY

stage() {  # stage NAME TIMEOUT_S CMD...: run, log, record the exit status
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s: $(tail -n 1 "$RES/$name.log")" | tee -a "$summary"
}

for s in $stages; do
  case $s in
    tests)   # every GPU-marked test (tests/scripts has none; it needs datasets to be collected)
      skip=""
      python3 -c "import datasets" 2>/dev/null || skip="--ignore=tests/scripts"
      stage gpu_tests "${TESTS_S:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu tests $skip ;;
    tests_topk)  # HyTopK's GPU tests and the timing helpers' (about 4 minutes on an H100, mostly compiles)
      stage gpu_tests_topk "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/topk \
        tests/benchmarking/test_timing.py ;;
    compat)  # the CPU suite of the patches under the host's Transformers version, GPU hidden
      CUDA_VISIBLE_DEVICES="" stage compat_tests 400 python3 -m pytest -q -p no:cacheprovider -x \
        tests/model_patches tests/test_replay.py tests/test_replay_models.py ;;
    kernels)
      stage bench_hytopk 300 python3 scripts/bench_hytopk.py --out "$RES" ${HYTOPK_ARGS:-}
      stage bench_sparse_attention 240 python3 scripts/bench_sparse_attention.py --out "$RES" ${SATTN_ARGS:-}
      stage bench_indexer_loss 120 python3 scripts/bench_indexer_loss.py --out "$RES/bench_indexer_loss.json"
      stage bench_indexer_loss_tiles 240 python3 scripts/bench_indexer_loss.py --tiles --sizes 32768 131072 \
        --out "$RES/bench_indexer_loss_tiles.json"
      stage bench_lm_loss 200 python3 scripts/bench_lm_loss.py --out "$RES/lm_loss" ${LM_LOSS_ARGS:-} ;;
    kl_one_pass)  # the given-target KL's one pass (the selection's lse given) against forward + backward (issue 23)
      stage bench_kl_one_pass_2x64 "${KL_S:-200}" python3 scripts/bench_indexer_loss.py --tiles --sizes 32768 131072 \
        --out "$RES/kl_one_pass_2x64.json"
      stage bench_kl_one_pass_32x128 "${KL_S:-200}" python3 scripts/bench_indexer_loss.py --tiles --sizes 32768 131072 \
        --index-shape 32,128 --out "$RES/kl_one_pass_32x128.json" ;;
    head_probs)  # the indexer KL's target on GQA query tiles: tile_head_probs against the fused atomics (issue 23)
      stage bench_head_probs "${HEAD_PROBS_S:-240}" python3 scripts/bench_head_probs.py --out "$RES/head_probs" ;;
    hytopk_small)  # the small indexers of converted dense models (issue 23): tiles, warps, stages, buffer sizes
      for heads in 2 4; do
        stage "hytopk_small_h${heads}d64" "${HYTOPK_SMALL_S:-280}" python3 scripts/bench_hytopk.py --heads "$heads" --dim 64 \
          --sweep 32768 131072 --reps 3
      done ;;
    ncu_hytopk)  # Nsight Compute on one HyTopK call of a 4 x 64 indexer at 32K (issue 23): the details page of
      # one launch of each kernel (the 4th: past the first chunk's short rows); the whole call's ~100 launches
      # under the full set would take many minutes
      for kern in scan refine finalize; do
        stage "ncu_hytopk_$kern" "${NCU_S:-100}" ncu --clock-control none --nvtx --nvtx-include "hytopk/" \
          -k "regex:hytopk_${kern}" --launch-skip 3 --launch-count 1 --set full --page details --print-units base \
          python3 scripts/ncu_hytopk.py ${NCU_ARGS:-}
      done ;;
    ncu_hytopk_source)  # Nsight Compute's per-instruction stall samples (source page, SASS) of the 4 x 64 scan
      # at 32K: the last chunk's first scan launch (the 26th: 9 chunks of a pre-pass scan, a first scan and a
      # second chance each), its details page and its source page as CSV (issue 23)
      stage ncu_hytopk_scan_report "${NCU_S:-150}" ncu --clock-control none --nvtx --nvtx-include "hytopk/" \
        -k regex:hytopk_scan_kernel --launch-skip 25 --launch-count 1 --set full --import-source no \
        -o "$RES/ncu_hytopk_scan" python3 scripts/ncu_hytopk.py ${NCU_ARGS:-}
      stage ncu_hytopk_scan_details 60 ncu -i "$RES/ncu_hytopk_scan.ncu-rep" --page details --print-units base
      stage ncu_hytopk_scan_source 60 ncu -i "$RES/ncu_hytopk_scan.ncu-rep" --page source --print-source sass --csv ;;
    hytopk_stages)  # the small indexers' scan with 3-4 key-tile stages, 16-row programs and the Gluon scan at 64
      # columns, GPU time by graph replay (issue 23: Nsight Compute puts most of the scan's stalls on the key tile's copy)
      stage hytopk_stages_h4d64 "${HYTOPK_SMALL_S:-280}" python3 scripts/bench_hytopk.py --heads 4 --dim 64 \
        --sweep 32768 --sweep-stages --sweep-lse --reps 5
      stage hytopk_stages_h2d64 "${HYTOPK_SMALL_S:-280}" python3 scripts/bench_hytopk.py --heads 2 --dim 64 \
        --sweep 131072 --sweep-stages --sweep-lse --reps 2 ;;
    hytopk_presample)  # the pre-pass sampling every 16th key against the default 32nd where it is unmeasured (issue 23:
      # 16 won at 4 x 64 / 32K on an H100 and lost at 2 x 64 / 128K on an H200, benchmarks/notes.md)
      stage hytopk_presample_h2d64_32k "${HYTOPK_SMALL_S:-280}" python3 scripts/bench_hytopk.py --heads 2 --dim 64 \
        --sweep 32768 --sweep-set presample=16 --sweep-lse --reps 5
      stage hytopk_presample_h4d64_128k "${HYTOPK_SMALL_S:-280}" python3 scripts/bench_hytopk.py --heads 4 --dim 64 \
        --sweep 131072 --sweep-set presample=16 --sweep-lse --reps 2 ;;
    ncu_mla)  # Nsight Compute on the MLA Gluon forward and dS + dK/dV kernels at 32K (issue 26): one launch each,
      # the details page with its stall reasons. The forward inside the script's NVTX range; the backward runs
      # on autograd's own thread, outside any range the script opens, so its launch is counted from the
      # start: at 32K a step launches it 24 times (8 chunks of 4096 queries x 3 key passes of 32 MiB), and
      # the 46th is the second step's last chunk's first pass (an early chunk's later passes are nearly empty)
      stage ncu_mla_forward "${NCU_S:-100}" ncu --clock-control none --nvtx --nvtx-include "mla/" \
        -k regex:mla_forward_kernel --launch-count 1 --set full --page details --print-units base \
        python3 scripts/ncu_mla.py ${NCU_ARGS:-}
      stage ncu_mla_backward_dkv "${NCU_S:-100}" ncu --clock-control none -k regex:mla_backward_dkv_kernel \
        --launch-skip 45 --launch-count 1 --set full --page details --print-units base \
        python3 scripts/ncu_mla.py ${NCU_ARGS:-} ;;
    mla_bwd)  # the MLA Gluon kernels (issue 26): the backward's GPU tests with one pass (the deterministic ones
      # and the Gluon forward's with them) and with key passes in separate processes (a kernel fault is sticky:
      # it fails every later test of its process), then the MLA benchmark at 32K (forward, atomic and
      # deterministic backward); with AB_OLD="<folder> ..." (each holding another hyscale_hf) those packages'
      # benchmarks too, before and after this tree's, in the same call
      t="tests/kernels/sparse_attn/test_gpu.py tests/kernels/sparse_attn/test_mla_gpu.py tests/kernels/sparse_attn/test_key_passes.py"
      stage mla_bwd_tests_one_pass "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu $t \
        -k "one_pass or permuted_output or deterministic or detached_prefix or gluon_forward"
      stage mla_bwd_tests_key_passes "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu $t -k key_passes
      sattn="scripts/bench_sparse_attention.py --budget-ms 1200 --skip gqa,dense --T 32768"
      bench_old() {  # bench_old before|after: each AB_OLD package's benchmark
        for pkg in ${AB_OLD:-}; do
          local name="$(basename "$pkg")_$1"
          stage "bench_mla_$name" 200 env PYTHONPATH="$pkg" python3 $sattn --out "$RES/mla_$name" ${SATTN_ARGS:-}
        done
      }
      bench_old before
      stage bench_mla 200 python3 $sattn --out "$RES/mla" ${SATTN_ARGS:-}
      bench_old after ;;
    replay)
      stage bench_replay "${REPLAY_S:-300}" python3 scripts/bench_replay.py --out "$RES" ${REPLAY_ARGS:-} ;;
    e2e)
      stage bench_e2e "${E2E_S:-560}" python3 scripts/bench_e2e.py --out "$RES" ${E2E_ARGS:-} ;;
    e2e_share)  # IndexShare in the converted stack (issue 23): hyscale with index_share 1, 2 and 3, and dense
      for n in 1 2 3; do
        arms=hyscale
        [ "$n" = 1 ] && arms="hyscale dense"
        stage "bench_e2e_share$n" "${E2E_S:-300}" python3 scripts/bench_e2e.py --stack smollm2 --index-share "$n" \
          --arms $arms --seqlens 32768 131072 --reps 2 --search-arms --out "$RES/share$n" ${E2E_SMOLLM2_ARGS:-}
      done ;;
    e2e_smollm2)  # the converted dense model (SmolLM2-shaped Llama, 30 layers), dense against hyscale
      stage bench_e2e_smollm2 "${E2E_S:-560}" python3 scripts/bench_e2e.py --stack smollm2 --arms hyscale dense \
        --seqlens 32768 131072 --reps 2 --search-arms --out "$RES/smollm2" ${E2E_SMOLLM2_ARGS:-} ;;
    long)  # long context: tiled + offload against hyscale at 128K, and the tiled arm's search to 1M tokens
      stage bench_long "${E2E_S:-560}" python3 scripts/bench_e2e.py --arms hyscale tiled_offload --seqlens 131072 \
        --reps 2 --loss-chunk 16384 --search-arms tiled_offload --out "$RES/long" ${LONG_ARGS:-} ;;
    memory)  # where a 1M-token step's memory goes, down to the attention's projections (memory_by_phase.py)
      stage memory_by_phase "${MEMORY_S:-500}" python3 scripts/memory_by_phase.py --arm tiled_offload --seqlen 1048576 \
        --detail --out "$RES/memory" ${MEMORY_ARGS:-} ;;
    profile)  # kernel time by category of one step: glm5 hyscale at 64K and 128K, smollm2 hyscale and dense at 32K
      stage profile_glm5 "${PROFILE_S:-300}" python3 scripts/profile_step.py --out "$RES/profile_glm5" ${PROFILE_ARGS:-}
      for arm in hyscale dense; do
        stage "profile_smollm2_$arm" "${PROFILE_S:-300}" python3 scripts/profile_step.py --stack smollm2 --arm $arm \
          --seqlens 32768 --out "$RES/profile_smollm2_$arm"
      done ;;
    fsdp2)   # needs 2 GPUs: bench_fsdp2 on 1 and 2 processes, then the main job under FSDP2 with LoRA
      cfg=scripts/accelerate/fsdp2_2gpu.yaml
      for n in 1 2; do
        stage "fsdp2_${n}gpu" "${FSDP2_S:-150}" accelerate launch --config_file $cfg --num_processes $n \
          scripts/bench_fsdp2.py --out "$RES/fsdp2_${n}gpu.json" ${FSDP2_ARGS:-}
      done
      stage fsdp2_compare 60 python3 scripts/bench_fsdp2.py --compare "$RES/fsdp2_1gpu.json" "$RES/fsdp2_2gpu.json"
      stage finetune_fsdp2_lora "${FINETUNE_S:-280}" accelerate launch --config_file $cfg scripts/finetune_long.py \
        --preset glm5 --max_steps 40 --dense_pretrain_steps 10 --dense_warmup_steps 10 --lora_r 8 --logging_steps 5 --passkey_trials 2 \
        --output_dir /tmp/finetune_fsdp2 --no_progress
      cp /tmp/finetune_fsdp2/results.json "$RES/finetune_fsdp2.json" 2>/dev/null ;;
    cp)  # needs several GPUs (nvidia-h200-x2 / -x8): context parallelism over all of them (issue 30)
      n=$(nvidia-smi -L | wc -l)
      stage bench_cp "${CP_S:-560}" torchrun --standalone --nproc_per_node "$n" scripts/bench_cp.py \
        --out "$RES/cp" ${CP_ARGS:-}
      # per-step losses of the recipe split over the GPUs against one GPU, at a length one GPU trains
      for k in 1 "$n"; do
        stage "finetune_cp$k" "${FINETUNE_S:-280}" accelerate launch --config_file scripts/accelerate/cp2_2gpu.yaml \
          --num_processes "$k" scripts/finetune_long.py --preset glm5 --cp_size "$k" --max_steps 20 --dense_pretrain_steps 5 \
          --dense_warmup_steps 5 --logging_steps 1 --passkey_trials 2 --output_dir "/tmp/finetune_cp$k" --no_progress
        cp "/tmp/finetune_cp$k/log_history.json" "$RES/finetune_cp${k}_log_history.json" 2>/dev/null
      done ;;
    realmodel)  # the main job's GPU preset on SmolLM2-135M; its GGUF file travels in parts (README)
      [ -f /tmp/smollm2.gguf ] || cat .gguf_parts/part-* >/tmp/smollm2.gguf
      rm -rf /tmp/realmodel
      stage realmodel "${REALMODEL_S:-560}" python3 scripts/finetune_long.py --preset gpu --model /tmp/smollm2.gguf \
        --output_dir /tmp/realmodel --no_progress ${REALMODEL_ARGS:-}
      cp /tmp/realmodel/results.json "$RES/finetune_smollm2_gpu.json" 2>/dev/null
      cp /tmp/realmodel/loss_curve.png "$RES/finetune_smollm2_gpu.png" 2>/dev/null
      for f in /tmp/realmodel/evaluation_*.json; do cp "$f" "$RES/smollm2_gpu_$(basename "$f")" 2>/dev/null; done ;;
    selections)  # the realmodel stage's trained indexer (/tmp/realmodel, same machine): its selections on real text
      stage bench_trained_selections "${SELECTIONS_S:-300}" python3 scripts/bench_trained_selections.py \
        --model /tmp/realmodel --seqlens 32768 131072 --out "$RES/selections" ${SELECTIONS_ARGS:-} ;;
    e2e_trained)  # the same trained model's whole step on real text, dense against hyscale (after realmodel)
      # three timed steps: one slow step (a compile, an allocation) moves a median of two to the mean
      stage bench_e2e_trained "${E2E_S:-560}" python3 scripts/bench_e2e.py --model /tmp/realmodel --arms hyscale dense \
        --seqlens 32768 131072 --reps 3 --search-arms --out "$RES/trained" ${E2E_SMOLLM2_ARGS:-} ;;
    profile_trained)  # where that step's kernel time goes (after realmodel)
      stage profile_trained "${PROFILE_S:-300}" python3 scripts/profile_step.py --model /tmp/realmodel \
        --seqlens 32768 131072 --out "$RES/profile_trained" ${PROFILE_ARGS:-} ;;
    *) echo "unknown stage $s" | tee -a "$summary" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$RES" .
echo "== summary"
cat "$summary"
for f in "$RES"/*.log; do echo "== $(basename "$f") (tail)"; tail -n 12 "$f"; done
