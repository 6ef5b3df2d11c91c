// zo_megatron._cpu_adam — the ZeRO-Offload CPU Adam kernel.
//
// One fused, memory-bound pass per chunk:
//   g  = load(grad[i]) * grad_scale            (grad: fp32 | bf16 | fp16)
//   Adam : g += wd * p                         (L2, uses the un-updated param)
//   AdamW: p *= (1 - lr * wd)                  (decoupled decay)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//   out16[i] = rne16(p)                        (optional; bf16 or fp16; may alias grad)
//   with extrapolate: out[i] = (p - p_old) + p (--dpu-weight-prediction's w_t + (w_t - w_{t-1}),
//   two fp32 operations in that order, then RNE; fp32, bf16 or fp16 out; p_old the param read)
// with exp_avg / exp_avg_sq stored in fp32 or bf16 (RNE on store; the update itself uses the
// unrounded fp32 moments of this step).
//
// No torch headers: the Python wrapper passes integer data pointers + dtype codes. The ISA
// (AVX-512 / AVX2+FMA+F16C / portable scalar) is chosen at RUN time from CPUID; the SIMD code is
// compiled with per-function target attributes, never -march=native. The AVX-512 source lives in
// cpu_adam_avx512.inc, included twice (with and without AVX512_BF16 conversions).
// Threads: OpenMP over contiguous 64-element-aligned blocks (see parallel_chunks), software
// prefetch 512 elements ahead. The *_segments entry points take a list of disjoint ranges of the
// same buffers and cut their total into such blocks (see SegPlan): one call and one parallel
// region per optimizer step, however many small segments (biases, LayerNorms) the partition has.
// Numerics: IEEE sqrt; the division m / denom is rcp14 + one Newton step on AVX-512 (~1-2 ulp,
// keeps the divider free for sqrt), an IEEE division elsewhere.
// fp32 -> bf16 / fp16 conversions are round-to-nearest-even and bit-exact with torch's .to().
//
// Aliasing contract: `out16` may be exactly the same buffer as a 16-bit `grad` (the engine reuses
// one pinned host buffer). Every code path loads grad[i] before it stores out16[i] and touches
// only element i for both, so the alias is safe. Out of place (param_out / exp_avg_out /
// exp_avg_sq_out given), element i's new state goes to the out buffers and the inputs are only
// read; each out buffer is either its input (in place) or apart from every other buffer. Other
// overlaps are rejected by the wrapper.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace py = pybind11;

namespace {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Distinct storage tags so templates can dispatch on the 16-bit format.
struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };
struct no_out_t { uint16_t x; };

#define ZO_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")))
#define ZO_AVX512_INLINE ZO_AVX512 inline __attribute__((always_inline))
#define ZO_AVX512BF \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,avx2")))
#define ZO_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZO_AVX2_INLINE ZO_AVX2 inline __attribute__((always_inline))

int g_threads = 1;
int g_isa = kScalar;
// Software prefetch distance in elements (0 = off). With only the hardware prefetchers the
// single-core kernels reached 80-94% of the roofline; prefetching 512 elements ahead into L1
// brought them to 94-98% (measured here, 1 and 2 threads, fp32 and bf16 states).
size_t g_prefetch = 512;
bool g_hw_bf16 = false;  // AVX-512 flavour: AVX512_BF16 conversions when the CPU has them
volatile uint32_t g_sink = 0;  // roofline kernel: keeps read-only streams alive

