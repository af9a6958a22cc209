// Experiment (bench/README.md, "A tile format for q8_0 decode, measured before building
// it"): q8_0 decode on a format that the library does NOT use, timed against the library's
// own f16 and q8_0 decode in the same process, one thread, one layer after another.
// The format: per KV head and 32-cell tile, the block scales (binary16) stored apart from
// the codes; K codes as [row group of 4][cell][4 rows] (code + 128, so one vpdpbusd adds 4
// rows x 16 cells of one query slot), V codes as [group of 4 cells][dimension][4 cells]
// (one vpdpbusd adds 4 cells x 16 dimensions). q.K on an 8-bit query per block of 32 rows;
// p.V on 8-bit unsigned weights w = p * d_v, rounded per group of NT tiles against the
// bound max(p) * max(d_v) of the group. The head dimension (128), the query heads per KV
// head (4), the KV heads (8) and the data (N(0, 0.5) values, N(0, 1) queries) are those of
// bench_kernels.cpp's attn_decode rows.
// Build: cmake --build build --target kvcache_exp_tile_q8 (AVX-512 VNNI CPUs only).
// Run: ./build/bench/kvcache_exp_tile_q8 <cells> <layers> <iterations>
//   e.g. 2048 1 400 (from the caches), 16384 4 40 (from DRAM). Prints the NMSE of the
//   tile kernel against a float64 decode over the stored (dequantized) values, then the
//   time per cell and KV head of each kernel in cycles at KVCACHE_BENCH_GHZ (default 4.1)
//   and the same-run ratios f16 / tile and f16 / library q8_0.
// Compile-time knobs: -DNT=<1|2|4> (tiles per weight group, default 1); -DABL=<mask> skips
// stages for ablations, giving wrong results (1: q.K, 2: the weights, 4: the p.V products).
#ifndef NT
#define NT 1
#endif
#ifndef ABL
#define ABL 0
#endif
#if !defined(__AVX512F__) || !defined(__AVX512VNNI__) || !defined(__AVX512BW__)
#error "kvcache_exp_tile_q8 needs AVX-512 F, BW and VNNI (-march=native on such a CPU)"
#endif
#include <immintrin.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "tile_q8_common.hpp"

using namespace tile_exp;
constexpr int G = 4, NH = 32;  // query heads per KV head, query heads

struct alignas(64) vtile { std::uint16_t d[4][32]; std::int8_t c[8][128][4]; };    // c[cell group][dim][4 cells]

