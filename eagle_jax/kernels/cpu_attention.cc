// Attention of new queries over each row's cached prefix, for XLA:CPU through the XLA FFI
// (built into the same library as cpu_matmul.cc): a few queries a head on the decode path
// (decode and verify), many in tiles on the tiled path (prefill chunks, causal, through
// the eagle_prefill_attention target; see below).
//
// Why: XLA's blocked loop over the cache (model.prefix_attention) visits every row up to
// the batch's longest prefix and runs the tiny per-(row, head) products as batched dots
// with transposed copies of each block. At batch 64 over a 384-slot cache that cost
// SmolLM2's decode step 1.8x its short-prefix time (270 -> 480 ms, 2-core Xeon), more than
// the weight products. Here each (row, kv head) reads only its own prefix, once, straight
// from the cache layout, with every query of the head group accumulating in one pass.
//
// Output: the online-softmax state of the prefix part -- running max m, denominator l
// and unnormalised accumulator acc per query -- which the caller merges with the new
// tokens' part (model.prefix_attention). A query's result depends only on its own
// vector and the row's prefix, never on how many other queries share the call, so a
// plain step and a verify step agree bit for bit on a shared query.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int AW = 16;
#else
constexpr int AW = 8;
#endif
// Naturally aligned vector types: unaligned memory is read and written only through
// aload/astore (memcpy, one unaligned vector move). Declared under-aligned (aligned(4)),
// GCC 12's AVX2 build kept every such local on the stack, copying each load through it
// as two 16-byte stores and a 32-byte load, a store-forwarding stall each: the prefill
// path ran at 1.6-3.7 GFLOP/s on a 2-core Zen 3 and made a 128-token chunk at 512
// tokens of prefix 6x slower than XLA's attention; naturally aligned, 56 GFLOP/s on
// one core, with the same bits. (The AVX-512 build did not show it.)
typedef float af __attribute__((vector_size(AW * 4)));
typedef int32_t ai __attribute__((vector_size(AW * 4)));

constexpr int kChunk = 64;      // slots scored before their softmax update
constexpr int64_t kPF = 16;     // slots of keys prefetched ahead on the decode path
constexpr int kMaxQ = 64;       // queries per (row, kv head): T * G
constexpr int kMaxQA = 128;     // queries of a decode unit's heads together
constexpr int kMaxD = 256;      // head dimension

inline af aload(const float* p) { af v; std::memcpy(&v, p, sizeof(af)); return v; }
inline void astore(float* p, af v) { std::memcpy(p, &v, sizeof(af)); }

