#!/bin/bash
# Build without setuptools and measure scaling past 2 cores.
set -x
PY=/opt/torch/.venv/bin/python3
NPINC=$($PY -c "import numpy; print(numpy.get_include())")
PYINC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SUF=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
nproc; lscpu | grep -E "Model name|L3|Thread|Socket|NUMA node\(s\)"; $PY -c "import ml_dtypes, numpy, torch, jax; print(numpy.__version__, torch.__version__, jax.__version__)"
gcc -O3 -std=gnu11 -fopenmp -fPIC -shared -DRMSNORM_HAVE_AVX2=1 -DRMSNORM_HAVE_AVX512=1 -Isrc -I$NPINC -I$PYINC \
  src/module.c src/dispatch.c src/driver.c src/kernels/scalar.c src/kernels/avx2.c src/kernels/avx512.c src/kernels/reference.c \
  -o rmsnorm/_core$SUF || exit 1
export PYTHONPATH=$PWD
$PY -m rmsnorm > $OUT/selfcheck.txt 2>&1; tail -3 $OUT/selfcheck.txt
N=$(nproc)
T="1,2,4,8,$N"
timeout 300 $PY -m rmsnorm.bench --no-peers --no-progress --threads $T --shapes 8192x8192,16384x4096,1000000x64,1x1048576,29x17389 \
   --dtypes fp32,bf16 --ops fwd,bwd,add --isa best --reps 5 --max-mb 8192 --csv $OUT/scaling.csv --png $OUT/scaling.png --markdown > $OUT/scaling.md 2>&1
tail -5 $OUT/scaling.md
timeout 240 $PY -m rmsnorm.bench --no-progress --threads $T --shapes 4096x4096 --dtypes fp32 \
   --ops fwd,bwd,torch.fwd,torch.fwd+bwd,jax.fwd,jax.vg --isa best --reps 5 --csv $OUT/peers.csv --png '' --markdown > $OUT/peers.md 2>&1
tail -5 $OUT/peers.md
