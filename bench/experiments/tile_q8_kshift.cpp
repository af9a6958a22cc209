// Experiment (bench/README.md, "A tile format for q8_0 decode, measured before building
// it"): the q8_0 K-shift on the tile format of tile_q8_decode.cpp (per KV head and 32-cell
// tile: 128 binary16 scales, then the codes + 128 as [group of 4 rows][cell][4 rows]),
// timed against the library's own f16 and q8_0 K-shift (ops::apply_k_shift, one thread) on
// caches of the same cells, one layer after another. Every cell moves by one shared delta;
// plain RoPE pairs (rows 2i, 2i + 1), head dim 128, 8 KV heads. Per unit of 32 rows and 16
// cells (one lane per cell): dequantize, rotate (x0 c - x1 s, x0 s + x1 c), the 16 cells'
// max |y| as a lane-wise max (no transposing tree: a block is one lane), scales
// binary16(max / 127), codes round-half-away(y / d) clamped to +-127; non-finite scales are
// not handled here (the library's kernel is). Prints the largest error of a rotated value
// against a float64 rotation of the stored values (in units of its block's new scale),
// then ns per block of 32 values and the same-run ratios f16 / tile and f16 / library q8_0.
// Build: cmake --build build --target kvcache_exp_tile_q8_kshift (AVX-512 BW CPUs).
// Run: ./build/bench/kvcache_exp_tile_q8_kshift <cells> <layers> <iterations>, e.g. 16384 8 16.
#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "kvcache_exp_tile_q8_kshift needs AVX-512 F and BW (-march=native on such a CPU)"
#endif
#include <immintrin.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "tile_q8_common.hpp"

using namespace tile_exp;

// Rotates every cell of one tile by the pairs' cos / sin (cs[64], sn[64]).
static void rotate_tile(ktile& K, const float* cs, const float* sn) {
    const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
    const __m512 half = _mm512_set1_ps(0.5f), lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    const __m512 q127 = _mm512_set1_ps(1.0f / 127.0f), one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512i byte = _mm512_set1_epi32(0xff);
    alignas(64) float y[8][4][16];
    for (int u = 0; u < 4; ++u)
        for (int h = 0; h < 2; ++h) {
            const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(&K.d[u][16 * h])));
            __m512 amax = _mm512_setzero_ps();
            for (int gi = 0; gi < 8; ++gi) {
                const int g = 8 * u + gi;
                const __m512i v = _mm512_xor_si512(_mm512_load_si512(&K.c[g][16 * h]), flip);  // signed codes
                const __m512 x0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)), d);
                const __m512 x1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)), d);
                const __m512 x2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)), d);
                const __m512 x3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)), d);
                const __m512 c0 = _mm512_set1_ps(cs[2 * g]), s0 = _mm512_set1_ps(sn[2 * g]);
                const __m512 c1 = _mm512_set1_ps(cs[2 * g + 1]), s1 = _mm512_set1_ps(sn[2 * g + 1]);
                const __m512 y0 = _mm512_fmsub_ps(x0, c0, _mm512_mul_ps(x1, s0));
                const __m512 y1 = _mm512_fmadd_ps(x0, s0, _mm512_mul_ps(x1, c0));
                const __m512 y2 = _mm512_fmsub_ps(x2, c1, _mm512_mul_ps(x3, s1));
                const __m512 y3 = _mm512_fmadd_ps(x2, s1, _mm512_mul_ps(x3, c1));
                _mm512_store_ps(y[gi][0], y0);
                _mm512_store_ps(y[gi][1], y1);
                _mm512_store_ps(y[gi][2], y2);
                _mm512_store_ps(y[gi][3], y3);
                amax = _mm512_range_ps(amax, _mm512_range_ps(_mm512_range_ps(y0, y1, 0x0B), _mm512_range_ps(y2, y3, 0x0B), 0x0B), 0x0B);
            }
            const __m256i hd = _mm512_cvtps_ph(_mm512_mul_ps(amax, q127), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_store_si256(reinterpret_cast<__m256i*>(&K.d[u][16 * h]), hd);
            const __m512 dn = _mm512_cvtph_ps(hd);
            const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dn, _mm512_setzero_ps(), _CMP_NEQ_OQ), one, dn);
            for (int gi = 0; gi < 8; ++gi) {
                __m512i w = _mm512_setzero_si512();
                for (int r = 0; r < 4; ++r) {
                    const __m512 t = _mm512_mul_ps(_mm512_load_ps(y[gi][r]), id);
                    // round half away from zero: trunc(t + copysign(0.5, t))
                    const __m512 hs = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(t), sign, _mm512_castps_si512(half), 0xEA));
                    const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(t, hs), nlim), lim);
                    const __m512i qi = _mm512_and_si512(_mm512_cvttps_epi32(q), byte);
                    w = r == 0 ? qi : _mm512_or_si512(w, _mm512_slli_epi32(qi, 8 * r));
                }
                _mm512_store_si512(&K.c[8 * u + gi][16 * h], _mm512_xor_si512(w, flip));
            }
        }
}