// Lane sum by halving (a fixed order, so a fixed result): log2(AW) shuffle-adds, not a
// serial chain of AW - 1 scalar adds.
inline float hsum(af v) {
#if defined(__AVX512F__)
  v += __builtin_shuffle(v, ai{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#endif
  v += __builtin_shuffle(v, ai{4, 5, 6, 7, 0, 1, 2, 3
#if defined(__AVX512F__)
                               , 12, 13, 14, 15, 8, 9, 10, 11
#endif
                         });
  v += __builtin_shuffle(v, ai{2, 3, 0, 1, 6, 7, 4, 5
#if defined(__AVX512F__)
                               , 10, 11, 8, 9, 14, 15, 12, 13
#endif
                         });
  return v[0] + v[1];
}

// exp(x) for x <= 0 (scores minus their running max), Cephes' single-precision
// polynomial after range reduction by ln 2: about 1 ulp. Below -87 the result is 0.
inline af vexp(af x) {
  const af lo = af{} - 87.0f;
  ai under = x < lo;
  x = x < lo ? lo : x;
  af fx = x * 1.44269504088896341f + 0.5f;
  ai n = __builtin_convertvector(fx, ai);
  af fn = __builtin_convertvector(n, af);
  n = fn > fx ? n - 1 : n;  // truncation toward zero -> floor
  fn = __builtin_convertvector(n, af);
  x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
  af z = x * x;
  af y = 1.9875691500e-4f + af{};
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  ai bits = (n + 127) << 23;
  af scale;
  std::memcpy(&scale, &bits, sizeof(af));
  y = y * scale;
  af zero = af{};
  return under ? zero : y;
}

struct Dims {
  int64_t B, T, KV, G, D, S;
  // A cache of every layer, [B, L, S, KV, D] (a target bound with its layers stacked):
  // this call reads layer ``layer``, whose slots are contiguous per row as in one layer's
  // [B, S, KV, D] (L = 1, layer = 0).
  int64_t L = 1, layer = 0;
  int64_t slot_stride() const { return KV * D; }
  int64_t offset(int64_t b, int64_t h) const { return (((b * L + layer) * S) * KV + h) * D; }
};

// The decode path's online-softmax update of one query over a chunk of n scores
// si[0..n-1]: si becomes exp(score - new max), the denominator l and accumulator acc_i
// [nv vectors] are rescaled to the new max m. (The tiled path updates a query a lane.)
inline void softmax_update(float* si, int64_t n, float& m, float& l, float* acc_i, int64_t nv) {
  float mx = m;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, si[j]);
  const float corr = std::exp(m - mx);  // 0 on the first chunk (m = -inf)
  af tot = af{};
  int64_t j = 0;
  for (; j + AW <= n; j += AW) {
    af p = vexp(aload(si + j) - mx);
    astore(si + j, p);
    tot += p;
  }
  float rest = 0.f;
  if (j < n) {  // the tail: pad with the max so the padding lanes are exp(0), then dropped
    alignas(64) float tmp[AW];
    for (int64_t u = 0; u < AW; ++u) tmp[u] = j + u < n ? si[j + u] - mx : 0.f;
    af p = vexp(aload(tmp));
    for (int64_t u = 0; j + u < n; ++u) { si[j + u] = p[u]; rest += p[u]; }
  }
  l = l * corr + (hsum(tot) + rest);
  m = mx;
  if (corr != 1.f)
    for (int64_t v = 0; v < nv; ++v) astore(acc_i + v * AW, aload(acc_i + v * AW) * corr);
}

// acc[0 .. nv vectors] += sum_j p[j] * value row j (at vj + j * row_stride), over n slots
// in order: VB accumulator vectors held in registers at a time, each element the same
// sequence of fused multiply-adds as slot by slot through memory.
template <int VB>
inline void values(const float* p, const float* vj0, int64_t row_stride, int64_t n, float* acc, int64_t nv) {
  for (int64_t v0 = 0; v0 < nv; v0 += VB) {
    af r[VB];
#pragma GCC unroll 8
    for (int u = 0; u < VB; ++u) r[u] = aload(acc + (v0 + u) * AW);
    const float* vj = vj0 + v0 * AW;
    for (int64_t j = 0; j < n; ++j, vj += row_stride) {
      const float pj = p[j];
#pragma GCC unroll 8
      for (int u = 0; u < VB; ++u) r[u] += pj * aload(vj + u * AW);
    }
#pragma GCC unroll 8
    for (int u = 0; u < VB; ++u) astore(acc + (v0 + u) * AW, r[u]);
  }
}

// One row b and kv heads h0 .. h0 + nh - 1: queries q[b, t, h, g, :] for every (t, g),
// slots lo..hi-1 of k/v[b, :, h, :]. Writes m, l [nq] and acc [nq, D] of head h0 + e at
// m_out/l_out + e * hstride * nq and acc_out + e * hstride * nq * D, query index g * T + t
// (the caller's [.., G, T] layout, so it needs no transpose).
//
// Several heads a unit read a slot's keys and values for all of them together, 768
// contiguous bytes for SmolLM2 (a single head's are a third of each slot, strided): on a
// 2-core Zen 3 the strided reads ran 1.6x slower for the same bytes. Each query's
// arithmetic is the same whichever heads share its unit (its own chains of fused
// multiply-adds, in slot order), so its bits do not depend on the grouping.
void unit(const Dims& d, const float* q, const float* kc, const float* vc, int64_t lo, int64_t hi, int64_t b,
          int64_t h0, int64_t nh, float* m_out, float* l_out, float* acc_out, int64_t hstride) {
  const int64_t nq = d.T * d.G, nqa = nh * nq, D = d.D, nv = D / AW;
  // Per-thread scratch (288 KiB: too much for a pool thread's stack to take lightly).
  alignas(64) static thread_local float qs[kMaxQA * kMaxD];
  alignas(64) static thread_local float acc[kMaxQA * kMaxD];
  alignas(64) static thread_local float s[kMaxQA * kChunk];
  static thread_local float m[kMaxQA], l[kMaxQA];
  for (int64_t e = 0; e < nh; ++e)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t g = 0; g < d.G; ++g)
        std::memcpy(qs + (e * nq + g * d.T + t) * D, q + (((b * d.T + t) * d.KV + h0 + e) * d.G + g) * D, D * sizeof(float));
  std::fill(acc, acc + nqa * D, 0.f);
  std::fill(m, m + nqa, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nqa, 0.f);
  const int64_t row_stride = d.slot_stride();  // between slots
  const float* kb = kc + d.offset(b, h0);
  const float* vb = vc + d.offset(b, h0);
  const int64_t span = nh * D;  // the unit's floats of a slot, contiguous
  for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, hi - j0);
    // Scores four slots at a time: four independent accumulator chains per query, each
    // query vector element loaded once for the four. Each score is the same chain (fused
    // multiply-adds over the vectors in order, then hsum) as a slot alone, the tail's,
    // so its bits do not depend on where the blocks of four fall. The chunk's values
    // are prefetched meanwhile, in address order, for the value pass below.
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      // Keys kPF slots ahead (past the prefix the address is only a hint: x86 prefetches
      // never fault; formed as an integer so no out-of-range pointer exists).
      const uintptr_t kp = reinterpret_cast<uintptr_t>(kb + (j0 + j) * row_stride) + sizeof(float) * uintptr_t(kPF * row_stride);
      const float* vp = vb + (j0 + j) * row_stride;
      for (int r = 0; r < 4; ++r)
        for (int64_t c = 0; c < span; c += 16) {
          __builtin_prefetch(reinterpret_cast<const void*>(kp + sizeof(float) * uintptr_t(r * row_stride + c)), 0, 3);
          __builtin_prefetch(vp + r * row_stride + c, 0, 3);
        }
      for (int64_t e = 0; e < nh; ++e) {
        const float* k0 = kb + (j0 + j) * row_stride + e * D;
        for (int64_t i = 0; i < nq; ++i) {
          const float* qi = qs + (e * nq + i) * D;
          af a0 = af{}, a1 = af{}, a2 = af{}, a3 = af{};
          for (int64_t v = 0; v < nv; ++v) {
            const af qv = aload(qi + v * AW);
            a0 += qv * aload(k0 + v * AW);
            a1 += qv * aload(k0 + row_stride + v * AW);
            a2 += qv * aload(k0 + 2 * row_stride + v * AW);
            a3 += qv * aload(k0 + 3 * row_stride + v * AW);
          }
          float* si = s + (e * nq + i) * kChunk + j;
          si[0] = hsum(a0), si[1] = hsum(a1), si[2] = hsum(a2), si[3] = hsum(a3);
        }
      }
    }
    for (; j < n; ++j) {
      for (int64_t e = 0; e < nh; ++e) {
        const float* kj = kb + (j0 + j) * row_stride + e * D;
        for (int64_t i = 0; i < nq; ++i) {
          const float* qi = qs + (e * nq + i) * D;
          af a = af{};
          for (int64_t v = 0; v < nv; ++v) a += aload(qi + v * AW) * aload(kj + v * AW);
          s[(e * nq + i) * kChunk + j] = hsum(a);
        }
      }
    }
    for (int64_t i = 0; i < nqa; ++i) softmax_update(s + i * kChunk, n, m[i], l[i], acc + i * D, nv);
    // Values (``values``), a query at a time; the chunk's values are in cache by now.
    for (int64_t e = 0; e < nh; ++e) {
      const float* ve = vb + j0 * row_stride + e * D;
      for (int64_t i = e * nq; i < (e + 1) * nq; ++i) {
        if (nv % 8 == 0) values<8>(s + i * kChunk, ve, row_stride, n, acc + i * D, nv);
        else if (nv % 4 == 0) values<4>(s + i * kChunk, ve, row_stride, n, acc + i * D, nv);
        else values<1>(s + i * kChunk, ve, row_stride, n, acc + i * D, nv);
      }
    }
  }
  for (int64_t e = 0; e < nh; ++e) {
    std::memcpy(m_out + e * hstride * nq, m + e * nq, nq * sizeof(float));
    std::memcpy(l_out + e * hstride * nq, l + e * nq, nq * sizeof(float));
    std::memcpy(acc_out + e * hstride * nq * D, acc + e * nq * D, nq * D * sizeof(float));
  }
}