// vpdpbusd through asm: with the intrinsic GCC 12 copied every accumulator to another
// register and back (bench/README.md, 2026-11-27, evening).
static inline __m512i dpb(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "vm"(s));
    return acc;
}
static inline __m512 exp512(__m512 x) {  // x <= ~8; accurate to ~2 ulp
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// decode of one KV head: G slots, query q[G][D] (already scaled), out[G][D]
static void decode_head(const ktile* kt, const vtile* vt, int ntiles, const float* q, float* out) {
    alignas(64) std::int32_t qd[G][32];  // int8 query, 4 per dword
    float dq[G][4];
    std::int32_t qcorr[G][4];
    for (int s = 0; s < G; ++s)
        for (int u = 0; u < 4; ++u) {
            std::int8_t q8[32];
            std::uint16_t b;
            quant_block(q + s * D + 32 * u, q8, b);
            dq[s][u] = h2f(b);
            int sum = 0;
            for (int i = 0; i < 32; ++i) sum += q8[i];
            qcorr[s][u] = 128 * sum;
            std::memcpy(&qd[s][8 * u], q8, 32);
        }
    alignas(64) float acc_out[G][D] = {};
    float m[G], l[G];
    __m512 lsum[G];
    for (int s = 0; s < G; ++s) { m[s] = -INFINITY; l[s] = 0; lsum[s] = _mm512_setzero_ps(); }
    float sw[G][4];
    alignas(64) float scb[G][NT * 32];
    alignas(64) float pb[G][NT * 32];
    alignas(64) std::uint8_t wbb[G][4][NT * 32];
    for (int t0 = 0; t0 < ntiles; t0 += NT) {
        if (t0 + NT < ntiles) {
            const char* nk = reinterpret_cast<const char*>(&kt[t0 + NT]);
            const char* nv = reinterpret_cast<const char*>(&vt[t0 + NT]);
            for (int i = 0; i < 4352 * NT; i += 64) { _mm_prefetch(nk + i, _MM_HINT_T0); _mm_prefetch(nv + i, _MM_HINT_T0); }
        }
        for (int tt = 0; tt < NT; ++tt) {
            const ktile& K = kt[t0 + tt];
            __m512 sc[G][2];
            for (int s = 0; s < G; ++s) sc[s][0] = sc[s][1] = _mm512_setzero_ps();
            for (int u = 0; u < 4 * !(ABL & 1); ++u) {
                __m512i a[G][2];
                for (int s = 0; s < G; ++s) a[s][0] = a[s][1] = _mm512_setzero_si512();
                for (int gi = 0; gi < 8; ++gi) {
                    const int g = 8 * u + gi;
                    const __m512i k0 = _mm512_load_si512(&K.c[g][0]), k1 = _mm512_load_si512(&K.c[g][16]);
                    for (int s = 0; s < G; ++s) {
                        const __m512i b = _mm512_set1_epi32(qd[s][g]);
                        a[s][0] = dpb(a[s][0], k0, b);
                        a[s][1] = dpb(a[s][1], k1, b);
                    }
                }
                const __m512 dk0 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(&K.d[u][0])));
                const __m512 dk1 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(&K.d[u][16])));
                for (int s = 0; s < G; ++s) {
                    const __m512i corr = _mm512_set1_epi32(qcorr[s][u]);
                    const __m512 f = _mm512_set1_ps(dq[s][u]);
                    sc[s][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[s][0], corr)), _mm512_mul_ps(dk0, f), sc[s][0]);
                    sc[s][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[s][1], corr)), _mm512_mul_ps(dk1, f), sc[s][1]);
                }
            }
            for (int s = 0; s < G; ++s) {
                _mm512_store_ps(&scb[s][32 * tt], sc[s][0]);
                _mm512_store_ps(&scb[s][32 * tt + 16], sc[s][1]);
            }
        }
        // V scales' maxima over the super tile
        float dvmax[4];
        for (int u = 0; u < 4; ++u) {
            __m512 mx = _mm512_setzero_ps();
            for (int tt = 0; tt < NT; ++tt) {
                const vtile& V = vt[t0 + tt];
                mx = _mm512_max_ps(mx, _mm512_max_ps(_mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(&V.d[u][0]))),
                                                     _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(&V.d[u][16])))));
            }
            dvmax[u] = _mm512_reduce_max_ps(mx);
        }
        for (int s = 0; s < G; ++s) {
            __m512 mx = _mm512_load_ps(&scb[s][0]);
            for (int i = 16; i < NT * 32; i += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(&scb[s][i]));
            const float tmax = _mm512_reduce_max_ps(mx);
            if (tmax > m[s] + 8.0f || m[s] == -INFINITY) {
                const float alpha = m[s] == -INFINITY ? 0.0f : std::exp(m[s] - tmax);
                m[s] = tmax;
                const __m512 al = _mm512_set1_ps(alpha);
                lsum[s] = _mm512_mul_ps(lsum[s], al);
                for (int k = 0; k < 8; ++k) _mm512_store_ps(&acc_out[s][16 * k], _mm512_mul_ps(_mm512_load_ps(&acc_out[s][16 * k]), al));
            }
            const __m512 mm = _mm512_set1_ps(m[s]);
            __m512 pm = _mm512_setzero_ps();
            for (int i = 0; i < NT * 32; i += 16) {
                const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(&scb[s][i]), mm));
                _mm512_store_ps(&pb[s][i], p);
                lsum[s] = _mm512_add_ps(lsum[s], p);
                pm = _mm512_max_ps(pm, p);
            }
            const float pmax = _mm512_reduce_max_ps(pm);
            for (int u = 0; u < 4 * !(ABL & 2); ++u) {
                const float bound = pmax * dvmax[u];
                const float inv = bound > 0 ? 255.0f / bound : 0.0f;
                sw[s][u] = bound / 255.0f;
                const __m512 iv = _mm512_set1_ps(inv);
                for (int tt = 0; tt < NT; ++tt) {
                    const vtile& V = vt[t0 + tt];
                    for (int h = 0; h < 2; ++h) {
                        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(&V.d[u][16 * h])));
                        const __m512i w = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(&pb[s][32 * tt + 16 * h]), d), iv));
                        _mm_store_si128(reinterpret_cast<__m128i*>(&wbb[s][u][32 * tt + 16 * h]), _mm512_cvtusepi32_epi8(w));
                    }
                }
            }
        }
        for (int sp = 0; sp < G; sp += 2) {
            __m512i a[2][8];
            for (int s = 0; s < 2; ++s)
                for (int k = 0; k < 8; ++k) a[s][k] = _mm512_setzero_si512();
            for (int tt = 0; tt < NT; ++tt) {
                const vtile& V = vt[t0 + tt];
                for (int cg = 0; cg < 8 * !(ABL & 4); ++cg) {
                    for (int s = 0; s < 2; ++s) {
                        std::int32_t wd[4];
                        for (int u = 0; u < 4; ++u) std::memcpy(&wd[u], &wbb[sp + s][u][32 * tt + 4 * cg], 4);
                        for (int k = 0; k < 8; ++k)
                            a[s][k] = dpb(a[s][k], _mm512_set1_epi32(wd[k / 2]), _mm512_load_si512(&V.c[cg][16 * k]));
                    }
                }
            }
            for (int s = 0; s < 2; ++s)
                for (int k = 0; k < 8; ++k) {
                    float* o = &acc_out[sp + s][16 * k];
                    _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[s][k]), _mm512_set1_ps(sw[sp + s][k / 2]), _mm512_load_ps(o)));
                }
        }
    }
    for (int s = 0; s < G; ++s) {
        l[s] = _mm512_reduce_add_ps(lsum[s]);
        for (int d = 0; d < D; ++d) out[s * D + d] = acc_out[s][d] / l[s];
    }
}

