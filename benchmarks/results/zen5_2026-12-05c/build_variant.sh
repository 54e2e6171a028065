# Build a kernel library variant: bash build_variant.sh NAME [extra g++ flags] -> /tmp/w/lib_NAME.so
# (the flags of sloserve/kernels/build.py's avx512 variant, from the current source)
mkdir -p /tmp/w
cd /work/main && g++ -O3 -std=c++17 -pthread -fPIC -shared -fno-math-errno -ffp-contract=off -fopenmp -DSL_USE_OMP -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c -mavx2 ${@:2} sloserve/kernels/csrc/kernels.cpp -o /tmp/w/lib_$1.so