// The decode path splits a row's prefix into blocks of kSplit slots at fixed positions
// (0, kSplit, 2 kSplit, ...), each block a unit of its own, merged afterwards in block
// order: at batch 1 a step has only KV (row, head) units, 3 for SmolLM2 over 2 threads,
// so one thread did twice the other's work, and over 1,000 slots a plain step spent 8 ms
// in attention. The blocks do not depend on the batch, the query count or the threads, so
// a query's bits still depend only on its vector and its row's prefix; a prefix of at
// most kSplit slots is one block, computed as before.
constexpr int64_t kSplit = 256;

inline int64_t blocks_of(int64_t len) { return std::max<int64_t>(1, (len + kSplit - 1) / kSplit); }

// Merges the online-softmax states of nb blocks (m, l [nb, nq], acc [nb, nq, D]), block 0
// first, into one (m_out, l_out [nq], acc_out [nq, D]).
void merge_blocks(int64_t nb, int64_t nq, int64_t D, const float* m, const float* l, const float* acc, float* m_out,
                  float* l_out, float* acc_out) {
  const int64_t nv = D / AW;
  for (int64_t i = 0; i < nq; ++i) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < nb; ++k) mx = std::max(mx, m[k * nq + i]);
    float tot = 0.f;
    float* out = acc_out + i * D;
    for (int64_t k = 0; k < nb; ++k) {
      const float c = std::exp(m[k * nq + i] - mx);  // each block holds a slot: its m is finite
      tot += l[k * nq + i] * c;
      const float* a = acc + (k * nq + i) * D;
      for (int64_t v = 0; v < nv; ++v) astore(out + v * AW, (k ? aload(out + v * AW) : af{}) + aload(a + v * AW) * c);
    }
    m_out[i] = mx;
    l_out[i] = tot;
  }
}