struct tile_cache {  // one layer: HKV heads, n cells
    int ntiles;
    std::vector<ktile> k;
    std::vector<vtile> v;
    std::vector<float> kf, vf;  // dequantized (stored) values [h][cell][D], for checks (layer 0 only)
};

static void build(tile_cache& tc, int n, const std::vector<float>& pat, bool keep) {
    tc.ntiles = n / 32;
    tc.k.resize(std::size_t(HKV) * tc.ntiles);
    tc.v.resize(std::size_t(HKV) * tc.ntiles);
    if (keep) { tc.kf.resize(std::size_t(HKV) * n * D); tc.vf.resize(std::size_t(HKV) * n * D); }
    std::size_t pi = 0;
    for (int h = 0; h < HKV; ++h)
        for (int c = 0; c < n; ++c)
            for (int kv = 0; kv < 2; ++kv)
                for (int u = 0; u < 4; ++u) {
                    float x[32];
                    for (int i = 0; i < 32; ++i) x[i] = pat[(pi++) % pat.size()];
                    std::int8_t q[32];
                    std::uint16_t db;
                    quant_block(x, q, db);
                    const int t = c / 32, j = c % 32;
                    if (kv == 0) {
                        ktile& K = tc.k[std::size_t(h) * tc.ntiles + t];
                        K.d[u][j] = db;
                        for (int i = 0; i < 32; ++i) K.c[8 * u + i / 4][j][i % 4] = static_cast<std::uint8_t>(q[i] + 128);
                    } else {
                        vtile& V = tc.v[std::size_t(h) * tc.ntiles + t];
                        V.d[u][j] = db;
                        for (int i = 0; i < 32; ++i) V.c[j / 4][32 * u + i][j % 4] = q[i];
                    }
                    if (keep)
                        for (int i = 0; i < 32; ++i)
                            (kv == 0 ? tc.kf : tc.vf)[(std::size_t(h) * n + c) * D + 32 * u + i] = q[i] * h2f(db);
                }
}

static void run_tiles(const tile_cache& tc, const float* qs, float* out) {
    for (int h = 0; h < HKV; ++h)
        decode_head(&tc.k[std::size_t(h) * tc.ntiles], &tc.v[std::size_t(h) * tc.ntiles], tc.ntiles, qs + h * G * D, out + h * G * D);
}

