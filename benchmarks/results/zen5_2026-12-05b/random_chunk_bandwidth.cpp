// Read 200 MB in 6 KB (or argv[1]-byte) chunks, in order and shuffled, 2 threads; -DPF=1
// adds software prefetch of the chunk two ahead. g++ -O3 -mavx512f -fopenmp -DPF=0 ...
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <random>
#include <omp.h>
#include <cstdlib>
int main(int argc, char** argv){
  const size_t CH = atoi(argv[1]); const size_t N = (size_t(200)<<20) / CH;
  char* buf = (char*)aligned_alloc(4096, N*CH); for(size_t i=0;i<N*CH;i++) buf[i]=i;
  std::vector<size_t> ord(N); for(size_t i=0;i<N;i++) ord[i]=i;
  for (int mode=0; mode<2; mode++){
    if(mode==1){ std::mt19937 g(1); std::shuffle(ord.begin(), ord.end(), g);}
    double best=1e9;
    for(int r=0;r<5;r++){
      auto t0=std::chrono::steady_clock::now();
      __m512i tot=_mm512_setzero_si512();
      #pragma omp parallel num_threads(2)
      { __m512i acc=_mm512_setzero_si512();
        #pragma omp for schedule(static)
        for(size_t i=0;i<N;i++){ const char* p=buf+ord[i]*CH;
          if(PF && i+2<N){ const char* q=buf+ord[i+2]*CH; for(size_t l=0;l<CH;l+=64) _mm_prefetch(q+l,_MM_HINT_T0);}
          for(size_t l=0;l<CH;l+=64) acc=_mm512_add_epi32(acc,_mm512_load_si512(p+l)); }
        #pragma omp critical
        tot=_mm512_add_epi32(tot,acc); }
      double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); best=std::min(best,s);
      if(_mm512_reduce_add_epi32(tot)==12345) printf("x");
    }
    printf("chunk %zu %s: %.1f GB/s\n", CH, mode?"random":"seq", N*CH/best/1e9);
  }
}
