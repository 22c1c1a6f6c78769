// Measures %globaltimer's update granularity: consecutive reads, and reads spaced by clock64 spins.
#include <cstdint>
#include <cstdio>
#include <map>
#include <vector>
__global__ void Reads(unsigned long long* t, long long* c, int n, int spin) {
  for (int i = 0; i < n; ++i) {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    t[i] = g;
    c[i] = clock64();
    const long long s = clock64();
    while (clock64() - s < spin) {
    }
  }
}
int main() {
  const int n = 4096;
  unsigned long long* t;
  long long* c;
  cudaMalloc(&t, n * 8);
  cudaMalloc(&c, n * 8);
  std::vector<unsigned long long> ht(n);
  std::vector<long long> hc(n);
  for (int spin : {0, 50, 200, 1000}) {
    Reads<<<1, 1>>>(t, c, n, spin);
    cudaMemcpy(ht.data(), t, n * 8, cudaMemcpyDeviceToHost);
    cudaMemcpy(hc.data(), c, n * 8, cudaMemcpyDeviceToHost);
    std::map<unsigned long long, int> hist;
    int zero = 0;
    for (int i = 1; i < n; ++i) {
      auto d = ht[i] - ht[i - 1];
      if (d == 0)
        ++zero;
      else
        hist[d]++;
    }
    double ns = double(ht[n - 1] - ht[0]) / (n - 1), cyc = double(hc[n - 1] - hc[0]) / (n - 1);
    printf(
        "spin=%d cycles: mean %.1f ns / %.1f cycles per read (%.2f GHz); zero deltas %d of %d; "
        "nonzero deltas:",
        spin, ns, cyc, cyc / ns, zero, n - 1);
    int shown = 0;
    for (auto& [d, k] : hist) {
      if (shown++ < 12) printf(" %llu ns x%d", d, k);
    }
    printf("\n");
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