// The tiled path, for a prefill chunk's many queries (T * G > kMaxQ): a head's queries in
// tiles of kMaxQ, each a unit of its own (a batch-1 chunk has only KV heads to spread over
// the threads otherwise). A tile is held transposed -- query vectors of AW lanes, one
// query a lane -- so the scores (a key element broadcast against kQV query vectors, over
// kJB slots at once), the softmax (lane-wise: no lane sums) and the value products (a
// value element broadcast against the probabilities of kQV query vectors) all run as
// register-blocked small matrix products straight from the cache layout, with nothing
// transposed per chunk of slots. Lanes never mix, so a query's bits depend on its own
// vector and its row's prefix only. The arithmetic differs from the decode path's, so
// the execution plan sends only prefill chunks here (cpu_matmul.ATTENTION_PREFILL_MIN_TOKENS).
constexpr int kQV = kMaxQ / AW;         // query vectors per tile
constexpr int kTileSlots = 128;         // slots scored before each softmax update (64 and 256: no faster)
constexpr int kJB = AW == 16 ? 4 : 1;   // slots (scores) or head-dim elements (values) per block

// sT[j, :] = q . key[j] for kJB slots j (kJB * kQV accumulators).
template <int JB>
inline void tile_scores(const float* qT, const float* kj, int64_t row_stride, int64_t D, float* sT) {
  af a[JB][kQV];
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < kQV; ++v) a[j][v] = af{};
  for (int64_t dd = 0; dd < D; ++dd) {
    af qv[kQV];
    for (int v = 0; v < kQV; ++v) qv[v] = aload(qT + dd * kMaxQ + v * AW);
    for (int j = 0; j < JB; ++j) {
      const af kv = af{} + kj[j * row_stride + dd];
      for (int v = 0; v < kQV; ++v) a[j][v] += kv * qv[v];
    }
  }
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < kQV; ++v) astore(sT + j * kMaxQ + v * AW, a[j][v]);
}