int main(int argc, char** argv) {
    const int n = argc > 1 ? std::atoi(argv[1]) : 16384;
    const int layers = argc > 2 ? std::atoi(argv[2]) : 8;
    const int iters = argc > 3 ? std::atoi(argv[3]) : 16;
    const std::vector<float> pf = random_pattern();
    const int ntiles = n / 32;
    std::vector<std::vector<ktile>> tl(layers, std::vector<ktile>(std::size_t(HKV) * ntiles));
    std::size_t pi = 0;
    for (auto& layer : tl)
        for (int h = 0; h < HKV; ++h)
            for (int c = 0; c < n; ++c)
                for (int u = 0; u < 4; ++u) {
                    float x[32];
                    for (int i = 0; i < 32; ++i) x[i] = pf[(pi++) % pf.size()];
                    std::int8_t q[32];
                    std::uint16_t db;
                    quant_block(x, q, db);
                    ktile& K = layer[std::size_t(h) * ntiles + c / 32];
                    K.d[u][c % 32] = db;
                    for (int i = 0; i < 32; ++i) K.c[8 * u + i / 4][c % 32][i % 4] = static_cast<std::uint8_t>(q[i] + 128);
                }
    // cos / sin of delta 1 (and -1), base 10000
    float cs[2][64], sn[2][64];
    for (int i = 0; i < 64; ++i) {
        const double th = std::pow(10000.0, -2.0 * i / D);
        cs[0][i] = static_cast<float>(std::cos(th));
        sn[0][i] = static_cast<float>(std::sin(th));
        cs[1][i] = cs[0][i];
        sn[1][i] = -sn[0][i];
    }
    {  // check one tile against a float64 rotation of its stored values
        ktile K = tl[0][0];
        const ktile before = K;
        rotate_tile(K, cs[0], sn[0]);
        double worst = 0;
        for (int c = 0; c < 32; ++c)
            for (int u = 0; u < 4; ++u) {
                const double dn = h2f(K.d[u][c]);
                for (int i = 0; i < 32; i += 2) {
                    const int r = 32 * u + i, pair = r / 2;
                    auto val = [&](const ktile& t, int row) {
                        return (t.c[row / 4][c][row % 4] - 128) * double(h2f(t.d[row / 32][c]));
                    };
                    const double x0 = val(before, r), x1 = val(before, r + 1);
                    const double y0 = x0 * cs[0][pair] - x1 * sn[0][pair], y1 = x0 * sn[0][pair] + x1 * cs[0][pair];
                    worst = std::max({worst, std::fabs(val(K, r) - y0) / dn, std::fabs(val(K, r + 1) - y1) / dn});
                }
            }
        std::printf("largest error of a rotated value: %.3f of its block's new scale (rounding alone: 0.5)\n", worst);
    }
    auto c16 = make_cache<kvcache::f16>(n, layers, pf);
    auto c8 = make_cache<kvcache::q8_0>(n, layers, pf);
    double tt = 0, t16 = 0, t8 = 0;
    int delta = 1;
    for (int it = 0; it < iters; ++it) {
        c16->seq_add(0, 0, -1, delta).value();
        c8->seq_add(0, 0, -1, delta).value();
        const int side = delta > 0 ? 0 : 1;
        delta = -delta;
        double a = now();
        for (auto& layer : tl)
            for (auto& K : layer) rotate_tile(K, cs[side], sn[side]);
        double b = now();
        kvcache::ops::apply_k_shift(*c16, 1);
        double c = now();
        kvcache::ops::apply_k_shift(*c8, 1);
        double d = now();
        if (it > 0) { tt += b - a; t16 += c - b; t8 += d - c; }
    }
    const double blocks = double(iters - 1) * layers * HKV * n * (D / 32);
    std::printf("n %d layers %d: ns per block  tile-q8 %.2f  f16 %.2f  q8_0(lib) %.2f   f16/tile %.2f  f16/q8lib %.2f\n", n, layers,
                tt / blocks * 1e9, t16 / blocks * 1e9, t8 / blocks * 1e9, t16 / tt, t16 / t8);
}
