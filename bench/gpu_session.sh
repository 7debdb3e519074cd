#!/usr/bin/env bash
# The GPU check on a GPU machine, from the repository root, in one step:
#
#   DALI_SITE=<folder with nvidia/dali> bash bench/gpu_session.sh [bench.gpu_check arguments]
#
# runs `python3 -m bench.gpu_check` (about 7 minutes on one H200: views, training, every gpu test, the
# loader against torchvision) from the working tree, without `make install`,
# with DALI_SITE (unpacked wheels, when DALI is not installed in that Python) first on the path, and
# writes its report and log into $OUT (default reports/gpu-check).
set -euo pipefail
export PYTHONPATH="${DALI_SITE:+$DALI_SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-reports/gpu-check}"
mkdir -p "$out"
python3 -c "import nvidia.dali, torch; print('DALI', nvidia.dali.__version__, '| torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
python3 -m bench.gpu_check --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