// accT[dd .. dd+kJB, :] += sum_j pT[j, :] * value[j, dd ..] over n slots.
inline void tile_values(const float* pT, const float* vb, int64_t row_stride, int64_t n, float* accT, int64_t dd) {
  af a[kJB][kQV];
  for (int e = 0; e < kJB; ++e)
    for (int v = 0; v < kQV; ++v) a[e][v] = aload(accT + (dd + e) * kMaxQ + v * AW);
  for (int64_t j = 0; j < n; ++j) {
    af pv[kQV];
    for (int v = 0; v < kQV; ++v) pv[v] = aload(pT + j * kMaxQ + v * AW);
    const float* vj = vb + j * row_stride + dd;
    for (int e = 0; e < kJB; ++e) {
      const af x = af{} + vj[e];
      for (int v = 0; v < kQV; ++v) a[e][v] += x * pv[v];
    }
  }
  for (int e = 0; e < kJB; ++e)
    for (int v = 0; v < kQV; ++v) astore(accT + (dd + e) * kMaxQ + v * AW, a[e][v]);
}

// Queries q0 .. q0 + nqt - 1 (index g * T + t) of (row b, kv head h) over slots 0..len-1,
// or, causal, query t over slots 0..len+t (the chunk's own keys, already in the cache at
// len + t, included): the whole of a prefill chunk's attention.
void tile_unit(const Dims& d, const float* q, const float* kc, const float* vc, int64_t len, int64_t b, int64_t h,
               int64_t q0, int64_t nqt, bool causal, float* m_out, float* l_out, float* acc_out) {
  const int64_t D = d.D, nq = d.T * d.G;
  alignas(64) static thread_local int32_t lim[kMaxQ];  // slots each lane sees
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;  // the lanes' fewest and most slots
  for (int64_t r = 0; r < kMaxQ; ++r) {
    const int64_t t = (q0 + std::min<int64_t>(r, nqt - 1)) % d.T;  // lanes past the tile repeat the last query's limit
    lim[r] = static_cast<int32_t>(causal ? std::min<int64_t>(len + t + 1, d.S) : len);
    lo = std::min<int64_t>(lo, lim[r]);
    hi = std::max<int64_t>(hi, lim[r]);
  }
  len = hi;  // slots lo.. are masked lane by lane (none without causal: every lane sees len)
  alignas(64) static thread_local float qT[kMaxD * kMaxQ];
  alignas(64) static thread_local float accT[kMaxD * kMaxQ];
  alignas(64) static thread_local float sT[kTileSlots * kMaxQ];
  alignas(64) static thread_local float m[kMaxQ], l[kMaxQ];
  std::fill(qT, qT + D * kMaxQ, 0.f);  // lanes past the tile: zero queries, never written out
  for (int64_t r = 0; r < nqt; ++r) {
    const int64_t i = q0 + r, g = i / d.T, t = i % d.T;
    const float* qi = q + (((b * d.T + t) * d.KV + h) * d.G + g) * D;
    for (int64_t dd = 0; dd < D; ++dd) qT[dd * kMaxQ + r] = qi[dd];
  }
  std::fill(accT, accT + D * kMaxQ, 0.f);
  std::fill(m, m + kMaxQ, -std::numeric_limits<float>::infinity());
  std::fill(l, l + kMaxQ, 0.f);
  const int64_t row_stride = d.slot_stride();  // between slots
  const float* kb = kc + d.offset(b, h);
  const float* vb = vc + d.offset(b, h);
  for (int64_t j0 = 0; j0 < len; j0 += kTileSlots) {
    const int64_t n = std::min<int64_t>(kTileSlots, len - j0);
    int64_t j = 0;
    for (; j + kJB <= n; j += kJB) tile_scores<kJB>(qT, kb + (j0 + j) * row_stride, row_stride, D, sT + j * kMaxQ);
    for (; j < n; ++j) tile_scores<1>(qT, kb + (j0 + j) * row_stride, row_stride, D, sT + j * kMaxQ);
    if (j0 + n > lo) {  // causal: slots past a lane's limit score -inf (its probability is 0)
      const af ninf = af{} - std::numeric_limits<float>::infinity();
      for (j = 0; j < n; ++j) {
        const ai slot = ai{} + static_cast<int32_t>(j0 + j);
        for (int v = 0; v < kQV; ++v) {
          ai lv;
          std::memcpy(&lv, lim + v * AW, sizeof(ai));
          astore(sT + j * kMaxQ + v * AW, slot < lv ? aload(sT + j * kMaxQ + v * AW) : ninf);
        }
      }
    }
    for (int v = 0; v < kQV; ++v) {  // the online softmax, a query a lane
      const af m_old = aload(m + v * AW);
      af mx = m_old;
      for (j = 0; j < n; ++j) {
        const af x = aload(sT + j * kMaxQ + v * AW);
        mx = x > mx ? x : mx;
      }
      const af corr = vexp(m_old - mx);  // 0 on the first chunk (m = -inf)
      af tot = af{};
      for (j = 0; j < n; ++j) {
        const af p = vexp(aload(sT + j * kMaxQ + v * AW) - mx);
        astore(sT + j * kMaxQ + v * AW, p);
        tot += p;
      }
      astore(l + v * AW, aload(l + v * AW) * corr + tot);
      astore(m + v * AW, mx);
      for (int64_t dd = 0; dd < D; ++dd) astore(accT + dd * kMaxQ + v * AW, aload(accT + dd * kMaxQ + v * AW) * corr);
    }
    for (int64_t dd = 0; dd < D; dd += kJB) tile_values(sT, vb + j0 * row_stride, row_stride, n, accT, dd);
  }
  const int64_t base = (b * d.KV + h) * nq + q0;
  std::memcpy(m_out + base, m, nqt * sizeof(float));
  std::memcpy(l_out + base, l, nqt * sizeof(float));
  for (int64_t r = 0; r < nqt; ++r)
    for (int64_t dd = 0; dd < D; ++dd) acc_out[(base + r) * D + dd] = accT[dd * kMaxQ + r];
}

