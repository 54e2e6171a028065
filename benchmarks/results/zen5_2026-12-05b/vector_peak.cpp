// 512-bit vpdpbusd and vfmadd231ps throughput on one core, 12 independent chains, and a
// mix of 8 dot products + 4 FMAs. g++ -O3 -mavx512f -mavx512bw -mavx512vnni vector_peak.cpp
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main(){
  __m512i a[12]; for(int i=0;i<12;i++) a[i]=_mm512_set1_epi32(i);
  __m512i b=_mm512_set1_epi8(3), c=_mm512_set1_epi8(5);
  __m512 f[12]; for(int i=0;i<12;i++) f[i]=_mm512_set1_ps(i);
  __m512 fb=_mm512_set1_ps(1.0001f), fc=_mm512_set1_ps(0.9999f);
  long N=200000000/12;
  auto t0=std::chrono::steady_clock::now();
  for(long n=0;n<N;n++){ _Pragma("GCC unroll 12") for(int i=0;i<12;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); asm volatile(""::"v"(a[0])); }
  auto t1=std::chrono::steady_clock::now();
  for(long n=0;n<N;n++){ _Pragma("GCC unroll 12") for(int i=0;i<12;i++) f[i]=_mm512_fmadd_ps(f[i],fb,fc); asm volatile(""::"v"(f[0])); }
  auto t2=std::chrono::steady_clock::now();
  // mixed: 8 dpbusd + 4 fp ops
  for(long n=0;n<N;n++){ _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); _Pragma("GCC unroll 4") for(int i=0;i<4;i++) f[i]=_mm512_fmadd_ps(f[i],fb,fc); asm volatile(""::"v"(a[0]),"v"(f[0])); }
  auto t3=std::chrono::steady_clock::now();
  double s1=std::chrono::duration<double>(t1-t0).count(), s2=std::chrono::duration<double>(t2-t1).count(), s3=std::chrono::duration<double>(t3-t2).count();
  double ops=N*12.0;
  printf("dpbusd %.2f G/s (%.0f GMAC/s), fma %.2f G/s (%.0f GFLOP/s), mixed 8+4: %.2f Ginstr/s\n", ops/s1/1e9, ops/s1*64/1e9, ops/s2/1e9, ops/s2*32/1e9, ops/s3/1e9);
  int s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_epi32(a[i]); float fs=0; for(int i=0;i<12;i++) fs+=_mm512_reduce_add_ps(f[i]);
  printf("%d %f\n",s,fs);
}
