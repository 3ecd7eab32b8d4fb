// The GPU check drivers' CUDA runtime error check: a failed call prints its
// name, place and message and exits 2 (the step then fails with them).
#pragma once
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                                        \
  do {                                                                                                  \
    cudaError_t e_ = (x);                                                                               \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                                                             \
      std::exit(2);                                                                                     \
    }                                                                                                   \
  } while (0)