int main(int argc, char** argv) {
    const int n = argc > 1 ? std::atoi(argv[1]) : 2048;
    const int layers = argc > 2 ? std::atoi(argv[2]) : 1;
    const int iters = argc > 3 ? std::atoi(argv[3]) : 200;
    const char* ghz_env = std::getenv("KVCACHE_BENCH_GHZ");
    const double ghz = ghz_env != nullptr ? std::strtod(ghz_env, nullptr) : 4.1;
    const std::vector<float> pf = random_pattern();
    std::vector<tile_cache> tcs(layers);
    for (int l = 0; l < layers; ++l) build(tcs[l], n, pf, l == 0);
    auto c16 = make_cache<kvcache::f16>(n, layers, pf);
    auto c8 = make_cache<kvcache::q8_0>(n, layers, pf);
    std::vector<float> q(NH * D);
    std::mt19937 r2(2);
    std::normal_distribution<float> n1(0.0f, 1.0f);
    for (auto& x : q) x = n1(r2);
    const float scale = 1.0f / std::sqrt(float(D));
    std::vector<float> qs(q.size());
    for (std::size_t i = 0; i < q.size(); ++i) qs[i] = q[i] * scale;
    std::vector<float> out(NH * D), out16(NH * D), out8(NH * D);
    // check against double reference on stored values (layer 0)
    run_tiles(tcs[0], qs.data(), out.data());
    double num = 0, den = 0;
    for (int h = 0; h < HKV; ++h)
        for (int s = 0; s < G; ++s) {
            const float* qq = &qs[(h * G + s) * D];
            std::vector<double> lg(n);
            double mx = -1e300;
            for (int c = 0; c < n; ++c) {
                double a = 0;
                for (int d = 0; d < D; ++d) a += double(qq[d]) * tcs[0].kf[(std::size_t(h) * n + c) * D + d];
                lg[c] = a;
                mx = std::max(mx, a);
            }
            double L = 0;
            std::vector<double> o(D, 0.0);
            for (int c = 0; c < n; ++c) {
                const double p = std::exp(lg[c] - mx);
                L += p;
                for (int d = 0; d < D; ++d) o[d] += p * tcs[0].vf[(std::size_t(h) * n + c) * D + d];
            }
            for (int d = 0; d < D; ++d) {
                const double ref = o[d] / L, e = out[(h * G + s) * D + d] - ref;
                num += e * e;
                den += ref * ref;
            }
        }
    std::printf("tile q8 NMSE vs stored values: %.3g\n", num / den);
    kvcache::ops::attention_params p;
    p.n_head = NH;
    p.n_threads = 1;
    kvcache::ops::attention_workspace w16, w8;
    const pos_t qp = n;
    const seq_id_t sq = 0;
    kvcache::ops::attention(*c16, 0, q.data(), &qp, &sq, 1, p, out16.data(), w16);
    kvcache::ops::attention(*c8, 0, q.data(), &qp, &sq, 1, p, out8.data(), w8);
    double t_tile = 0, t16 = 0, t8 = 0;
    for (int it = 0; it < iters; ++it) {
        const int l = it % layers;
        double a = now();
        run_tiles(tcs[l], qs.data(), out.data());
        double b = now();
        kvcache::ops::attention(*c16, l, q.data(), &qp, &sq, 1, p, out16.data(), w16);
        double c = now();
        kvcache::ops::attention(*c8, l, q.data(), &qp, &sq, 1, p, out8.data(), w8);
        double d = now();
        if (it >= layers) { t_tile += b - a; t16 += c - b; t8 += d - c; }
    }
    const double cells = double(iters - layers) * n * HKV;
    std::printf("n %d layers %d: cycles/cell/kvhead  tile-q8 %.1f  f16 %.1f  q8_0(lib) %.1f   f16/tile %.2f  f16/q8lib %.2f\n", n, layers,
                t_tile / cells * ghz * 1e9, t16 / cells * ghz * 1e9, t8 / cells * ghz * 1e9, t16 / t_tile, t16 / t8);
}
