// Float32 matrix products against pre-packed weights, for XLA:CPU through the XLA FFI.
// The weights are float32 or bfloat16 (eagle_packed_matmul_bf16: half the bytes to
// stream, widened exactly to float32 in registers, so the arithmetic is the float32
// kernel's on the rounded weights).
//
// Why: XLA:CPU runs a product of a few rows (a verify forward: 4 to 16 tokens) through a
// general GEMM that re-packs the weights on every call, so 6 rows cost about 2x one row
// although both only have to stream the weights once from memory. Here the weights are
// packed once, at load, into panels of NB columns ([P, K, NB], P = N / NB), and a panel
// is streamed contiguously while MR rows accumulate in registers, so each weight is read
// from memory once per call whatever the row count (at 8 rows the FMAs, not memory,
// then bound it).
//
// Each output element is the same chain of fused multiply-adds over k = 0..K-1, whatever
// the row count, the block a row falls in, or the thread: a row's result does not
// depend on which other rows share the call (plain and verify steps agree bit for bit).
//
// Built by eagle_jax/cpu_matmul.py with -march=native on the machine that runs it.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__)
#include <immintrin.h>
constexpr int VW = 16;  // floats per vector register
constexpr int NV = 4;   // vectors per panel row
constexpr int MR = 6;   // rows per register block: of 32 registers, 24 accumulators, 4 weights
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
constexpr int VW = 8;
constexpr int NV = 2;
constexpr int MR = 6;   // of 16 registers: 12 accumulators, 2 weights, 1 broadcast
#else
constexpr int VW = 8;
constexpr int NV = 2;
constexpr int MR = 6;
#endif
constexpr int NB = NV * VW;      // panel width, in columns
// Panel rows prefetched ahead (48 rows: 12 KiB). With one activation row the loop is a
// pure stream the hardware prefetcher keeps up with; with 4 to 8 rows the FMAs occupy the
// core between loads and the stream stalls without explicit prefetches. Measured (with the
// earlier vector-extension build) on a 2-core Xeon, SmolLM2's 210 body matrices: 6 rows
// 29.3 -> 21-23 ms, 8 rows 35.8 -> 25-29 ms, 1 row unchanged (about 19.5 ms).
constexpr int64_t PF = 48;

