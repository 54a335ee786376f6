// XXH3 built for AVX2 (this file alone is compiled with -mavx2: CMakeLists.txt); content_digest.cpp
// calls it only where the CPU has AVX2, so the library still runs on any x86-64.
#ifdef __AVX2__
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include "third_party/xxhash.h"

namespace torch_ext::reactive {

uint64_t xxh3_64_avx2(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace torch_ext::reactive

#endif  // __AVX2__
