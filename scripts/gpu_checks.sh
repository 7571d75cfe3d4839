#!/usr/bin/env bash
# Every GPU check in one run (at most 8 minutes: GPU_CHECKS_DEADLINE_S), its outputs under one folder.
#
# Through the device tool (one call), from the repository root:
#   1. Here, once (and again when the data or the pinned versions change):
#        bash scripts/gpu_checks.sh --prepare
#      fills .gpu_carry/ (ignored by git, ~50 MiB): wheels of the packages the device's python3 lacks (datasets,
#      evaluate, dill, multiprocess, at the versions of this .venv, for Python 3.12) and data.tar.xz, the offline
#      benchmark data of the Debian packages (Fashion-MNIST, opencv-doc's images, the fonts).
#   2. run(command='bash scripts/gpu_checks.sh "$OUT"', carry=[".gpu_carry"], timeout_s=600)
#   The project's .venv is not carried: it is 1.8 GiB (the tree that travels is limited to 64 MiB), Python 3.11 and
#   a CPU-only torch. The device's own python3 (CUDA torch, transformers, accelerate, pytest) runs everything, with
#   the repository on PYTHONPATH and the carried wheels installed under /tmp; the data is unpacked at the Debian
#   paths (/usr/share/..., as root) or, failing that, under /tmp with HF_GSC_* pointing at it.
#
# What it checks (each step under a timeout, all under GPU_CHECKS_DEADLINE_S, default 480 s; a failing step is
# recorded and the next one runs):
#   1. device_tests: the tests skipped without CUDA (@pytest.mark.skipif(not torch.cuda.is_available(), ...),
#      found by grep), one pytest process (two xdist workers only when torch.cuda.device_count() >= 2).
#   compiled_bf16: scripts/benchmark_compiled.py, ResNet-50, ViT-B/16 and Swin-T (random weights, 224 px) in bf16
#      autocast at batch 64, 256 and 1: MSP and GSC eager and compiled whole (detector.compiled(mode=
#      "reduce-overhead"): torch.compile fullgraph, CUDA graphs), their times, GSC / MSP both ways, the compile time of
#      the first call and the compiled-vs-eager score difference. Targets: GSC at most 1.02x MSP at batch 64 and at
#      most 1.10x at batch 1 (the latency of a served image).
#   2. eval_device_fp32, eval_device_bf16, eval_cpu_fp32: scripts/evaluate_ood.py on the ResNet reference model,
#      fmnist-ood, gsc,msp,energy,odin,react,adascale_a,nnguide,mahalanobis_pp (the own-pass,
#      chunked-bank and float64-statistics paths), --max-samples 1000, on the GPU in fp32 and --mixed-precision bf16,
#      and the same fp32 command on the CPU (CUDA_VISIBLE_DEVICES= ACCELERATE_USE_CPU=1). summary.json compares
#      each method's average AUROC / FPR95 on the GPU with the CPU run and records device, precision and images/s.
#   3. cost_fp32, cost_bf16: scripts/benchmark_efficiency.py, ResNet-50, ViT-B/16 and Swin-T (random weights,
#      224 px), batch 64, on CUDA. Targets: every GSC approximation at most 1.05x MSP's time and at most 1.10x MSP's
#      peak memory (torch.cuda.max_memory_allocated). With --per-coordinate --step-alone: ResNet-50's head reads F
#      through a mean over positions, so GSC's step runs per channel; it is also run on every coordinate of F
#      (gsc_*_per_coordinate rows, and the step alone both ways, with whether the masks are the same).
#      per_channel_fp32, per_channel_bf16: the same for ResNet-50 alone at batch 256.
#   4. data_loading: scripts/benchmark_data_loading.py --model vit-b16-random --device cuda --mixed-precision bf16
#      (the model alone and the loop in bf16, the loop with the evaluation's default workers and with 4, 8 and 15).
#      Target: ViT-B/16 end-to-end images/s through the evaluation's data loop at least 0.8x its model-only images/s
#      (the issue's: 0.9x of the fp32 model alone; bf16's model alone is the stricter denominator).
#   5. shared_pass: scripts/benchmark_shared_pass.py on the GPU (the evaluation with every one-pass method against
#      KNN alone and MSP alone, 3 rounds of 1,024 samples per split: one round of sub-second runs carries the first
#      run's warm-up; its JSON holds the ratios), on its small random ViT (hidden 192). Target: at most 1.5x KNN
#      alone. shared_pass_vit_b16: the same on a random ViT-B/16 at 224 px (--model vit-b16), 1 round (target 1.3x).
#   Order and the 8 minutes: compiled_bf16, cost_bf16, data_loading, the evaluations, shared_pass_vit_b16; cost_fp32,
#   per_channel_* and shared_pass (measured before, in docs/results/gpu/) run only with GPU_CHECKS_MORE=1.
#
# Output (at most 8 files, as the device tool returns them): summary.json (each step's command, exit status,
# seconds and limit; the findings above against their targets), progress.log, cost_tables.md (the cost JSONs'
# tables) and details.tar.gz (every log and JSON, nvidia-smi, pip freeze; no score caches or plots).
#
# Rehearsal on a machine without a GPU (a few minutes; cpu instead of cuda, 200 samples, batch 2, 1 round;
# keeps details/ unpacked):
#   bash scripts/gpu_checks.sh --cpu-rehearsal /tmp/gpu_rehearsal
# PYTHON picks the interpreter (default: .venv/bin/python for --prepare and the rehearsal when present, else python3);
# GPU_CHECKS_LIMIT_SCALE multiplies every step's limit (default 1; a rehearsal on a busy CPU needs more time than
# the GPU's limits give: GPU_CHECKS_LIMIT_SCALE=4 GPU_CHECKS_DEADLINE_S=2400).
# GPU_CHECKS_DATA_ROOT unpacks the carried data elsewhere than / (hf_gsc's HF_GSC_* variables then point at it).

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
CARRY=$REPO/.gpu_carry
MODE=gpu
DIR=
for arg in "$@"; do
    case $arg in
        --prepare) MODE=prepare ;;
        --cpu-rehearsal) MODE=rehearsal ;;
        -h|--help) sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $arg (see --help)" >&2; exit 2 ;;
        *) DIR=$arg ;;
    esac