// ------------------------------------------------------------------------------------------
// Scalar conversions (bit-exact with torch's .to(bfloat16) / .to(float16) for non-NaN values).
// ------------------------------------------------------------------------------------------
inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline uint16_t f32_to_bf16_rne(float f) {
  uint32_t b = f2u(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN -> canonical quiet NaN
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}
inline float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_f16_rne(float f) {
  const uint32_t x = f2u(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return static_cast<uint16_t>(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                       // below 2^-14: fp16 subnormal or zero
    if (ax <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 (tie -> even 0)
    const uint32_t e = ax >> 23;                // 103..112
    const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;            // 14..23
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t rebased = ax - (112u << 23);   // exponent bias 127 -> 15
  uint32_t h = rebased >> 13;
  const uint32_t rem = rebased & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent: fine
  return static_cast<uint16_t>(sign | h);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (e == 0x1F) return u2f(sign | 0x7F800000u | (mant << 13));
  if (e == 0) {
    if (mant == 0) return u2f(sign);
    float r = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -r : r;
  }
  return u2f(sign | ((e + 112u) << 23) | (mant << 13));
}

inline float sload(const float* p, size_t i) { return p[i]; }
inline float sload(const bf16_t* p, size_t i) { return bf16_to_f32(p[i].x); }
inline float sload(const f16_t* p, size_t i) { return f16_to_f32(p[i].x); }
inline void sstore(float* p, size_t i, float v) { p[i] = v; }
inline void sstore(bf16_t* p, size_t i, float v) { p[i].x = f32_to_bf16_rne(v); }
inline void sstore(f16_t* p, size_t i, float v) { p[i].x = f32_to_f16_rne(v); }

// Prefetch (into L1) the cache lines of 64 elements of every input stream, starting at element i.
// Written-only streams (a separate out16) are not prefetched; an aliased out16 is the grad stream.
// always_inline: as an out-of-line function GCC deems it pure (a prefetch has no visible effect)
// and deletes the calls.
template <class GT, class ST>
inline __attribute__((always_inline)) void prefetch64(const float* p, const GT* g, const ST* m,
                                                      const ST* v, size_t i) {
  const char* pp = reinterpret_cast<const char*>(p + i);
  const char* gp = reinterpret_cast<const char*>(g + i);
  const char* mp = reinterpret_cast<const char*>(m + i);
  const char* vp = reinterpret_cast<const char*>(v + i);
  for (size_t off = 0; off < 64 * sizeof(float); off += 64) _mm_prefetch(pp + off, _MM_HINT_T0);
  for (size_t off = 0; off < 64 * sizeof(GT); off += 64) _mm_prefetch(gp + off, _MM_HINT_T0);
  for (size_t off = 0; off < 64 * sizeof(ST); off += 64) {
    _mm_prefetch(mp + off, _MM_HINT_T0);
    _mm_prefetch(vp + off, _MM_HINT_T0);
  }
}

// ------------------------------------------------------------------------------------------
// Hyper-parameters, folded once per call (double precision, then rounded to fp32).
// ------------------------------------------------------------------------------------------
struct Hyper {
  float b1, omb1, b2, omb2, eps, step_size, inv_sqrt_bc2, decay, wd_l2, gscale;
  bool extrapolate = false;  // out = (p - p_old) + p instead of p (weight prediction)
};

Hyper make_hyper(long long step, double lr, double beta1, double beta2, double eps, double wd,
                 bool adamw, bool bias_correction, double grad_scale) {
  double bc1 = 1.0, bc2 = 1.0;
  if (bias_correction) {
    bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  Hyper h;
  h.b1 = static_cast<float>(beta1);
  h.omb1 = static_cast<float>(1.0 - beta1);
  h.b2 = static_cast<float>(beta2);
  h.omb2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.step_size = static_cast<float>(lr / bc1);
  h.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  h.decay = static_cast<float>(adamw ? 1.0 - lr * wd : 1.0);
  h.wd_l2 = static_cast<float>(adamw ? 0.0 : wd);
  h.gscale = static_cast<float>(grad_scale);
  return h;
}

// One element; shared by the scalar path and the AVX2 tail.
// The state streams: read from (p, m, v), the new values written to (pw, mw, vw). In place, the
// write pointers are the read pointers (the default); out of place they are other buffers of the
// same size and type (--overlap-cpu-step's alternate state). Same arithmetic either way: only the
// store addresses differ, so both give the same bits.
template <class ST>
struct State {
  const float* p;
  const ST* m;
  const ST* v;
  float* pw;
  ST* mw;
  ST* vw;
  State at(size_t s) const { return {p + s, m + s, v + s, pw + s, mw + s, vw + s}; }
};

template <bool L2, class GT, class ST, class OT>
inline void adam_elem(const Hyper& h, const State<ST>& st, const GT* g, OT* o, size_t i) {
  float gi = sload(g, i) * h.gscale;
  const float p_old = st.p[i];
  float pi = p_old;
  if (L2) gi = gi + h.wd_l2 * pi;
  const float mi = h.b1 * sload(st.m, i) + h.omb1 * gi;
  const float vi = h.b2 * sload(st.v, i) + (h.omb2 * gi) * gi;
  const float denom = std::sqrt(vi) * h.inv_sqrt_bc2 + h.eps;
  pi = pi * h.decay - h.step_size * (mi / denom);
  st.pw[i] = pi;
  sstore(st.mw, i, mi);
  sstore(st.vw, i, vi);
  if constexpr (!std::is_same<OT, no_out_t>::value) sstore(o, i, h.extrapolate ? (pi - p_old) + pi : pi);
}

template <bool L2, class GT, class ST, class OT>
void adam_range_scalar(const Hyper& h, const State<ST>& st, const GT* g, OT* o, size_t b, size_t e) {
  size_t i = b;
  for (; i + 4 <= e; i += 4) {
    adam_elem<L2>(h, st, g, o, i);
    adam_elem<L2>(h, st, g, o, i + 1);
    adam_elem<L2>(h, st, g, o, i + 2);
    adam_elem<L2>(h, st, g, o, i + 3);
  }
  for (; i < e; ++i) adam_elem<L2>(h, st, g, o, i);
}

// ------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: 8 lanes, unrolled x4.
// ------------------------------------------------------------------------------------------
ZO_AVX2_INLINE __m256 v8_load(const float* p) { return _mm256_loadu_ps(p); }
ZO_AVX2_INLINE __m256 v8_load(const bf16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
ZO_AVX2_INLINE __m256 v8_load(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
ZO_AVX2_INLINE void v8_store(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
ZO_AVX2_INLINE void v8_store(bf16_t* p, __m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // r holds values < 2^16 in each 32-bit lane: unsigned-saturating pack is exact.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
ZO_AVX2_INLINE void v8_store(f16_t* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

struct H8 {
  __m256 b1, omb1, b2, omb2, eps, ss, isb2, decay, wd, gs;
  bool extrapolate;
};

template <bool L2, class GT, class ST, class OT>
ZO_AVX2_INLINE void adam8(const H8& h, const State<ST>& st, const GT* g, OT* o, size_t i) {
  __m256 gi = _mm256_mul_ps(v8_load(g + i), h.gs);  // grad read first (may alias o)
  const __m256 p_old = _mm256_loadu_ps(st.p + i);
  __m256 pi = p_old;
  if (L2) gi = _mm256_fmadd_ps(pi, h.wd, gi);
  const __m256 mi = _mm256_fmadd_ps(h.b1, v8_load(st.m + i), _mm256_mul_ps(h.omb1, gi));
  const __m256 vi = _mm256_fmadd_ps(h.b2, v8_load(st.v + i), _mm256_mul_ps(_mm256_mul_ps(h.omb2, gi), gi));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), h.isb2, h.eps);
  pi = _mm256_fnmadd_ps(h.ss, _mm256_div_ps(mi, denom), _mm256_mul_ps(pi, h.decay));
  _mm256_storeu_ps(st.pw + i, pi);
  v8_store(st.mw + i, mi);
  v8_store(st.vw + i, vi);
  if constexpr (!std::is_same<OT, no_out_t>::value)
    v8_store(o + i, h.extrapolate ? _mm256_add_ps(_mm256_sub_ps(pi, p_old), pi) : pi);
}

template <bool L2, class GT, class ST, class OT>
ZO_AVX2 void adam_range_avx2(const Hyper& hs, const State<ST>& st, const GT* g, OT* o, size_t b, size_t e) {
  H8 h;
  h.b1 = _mm256_set1_ps(hs.b1); h.omb1 = _mm256_set1_ps(hs.omb1);
  h.b2 = _mm256_set1_ps(hs.b2); h.omb2 = _mm256_set1_ps(hs.omb2);
  h.eps = _mm256_set1_ps(hs.eps); h.ss = _mm256_set1_ps(hs.step_size);
  h.isb2 = _mm256_set1_ps(hs.inv_sqrt_bc2); h.decay = _mm256_set1_ps(hs.decay);
  h.wd = _mm256_set1_ps(hs.wd_l2); h.gs = _mm256_set1_ps(hs.gscale);
  h.extrapolate = hs.extrapolate;
  size_t i = b;
  const size_t pf = g_prefetch;
  for (; i + 32 <= e; i += 32) {
    if (pf && (i & 63) == 0 && i + pf + 64 <= e) prefetch64(st.p, g, st.m, st.v, i + pf);
    adam8<L2>(h, st, g, o, i);
    adam8<L2>(h, st, g, o, i + 8);
    adam8<L2>(h, st, g, o, i + 16);
    adam8<L2>(h, st, g, o, i + 24);
  }
  for (; i + 8 <= e; i += 8) adam8<L2>(h, st, g, o, i);
  for (; i < e; ++i) adam_elem<L2>(hs, st, g, o, i);
}

// ------------------------------------------------------------------------------------------
// AVX-512: two flavours of the same source (csrc/cpu_adam_avx512.inc), each function carrying its
// own target attribute. k512bf additionally uses AVX512_BF16 for fp32 -> bf16 (SPR, Zen 4, ...).
// ------------------------------------------------------------------------------------------
namespace k512 {
#define ZO_TGT ZO_AVX512
#define ZO_HW_BF16 0
#include "cpu_adam_avx512.inc"
#undef ZO_HW_BF16
#undef ZO_TGT
}  // namespace k512
namespace k512bf {
#define ZO_TGT ZO_AVX512BF
#define ZO_HW_BF16 1
#include "cpu_adam_avx512.inc"
#undef ZO_HW_BF16
#undef ZO_TGT
}  // namespace k512bf

// ------------------------------------------------------------------------------------------
// Threading: one contiguous chunk per thread, boundaries on 64-element multiples.
// ------------------------------------------------------------------------------------------
constexpr size_t kMinParallel = size_t(1) << 15;
size_t g_block = size_t(1) << 18;  // largest dynamic-schedule block (elements); 0 = static chunks

// Work partition. Below kMinParallel elements: one call, one thread. Otherwise [0, n) is cut
// into contiguous blocks (a multiple of 64 elements: whole cache lines of every stream, no false
// sharing) that the threads claim in order (schedule(dynamic, 1)), so a thread delayed by another
// process on the machine does not hold the whole call back. The block size depends on n only
// (about n/16, clamped to [16K, g_block]), never on the thread count: per-block partial sums
// (grad_sumsq) are then added in block order and the result is bit-identical for any number of
// threads. g_block = 0 selects one static chunk per thread instead (kept for benchmarking).
inline size_t block_of(size_t n) {
  if (!g_block) return 0;
  const size_t lo = std::min<size_t>(size_t(1) << 14, g_block);
  const size_t want = ((n + 15) / 16 + 63) & ~size_t(63);
  return std::min(g_block, std::max(lo, want));
}

inline size_t n_slots(size_t n) {
  const size_t T = static_cast<size_t>(std::max(g_threads, 1));
  if (n < kMinParallel) return 1;
  const size_t B = block_of(n);
  return B ? (n + B - 1) / B : T;
}

template <class F>
void parallel_chunks(size_t n, F&& f) {
  const int T = g_threads;
  if (n < kMinParallel) { f(size_t(0), n, 0); return; }
  if (const size_t B = block_of(n)) {
    const long long nb = static_cast<long long>((n + B - 1) / B);
    if (T <= 1) {
      for (long long k = 0; k < nb; ++k) {
        const size_t b = static_cast<size_t>(k) * B;
        f(b, std::min(n, b + B), static_cast<int>(k));
      }
      return;
    }
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
    for (long long k = 0; k < nb; ++k) {
      const size_t b = static_cast<size_t>(k) * B;
      f(b, std::min(n, b + B), static_cast<int>(k));
    }
    return;
  }
  if (T <= 1) { f(size_t(0), n, 0); return; }
#pragma omp parallel num_threads(T)
  {
    const size_t nt = static_cast<size_t>(omp_get_num_threads());
    const size_t t = static_cast<size_t>(omp_get_thread_num());
    const size_t per = (((n + nt - 1) / nt) + 63) & ~size_t(63);
    const size_t b = std::min(n, t * per);
    const size_t e = std::min(n, b + per);
    if (b < e) f(b, e, static_cast<int>(t));
  }
}

// ------------------------------------------------------------------------------------------
// Segment lists: many disjoint ranges of the same buffers in one call (one OpenMP fork).
// ------------------------------------------------------------------------------------------
// The segments are laid end to end in a virtual range [0, N), N = their total length, and [0, N)
// is cut the way parallel_chunks cuts [0, n) (blocks of block_of(N) elements claimed in order, or
// one chunk per thread in static mode; one chunk on the calling thread below kMinParallel). Each
// cut then moves up to the next multiple of 64 elements from the start of the segment it falls in
// (or to that segment's end): a chunk batches tiny segments and splits big ones, so all threads
// get work however small the segments are, and every piece of a segment starts 64k elements
// from the segment's start, exactly where a chunk of a single adam_step call on that segment
// could start. The vector body / scalar tail split of every element is then the one of that call
// (on AVX2 the two round differently: FMA vs separate multiply and add), so the results are
// bit-identical to one adam_step per segment. The plan depends on the segment list and the block
// setting only (and on the thread count in static mode), so per-chunk partial sums added in chunk
// order are deterministic like run_sumsq's.
struct SegPlan {
  std::vector<size_t> start;  // segment j = buffer elements [start[j], start[j] + len_j)
  std::vector<size_t> cum;    // virtual offset of segment j; cum.back() = N
  std::vector<size_t> cut;    // chunk k = virtual [cut[k], cut[k + 1])
};

SegPlan plan_segments(const std::vector<size_t>& start, const std::vector<size_t>& end) {
  SegPlan s;
  s.start = start;
  s.cum.reserve(start.size() + 1);
  s.cum.push_back(0);
  for (size_t j = 0; j < start.size(); ++j) {
    if (end[j] <= start[j]) throw std::invalid_argument("segment " + std::to_string(j) + ": end must be > start");
    if (j && start[j] < end[j - 1]) throw std::invalid_argument("segments must be sorted and disjoint");
    s.cum.push_back(s.cum.back() + (end[j] - start[j]));
  }
  const size_t n = s.cum.back();
  size_t B = n < kMinParallel ? n : block_of(n);
  if (!B) {
    const size_t T = static_cast<size_t>(std::max(g_threads, 1));
    B = (((n + T - 1) / T) + 63) & ~size_t(63);
  }
  s.cut.push_back(0);
  for (size_t x = B; x < n; x += B) {
    const size_t j = static_cast<size_t>(std::upper_bound(s.cum.begin(), s.cum.end(), x) - s.cum.begin()) - 1;
    const size_t c = s.cum[j] + std::min(s.cum[j + 1] - s.cum[j], (x - s.cum[j] + 63) & ~size_t(63));
    if (c > s.cut.back() && c < n) s.cut.push_back(c);  // tiny blocks (_set_block) may snap together
  }
  s.cut.push_back(n);
  return s;
}

// f(j, b, e) for each piece of chunk k: elements [b, e) counted from the start of segment j.
template <class F>
void for_pieces(const SegPlan& s, size_t k, F&& f) {
  size_t x = s.cut[k];
  const size_t xe = s.cut[k + 1];
  size_t j = static_cast<size_t>(std::upper_bound(s.cum.begin(), s.cum.end(), x) - s.cum.begin()) - 1;
  for (; x < xe; ++j) {
    const size_t pe = std::min(xe, s.cum[j + 1]);
    f(j, x - s.cum[j], pe - s.cum[j]);
    x = pe;
  }
}

// f(k) for every chunk of the plan, in one parallel region; threads claim chunks in order.
template <class F>
void parallel_plan(const SegPlan& s, F&& f) {
  const long long nc = static_cast<long long>(s.cut.size()) - 1;
  const int T = static_cast<int>(std::min<long long>(g_threads, nc));
  if (T <= 1) {
    for (long long k = 0; k < nc; ++k) f(static_cast<size_t>(k));
    return;
  }
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
  for (long long k = 0; k < nc; ++k) f(static_cast<size_t>(k));
}

// ------------------------------------------------------------------------------------------
// Adam entry points.
// ------------------------------------------------------------------------------------------
template <bool L2, class GT, class ST, class OT>
inline void adam_range_isa(const Hyper& h, const State<ST>& st, const GT* g, OT* o, size_t b, size_t e,
                           int isa) {
  if (isa == kAvx512) {
    if (g_hw_bf16) k512bf::adam_range<L2>(h, st, g, o, b, e);
    else k512::adam_range<L2>(h, st, g, o, b, e);
  }
  else if (isa == kAvx2) adam_range_avx2<L2>(h, st, g, o, b, e);
  else adam_range_scalar<L2>(h, st, g, o, b, e);
}

// Calls f with the typed pointers the dtype codes name: f(g) / f(m, v) / f(o), o a null
// no_out_t* when there is no 16-bit output.
template <class F>
void dispatch_grad(uintptr_t g, int gd, F&& f) {
  if (gd == kF32) f(reinterpret_cast<const float*>(g));
  else if (gd == kBF16) f(reinterpret_cast<const bf16_t*>(g));
  else if (gd == kF16) f(reinterpret_cast<const f16_t*>(g));
  else throw std::invalid_argument("grad dtype must be fp32, bf16 or fp16");
}

template <class F>
void dispatch_state(uintptr_t m, uintptr_t v, int sd, F&& f) {
  if (sd == kF32) f(reinterpret_cast<float*>(m), reinterpret_cast<float*>(v));
  else if (sd == kBF16) f(reinterpret_cast<bf16_t*>(m), reinterpret_cast<bf16_t*>(v));
  else throw std::invalid_argument("optimizer state dtype must be fp32 or bf16");
}

template <class F>
void dispatch_out(uintptr_t o, int od, F&& f) {
  if (od == kNone || o == 0) f(static_cast<no_out_t*>(nullptr));
  else if (od == kBF16) f(reinterpret_cast<bf16_t*>(o));
  else if (od == kF16) f(reinterpret_cast<f16_t*>(o));
  else if (od == kF32) f(reinterpret_cast<float*>(o));   // fp32 runs' extrapolated copy
  else throw std::invalid_argument("param16_out dtype must be bf16, fp16 or fp32");
}

// The state pointers, typed: written where an out pointer is given (nonzero), else in place.
struct StatePtrs {
  uintptr_t p, m, v, pw, mw, vw;
};

inline StatePtrs state_ptrs(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t pw, uintptr_t mw, uintptr_t vw) {
  return {p, m, v, pw ? pw : p, mw ? mw : m, vw ? vw : v};
}

// f(g, state, o), typed.
template <class F>
void dispatch_types(uintptr_t g, int gd, const StatePtrs& s, int sd, uintptr_t o, int od, F&& f) {
  dispatch_grad(g, gd, [&](auto* gp) {
    dispatch_state(s.m, s.v, sd, [&](auto* mp, auto* vp) {
      using ST = std::remove_pointer_t<decltype(mp)>;
      const State<ST> st{reinterpret_cast<const float*>(s.p), mp, vp, reinterpret_cast<float*>(s.pw),
                         reinterpret_cast<ST*>(s.mw), reinterpret_cast<ST*>(s.vw)};
      dispatch_out(o, od, [&](auto* op) { f(gp, st, op); });
    });
  });
}

void adam_step(uintptr_t p, uintptr_t g, int gd, uintptr_t m, uintptr_t v, int sd, uintptr_t o,
               int od, size_t n, long long step, double lr, double beta1, double beta2, double eps,
               double wd, bool adamw, bool bias_correction, double grad_scale, uintptr_t pw,
               uintptr_t mw, uintptr_t vw) {
  if (n == 0) return;
  if (!p || !g || !m || !v) throw std::invalid_argument("null data pointer");
  if (step < 1) throw std::invalid_argument("step must be >= 1 (1-based)");
  const Hyper h = make_hyper(step, lr, beta1, beta2, eps, wd, adamw, bias_correction, grad_scale);
  const bool l2 = !adamw && wd != 0.0;
  const int isa = g_isa;
  const StatePtrs sp = state_ptrs(p, m, v, pw, mw, vw);
  py::gil_scoped_release nogil;
  dispatch_types(g, gd, sp, sd, o, od, [&](auto* gp, const auto& st, auto* op) {
    parallel_chunks(n, [&](size_t b, size_t e, int) {
      if (l2) adam_range_isa<true>(h, st, gp, op, b, e, isa);
      else adam_range_isa<false>(h, st, gp, op, b, e, isa);
    });
  });
}

// adam_step over segments [seg_start[j], seg_end[j]) of the same buffers, each with its own weight
// decay (its own Hyper, and L2 only where its decay is nonzero, as adam_step decides per call) and,
// when seg_lr is given, its own learning rate (--decoupled-lr: still one parallel region).
void adam_step_segments(uintptr_t p, uintptr_t g, int gd, uintptr_t m, uintptr_t v, int sd, uintptr_t o,
                        int od, const std::vector<size_t>& seg_start, const std::vector<size_t>& seg_end,
                        const std::vector<double>& seg_wd, long long step, double lr, double beta1,
                        double beta2, double eps, bool adamw, bool bias_correction, double grad_scale,
                        uintptr_t pw, uintptr_t mw, uintptr_t vw, const std::vector<double>& seg_lr,
                        bool extrapolate) {
  if (seg_end.size() != seg_start.size() || seg_wd.size() != seg_start.size())
    throw std::invalid_argument("seg_start, seg_end and seg_wd must have the same length");
  if (!seg_lr.empty() && seg_lr.size() != seg_start.size())
    throw std::invalid_argument("seg_lr must be empty or as long as seg_start");
  if (seg_start.empty()) return;
  if (!p || !g || !m || !v) throw std::invalid_argument("null data pointer");
  if (step < 1) throw std::invalid_argument("step must be >= 1 (1-based)");
  const SegPlan plan = plan_segments(seg_start, seg_end);
  std::vector<Hyper> hyp;
  std::vector<char> l2;
  hyp.reserve(seg_wd.size());
  l2.reserve(seg_wd.size());
  for (size_t j = 0; j < seg_wd.size(); ++j) {
    const double wd = seg_wd[j];
    hyp.push_back(make_hyper(step, seg_lr.empty() ? lr : seg_lr[j], beta1, beta2, eps, wd, adamw,
                             bias_correction, grad_scale));
    hyp.back().extrapolate = extrapolate;
    l2.push_back(!adamw && wd != 0.0);
  }
  const int isa = g_isa;
  const StatePtrs sp = state_ptrs(p, m, v, pw, mw, vw);
  py::gil_scoped_release nogil;
  dispatch_types(g, gd, sp, sd, o, od, [&](auto* gp, const auto& st, auto* op) {
    parallel_plan(plan, [&](size_t k) {
      for_pieces(plan, k, [&](size_t j, size_t b, size_t e) {
        // Pointers at the segment's start, indices from it: exactly the call adam_step gets for
        // a slice (also the AVX2 prefetch cadence, which counts from the range's origin).
        const size_t s = plan.start[j];
        const auto os = op ? op + s : op;  // no out16: stays null
        if (l2[j]) adam_range_isa<true>(hyp[j], st.at(s), gp + s, os, b, e, isa);
        else adam_range_isa<false>(hyp[j], st.at(s), gp + s, os, b, e, isa);
      });
    });
  });
}

// ------------------------------------------------------------------------------------------
// Sum of squares in fp64 + finiteness. Each square of a finite fp32 is <= 1.2e77, so a sum over
// any possible n stays far below DBL_MAX: the sum is finite iff every element is finite.
// ------------------------------------------------------------------------------------------
template <class GT>
double sumsq_scalar(const GT* g, size_t b, size_t e) {
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  size_t i = b;
  for (; i + 4 <= e; i += 4) {
    const double x0 = sload(g, i), x1 = sload(g, i + 1), x2 = sload(g, i + 2), x3 = sload(g, i + 3);
    a0 += x0 * x0; a1 += x1 * x1; a2 += x2 * x2; a3 += x3 * x3;
  }
  for (; i < e; ++i) { const double x = sload(g, i); a0 += x * x; }
  return (a0 + a1) + (a2 + a3);
}

template <class GT>
ZO_AVX2 double sumsq_avx2(const GT* g, size_t b, size_t e) {
  __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  size_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m256 x0 = v8_load(g + i), x1 = v8_load(g + i + 8);
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x0));
    const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1));
    const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(x1));
    const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(x1, 1));
    a[0] = _mm256_fmadd_pd(d0, d0, a[0]); a[1] = _mm256_fmadd_pd(d1, d1, a[1]);
    a[2] = _mm256_fmadd_pd(d2, d2, a[2]); a[3] = _mm256_fmadd_pd(d3, d3, a[3]);
  }
  const __m256d s = _mm256_add_pd(_mm256_add_pd(a[0], a[1]), _mm256_add_pd(a[2], a[3]));
  alignas(32) double t[4];
  _mm256_store_pd(t, s);
  double r = (t[0] + t[1]) + (t[2] + t[3]);
  for (; i < e; ++i) { const double x = sload(g, i); r += x * x; }
  return r;
}

template <class GT>
double sumsq_range_isa(const GT* g, size_t b, size_t e, int isa) {
  if (isa == kAvx512) return k512::sumsq_range(g, b, e);
  if (isa == kAvx2) return sumsq_avx2(g, b, e);
  return sumsq_scalar(g, b, e);
}

template <class GT>
double run_sumsq(const GT* g, size_t n, int isa) {
  std::vector<double> part(n_slots(n) * 8, 0.0);  // one slot per chunk/block, 64 B apart
  parallel_chunks(n, [&](size_t b, size_t e, int t) {
    part[static_cast<size_t>(t) * 8] = sumsq_range_isa(g, b, e, isa);
  });
  double s = 0;
  for (size_t t = 0; t < part.size(); t += 8) s += part[t];  // fixed order: deterministic
  return s;
}

py::tuple grad_sumsq_and_finite(uintptr_t g, int gd, size_t n) {
  double s = 0.0;
  if (n) {
    if (!g) throw std::invalid_argument("null data pointer");
    const int isa = g_isa;
    py::gil_scoped_release nogil;
    dispatch_grad(g, gd, [&](auto* gp) { s = run_sumsq(gp, n, isa); });
  }
  return py::make_tuple(s, static_cast<bool>(std::isfinite(s)));
}

// (sum of squares of the counted segments, every element of every segment finite). Uncounted
// segments are summed apart: their sum is finite iff all their elements are (see above).
py::tuple grad_sumsq_and_finite_segments(uintptr_t g, int gd, const std::vector<size_t>& seg_start,
                                         const std::vector<size_t>& seg_end,
                                         const std::vector<bool>& seg_counted) {
  if (seg_end.size() != seg_start.size() || seg_counted.size() != seg_start.size())
    throw std::invalid_argument("seg_start, seg_end and seg_counted must have the same length");
  double counted = 0.0, other = 0.0;
  if (!seg_start.empty()) {
    if (!g) throw std::invalid_argument("null data pointer");
    const SegPlan plan = plan_segments(seg_start, seg_end);
    const int isa = g_isa;
    py::gil_scoped_release nogil;
    std::vector<double> part((plan.cut.size() - 1) * 8, 0.0);  // chunk k: [counted, other], 64 B apart
    dispatch_grad(g, gd, [&](auto* gp) {
      parallel_plan(plan, [&](size_t k) {
        for_pieces(plan, k, [&](size_t j, size_t b, size_t e) {
          const size_t s = plan.start[j];
          part[k * 8 + (seg_counted[j] ? 0 : 1)] += sumsq_range_isa(gp, s + b, s + e, isa);
        });
      });
    });
    for (size_t k = 0; k < part.size(); k += 8) {  // chunk order: deterministic
      counted += part[k];
      other += part[k + 1];
    }
  }
  return py::make_tuple(counted, static_cast<bool>(std::isfinite(counted + other)));
}

// ------------------------------------------------------------------------------------------
// Roofline: moves exactly the bytes of adam_step (same streams, same chunking, same threads)
// with no arithmetic: read-write streams are stored back XOR a run-time zero, read-only grads
// are OR-folded into a sink (or, for a 16-bit grad with a 16-bit output, stored to the output).
// ------------------------------------------------------------------------------------------
template <class V> struct Raw;
template <> struct Raw<float> {
  ZO_AVX512_INLINE static __m512i ld(const float* p) { return _mm512_loadu_si512(p); }
  ZO_AVX512_INLINE static void st(float* p, __m512i x) { _mm512_storeu_si512(p, x); }
  ZO_AVX512_INLINE static __m512i x(__m512i a, __m512i z) { return _mm512_xor_si512(a, z); }
  ZO_AVX512_INLINE static __m512i orr(__m512i acc, __m512i a) { return _mm512_or_si512(acc, a); }
};
template <class T16> struct Raw16 {
  ZO_AVX512_INLINE static __m256i ld(const T16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  ZO_AVX512_INLINE static void st(T16* p, __m256i x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  ZO_AVX512_INLINE static __m256i x(__m256i a, __m256i z) { return _mm256_xor_si256(a, z); }
  ZO_AVX512_INLINE static __m512i orr(__m512i acc, __m256i a) { return _mm512_or_si512(acc, _mm512_castsi256_si512(a)); }
};
template <> struct Raw<bf16_t> : Raw16<bf16_t> {};
template <> struct Raw<f16_t> : Raw16<f16_t> {};

template <class T> ZO_AVX512_INLINE __m256i to16(__m512i a) { return _mm512_cvtepi32_epi16(a); }

template <class GT, class ST, class OT>
ZO_AVX512 uint32_t roof_range_avx512(float* p, const GT* g, ST* m, ST* v, OT* o, size_t b, size_t e,
                                     uint32_t zero) {
  const __m512i z = _mm512_set1_epi32(static_cast<int>(zero));
  const __m256i z16 = _mm256_set1_epi32(static_cast<int>(zero));
  __m512i acc = _mm512_setzero_si512();
  constexpr bool g16 = !std::is_same<GT, float>::value;
  constexpr bool s16 = !std::is_same<ST, float>::value;
  constexpr bool has_out = !std::is_same<OT, no_out_t>::value;
  size_t i = b;
  const size_t pf = g_prefetch;
  for (; i + 16 <= e; i += 16) {
    if (pf && (i & 63) == 0 && i + pf + 64 <= e) prefetch64(p, g, m, v, i + pf);
    const auto gi = Raw<GT>::ld(g + i);
    const __m512i pi = _mm512_loadu_si512(p + i);
    const auto mi = Raw<ST>::ld(m + i);
    const auto vi = Raw<ST>::ld(v + i);
    _mm512_storeu_si512(p + i, _mm512_xor_si512(pi, z));
    if constexpr (s16) { Raw<ST>::st(m + i, Raw<ST>::x(mi, z16)); Raw<ST>::st(v + i, Raw<ST>::x(vi, z16)); }
    else { Raw<ST>::st(m + i, Raw<ST>::x(mi, z)); Raw<ST>::st(v + i, Raw<ST>::x(vi, z)); }
    if constexpr (has_out) {
      if constexpr (g16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_xor_si256(gi, z16));
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), to16<GT>(gi));
    } else {
      acc = Raw<GT>::orr(acc, gi);
    }
  }
  uint32_t tail = 0;
  for (; i < e; ++i) {  // byte-for-byte scalar tail
    uint32_t pb; std::memcpy(&pb, p + i, 4); pb ^= zero; std::memcpy(p + i, &pb, 4);
    if constexpr (s16) { m[i].x ^= static_cast<uint16_t>(zero); v[i].x ^= static_cast<uint16_t>(zero); }
    else { uint32_t t; std::memcpy(&t, m + i, 4); t ^= zero; std::memcpy(m + i, &t, 4);
           std::memcpy(&t, v + i, 4); t ^= zero; std::memcpy(v + i, &t, 4); }
    uint32_t gb = 0; std::memcpy(&gb, g + i, sizeof(GT));
    if constexpr (has_out) { o[i].x = static_cast<uint16_t>(gb ^ zero); } else { tail |= gb; }
  }
  return static_cast<uint32_t>(_mm512_reduce_or_epi32(acc)) | tail;
}

template <class GT, class ST, class OT>
uint32_t roof_range_generic(float* p, const GT* g, ST* m, ST* v, OT* o, size_t b, size_t e, uint32_t zero) {
  uint32_t acc = 0;
  uint32_t* pu = reinterpret_cast<uint32_t*>(p);
  for (size_t i = b; i < e; ++i) {
    pu[i] ^= zero;
    if constexpr (std::is_same<ST, float>::value) {
      reinterpret_cast<uint32_t*>(m)[i] ^= zero; reinterpret_cast<uint32_t*>(v)[i] ^= zero;
    } else { m[i].x ^= static_cast<uint16_t>(zero); v[i].x ^= static_cast<uint16_t>(zero); }
    uint32_t gb = 0; std::memcpy(&gb, g + i, sizeof(GT));
    if constexpr (!std::is_same<OT, no_out_t>::value) o[i].x = static_cast<uint16_t>(gb ^ zero);
    else acc |= gb;
  }
  return acc;
}

template <class GT, class ST, class OT>
void run_roof(float* p, const GT* g, ST* m, ST* v, OT* o, size_t n, int isa, uint32_t zero) {
  std::vector<uint32_t> part(n_slots(n) * 16, 0);
  parallel_chunks(n, [&](size_t b, size_t e, int t) {
    part[static_cast<size_t>(t) * 16] = (isa == kAvx512) ? roof_range_avx512(p, g, m, v, o, b, e, zero)
                                                         : roof_range_generic(p, g, m, v, o, b, e, zero);
  });
  uint32_t s = 0;
  for (uint32_t x : part) s |= x;
  g_sink = s;
}

template <class GT, class ST>
void roof_out(float* p, const GT* g, ST* m, ST* v, uintptr_t o, int od, size_t n, int isa, uint32_t z) {
  if (od == kNone || o == 0) run_roof(p, g, m, v, static_cast<no_out_t*>(nullptr), n, isa, z);
  else run_roof(p, g, m, v, reinterpret_cast<bf16_t*>(o), n, isa, z);  // 16-bit either way
}

template <class GT>
void roof_state(float* p, const GT* g, uintptr_t m, uintptr_t v, int sd, uintptr_t o, int od, size_t n,
                int isa, uint32_t z) {
  if (sd == kF32) roof_out(p, g, reinterpret_cast<float*>(m), reinterpret_cast<float*>(v), o, od, n, isa, z);
  else roof_out(p, g, reinterpret_cast<bf16_t*>(m), reinterpret_cast<bf16_t*>(v), o, od, n, isa, z);
}

void roofline(uintptr_t p, uintptr_t g, int gd, uintptr_t m, uintptr_t v, int sd, uintptr_t o, int od,
              size_t n, uint32_t zero) {
  if (n == 0) return;
  if (!p || !g || !m || !v) throw std::invalid_argument("null data pointer");
  // Pure data movement: use the widest ISA the CPU has, whatever the Adam ISA is.
  const int isa = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
                      ? kAvx512 : kScalar;
  float* pp = reinterpret_cast<float*>(p);
  py::gil_scoped_release nogil;
  if (gd == kF32) roof_state(pp, reinterpret_cast<const float*>(g), m, v, sd, o, od, n, isa, zero);
  else roof_state(pp, reinterpret_cast<const bf16_t*>(g), m, v, sd, o, od, n, isa, zero);
}

// ------------------------------------------------------------------------------------------
// ISA selection.
// ------------------------------------------------------------------------------------------
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_bf16() { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }

bool cpu_has_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

const char* isa_name(int isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar"; }

py::list available_isas() {
  py::list l;
  if (cpu_has_avx512()) l.append("avx512");
  if (cpu_has_avx2()) l.append("avx2");
  l.append("scalar");
  return l;
}

void set_isa(const std::string& name) {
  if (name == "avx512") {
    if (!cpu_has_avx512()) throw std::runtime_error("this CPU lacks AVX-512 (F/BW/VL/DQ + FMA + F16C)");
    g_isa = kAvx512;
  } else if (name == "avx2") {
    if (!cpu_has_avx2()) throw std::runtime_error("this CPU lacks AVX2 + FMA + F16C");
    g_isa = kAvx2;
  } else if (name == "scalar") {
    g_isa = kScalar;
  } else {
    throw std::invalid_argument("unknown ISA '" + name + "' (expected avx512, avx2 or scalar)");
  }
}

// ------------------------------------------------------------------------------------------
// CRC32C, the NVMe tier's block checksum: its own section (csrc/checksum.inc), sharing only the
// module and the CPUID helpers with the Adam kernel.
// ------------------------------------------------------------------------------------------
#include "checksum.inc"

}  // namespace

PYBIND11_MODULE(_cpu_adam, mod) {
  mod.doc() = "ZeRO-Offload CPU Adam kernel (AVX-512 / AVX2 / scalar, OpenMP). Raw pointers; "
              "use zo_megatron.offload.cpu_adam, which validates tensors.";
  g_isa = cpu_has_avx512() ? kAvx512 : cpu_has_avx2() ? kAvx2 : kScalar;
  g_hw_bf16 = cpu_has_avx512_bf16();
  mod.attr("DTYPE_F32") = static_cast<int>(kF32);
  mod.attr("DTYPE_BF16") = static_cast<int>(kBF16);
  mod.attr("DTYPE_F16") = static_cast<int>(kF16);
  mod.attr("DTYPE_NONE") = static_cast<int>(kNone);
  mod.attr("ISA_COMPILED") = py::make_tuple("avx512", "avx2", "scalar");
  mod.def("adam_step", &adam_step, py::arg("param"), py::arg("grad"), py::arg("grad_dtype"),
          py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("state_dtype"), py::arg("out16"),
          py::arg("out_dtype"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
          py::arg("bias_correction"), py::arg("grad_scale"), py::arg("param_out") = 0,
          py::arg("exp_avg_out") = 0, py::arg("exp_avg_sq_out") = 0,
          "Fused Adam/AdamW step over n elements (integer data pointers; out16=0 for none). "
          "param_out / exp_avg_out / exp_avg_sq_out: 0 = update in place, else read the old value "
          "from param / exp_avg / exp_avg_sq and write the new one there (same dtype and size).");
  mod.def("adam_step_segments", &adam_step_segments, py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("state_dtype"),
          py::arg("out16"), py::arg("out_dtype"), py::arg("seg_start"), py::arg("seg_end"),
          py::arg("seg_wd"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("eps"), py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"),
          py::arg("param_out") = 0, py::arg("exp_avg_out") = 0, py::arg("exp_avg_sq_out") = 0,
          py::arg("seg_lr") = std::vector<double>(), py::arg("extrapolate") = false,
          "adam_step over the sorted, disjoint segments [seg_start[j], seg_end[j]) of the same "
          "buffers, weight decay seg_wd[j] (learning rate seg_lr[j] if given, else lr), in one "
          "parallel pass; other elements are not touched (neither in the inputs nor in the out buffers). "
          "extrapolate: out16 gets (p - p_old) + p, the weight-predicted copy.");
  mod.def("grad_sumsq_and_finite", &grad_sumsq_and_finite, py::arg("grad"), py::arg("grad_dtype"),
          py::arg("n"), "(sum of squares in fp64, all finite) of n elements.");
  mod.def("grad_sumsq_and_finite_segments", &grad_sumsq_and_finite_segments, py::arg("grad"),
          py::arg("grad_dtype"), py::arg("seg_start"), py::arg("seg_end"), py::arg("seg_counted"),
          "(fp64 sum of squares of the counted segments, all elements of all segments finite); "
          "segments [seg_start[j], seg_end[j]) sorted and disjoint.");
  mod.def("roofline", &roofline, py::arg("param"), py::arg("grad"), py::arg("grad_dtype"),
          py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("state_dtype"), py::arg("out16"),
          py::arg("out_dtype"), py::arg("n"), py::arg("zero") = 0u,
          "Moves exactly adam_step's bytes with no arithmetic (benchmark roofline). zero must be 0.");
  mod.def("set_num_threads", [](int n) {
    if (n < 1) throw std::invalid_argument("num_threads must be >= 1");
    g_threads = n;
  });
  mod.def("get_num_threads", []() { return g_threads; });
  mod.def("_set_block", [](size_t b) { g_block = b ? ((b + 63) & ~size_t(63)) : 0; },
          "Private: dynamic-schedule block in elements (0: one static chunk per thread).");
  mod.def("_get_block", []() { return g_block; });
  mod.def("_set_prefetch", [](size_t d) { g_prefetch = d; },
          "Private (tuning): software prefetch distance in elements, 0 = off (default 512).");
  mod.def("_get_prefetch", []() { return g_prefetch; });
  mod.def("set_isa", &set_isa);
  mod.def("get_isa", []() { return std::string(isa_name(g_isa)); });
  mod.def("available_isas", &available_isas);
  mod.def("has_avx512_bf16", &cpu_has_avx512_bf16);
  mod.def("_set_avx512_bf16", [](bool on) {
    if (on && !cpu_has_avx512_bf16()) throw std::runtime_error("this CPU lacks AVX512_BF16");
    g_hw_bf16 = on;
  }, "Private (tests): use AVX512_BF16 conversions inside the avx512 path.");
  mod.def("_get_avx512_bf16", []() { return g_hw_bf16; });
  mod.def("_f32_to_bf16_scalar", [](float f) { return f32_to_bf16_rne(f); });
  mod.def("_f32_to_f16_scalar", [](float f) { return f32_to_f16_rne(f); });
  mod.def("_f16_to_f32_scalar", [](uint16_t h) { return f16_to_f32(h); });

  crc32c::init();
  mod.def("crc32c", &crc32c::of_buffer, py::arg("buf"), py::arg("value") = 0u,
          "CRC32C (Castagnoli) of a C-contiguous Python buffer, continuing `value` (zlib.crc32's "
          "convention); releases the GIL.");
  mod.def("crc32c_ptr", &crc32c::of_pointer, py::arg("ptr"), py::arg("n"), py::arg("value") = 0u,
          "CRC32C of n bytes at an integer address (a contiguous tensor's data_ptr()); releases the GIL.");
  mod.def("crc32c_impl", []() { return std::string(crc32c::impl_name()); },
          "The CRC32C path in use: sse4.2 or software.");
  mod.def("crc32c_impls", []() {
    py::list l;
    if (cpu_has_sse42()) l.append("sse4.2");
    l.append("software");
    return l;
  });
  mod.def("_set_crc32c_impl", &crc32c::set_impl, "Private (tests, benchmarks): sse4.2 or software.");
}
