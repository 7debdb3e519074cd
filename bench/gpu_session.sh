#!/usr/bin/env bash
# The GPU check on a GPU machine, from the repository root, in one step:
#
#   DALI_SITE=<folder with nvidia/dali> bash bench/gpu_session.sh [bench.gpu_check arguments]
#
# runs `python3 -m bench.gpu_check` (about 7 minutes on one H200: views, training, every gpu test, the
# loader against torchvision) from the working tree, without `make install`,
# with DALI_SITE (unpacked wheels, when DALI is not installed in that Python) first on the path, and
# writes its report and log into $OUT (default reports/gpu-check).
#
# A user's `pip install nvidia-dali-cuda130` brings nvImageCodec's nvTIFF and nvJPEG2000 libraries, without
# which every pipeline prints "Failed to load" lines (and the quiet-console gpu test fails). Wheels put in
# .gpu/codecs (6.7 MB; carried with the last part) are installed into DALI_SITE first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .gpu/codecs nvidia-nvtiff-cu13==0.8.0.82 nvidia-nvjpeg2k-cu13==0.11.0.51
set -euo pipefail
if [ -n "${DALI_SITE:-}" ] && compgen -G ".gpu/codecs/*.whl" > /dev/null; then
    # into a folder of their own, then beside DALI's nvidia/ packages (pip's --target --upgrade would
    # replace the whole nvidia/ folder)
    rm -rf /tmp/codecs
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/codecs .gpu/codecs/*.whl
    cp -r /tmp/codecs/nvidia/. "$DALI_SITE/nvidia/"
fi
export PYTHONPATH="${DALI_SITE:+$DALI_SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-reports/gpu-check}"
mkdir -p "$out"
python3 -c "import nvidia.dali, torch; print('DALI', nvidia.dali.__version__, '| torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
python3 -m bench.gpu_check --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