done
if [[ -z ${PYTHON:-} ]]; then
    if [[ $MODE != gpu && -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi

# --------------------------------------------------------------------------------------------- --prepare
#: Packages the GPU machine's python3 lacks (from the list of its packages); their own needs are all there.
CARRIED_PACKAGES=(datasets evaluate dill multiprocess)
#: The Debian data the offline benchmarks and the data-loading benchmark read (Makefile's DATA_PACKAGES).
DATA_PATHS=(usr/share/datasets/fashion-mnist usr/share/fonts/truetype/dejavu usr/share/fonts/truetype/liberation
            usr/share/fonts/truetype/freefont)
OPENCV_DATA=usr/share/doc/opencv-doc/examples/data

if [[ $MODE == prepare ]]; then
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" || exit 1
    pins=()
    for package in "${CARRIED_PACKAGES[@]}"; do
        version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package") || exit 1
        pins+=("$package==$version")
    done
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d "$CARRY/wheels" "${pins[@]}" || exit 1
    # opencv-doc's images without its stereo-calibration photos (left01.jpg ...), which nothing here reads.
    opencv=$(cd / && find "$OPENCV_DATA" -maxdepth 1 \( -name '*.png' -o -name '*.jpg' \) \
        ! -regex '.*/\(left\|right\)[0-9]+\.jpg' | sort) || exit 1
    # shellcheck disable=SC2086  # one path a word: none has a space
    tar -C / -cf - "${DATA_PATHS[@]}" $opencv | xz -T1 -6 >"$CARRY/data.tar.xz" || exit 1
    du -sh "$CARRY"/wheels/* "$CARRY/data.tar.xz"
    bytes=$(( $(du -sb "$CARRY" | cut -f1) + $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) ))
    echo "tracked files + .gpu_carry: $(( bytes / 1048576 )) MiB of the 64 MiB that may travel to the GPU machine"
    exit 0
fi

# ----------------------------------------------------------------------------------------------- set-up
DIR=${DIR:-${OUT:-gpu_out}}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd) || exit 1
DETAILS=$DIR/details
rm -rf "$DETAILS" && mkdir -p "$DETAILS/logs" || exit 1
PROGRESS=$DIR/progress.log
STEPS=$DETAILS/steps.tsv
: >"$PROGRESS"
: >"$STEPS"
DEADLINE=${GPU_CHECKS_DEADLINE_S:-480}
# Each step's limit times this (a CPU rehearsal on a loaded machine: e.g. 4 with GPU_CHECKS_DEADLINE_S=2400).
LIMIT_SCALE=${GPU_CHECKS_LIMIT_SCALE:-1}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

say() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$PROGRESS"; }

# step NAME LIMIT_S COMMAND...: runs COMMAND under `timeout` (LIMIT_S, cut to what the deadline leaves), its output in
# details/logs/NAME.log, and records NAME, exit status (124: timed out; "skipped": no time left), seconds, limit and
# the command in details/steps.tsv.
step() {
    local name=$1 limit=$2 left start status command
    shift 2
    command=$(printf '%q ' "$@")  # shell-quoted on one line, for the TSV
    command=${command% }
    limit=$(( limit * LIMIT_SCALE ))
    left=$(( DEADLINE - SECONDS ))
    if (( left < 20 )); then
        say "$name: skipped, ${left}s left of ${DEADLINE}s"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" skipped 0 0 "$command" >>"$STEPS"
        return
    fi
    (( limit > left )) && limit=$left
    say "$name (limit ${limit}s): $command"
    start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$DETAILS/logs/$name.log" 2>&1
    status=$?
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" $(( SECONDS - start )) "$limit" "$command" >>"$STEPS"
    say "$name: exit status $status after $(( SECONDS - start ))s"
}

if [[ $MODE == gpu ]]; then
    DEVICE=cuda MAX_SAMPLES=1000 BATCH=64 REPEATS=10 WARMUP=3 THREADS=8
    # 1,024 samples per split: at the default 128 an H200 run lasts under a second and fixed costs decide the ratio.
    SHARED_PASS=(--rounds 3 --max-samples 1024 --max-fit-samples 1024 --batch-size 64)
    # ViT-B/16's Mahalanobis needs hidden + classes = 778 fitting samples; its forward makes each round ~30 s.
    SHARED_PASS_VIT_B16=(--model vit-b16 --rounds 1 --max-samples 1024 --max-fit-samples 1024 --batch-size 64)
    LARGE_BATCH=256
    # 2048 JPEGs made there (~15 s), two rounds of the model alone and the loop with the evaluation's workers (~40 s).
    DATA_LOADING=(--model vit-b16-random --device cuda --batch-size 64 --measure model_only,workers_N --repeats 2
                  --mixed-precision bf16 --worker-counts 4,8,15)
    # Batches above 1 share one compile per method and model (batch dimension dynamic); batch 1 compiles again.
    COMPILED=(--device cuda --batch-sizes 1,64,256 --repeats 10 --warmup 3 --mixed-precision bf16
              --compile-mode reduce-overhead)
    DEVICE_ENV=()
else
    DEVICE=cpu MAX_SAMPLES=200 BATCH=2 REPEATS=1 WARMUP=0 THREADS=1
    SHARED_PASS=(--rounds 1 --max-samples 32 --max-fit-samples 64)
    # A ViT-B/16 round takes minutes on a CPU: the small ViT stands in (the JSON's setup names the model).
    SHARED_PASS_VIT_B16=(--model vit-ti --rounds 1 --max-samples 32 --max-fit-samples 64)
    LARGE_BATCH=4
    DATA_LOADING=(--model cheap-vit --device cpu --num-images 64 --repeats 1 --mixed-precision bf16 --worker-counts 1)
    # The plumbing only: small inputs, aot_eager (no C++ compile on a CPU), one model.
    COMPILED=(--device cpu --models resnet-50 --image-size 64 --batch-sizes 1,2 --repeats 1 --warmup 0
              --mixed-precision bf16 --compile-mode default --backend aot_eager)
    DEVICE_ENV=(CUDA_VISIBLE_DEVICES=)
    export OMP_NUM_THREADS=1
fi
say "gpu_checks.sh $MODE: python $PYTHON, outputs in $DIR, deadline ${DEADLINE}s"

# The carried payload (GPU only: the rehearsal's machine has the Debian packages and a .venv).
if [[ $MODE == gpu && -d $CARRY ]]; then
    if ! "$PYTHON" -c "import datasets, evaluate" 2>/dev/null && compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
        site=/tmp/gpu_checks_site
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$CARRY"/wheels/*.whl >"$DETAILS/logs/wheels.log" 2>&1
        say "wheels installed in $site: exit status $?"
        export PYTHONPATH=$PYTHONPATH:$site
    fi
    if [[ -f $CARRY/data.tar.xz ]]; then
        root=${GPU_CHECKS_DATA_ROOT:-/}
        [[ $root != / || -w /usr/share ]] || root=/tmp/gpu_checks_root
        mkdir -p "$root" && tar -C "$root" --skip-old-files -xJf "$CARRY/data.tar.xz" 2>"$DETAILS/logs/data.log"
        say "data unpacked under $root: exit status $?"
        if [[ $root != / ]]; then  # hf_gsc's own overrides (benchmark_data_loading.py's photos then come from skimage)
            export HF_GSC_FASHION_MNIST_DIR=$root/usr/share/datasets/fashion-mnist
            export HF_GSC_OPENCV_DATA=$root/$OPENCV_DATA HF_GSC_OPENCV_DIGITS=$root/$OPENCV_DATA/digits.png
            export HF_GSC_FONT_DIRS=$root/usr/share/fonts/truetype/dejavu:$root/usr/share/fonts/truetype/liberation:$root/usr/share/fonts/truetype/freefont
        fi
    fi
elif [[ $MODE == gpu ]]; then
    say "no .gpu_carry/ (bash scripts/gpu_checks.sh --prepare, then carry it): relying on what the machine has"
fi

# ------------------------------------------------------------------------------------------------- steps
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
else
    echo "no nvidia-smi"
fi >"$DETAILS/nvidia-smi.txt" 2>&1
"$PYTHON" -m pip freeze 2>/dev/null | grep -iE 'torch|transformers|accelerate|datasets|evaluate|pyarrow|fsspec|huggingface' >"$DETAILS/pip-freeze.txt"
step environment 30 "$PYTHON" -c "
import json, sys, torch, transformers, accelerate, datasets
cuda = torch.cuda.is_available()
print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,
                  'transformers': transformers.__version__, 'accelerate': accelerate.__version__,
                  'datasets': datasets.__version__, 'device_count': torch.cuda.device_count(),
                  'device': torch.cuda.get_device_name(0) if cuda else 'cpu',
                  'bf16': torch.cuda.is_bf16_supported() if cuda else None}))"

# 1. The tests skipped without CUDA.
mapfile -t CUDA_TESTS < <(awk '/skipif\(not torch\.cuda\.is_available\(\)/ {want = 1; next}
    want && /^(async )?def test_/ {name = $0; sub(/^(async )?def /, "", name); sub(/\(.*/, "", name);
                                   print FILENAME "::" name; want = 0}' tests/*.py)
