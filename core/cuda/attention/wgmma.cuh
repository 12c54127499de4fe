// Hopper (sm_90a) building blocks of the attention kernels (beside mma_sync.cuh's): warpgroup MMAs
// (wgmma) on bf16 with f32 accumulation, the descriptors of the tiles that wgmma reads, and TMA
// tile copies that complete on mbarriers.
#pragma once

#include <cstdint>

#include "core/cuda/attention/mma_sync.cuh"

namespace iris::cuda {

// wgmma exists only in sm_90a code; elsewhere (the host pass, plain sm_90 or other archs) these
// trap, and the kernels that call them are never launched: their dispatchers check for a
// compute capability 9.0 device in an sm_90a build first.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define IRIS_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define IRIS_SM90A_ASM(...) __trap()
#endif
// The 32 accumulator operands d[o] .. d[o + 31] of a wgmma asm statement.
#define IRIS_WGMMA_ACC32(d, o)                                                            \
  "+f"((d)[(o) + 0]), "+f"((d)[(o) + 1]), "+f"((d)[(o) + 2]), "+f"((d)[(o) + 3]),         \
      "+f"((d)[(o) + 4]), "+f"((d)[(o) + 5]), "+f"((d)[(o) + 6]), "+f"((d)[(o) + 7]),     \
      "+f"((d)[(o) + 8]), "+f"((d)[(o) + 9]), "+f"((d)[(o) + 10]), "+f"((d)[(o) + 11]),   \
      "+f"((d)[(o) + 12]), "+f"((d)[(o) + 13]), "+f"((d)[(o) + 14]), "+f"((d)[(o) + 15]), \
      "+f"((d)[(o) + 16]), "+f"((d)[(o) + 17]), "+f"((d)[(o) + 18]), "+f"((d)[(o) + 19]), \
      "+f"((d)[(o) + 20]), "+f"((d)[(o) + 21]), "+f"((d)[(o) + 22]), "+f"((d)[(o) + 23]), \
      "+f"((d)[(o) + 24]), "+f"((d)[(o) + 25]), "+f"((d)[(o) + 26]), "+f"((d)[(o) + 27]), \
      "+f"((d)[(o) + 28]), "+f"((d)[(o) + 29]), "+f"((d)[(o) + 30]), "+f"((d)[(o) + 31])
// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B from shared memory (K-major).
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
  IRIS_SM90A_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%"
      "25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : IRIS_WGMMA_ACC32(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
// D[64 x 64] += A[64 x 16] B[16 x 64], A from registers (each warp's 16 rows in the mma.sync
// A-fragment layout), B from shared memory MN-major (transposed).
__device__ __forceinline__ void wgmma_m64n64k16_rs_tb(float (&d)[32], const uint32_t (&a)[4],
                                                      uint64_t desc_b) {
  IRIS_SM90A_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%"
      "25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : IRIS_WGMMA_ACC32(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
__device__ __forceinline__ void wgmma_fence() {
  IRIS_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  IRIS_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  IRIS_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_async_shared() {
  IRIS_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Shared-memory matrix descriptor of a tile of 128-byte rows in the 128-byte swizzle (8-row
// groups 1024 bytes apart, the stride byte offset). The tile starts 1024-byte aligned. Both K-major
// operands (Q, K) and the MN-major V use this layout: a row is one key's 64 columns.
__device__ __forceinline__ uint64_t sw128_desc(const void* p) {
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// D[64 x 8] += A[64 x 16] B[16 x 8]: head_dim 72's last eight output columns.
__device__ __forceinline__ void wgmma_m64n8k16_rs_tb(float (&d)[4], const uint32_t (&a)[4],
                                                     uint64_t desc_b) {
  IRIS_SM90A_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, "
      "1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// Descriptor of an unswizzled tile of 8 x 16-byte core matrices: `lbo` bytes between core
// matrices along K, `sbo` between them along M/N (K-major); for MN-major operands the roles swap.
__device__ __forceinline__ uint64_t interleave_desc(const void* p, int lbo, int sbo) {
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}

// mbarriers and TMA (the tensor memory accelerator): a tile copy writes shared memory through
// the async proxy, as wgmma reads it, and signals its bytes on an mbarrier.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  IRIS_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)),
                 "r"(arrivals));
}
// Makes initialised mbarriers visible to the async proxy and the cluster.
__device__ __forceinline__ void mbarrier_init_fence() {
  IRIS_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of transactions before the phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  IRIS_SM90A_ASM(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)),
      "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  IRIS_SM90A_ASM(
      "{\n.reg .pred done;\nwait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_again;\n}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}
// Box (c0, c1) of a 2-D tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tensor_map, uint64_t* bar,
                                            int c0, int c1) {
  IRIS_SM90A_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%3, %4}], [%2];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(shared_address(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128-byte-swizzled tile.
__device__ __forceinline__ int sw128_offset(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

}  // namespace iris::cuda