// Units claimed from a counter by the caller and any pool helper that gets to run (as in
// cpu_matmul.cc: a helper still queued never holds the call up).
struct AttnJob {
  Dims d;
  const float *q, *k, *v;
  const int32_t* lens;
  float *m, *l, *acc;
  int64_t units, chunks, tiles;  // tiled: units per (row, kv head)
  bool tiled, causal;            // the tiled path; causal: the chunk's own keys too (prefill)
  // The decode path's units: row b's are first_unit[b] .. first_unit[b + 1] - 1, a
  // (group of ``heads`` kv heads, block) each; a row of several blocks writes them to
  // the partial states (pm, pl, pacc; head h's block blk at first_partial[b] + h * nb +
  // blk), merged by the caller.
  std::vector<int64_t> first_unit, first_partial;
  int64_t heads = 1;  // kv heads a decode unit takes
  float *pm = nullptr, *pl = nullptr, *pacc = nullptr;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    const int64_t nq = d.T * d.G;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      for (int64_t u = units * c / chunks; u < units * (c + 1) / chunks; ++u) {
        if (!tiled) {
          // Row b's units: (head group g, block blk) at first_unit[b] + g * nb + blk.
          const int64_t b = std::upper_bound(first_unit.begin(), first_unit.end(), u) - first_unit.begin() - 1;
          const int64_t len = std::clamp<int64_t>(lens[b], 0, d.S), nb = blocks_of(len);
          const int64_t g = (u - first_unit[b]) / nb, blk = (u - first_unit[b]) % nb, h0 = g * heads;
          if (nb == 1) {
            const int64_t base = (b * d.KV + h0) * nq;
            unit(d, q, k, v, 0, len, b, h0, heads, m + base, l + base, acc + base * d.D, 1);
          } else {  // partial states at (first_partial[b] + h * nb + blk) * nq
            const int64_t pu = first_partial[b] + h0 * nb + blk;
            unit(d, q, k, v, blk * kSplit, std::min(len, (blk + 1) * kSplit), b, h0, heads, pm + pu * nq, pl + pu * nq,
                 pacc + pu * nq * d.D, nb);
          }
        } else {
          const int64_t b = u / (d.KV * tiles), h = u / tiles % d.KV, tile = u % tiles;
          const int64_t len = std::clamp<int64_t>(lens[b], 0, d.S);
          const int64_t q0 = tile * kMaxQ;
          tile_unit(d, q, k, v, len, b, h, q0, std::min<int64_t>(kMaxQ, d.T * d.G - q0), causal, m, l, acc);
        }
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// ``layer``: null for k/v [B, S, KV, D]; else a scalar, and k/v are [B, L, S, KV, D].
ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::S32> lens, const ffi::Buffer<ffi::S32>* layer, ffi::ResultBuffer<ffi::F32> m,
                     ffi::ResultBuffer<ffi::F32> l, ffi::ResultBuffer<ffi::F32> acc, bool causal) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), ld = lens.dimensions();
  const size_t kr = layer ? 5 : 4;
  if (qd.size() != 5 || kd.size() != kr || vd.size() != kr || ld.size() != 1)
    return ffi::Error::InvalidArgument(
        "eagle_prefix_attention: expects q [B,T,KV,G,D], k/v [B,S,KV,D] (or [B,L,S,KV,D] with a layer), lens [B]");
  Dims d{qd[0], qd[1], qd[2], qd[3], qd[4], kd[layer ? 2 : 1]};
  for (size_t i = 0; i < kr; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("eagle_prefix_attention: k and v shapes differ");
  if (layer) {
    if (layer->element_count() != 1) return ffi::Error::InvalidArgument("eagle_prefix_attention: layer must be a scalar");
    d.L = kd[1];
    d.layer = layer->typed_data()[0];
    if (d.layer < 0 || d.layer >= d.L) return ffi::Error::InvalidArgument("eagle_prefix_attention: layer out of range");
  }
  if (kd[0] != d.B || kd[kr - 2] != d.KV || kd[kr - 1] != d.D || ld[0] != d.B)
    return ffi::Error::InvalidArgument("eagle_prefix_attention: q, k/v and lens disagree on B, KV or D");
  if (d.D > kMaxD || d.D % AW)
    return ffi::Error::InvalidArgument("eagle_prefix_attention: needs D <= 256 and D a multiple of the vector width");
  const int64_t nq = d.T * d.G;
  const bool tiled = causal || nq > kMaxQ;  // else the decode path, one unit a head
  const int64_t tiles = tiled ? (nq + kMaxQ - 1) / kMaxQ : 1;
  const auto md = m->dimensions(), ad = acc->dimensions();
  if (md.size() != 3 || md[0] != d.B || md[1] != d.KV || md[2] != nq || ad.size() != 4 || ad[3] != d.D)
    return ffi::Error::InvalidArgument("eagle_prefix_attention: outputs must be m, l [B,KV,G*T] and acc [B,KV,G*T,D]");
  auto job = std::make_shared<AttnJob>();
  int64_t units = d.B * d.KV * tiles;
  bool split = false;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (!tiled) {
    // All of a row's kv heads in one unit where those units, (row, block) pairs, are
    // enough to share out over the threads (and there is scratch for their queries);
    // else a unit a head.
    int64_t blocks = 0;
    for (int64_t b = 0; b < d.B; ++b) blocks += blocks_of(std::clamp<int64_t>(lens.typed_data()[b], 0, d.S));
    if (blocks >= 2 * threads && d.KV * nq <= kMaxQA) job->heads = d.KV;
    const int64_t groups = d.KV / job->heads;
    job->first_unit.resize(d.B + 1);
    job->first_partial.resize(d.B + 1);
    units = 0;
    int64_t partials = 0;
    for (int64_t b = 0; b < d.B; ++b) {
      job->first_unit[b] = units;
      job->first_partial[b] = partials;
      const int64_t nb = blocks_of(std::clamp<int64_t>(lens.typed_data()[b], 0, d.S));
      split |= nb > 1;
      units += groups * nb;
      partials += d.KV * nb;
    }
    job->first_unit[d.B] = units;
    job->first_partial[d.B] = partials;
    if (split) {  // the calling thread's, kept between calls (a fresh large buffer faults its pages in)
      static thread_local std::vector<float> partial;
      if (partial.size() < static_cast<size_t>(partials * nq * (d.D + 2))) partial.resize(partials * nq * (d.D + 2));
      job->pm = partial.data();
      job->pl = job->pm + partials * nq;
      job->pacc = job->pl + partials * nq;
    }
  }
  if (units == 0) return ffi::Error::Success();
  job->d = d;
  job->q = q.typed_data(); job->k = k.typed_data(); job->v = v.typed_data();
  job->lens = lens.typed_data();
  job->m = m->typed_data(); job->l = l->typed_data(); job->acc = acc->typed_data();
  job->units = units;
  job->tiles = tiles;
  job->tiled = tiled;
  job->causal = causal;
  job->chunks = std::min<int64_t>(units, threads == 1 ? 1 : 4 * threads);
  for (int64_t t = 1; t < std::min(threads, job->chunks); ++t) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  if (split) {
    for (int64_t b = 0; b < d.B; ++b) {
      const int64_t nb = blocks_of(std::clamp<int64_t>(lens.typed_data()[b], 0, d.S));
      if (nb == 1) continue;
      for (int64_t h = 0; h < d.KV; ++h) {
        const int64_t u = job->first_partial[b] + h * nb, base = (b * d.KV + h) * nq;
        merge_blocks(nb, nq, d.D, job->pm + u * nq, job->pl + u * nq, job->pacc + u * nq * d.D,
                     m->typed_data() + base, l->typed_data() + base, acc->typed_data() + base * d.D);
      }
    }
  }
  return ffi::Error::Success();
}

