#!/bin/bash
PY=/opt/torch/.venv/bin/python3
NPINC=$($PY -c "import numpy; print(numpy.get_include())")
PYINC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SUF=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
gcc -O3 -std=gnu11 -fopenmp -fPIC -shared -DRMSNORM_HAVE_AVX2=1 -DRMSNORM_HAVE_AVX512=1 -DRMSNORM_HAVE_AVX512BF16=1 -Isrc -I$NPINC -I$PYINC \
  src/module.c src/dispatch.c src/driver.c src/kernels/scalar.c src/kernels/avx2.c src/kernels/avx512.c src/kernels/avx512bf16.c src/kernels/reference.c \
  -o rmsnorm/_core$SUF || exit 1
export PYTHONPATH=$PWD RMSNORM_CACHE_DIR=/tmp/rmsc
$PY -c 'import rmsnorm.jax as r; print("jax backend", r.BACKEND, r.FFI_ERROR)'

timeout 400 $PY -m rmsnorm.bench --no-progress --threads 1,2,4,8,16 --shapes 4096x4096 --dtypes fp32 \
   --ops jax.fwd,jax.vg,torch.fwd+bwd --isa best --reps 5 --csv $OUT/adapters.csv --png '' --markdown > $OUT/adapters.md 2>&1
grep -E "^\| (jax|torch)" $OUT/adapters.md