WORKERS=()
if [[ $("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) -ge 2 ]] \
        && "$PYTHON" -c "import xdist" 2>/dev/null; then
    WORKERS=(-n 2)
fi
if (( ${#CUDA_TESTS[@]} )); then
    step device_tests 90 "$PYTHON" -m pytest -q -rs -p no:cacheprovider "${WORKERS[@]}" "${CUDA_TESTS[@]}"
else
    say "device_tests: no test marked skipif(not torch.cuda.is_available()) found in tests/"
    printf '%s\t%s\t%s\t%s\t%s\n' device_tests no-tests-found 0 0 "" >>"$STEPS"
fi

MORE=${GPU_CHECKS_MORE:-0}

# GSC against MSP in bf16, eager and compiled, at batch 64, 256 and 1 (the served latency).
step compiled_bf16 200 "$PYTHON" scripts/benchmark_compiled.py "${COMPILED[@]}" --output "$DETAILS/compiled_bf16.json"

# 3. GSC's cost next to MSP at realistic scale (eager, with the step alone and the per-coordinate comparison);
# the per-channel step of ResNet-50's pooled head against the step on every coordinate.
for precision in bf16 fp32; do
    [[ $precision == fp32 && $MORE != 1 ]] && continue
    mixed=$([[ $precision == fp32 ]] && echo no || echo bf16)
    step "cost_$precision" 90 "$PYTHON" scripts/benchmark_efficiency.py \
        --models resnet-50-random,vit-b16-random,swin-t-random --baselines msp --batch-sizes "$BATCH" \
        --per-coordinate --step-alone --repeats "$REPEATS" --warmup "$WARMUP" --threads "$THREADS" --device "$DEVICE" \
        --mixed-precision "$mixed" --output "$DETAILS/cost_$precision.json"
done

# 4. ViT-B/16 through the evaluation's data loop against the model alone, in bf16.
step data_loading 90 "$PYTHON" scripts/benchmark_data_loading.py "${DATA_LOADING[@]}" --output "$DETAILS/data_loading.json"

# 2. The evaluation on the device in fp32 and bf16, then the same fp32 command on the CPU (it needs no GPU).
EVALUATE=("$PYTHON" scripts/evaluate_ood.py --model hf_gsc/reference_models/resnet --benchmark fmnist-ood
          --methods gsc,msp,energy,odin,react,adascale_a,nnguide,mahalanobis_pp --max-samples "$MAX_SAMPLES" --seed 0 --no-plots --overwrite)
step eval_device_fp32 75 env "${DEVICE_ENV[@]}" "${EVALUATE[@]}" --mixed-precision no --output-dir "$DETAILS/eval_device_fp32"
step eval_device_bf16 75 env "${DEVICE_ENV[@]}" "${EVALUATE[@]}" --mixed-precision bf16 --output-dir "$DETAILS/eval_device_bf16"
step eval_cpu_fp32 90 env CUDA_VISIBLE_DEVICES= ACCELERATE_USE_CPU=1 "${EVALUATE[@]}" --mixed-precision no \
    --output-dir "$DETAILS/eval_cpu_fp32"

# 5. The full comparison table against one method, on the GPU.
step shared_pass_vit_b16 150 "$PYTHON" scripts/benchmark_shared_pass.py "${SHARED_PASS_VIT_B16[@]}" \
    --output "$DETAILS/shared_pass_vit_b16.json"
if [[ $MORE == 1 ]]; then
    for precision in fp32 bf16; do
        mixed=$([[ $precision == fp32 ]] && echo no || echo bf16)
        step "per_channel_$precision" 60 "$PYTHON" scripts/benchmark_efficiency.py \
            --models resnet-50-random --baselines msp --batch-sizes "$LARGE_BATCH" --per-coordinate --step-alone \
            --repeats "$REPEATS" --warmup "$WARMUP" --threads "$THREADS" --device "$DEVICE" \
            --mixed-precision "$mixed" --output "$DETAILS/per_channel_$precision.json"
    done
    step shared_pass 150 "$PYTHON" scripts/benchmark_shared_pass.py "${SHARED_PASS[@]}" --output "$DETAILS/shared_pass.json"
fi

# ----------------------------------------------------------------------------------------------- summary
"$PYTHON" scripts/gpu_checks_summary.py --mode "$MODE" --seconds "$SECONDS" "$DIR" 2>&1 | tee -a "$PROGRESS"
tar -C "$DIR" -czf "$DIR/details.tar.gz" --exclude=scores --exclude=detectors --exclude='*.png' details
# Exit status 1 when a step failed or was skipped.
failed=$(awk -F'\t' '$2 != "0"' "$STEPS" | wc -l)
[[ $MODE == gpu ]] && rm -rf "$DETAILS"  # the device tool returns at most 8 files: details travel packed
say "done in ${SECONDS}s, $failed step(s) not passed: $(ls "$DIR" | tr '\n' ' ')"
(( failed == 0 ))