// The vector operations, as intrinsics on x86. GCC 12 kept the generic vector-extension
// version's accumulators (an under-aligned vector type loaded through memcpy) on the
// stack: every FMA was a load and a store, and on a 4th-generation Xeon SmolLM2's 210 body
// products (one jitted graph) took 1.6x XLA's own dot on 1 row and on 8 rows; with
// intrinsics, 0.99x and 0.62x (17.4 and 21.2 ms).
// With intrinsics the block's accumulators stay in registers. The arithmetic is the same
// fused multiply-add either way, so results are unchanged bit for bit.
#if defined(__AVX512F__)
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf loadu(const float* p) { return _mm512_loadu_ps(p); }
static inline void storeu(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf splat(float s) { return _mm512_set1_ps(s); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf loadu(const float* p) { return _mm256_loadu_ps(p); }
static inline void storeu(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf splat(float s) { return _mm256_set1_ps(s); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
#else
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
static inline vf vzero() { return vf{}; }
static inline vf loadu(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void storeu(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
static inline vf splat(float s) { return vf{} + s; }
static inline vf fma(vf a, vf b, vf c) { return a * b + c; }  // contracted by -ffp-contract=fast
#endif

// How a panel's weights are stored, and loaded as float32 vectors.
struct F32W {
  using T = float;
  static inline vf load(const float* p) { return loadu(p); }
};
// bfloat16 is the upper half of a float32: shifting its bits up 16 widens it exactly.
struct BF16W {
  using T = uint16_t;
  static inline vf load(const uint16_t* p) {
#if defined(__AVX512F__)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__) && defined(__FMA__)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
    float f[VW];
    for (int i = 0; i < VW; ++i) {
      const uint32_t u = uint32_t(p[i]) << 16;
      std::memcpy(&f[i], &u, 4);
    }
    return loadu(f);
#endif
  }
};

// y[0:R, n0:n0+NB] = x[0:R, :] @ panel, the panel [K, NB] contiguous.
template <int R, class W>
static inline void block(const float* __restrict x, const typename W::T* __restrict panel, float* __restrict y,
                         int64_t K, int64_t N, int64_t n0) {
  vf acc[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    vf wk[NV];
    // Panels lie back to back, so past a panel's end this fetches the next one's start;
    // past the last one the address is only a hint (x86 prefetches never fault), formed
    // as an integer so no out-of-range pointer exists.
    // (A 64-byte line holds 16 floats or 32 bfloat16s: the float32 stride over-fetches
    // the latter by one line in two, which costs nothing measurable.)
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(panel) + sizeof(typename W::T) * uintptr_t((k + PF) * NB);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) __builtin_prefetch(reinterpret_cast<const void*>(ahead + sizeof(typename W::T) * v * VW), 0, 3);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) wk[v] = W::load(panel + k * NB + v * VW);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const vf xs = splat(x[r * K + k]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = fma(xs, wk[v], acc[r][v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) storeu(y + r * N + n0 + v * VW, acc[r][v]);
}

template <int R, class W>
static void rows_tail(const float* x, const typename W::T* panel, float* y, int64_t K, int64_t N, int64_t n0, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) block<R, W>(x, panel, y, K, N, n0);
    else rows_tail<R - 1, W>(x, panel, y, K, N, n0, rows);
  }
}

// Panels p0..p1 for every row.
template <class W>
static void panels(const float* x, const typename W::T* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const typename W::T* panel = w + p * K * NB;
    const int64_t n0 = p * NB;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) block<MR, W>(x + m * K, panel, y + m * N, K, N, n0);
    if (m < M) rows_tail<MR - 1, W>(x + m * K, panel, y + m * N, K, N, n0, M - m);
  }
}

// Work shared with XLA's intra-op thread pool without blocking on it: chunks of panels
// are claimed from a counter by the calling thread and by any helper task that gets to
// run; the caller waits only for chunks a helper has already claimed, so a helper that
// is still queued (every pool thread busy) never holds the call up. The state is shared
// so that a helper which starts after the call returned finds no chunk and leaves.
template <class W>
struct Job {
  const float* x;
  const typename W::T* w;
  float* y;
  int64_t M, K, N, P, chunks;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      panels<W>(x, w, y, M, K, N, P * c / chunks, P * (c + 1) / chunks);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// ``layer``: null for w [P, K, NB]; else a scalar, and w is every layer's panels
// [L, P, K, NB] (a target bound with its layers stacked), of which layer ``layer`` runs.
template <class W, class WBuf>
static ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, WBuf w, const ffi::Buffer<ffi::S32>* layer,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const size_t o = layer ? 1 : 0;  // the layer axis
  if (xd.size() != 2 || wd.size() != 3 + o || wd[2 + o] != NB || wd[1 + o] != xd[1])
    return ffi::Error::InvalidArgument(
        "eagle_packed_matmul: expects x [M, K] and w [P, K, NB] (or [L, P, K, NB] with a layer) with the library's NB");
  const int64_t M = xd[0], K = xd[1], P = wd[o], N = P * NB;
  int64_t first = 0;  // the layer's first panel element
  if (layer) {
    if (layer->element_count() != 1) return ffi::Error::InvalidArgument("eagle_packed_matmul: layer must be a scalar");
    const int64_t i = layer->typed_data()[0];
    if (i < 0 || i >= wd[0]) return ffi::Error::InvalidArgument("eagle_packed_matmul: layer out of range");
    first = i * P * K * NB;
  }
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("eagle_packed_matmul: output must be [M, P * NB]");
  if (M == 0 || P == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread balance the load; a chunk is never less than a panel.
  const int64_t chunks = std::min<int64_t>(P, threads == 1 ? 1 : 4 * threads);
  auto job = std::make_shared<Job<W>>();
  job->x = x.typed_data();
  job->w = reinterpret_cast<const typename W::T*>(w.untyped_data()) + first;
  job->y = y->typed_data();
  job->M = M; job->K = K; job->N = N; job->P = P; job->chunks = chunks;
  for (int64_t t = 1; t < std::min(threads, chunks); ++t) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < chunks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return ffi::Error::Success();
}

static ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                               ffi::ResultBuffer<ffi::F32> y) {
  return Run<F32W>(pool, x, w, nullptr, y);
}

static ffi::Error PackedMatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                                   ffi::ResultBuffer<ffi::F32> y) {
  return Run<BF16W>(pool, x, w, nullptr, y);
}

static ffi::Error PackedMatmulLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Run<F32W>(pool, x, w, &layer, y);
}

static ffi::Error PackedMatmulLayerBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Run<BF16W>(pool, x, w, &layer, y);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_packed_matmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_packed_matmul_bf16, PackedMatmulBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_packed_matmul_layer, PackedMatmulLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_packed_matmul_layer_bf16, PackedMatmulLayerBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The panel width this build packs for (the Python side packs to match).
extern "C" int eagle_packed_matmul_nb() { return NB; }

// The code path this build took (for the start-up line and the doctor).
extern "C" const char* eagle_packed_matmul_isa() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2";
#else
  return "generic vectors";
#endif
}
