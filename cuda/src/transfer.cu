// The strided transfers on the GPU: the weight reshard's descriptors
// (Moebius §4.3) executed by one kernel launch. The cuda backend builds this
// file with nvcc at its first copy (cuda/src/lib.rs) and the GPU check times
// the same kernel against a device-to-device copy (scripts/gpu/copy_check.cu).
//
// A descriptor is counts[0] × counts[1] runs of `run` bytes; run (a, b) is
// read at src + a·ss0 + b·ss1 and written at dst + a·ds0 + b·ds1. Runs of
// one launch must not overlap (the plan's reshard moves between distinct
// slots). Every run is cut into `chunk`-byte pieces (16 when every address,
// stride and run length allows it) and the launch's threads take consecutive
// pieces: a warp copies 512 contiguous bytes of a run, coalesced.
#include <cstdint>

struct MoeforgeCopy {
  unsigned long long src, dst, run, c0, c1, ss0, ss1, ds0, ds1;
  unsigned long long first;  // pieces before this descriptor (prefix sum)
};

template <class T>
__device__ __forceinline__ void moeforge_transfer_pieces(const MoeforgeCopy* d, int n, unsigned long long pieces,
                                                         const unsigned char* src, unsigned char* dst) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long p = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < pieces;
       p += stride) {
    int lo = 0, hi = n - 1;  // the descriptor holding piece p
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (d[mid].first <= p) lo = mid;
      else hi = mid - 1;
    }
    const MoeforgeCopy& c = d[lo];
    const unsigned long long per_run = c.run / sizeof(T), local = p - c.first;
    const unsigned long long r = local / per_run, k = local % per_run, a = r / c.c1, b = r % c.c1;
    const T* s = reinterpret_cast<const T*>(src + c.src + a * c.ss0 + b * c.ss1) + k;
    T* t = reinterpret_cast<T*>(dst + c.dst + a * c.ds0 + b * c.ds1) + k;
    *t = *s;
  }
}

// `chunk` is 16, 8, 4 or 1: the piece size every descriptor's addresses allow.
extern "C" __global__ void moeforge_transfer(const MoeforgeCopy* d, int n, unsigned long long pieces,
                                             const unsigned char* src, unsigned char* dst, int chunk) {
  switch (chunk) {
    case 16: moeforge_transfer_pieces<uint4>(d, n, pieces, src, dst); break;
    case 8: moeforge_transfer_pieces<unsigned long long>(d, n, pieces, src, dst); break;
    case 4: moeforge_transfer_pieces<unsigned int>(d, n, pieces, src, dst); break;
    default: moeforge_transfer_pieces<unsigned char>(d, n, pieces, src, dst); break;
  }
}
