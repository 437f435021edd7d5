// Must not compile: the CUDA executor for a GPU older than compute capability 8.0. The
// device pass stops at exec/cuda/architecture.cuh's error, which names the flag to use,
// before ptxas sees a cp.async (tests/CMakeLists.txt checks the text).
#include "kvpolicy/kvpolicy.cuh"

int main() { return 0; }