// kCausal false: the prefix part of decode and verify attention. kCausal true: a prefill
// chunk's whole attention: lens[b] is the chunk's start, its T keys already in the cache
// from there; query t sees slots 0..lens[b]+t.
template <bool kCausal>
ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lens, ffi::ResultBuffer<ffi::F32> m,
                          ffi::ResultBuffer<ffi::F32> l, ffi::ResultBuffer<ffi::F32> acc) {
  return Attention(pool, q, k, v, lens, nullptr, m, l, acc, kCausal);
}

// The same over one layer of a stacked cache k/v [B, L, S, KV, D] (``layer`` [], int32).
template <bool kCausal>
ffi::Error LayerAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l,
                          ffi::ResultBuffer<ffi::F32> acc) {
  return Attention(pool, q, k, v, lens, &layer, m, l, acc, kCausal);
}

}  // namespace

// q, k, v, lens [, layer] -> m, l, acc.
#define EAGLE_ATTENTION_INPUTS                     \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::Buffer<ffi::F32>>()                \
      .Arg<ffi::Buffer<ffi::F32>>()                \
      .Arg<ffi::Buffer<ffi::F32>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()
#define EAGLE_ATTENTION_OUTPUTS                    \
  .Ret<ffi::Buffer<ffi::F32>>()                    \
      .Ret<ffi::Buffer<ffi::F32>>()                \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_prefix_attention, CacheAttention<false>,
                              EAGLE_ATTENTION_INPUTS EAGLE_ATTENTION_OUTPUTS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_prefill_attention, CacheAttention<true>,
                              EAGLE_ATTENTION_INPUTS EAGLE_ATTENTION_OUTPUTS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_prefix_attention_layer, LayerAttention<false>,
                              EAGLE_ATTENTION_INPUTS.Arg<ffi::Buffer<ffi::S32>>() EAGLE_ATTENTION_OUTPUTS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle_prefill_attention_layer, LayerAttention<true>,
                              EAGLE_ATTENTION_INPUTS.Arg<ffi::Buffer<ffi::S32>>() EAGLE_ATTENTION_OUTPUTS);
