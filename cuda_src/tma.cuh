// tma.cuh: sm_90 bulk tensor copies (TMA), the shared-memory barriers they complete on
// (mbarrier), and the warp-specialisation primitives of the Hopper kernels (register
// reallocation with setmaxnreg, named barriers between warpgroups), and the bulk reductions
// from shared to global memory with the semaphores that put them in a fixed order.
//
// A TMA load copies one box of a global tensor, described by a tensor map the host encodes
// (cuTensorMapEncodeTiled: base address, dims, byte strides, box, 128-byte swizzle), into shared
// memory, and counts its bytes against an mbarrier's transaction count. One thread issues it;
// the threads that consume the tile wait on the barrier's phase. With the 128-byte swizzle and a
// box of [rows][64] 16-bit elements, a box lands exactly as one panel of a SwizzledTile
// (wgmma.cuh), so the tile serves wgmma directly.
//
// Phases: an mbarrier completes a phase when its expected arrivals and bytes are in; waiters ask
// for the completion of the phase with a given parity. A circular buffer of stages waits for
// parity (use / stages) & 1 on the "full" barrier of a stage and the producer for the opposite
// parity on its "empty" barrier (a fresh barrier counts as having completed parity 1).
#pragma once

#include "common.cuh"
#include "wgmma.cuh"  // kWarpgroupThreads

namespace cuattn {

// CUtensorMap: 128 opaque bytes the host encodes; kernels take it inside their parameter struct
// (params.cuh), which lives in the kernel's parameter space for the whole grid.
struct alignas(64) TensorMap {
  unsigned long long raw[16];
};

constexpr int kMbarrierBytes = 8;  // one mbarrier (.b64) in shared memory

__device__ __forceinline__ void mbarrier_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Barrier initialisation visible to the async proxy (TMA) before anyone uses the barriers.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The producer's arrival, announcing `bytes` of TMA traffic that will complete the phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Block until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(u32 bar, int parity) {
  u32 done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// One 4-D box at coordinates (c0 innermost .. c3) into shared address `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// One 4-D box from shared address `src` to coordinates (c0 innermost .. c3) of the map's tensor,
// as a bulk async-group operation of the issuing thread (bulk_commit, bulk_wait_read below).
// The TMA writes only the box's elements inside the tensor: rows and columns past its dims are
// dropped.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// Dynamic shared memory one CTA may have on sm_90 (227 KB): both Hopper kernels size their stages by it.
constexpr int kSm90MaxSmem = 232448;
constexpr int kRegistersPerSm = 65536;  // the register file a CTA of one per SM shares out
constexpr int kRegisterGranule = 8;      // setmaxnreg counts are multiples of 8

// The registers each consumer warpgroup of a warp-specialised CTA (one producer warpgroup giving
// up all but `producer_registers`, `consumers` consumer warpgroups, one CTA per SM) may take.
// The launch gives every thread the register file over the CTA's threads in whole granules (168
// with two consumers, 128 with three); setmaxnreg hands what the producer gives up to the
// consumers, and an increase past that pool waits forever.
__host__ __device__ constexpr int consumer_registers(int consumers, int producer_registers) {
  const int warpgroups = consumers + 1;
  const int at_launch = kRegistersPerSm / (kWarpgroupThreads * warpgroups) / kRegisterGranule * kRegisterGranule;
  return (at_launch * warpgroups - producer_registers) / consumers / kRegisterGranule * kRegisterGranule;
}

// Hand registers between warpgroups (sm_90a): the producer gives its own up, the consumers take
// them. Every warp of a warpgroup executes the same one.
template <int REGISTERS>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}
template <int REGISTERS>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}

// The lane's cp.async copies issued so far arrive on `bar` once they have landed. The barrier's
// expected count includes this arrival (.noinc), so a lane that loads a stage's small rows by
// cp.async completes the stage with the TMA bytes without waiting for its own copies.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Named barriers over `threads` threads (id 0 is __syncthreads): sync waits for the count,
// arrive counts itself without waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Whether `pred` holds in any of the `threads` threads that meet at named barrier `id` (a barrier
// with an OR reduction: each waits for all and gets the same answer).
__device__ __forceinline__ bool named_barrier_any(int id, int threads, bool pred) {
  u32 any;
  asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %1, 0;\n barrier.cta.red.or.pred p, %2, %3, p;\n"
               " selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(any)
               : "r"(static_cast<u32>(pred)), "r"(id), "r"(threads)
               : "memory");
  return any != 0;
}

// ---------------------------------------------------------------------------------------------
// Bulk reductions from shared to global memory, and the global semaphores that order them.
//
// cp.reduce.async.bulk adds `bytes` (a multiple of 16, both addresses 16-byte aligned) of fp32
// from shared memory into global memory element by element, in L2, as one asynchronous
// operation of the issuing thread: one instruction per tile instead of one atomic per element
// pair. Its bulk async-group completes in two steps: `.read` once the shared source may be
// overwritten, plain once the global writes are performed.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, u32 smem, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem),
               "r"(bytes)
               : "memory");
}
// cp.async.bulk copies `bytes` (same rules) from shared to global memory, in the same bulk
// async-group as the reductions: the first reduction into a slot can store instead of adding to
// zeros, so the slot needs no memset.
__device__ __forceinline__ void bulk_store(float* gmem, u32 smem, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most N of this thread's bulk groups still read their shared source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// At most N of this thread's bulk groups are not yet complete (global writes performed).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy and async-proxy accesses to global memory (the bulk
// reductions run in the async proxy, the semaphores in the generic one).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// nanoseconds between two reads of a semaphore that is not yet ours: short against a tile's
// reduction, long enough to keep the spinning thread off the L2 port
constexpr int kSemaphoreBackoffNs = 64;

// Reads of a semaphore before a waiter gives up: at least kSemaphoreBackoffNs apart plus an L2
// round trip each, so between about 2 s and 20 s, where a legitimate wait (for an earlier CTA
// to reach the same tile) lasts microseconds to milliseconds. A value that never comes is a bug
// in the ordering (or an earlier CTA that faulted); the caller turns it into a launch error.
constexpr int kSemaphoreMaxSpins = 1 << 25;

// Spin until the global semaphore reads `value` (acquire, GPU scope): true when it did, false
// when it had not after kSemaphoreMaxSpins reads; the caller traps. (A trap inside the spin
// loop, on the consumers' divergent path, made ptxas serialise the sm_90a backward's wgmma and
// spill 2 KB; its dQ writer lane traps on the result instead.)
__device__ __forceinline__ bool semaphore_wait_equal(const int* sem, int value) {
  for (int spins = 0; spins < kSemaphoreMaxSpins; ++spins) {
    int seen;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
    if (seen == value) return true;
    __nanosleep(kSemaphoreBackoffNs);
  }
  return false;
}
// Add one to the global semaphore, releasing this thread's earlier writes (GPU scope).
__device__ __forceinline__ void semaphore_increment(int* sem) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}

}  // namespace cuattn
