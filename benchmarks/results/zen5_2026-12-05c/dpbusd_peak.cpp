// vpdpbusd throughput on one core: embedded-broadcast memory operand (mode 0), vpbroadcastd from
// memory + register form (1), registers only (2), NA independent accumulators.
//   g++ -O3 -mavx512f -mavx512bw -mavx512vnni -mavx512vl dpbusd_peak.cpp -o /tmp/p && /tmp/p
// (g++ adds register moves of its own at NA 16/20; NA 8 is the clean reading)
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
static inline __m512i dpb(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x)); return acc; }
double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
template<int MODE, int NA>
void run(const int32_t* xs, long n){
  __m512i w[8]; for(int c=0;c<8;c++) w[c]=_mm512_set1_epi32(c+1);
  __m512i a[NA]; for(int i=0;i<NA;i++) a[i]=_mm512_setzero_si512();
  double t=now();
  for(long it=0; it<n; ++it){
    _Pragma("GCC unroll 32") for(int i=0;i<NA;i++) {
      if (MODE==0) a[i]=dpb(a[i], w[i&7], xs+i);
      else if (MODE==1) a[i]=_mm512_dpbusd_epi32(a[i], w[i&7], _mm512_set1_epi32(xs[i]));
      else a[i]=_mm512_dpbusd_epi32(a[i], w[i&7], w[(i+3)&7]);
    }
    asm volatile("" : : "r"(xs));
    xs += (it & 1) ? -32 : 32;
  }
  t=now()-t; __m512i s=a[0]; for(int i=1;i<NA;i++) s=_mm512_add_epi32(s,a[i]);
  printf("mode %d NA %d: %.2f G/s (%.0f GOP/s) %d\n", MODE, NA, 1.0*NA*n/t/1e9, 1.0*NA*n*128/t/1e9, _mm512_reduce_add_epi32(s));
}
int main(){
  alignas(64) static int32_t xs[256]; for(int i=0;i<256;i++) xs[i]=i*7;
  long n=20000000;
  run<0,8>(xs,n); run<0,16>(xs,n); run<0,20>(xs,n);
  run<1,8>(xs,n); run<1,16>(xs,n); run<1,20>(xs,n);
  run<2,8>(xs,n); run<2,16>(xs,n); run<2,20>(xs,n);
}
