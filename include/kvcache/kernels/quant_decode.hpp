// kvcache kernels: attention that reads q8_0 / q4_0 K and V blocks in place.
//
// The generic path (tile_source.hpp, converted_tiles) dequantizes each visited tile into
// f32 scratch and runs the f32 kernel on it: every value is converted, scaled, stored and
// loaded again (and K transposed one value at a time), and decode ran at 0.19-0.26 of the
// f16 speed. quant_tiles adds the two stages attention_kernel (attention.hpp) then calls
// instead, for every item (decode and prefill, both V arrangements, every layout):
//
// - score (q.K, integer dot products on a 16-bit query): each slot's scaled query is
//   quantized per block of 32 K rows to int16 (d_q = max|q| / 32767). A K unit is 32
//   values of one cell; the units of 16 (AVX-512) or 8 (AVX2) cells are transposed in
//   registers into one vector per 4 K rows (a dword of 4 int8 codes per cell; q4_0
//   nibbles unpacked and re-centred to -8..7), sign-extended to int16 and multiplied with
//   the slot's 4 query values by vpdpwssd (AVX-512 VNNI) or vpmaddwd: an exact int32 sum
//   per cell and pair of rows. At the end of each block the sums are converted and scaled
//   by d_k (per cell) * d_q (per slot). Per slot and 4 K rows of 16 cells: 2 vpdpwssd
//   where the f16 kernel issues 4 FMAs (and the conversions are shared by the slots).
// - score on AVX-512 VNNI builds: the int16 query codes (|q| <= 32639) are split into two
//   signed bytes, q = 256 hi + lo, the K codes made unsigned (q8_0: + 128; q4_0: the stored
//   nibbles) and vpdpbusd adds 4 rows x 16 cells per instruction for lo and for hi; per
//   block sum = 256 hi + lo - offset * sum(q), exact in int32, one lane per cell (no sign
//   extension of K, no lane pairs to add at the end). Both 16-cell halves of the tile are
//   in registers per K unit, so each query broadcast feeds two vpdpbusd.
// - prefetch: the next tile's K lines (and V lines one tile further) are asked for spread
//   over the score / accumulate loops, one unit's lines per step. q8_0 16K-cell decode,
//   1 thread, Zen 5 VM (contended), f16 time / q8_0 time in alternating runs: 0.52-0.60
//   with the burst of all lines at the start of the tile that was here before, 0.72-0.90
//   spread, 0.48-0.50 with no prefetch at all.
// - accumulate (p.V, f32): the block scale is folded into the probability (w = p * d_v per
//   cell, block and slot, exactly 0 for a cell the slot does not see), for all the tile's
//   units before any FMA (their scale gathers overlap instead of stalling each unit's
//   FMAs); each V unit is widened int8 -> int32 -> f32 in registers and accumulated with
//   FMAs. q4_0 codes: AVX-512 looks (code - 8) up in a 16-entry table (one vpermps per 16
//   values); AVX2's float path (below: a tile with a non-finite weight) accumulates them
//   as 0..15 and subtracts 8 * sum(w) once per block.
// - accumulate, q4_0 on AVX2 (accumulate_bytes): p.V on 8-bit weights. Where f16 decode is
//   held by its own FMAs (an AVX2 core: 2 x 8 lanes per cycle), the float p.V issued the
//   same 64 FMAs per cell and KV head as f16 (4 query heads, head dim 128) plus the codes'
//   widening, and took ~68 of q4_0's ~106 cycles per cell and KV head (Zen 3, perf). Now
//   the folded weights of each unit and slot are rounded to int8 per tile (step sw = max|w|
//   / 127, or sum|w| / 2168 where that is larger, so that the tile's int16 sums cannot
//   overflow), the nibbles of two cells are interleaved so that one vpmaddubsw multiplies
//   16 dimensions of both cells by their two weights, the int16 sums of the tile's 16 cell
//   pairs are widened and added to the f32 accumulators times sw, and 8 sw sum(wq) is taken
//   off (the codes are 0..15). Per cell pair, unit and slot: 2 vpmaddubsw and 2 adds where
//   the float path issued 8 FMAs. Zen 3 (2.445 GHz), attn_decode_hot/q4_0, least of 15
//   runs on a contended host: 102-106 -> 75-81 cycles per cell and KV head.
//   The weights' rounding (at most sw / 2 per cell and tile) adds NMSE 1.5e-5 - 2.2e-4
//   against the stored values; against the unquantized values q4_0's attention NMSE moves
//   from 1.276e-2 to 1.278e-2 - 1.281e-2 (its 4-bit codes' own error). Each slot's weights are
//   its own, so the deterministic mode holds. A NaN / inf weight (a bad scale a slot sees)
//   sends the tile to the float path. q8_0 keeps float p.V: its codes' products with 8-bit
//   weights overflow vpmaddubsw's int16 pair sums, and its 8-bit rounding is the size
//   of the weights'.
//
// Why a 16-bit query for q8_0 and not llama.cpp's 8-bit one (vpdpbusd on int8 q and K):
// with an int8 query the error of q.K doubles for q8_0 K (the query's rounding, max|q| /
// 254 per block, is as large as the K codes' own), which moved attention NMSE against the
// unquantized float64 above llama.cpp's format with f32 queries (tests/element/
// test_quant.cpp); int16 adds 2^-16 of the block's largest value: NMSE ~4e-10 against
// the stored values, 1e5 times below the K/V rounding. It costs one sign extension per 4
// rows and 16 cells, shared by all slots (AVX-512 VNNI: a second vpdpbusd).
// q4_0 K on AVX-512 VNNI and AVX2 takes the query as one signed byte per value (byte_query),
// as llama.cpp's q4_0 dot products do: the 4-bit codes' own rounding is ~16x the byte
// query's, so attention NMSE against the unquantized values stays 1.28e-2 (llama.cpp's
// format with f32 queries: 1.26e-2) and the error against the stored values is ~3e-5.
// VNNI: one vpdpbusd per 4 rows, 16 cells and slot on the stored nibbles (0..15), minus 8
// sum(q) per block. AVX2: vpmaddubsw (nibbles x query bytes, int16 sums of two rows, 8 of
// them added in int16 without overflow) and one vpmaddwd by ones per block, in place of a
// sign extension, two vpmaddwd and two adds per 4 rows: q4_0 decode from the caches
// 110 -> 79 cycles per cell and KV head (Zen 5, x86-64-v3 build).
//
// Results: each slot's scores and V sums depend on its own query and mask only (integer
// sums are exact, the f32 steps run in a fixed order per slot, w = 0 outside its mask),
// so ops' deterministic mode (bits independent of the call's other rows and of the
// threads) holds. Masks, windows and soft-cap are applied by attention_kernel on the
// scores as for every element; a NaN / inf scale (element/q8_0.hpp) makes the rows that
// see the cell NaN. Compiled with AVX2 + FMA + F16C (x86-64-v3) or AVX-512 BW/VL;
// elsewhere quant_tiles::fast is false and the generic path runs.
#pragma once

#include <array>    // scales16_run windows
#include <bit>      // std::countr_zero
#include <cmath>    // std::fabs, std::nearbyint, std::isfinite
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <cstring>  // std::memcpy
#include <limits>   // quiet_NaN
#include <type_traits>  // std::is_same_v, std::conditional_t

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../config.hpp"
#include "../element/q4_0.hpp"
#include "../element/q8_0.hpp"
#include "../format/kv_view.hpp"
#include "tile_source.hpp"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define KVCACHE_QDEC_512 1
#if defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define KVCACHE_QDEC_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVCACHE_QDEC_256 1
#endif

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// Tiles of a q8_0 / q4_0 cache: the generic path's conversion (converted_tiles) plus the
/// decode stages that read the blocks in place (see the top of this file). Scratch: the
/// converted_tiles buffers; k_buf also holds the quantized queries (M x dk int16 and
/// M x dk / 32 scales) while the fast stages run, v_buf the folded probabilities.
template <class Element>
struct quant_tiles : converted_tiles<Element> {
    using T = typename Element::storage_type;
    static constexpr bool four_bit = std::is_same_v<Element, q4_0>;
    static_assert(four_bit || std::is_same_v<Element, q8_0>, "quant_tiles: q8_0 or q4_0");
#if defined(KVCACHE_QDEC_512) || defined(KVCACHE_QDEC_256)
    /// Whether this build has the fast stages (else attention_kernel takes the generic path).
    static constexpr bool fast = true;
#else
    static constexpr bool fast = false;
#endif
    /// Bytes of one unit (34 or 18) and offset of its codes after the binary16 scale.
    static constexpr std::size_t unit_bytes = sizeof(T);
    static constexpr std::size_t codes_at = 2;
#if defined(KVCACHE_QDEC_VNNI) || defined(KVCACHE_QDEC_256)
    /// q4_0 on AVX-512 VNNI and AVX2: the query as one signed byte per value (see the top of
    /// this file: the 4-bit K codes' rounding is ~16x the byte query's).
    static constexpr bool byte_query = four_bit;
#else
    static constexpr bool byte_query = false;
#endif
#if defined(KVCACHE_QDEC_VNNI)
    static constexpr bool vnni = true;
    /// Largest |query code|: 127 * 256 + 127, so that each code splits into two signed bytes
    /// (127 for a byte query).
    static constexpr float q_max = byte_query ? 127.0f : 32639.0f;
#else
    static constexpr bool vnni = false;
    static constexpr float q_max = byte_query ? 127.0f : 32767.0f;
#endif

    /// Bytes per slot and block of the query's byte form (prepare): 32 for a byte query, 64
    /// for VNNI's two bytes per int16 value.
    static constexpr std::size_t q_bytes_per_block = byte_query ? 32 : 64;
    /// Where prepare puts the query's bytes (after the scales dq of m slots x nu blocks) and
    /// their block sums (after the bytes).
    /// (F: float or const float.)
    template <class F>
    static auto* q_bytes(F* dq, std::size_t m, std::uint32_t nu) noexcept {
        using B = std::conditional_t<std::is_const_v<F>, const std::int8_t, std::int8_t>;
        return reinterpret_cast<B*>(dq + m * nu);
    }
    template <class F>
    static auto* q_sums(F* dq, std::size_t m, std::uint32_t nu) noexcept {
        using S = std::conditional_t<std::is_const_v<F>, const std::int32_t, std::int32_t>;
        return reinterpret_cast<S*>(dq + m * nu + m * nu * q_bytes_per_block / sizeof(float));
    }

    /// Quantizes the M scaled queries of q_buf ([K row][slot], dk rows) to int16 per block
    /// of 32 rows into k_buf: q16 [slot][row], then the scales dq [slot][block].
    void prepare(const float* q_buf, std::size_t m, std::uint32_t dk) const noexcept {
        auto* q16 = reinterpret_cast<std::int16_t*>(this->k_buf);
        float* dq = this->k_buf + (m * dk + 1) / 2;
        const std::uint32_t nu = dk / 32;
        for (std::size_t s = 0; s < m; ++s)
            for (std::uint32_t u = 0; u < nu; ++u) {
                float amax = 0.0f;
                bool finite = true;
                for (std::uint32_t i = 0; i < 32; ++i) {
                    const float x = q_buf[(std::size_t{u} * 32 + i) * m + s];
                    finite = finite && std::isfinite(x);
                    amax = std::fabs(x) > amax ? std::fabs(x) : amax;
                }
                const float inv = finite && amax > 0.0f ? q_max / amax : 0.0f;
                dq[s * nu + u] = finite ? amax / q_max : std::numeric_limits<float>::quiet_NaN();
                for (std::uint32_t i = 0; i < 32; ++i) {
                    const float x = q_buf[(std::size_t{u} * 32 + i) * m + s] * inv;
                    float r = std::nearbyint(x);
                    r = r > q_max ? q_max : (r < -q_max ? -q_max : r);
                    q16[s * dk + std::size_t{u} * 32 + i] = static_cast<std::int16_t>(r);
                }
            }
#if defined(KVCACHE_QDEC_VNNI) || defined(KVCACHE_QDEC_256)
        // VNNI: each int16 value as two signed bytes, q = 256 hi + lo (lo the signed low byte;
        // |q| <= q_max keeps hi in -127..127), per slot and block [lo x 32][hi x 32]; a byte
        // query (VNNI or AVX2): the codes as bytes, 32 per slot and block. Then the block
        // sums of q: qb = dq + m * nu, sums after the bytes.
        if constexpr (byte_query || vnni) {
            constexpr std::size_t per = q_bytes_per_block;
            std::int8_t* qb = q_bytes(dq, m, nu);
            std::int32_t* qsum = q_sums(dq, m, nu);
            for (std::size_t s = 0; s < m; ++s)
                for (std::uint32_t u = 0; u < nu; ++u) {
                    std::int32_t sum = 0;
                    std::int8_t* b = qb + (s * nu + u) * per;
                    for (std::uint32_t i = 0; i < 32; ++i) {
                        const std::int32_t q = q16[s * dk + std::size_t{u} * 32 + i];
                        const auto lo = static_cast<std::int8_t>(static_cast<std::uint8_t>(q & 0xFF));
                        b[i] = lo;
                        if constexpr (!byte_query) b[32 + i] = static_cast<std::int8_t>((q - lo) / 256);
                        sum += q;
                    }
                    qsum[s * nu + u] = sum;
                }
        }
#endif
    }

#if defined(KVCACHE_QDEC_512)
    // ---------------------------------------------------------------- AVX-512
    /// Scales of the 16 consecutive units at `base` (unit_bytes apart, as in a K tile or a
    /// transposed V tile): the binary16 words picked by one vpermt2w per 128-byte window
    /// (16 x 34 bytes: 4 windows), the windows' lanes or-ed together. Zen 5: ~9 cycles per
    /// 16 scales against ~30 for a 16-lane vpgatherdd. Reads only the 16 units'
    /// bytes (a window past them is a masked load, which does not fault).
    static __m512 scales16_run(const char* base) noexcept {
        constexpr std::uint32_t wpu = unit_bytes / 2;                  // binary16 words per unit
        constexpr std::uint32_t span = 16 * wpu, n_win = 15 * wpu / 64 + 1;
        static_assert(unit_bytes % 2 == 0 && n_win <= 4, "scales16_run: 16 units in at most 4 windows of 64 words");
        struct window {
            alignas(64) std::uint16_t idx[32];
            __mmask32 lanes;
        };
        static constexpr auto windows = [] {
            std::array<window, n_win> w{};
            for (std::uint32_t i = 0; i < 16; ++i) {
                const std::uint32_t word = i * wpu, k = word / 64;
                w[k].idx[i] = static_cast<std::uint16_t>(word - 64 * k);
                w[k].lanes |= __mmask32{1} << i;
            }
            return w;
        }();
        auto part = [base](std::uint32_t w0) {  // words [w0, w0 + 32) of the 16 units, zero past them
            if (w0 >= span) return _mm512_setzero_si512();
            const std::uint32_t n = span - w0 < 32 ? span - w0 : 32;
            const auto* p = base + std::size_t{w0} * 2;
            if (n == 32) return _mm512_loadu_si512(p);
            return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((std::uint64_t{1} << n) - 1), p);
        };
        __m512i r = _mm512_setzero_si512();
        for (std::uint32_t k = 0; k < n_win; ++k)
            r = _mm512_or_si512(r, _mm512_maskz_permutex2var_epi16(windows[k].lanes, part(64 * k),
                                                                   _mm512_load_si512(windows[k].idx), part(64 * k + 32)));
        return _mm512_cvtph_ps(_mm512_castsi512_si256(r));
    }
    /// Scales of a row-major V block of two units per cell (64 dimensions: cells 2 *
    /// unit_bytes apart, a cell's units side by side) for the 16 cells at `base`: d0 = the
    /// first unit's, d1 = the second's. A 128-byte window at each pair of cells holds their
    /// 4 scales; one vpermt2w per window, the same index for every window (lanes 2k, 2k + 1
    /// for the first units of cells 2k, 2k + 1, lanes 16 + 2k, 17 + 2k for the second),
    /// masked to its 4 lanes. Reads only the 16 cells' bytes (a masked tail).
    static void scales16_pairs(const char* base, __m512& d0, __m512& d1) noexcept {
        constexpr std::uint32_t wpu = unit_bytes / 2, cw = 2 * wpu;  // words per unit, per cell
        constexpr std::uint32_t need = cw + wpu + 1;                  // words a window reads
        static_assert(need <= 64, "scales16_pairs: the 4 scales of two cells within 64 words");
        static constexpr auto idx = [] {
            struct table {
                alignas(64) std::uint16_t v[32];
            } t{};
            for (std::uint32_t l = 0; l < 32; ++l)
                t.v[l] = static_cast<std::uint16_t>((l % 2 == 1 ? cw : 0) + (l >= 16 ? wpu : 0));
            return t;
        }();
        const __m512i ix = _mm512_load_si512(idx.v);
        constexpr auto hi_mask = static_cast<__mmask32>(need > 32 ? (std::uint64_t{1} << (need - 32)) - 1 : 0);
        __m512i r = _mm512_setzero_si512();
        for (std::uint32_t k = 0; k < 8; ++k) {
            const char* p = base + std::size_t{2 * k} * cw * 2;
            const __m512i lo = need >= 32 ? _mm512_loadu_si512(p)
                                          : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((std::uint64_t{1} << need) - 1), p);
            const __m512i hi = need > 32 ? _mm512_maskz_loadu_epi16(hi_mask, p + 64) : _mm512_setzero_si512();
            const auto lanes = static_cast<__mmask32>((0x3u << (2 * k)) | (0x3u << (16 + 2 * k)));
            r = _mm512_or_si512(r, _mm512_maskz_permutex2var_epi16(lanes, lo, ix, hi));
        }
        d0 = _mm512_cvtph_ps(_mm512_castsi512_si256(r));
        d1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(r, 1));
    }
    /// Codes of 16 units (cells c .. c + 15 of one K row block) as 8 vectors, vector g holding
    /// rows [4g, 4g + 4) of every cell as 4 signed bytes (lane = cell); Raw: q4_0 nibbles as
    /// stored (0..15).
    template <bool Raw = false>
    static void k_codes16(const char* base, __m512i (&x)[8]) noexcept {
        if constexpr (!four_bit) {
            __m512i z[8];
            for (int i = 0; i < 8; ++i) {
                const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + i * unit_bytes + codes_at));
                const __m256i hi =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (i + 8) * unit_bytes + codes_at));
                z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            }
            // 8 x 8 dword transposes in both 256-bit halves.
            __m512i t[8], w[8];
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
                t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                w[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
                w[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
                w[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
                w[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
            }
            // w[0..3]: rows 0..3 of cells 0-3 (128-bit lane 0) and 8-11 (lane 2), rows 4..7 in
            // lanes 1 and 3; w[4..7] the same for cells 4-7 / 12-15.
            const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
            const __m512i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
            for (int g = 0; g < 4; ++g) {
                x[g] = _mm512_permutex2var_epi64(w[g], lo_idx, w[g + 4]);
                x[g + 4] = _mm512_permutex2var_epi64(w[g], hi_idx, w[g + 4]);
            }
        } else {
            __m512i z[4];
            for (int i = 0; i < 4; ++i) {
                __m512i v = _mm512_castsi128_si512(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + i * unit_bytes + codes_at)));
                v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (i + 4) * unit_bytes + codes_at)), 1);
                v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (i + 8) * unit_bytes + codes_at)), 2);
                v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (i + 12) * unit_bytes + codes_at)), 3);
                z[i] = v;
            }
            // 4 x 4 dword transposes in each 128-bit lane: y[g] lane k = dword g of cells 4k..4k+3.
            const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
            const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
            const __m512i y[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                                  _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
            const __m512i nib = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(Raw ? 0 : 8);
            for (int g = 0; g < 4; ++g) {
                x[g] = _mm512_sub_epi8(_mm512_and_si512(y[g], nib), eight);  // values 4g..4g+3
                x[g + 4] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(y[g], 4), nib), eight);  // 16+4g..
            }
        }
    }

#if defined(KVCACHE_QDEC_VNNI)
    /// Codes of 16 units as 8 vectors of unsigned bytes (lane = cell, 4 rows per lane):
    /// q8_0 codes + 128, q4_0 nibbles as stored (0..15).
    static void k_codes16u(const char* base, __m512i (&x)[8]) noexcept {
        k_codes16<true>(base, x);
        if constexpr (!four_bit)
            for (int g = 0; g < 8; ++g) x[g] = _mm512_xor_si512(x[g], _mm512_set1_epi8(-128));
    }

    /// q.K of the 32 cells of K tile `tile` of head h for M slots into out[s * 32 + cell]:
    /// vpdpbusd of the unsigned K bytes with the query's low and high bytes (prepare),
    /// sum = 256 hi + lo - offset * sum(q) per block, exact in int32.
    template <std::size_t M>
    void score(const kv_layer_view<const T>& kv, std::uint32_t h, std::uint32_t tile, float* out,
               [[maybe_unused]] const char* pfk) const noexcept {
        const std::uint32_t nu = kv.k_units(), dk = kv.dim_k;
        const float* dq = this->k_buf + (M * dk + 1) / 2;
        const auto* qb = reinterpret_cast<const char*>(q_bytes(dq, M, nu));
        const std::int32_t* qsum = q_sums(dq, M, nu);
        const char* kt = reinterpret_cast<const char*>(kv.k_tile_ptr(h, tile));
        constexpr std::int32_t koff = four_bit ? 8 : 128;
        auto bq = [](const char* p) {
            std::int32_t v;
            std::memcpy(&v, p, sizeof v);
            return _mm512_set1_epi32(v);
        };
        // Both 16-cell halves of the tile per K unit: each query broadcast feeds two vpdpbusd
        // (one per half), half the broadcasts of a pass per half. 16 code vectors, 4 G
        // accumulators and 2 broadcasts: G = 2 fits the 32 registers (byte query: one
        // vpdpbusd per 4 rows, 16 cells and slot, 2 G accumulators: G = 4).
        constexpr std::size_t G = byte_query ? (M < 4 ? M : 4) : (M < 2 ? M : 2);
        __m512 f[M][2];
        for (std::size_t s = 0; s < M; ++s) f[s][0] = f[s][1] = _mm512_setzero_ps();
        for (std::uint32_t u = 0; u < nu; ++u) {
            const std::size_t off = std::size_t{u} * k_tile * unit_bytes;
            const char* base = kt + off;
            if (pfk != nullptr)
                for (std::size_t o = 0; o < k_tile * unit_bytes; o += 64) __builtin_prefetch(pfk + off + o, 0, 2);
            __m512i x[2][8];
            k_codes16u(base, x[0]);
            k_codes16u(base + 16 * unit_bytes, x[1]);
            const __m512 dk16[2] = {scales16_run(base), scales16_run(base + 16 * unit_bytes)};
            for (std::size_t s0 = 0; s0 < M; s0 += G) {
                if constexpr (byte_query) {  // sum = dot(nibbles, q) - 8 sum(q)
                    __m512i acc[G][2];
                    for (std::size_t s = 0; s < G; ++s) acc[s][0] = acc[s][1] = _mm512_setzero_si512();
                    for (int g = 0; g < 8; ++g)
                        for (std::size_t s = 0; s < G; ++s) {
                            const __m512i qv = bq(qb + ((s0 + s) * nu + u) * 32 + 4 * g);
                            for (int c = 0; c < 2; ++c) acc[s][c] = _mm512_dpbusd_epi32(acc[s][c], x[c][g], qv);
                        }
                    for (std::size_t s = 0; s < G; ++s) {
                        const std::size_t su = (s0 + s) * nu + u;
                        const __m512i corr = _mm512_set1_epi32(koff * qsum[su]);
                        const __m512 d = _mm512_set1_ps(dq[su]);
                        for (int c = 0; c < 2; ++c)
                            f[s0 + s][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[s][c], corr)),
                                                           _mm512_mul_ps(dk16[c], d), f[s0 + s][c]);
                    }
                    continue;
                }
                __m512i lo[G][2], hi[G][2];
                for (std::size_t s = 0; s < G; ++s) lo[s][0] = lo[s][1] = hi[s][0] = hi[s][1] = _mm512_setzero_si512();
                for (int g = 0; g < 8; ++g)
                    for (std::size_t s = 0; s < G; ++s) {
                        const char* qp = qb + ((s0 + s) * nu + u) * 64 + 4 * g;
                        const __m512i ql = bq(qp), qh = bq(qp + 32);
                        for (int c = 0; c < 2; ++c) {
                            lo[s][c] = _mm512_dpbusd_epi32(lo[s][c], x[c][g], ql);
                            hi[s][c] = _mm512_dpbusd_epi32(hi[s][c], x[c][g], qh);
                        }
                    }
                for (std::size_t s = 0; s < G; ++s) {
                    const std::size_t su = (s0 + s) * nu + u;
                    const __m512i corr = _mm512_set1_epi32(koff * qsum[su]);
                    const __m512 d = _mm512_set1_ps(dq[su]);
                    for (int c = 0; c < 2; ++c) {
                        const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[s][c], 8), lo[s][c]), corr);
                        f[s0 + s][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dk16[c], d), f[s0 + s][c]);
                    }
                }
            }
        }
        for (std::size_t s = 0; s < M; ++s)
            for (int c = 0; c < 2; ++c) _mm512_storeu_ps(out + s * k_tile + 16 * c, f[s][c]);
    }
#else
    /// q.K of the 32 cells of K tile `tile` of head h for M slots into out[s * 32 + cell].
    template <std::size_t M>
    void score(const kv_layer_view<const T>& kv, std::uint32_t h, std::uint32_t tile, float* out,
               [[maybe_unused]] const char* pfk) const noexcept {
        const auto* q16 = reinterpret_cast<const std::int16_t*>(this->k_buf);
        const float* dq = this->k_buf + (M * kv.dim_k + 1) / 2;
        const std::uint32_t nu = kv.k_units(), dk = kv.dim_k;
        const char* kt = reinterpret_cast<const char*>(kv.k_tile_ptr(h, tile));
        if (pfk != nullptr)  // the next tile's K lines
            for (std::size_t o = 0; o < std::size_t{k_tile} * nu * unit_bytes; o += 64) __builtin_prefetch(pfk + o, 0, 2);
        const __m512i dup_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m512i dup_hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
        constexpr std::size_t G = M < 4 ? M : 4;  // slots per pass: 2 G int32 accumulators

        __m512 f[2][M][2];
        for (int hh = 0; hh < 2; ++hh)
            for (std::size_t s = 0; s < M; ++s) f[hh][s][0] = f[hh][s][1] = _mm512_setzero_ps();
        for (std::uint32_t u = 0; u < nu; ++u)
            for (std::uint32_t c0 = 0; c0 < k_tile; c0 += 16) {  // (address order)
                const char* base = kt + (std::size_t{u} * k_tile + c0) * unit_bytes;
                __m512i x[8];
                k_codes16(base, x);
                const __m512 dk16 = scales16_run(base);
                const __m512 dlo = _mm512_permutexvar_ps(dup_lo, dk16), dhi = _mm512_permutexvar_ps(dup_hi, dk16);
                auto& fh = f[c0 / 16];
                for (std::size_t s0 = 0; s0 < M; s0 += G) {
                    __m512i ia[G][2];
                    for (std::size_t s = 0; s < G; ++s) ia[s][0] = ia[s][1] = _mm512_setzero_si512();
                    for (int g = 0; g < 8; ++g) {
                        const __m512i lo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(x[g]));        // cells 0..7
                        const __m512i hi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(x[g], 1));  // 8..15
                        for (std::size_t s = 0; s < G; ++s) {
                            std::int64_t qq;
                            std::memcpy(&qq, q16 + (s0 + s) * dk + std::size_t{u} * 32 + 4 * g, sizeof qq);
                            const __m512i qv = _mm512_set1_epi64(qq);
#if defined(__AVX512VNNI__)
                            ia[s][0] = _mm512_dpwssd_epi32(ia[s][0], lo, qv);
                            ia[s][1] = _mm512_dpwssd_epi32(ia[s][1], hi, qv);
#else
                            ia[s][0] = _mm512_add_epi32(ia[s][0], _mm512_madd_epi16(lo, qv));
                            ia[s][1] = _mm512_add_epi32(ia[s][1], _mm512_madd_epi16(hi, qv));
#endif
                        }
                    }
                    for (std::size_t s = 0; s < G; ++s) {
                        const __m512 d = _mm512_set1_ps(dq[(s0 + s) * nu + u]);
                        fh[s0 + s][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[s][0]), _mm512_mul_ps(dlo, d), fh[s0 + s][0]);
                        fh[s0 + s][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[s][1]), _mm512_mul_ps(dhi, d), fh[s0 + s][1]);
                    }
                }
            }
        // Lanes (2c, 2c + 1) hold cell c's two row pairs: add them.
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        for (int hh = 0; hh < 2; ++hh)
            for (std::size_t s = 0; s < M; ++s)
                _mm512_storeu_ps(out + s * k_tile + 16 * hh,
                                 _mm512_add_ps(_mm512_permutex2var_ps(f[hh][s][0], ev, f[hh][s][1]),
                                               _mm512_permutex2var_ps(f[hh][s][0], od, f[hh][s][1])));
    }

#endif  // KVCACHE_QDEC_VNNI

    /// The 32 values of a unit's codes as floats: a = values 0..15, b = 16..31 (q4_0: code - 8).
    static void v_values(const char* unit, __m512& a, __m512& b) noexcept {
        const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + codes_at));
        if constexpr (!four_bit) {
            const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + codes_at + 16));
            a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c0));
            b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c1));
        } else {
            // One vpermps per 16 values looks (code - 8) up in a 16-entry table, in place of
            // a convert and the 8 * sum(w) correction; vpermps reads the low 4 bits of each
            // index only, so neither nibble needs masking (after the 16-bit shift each byte's
            // low 4 bits are its own high nibble).
            const __m512 table = _mm512_setr_ps(-8.0f, -7.0f, -6.0f, -5.0f, -4.0f, -3.0f, -2.0f, -1.0f, 0.0f, 1.0f,
                                                2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f);
            a = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c0), table);
            b = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(c0, 4)), table);
        }
    }
#endif  // KVCACHE_QDEC_512

#if defined(KVCACHE_QDEC_256)
    // ---------------------------------------------------------------- AVX2
    /// Scales of the 8 units at `base`, `stride` bytes apart: 8 scalar loads packed into
    /// two 64-bit words, one conversion (an 8-lane gather costs ~15 cycles on Zen 5; the AVX2
    /// binary there, attn_decode vs_f16 in 3 alternating runs: q4_0 0.95-1.01 with the
    /// gather, 1.01-1.03 without; q8_0 1.03-1.08 and 1.05-1.08).
    static __m256 scales8(const char* base, std::int32_t stride) noexcept {
        std::uint64_t q[2];
        for (int k = 0; k < 2; ++k) {
            std::uint64_t v = 0;
            for (int i = 0; i < 4; ++i) {
                std::uint16_t d;
                std::memcpy(&d, base + static_cast<std::ptrdiff_t>(4 * k + i) * stride, sizeof d);
                v |= std::uint64_t{d} << (16 * i);
            }
            q[k] = v;
        }
        return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(q[1]), static_cast<long long>(q[0])));
    }
    /// Codes of 8 units (cells c .. c + 7) as 8 vectors: vector g = rows [4g, 4g + 4) of every
    /// cell as 4 signed bytes (lane = cell); Raw: q4_0 nibbles as stored (0..15).
    template <bool Raw = false>
    static void k_codes8(const char* base, __m256i (&x)[8]) noexcept {
        if constexpr (!four_bit) {
            __m256i z[8], t[8], w[8];
            for (int i = 0; i < 8; ++i)
                z[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + i * unit_bytes + codes_at));
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]);
                t[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                w[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
                w[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
                w[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
                w[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
            }
            for (int g = 0; g < 4; ++g) {
                x[g] = _mm256_permute2x128_si256(w[g], w[g + 4], 0x20);
                x[g + 4] = _mm256_permute2x128_si256(w[g], w[g + 4], 0x31);
            }
        } else {
            __m256i z[4];
            for (int i = 0; i < 4; ++i)
                z[i] = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + i * unit_bytes + codes_at))),
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (i + 4) * unit_bytes + codes_at)), 1);
            const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
            const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
            const __m256i y[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                                  _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
            const __m256i nib = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(Raw ? 0 : 8);
            for (int g = 0; g < 4; ++g) {
                x[g] = _mm256_sub_epi8(_mm256_and_si256(y[g], nib), eight);
                x[g + 4] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(y[g], 4), nib), eight);
            }
        }
    }

    template <std::size_t M>
    void score(const kv_layer_view<const T>& kv, std::uint32_t h, std::uint32_t tile, float* out,
               [[maybe_unused]] const char* pfk) const noexcept {
        const auto* q16 = reinterpret_cast<const std::int16_t*>(this->k_buf);
        const float* dq = this->k_buf + (M * kv.dim_k + 1) / 2;
        const std::uint32_t nu = kv.k_units(), dk = kv.dim_k;
        const char* kt = reinterpret_cast<const char*>(kv.k_tile_ptr(h, tile));
        if constexpr (byte_query) {
            // vpmaddubsw of the nibbles (0..15) with the query bytes: int16 sums of two rows
            // (|x| <= 2 * 15 * 127), added over the 8 row groups of a block in int16 (<= 30480),
            // then vpmaddwd with ones: one int32 lane per cell; sum - 8 sum(q) per block.
            const auto* qb = reinterpret_cast<const char*>(q_bytes(dq, M, nu));
            const std::int32_t* qsum = q_sums(dq, M, nu);
            const __m256i ones = _mm256_set1_epi16(1);
            constexpr std::size_t G = M < 4 ? M : 4;
            for (std::uint32_t c0 = 0; c0 < k_tile; c0 += 8) {
                alignas(32) float f[M][8] = {};
                for (std::uint32_t u = 0; u < nu; ++u) {
                    const std::size_t off = (std::size_t{u} * k_tile + c0) * unit_bytes;
                    const char* base = kt + off;
                    if (pfk != nullptr)
                        for (std::size_t o = 0; o < 8 * unit_bytes; o += 64) __builtin_prefetch(pfk + off + o, 0, 2);
                    __m256i x[8];
                    k_codes8<true>(base, x);
                    const __m256 dk8 = scales8(base, static_cast<std::int32_t>(unit_bytes));
                    for (std::size_t s0 = 0; s0 < M; s0 += G) {
                        __m256i acc[G];
                        for (std::size_t s = 0; s < G; ++s) acc[s] = _mm256_setzero_si256();
                        for (int g = 0; g < 8; ++g)
                            for (std::size_t s = 0; s < G; ++s) {
                                std::int32_t qq;
                                std::memcpy(&qq, qb + ((s0 + s) * nu + u) * 32 + 4 * g, sizeof qq);
                                acc[s] = _mm256_add_epi16(acc[s], _mm256_maddubs_epi16(x[g], _mm256_set1_epi32(qq)));
                            }
                        for (std::size_t s = 0; s < G; ++s) {
                            const std::size_t su = (s0 + s) * nu + u;
                            const __m256i t = _mm256_sub_epi32(_mm256_madd_epi16(acc[s], ones), _mm256_set1_epi32(8 * qsum[su]));
                            float* fs = f[s0 + s];
                            _mm256_store_ps(fs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dk8, _mm256_set1_ps(dq[su])),
                                                                _mm256_load_ps(fs)));
                        }
                    }
                }
                for (std::size_t s = 0; s < M; ++s) _mm256_storeu_ps(out + s * k_tile + c0, _mm256_load_ps(f[s]));
            }
            return;
        }
        const __m256i hadd_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        constexpr std::size_t G = M < 4 ? M : 4;  // slots per pass: 2 G accumulators, the codes from memory
        for (std::uint32_t c0 = 0; c0 < k_tile; c0 += 8) {
            alignas(32) float f[M][8] = {};  // cells 0, 1, 4, 5, 2, 3, 6, 7 (vphaddd order)
            for (std::uint32_t u = 0; u < nu; ++u) {
                const std::size_t off = (std::size_t{u} * k_tile + c0) * unit_bytes;
                const char* base = kt + off;
                if (pfk != nullptr)  // the next tile's K lines, spread over the loop
                    for (std::size_t o = 0; o < 8 * unit_bytes; o += 64) __builtin_prefetch(pfk + off + o, 0, 2);
                // The 8 code vectors go through the stack so that each row group is sign-extended
                // once (vpmovsxbw from memory) for the 4 slots of a pass: in registers, 8 code
                // vectors and 8 accumulators do not fit the 16 ymm, and 2 slots per pass repeated
                // the extension (and its extract) per pair of slots. Per slot and unit the two
                // accumulators' lane pairs are added in int32 (vphaddd: the block sum, exact) before
                // one conversion and FMA. Zen 5, x86-64-v3 build, q8_0 decode from the caches:
                // 100-102 -> 91 cycles per cell and KV head.
                alignas(32) std::int8_t xs[8][32];
                {
                    __m256i x[8];
                    k_codes8(base, x);
                    for (int g = 0; g < 8; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(xs[g]), x[g]);
                }
                const __m256 dk8 = scales8(base, static_cast<std::int32_t>(unit_bytes));
                const __m256 dkp = _mm256_permutevar8x32_ps(dk8, hadd_order);
                for (std::size_t s0 = 0; s0 < M; s0 += G) {
                    __m256i ia[G][2];
                    for (std::size_t s = 0; s < G; ++s) ia[s][0] = ia[s][1] = _mm256_setzero_si256();
                    for (int g = 0; g < 8; ++g) {
                        const __m256i lo = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(xs[g])));       // cells 0..3
                        const __m256i hi = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(xs[g] + 16)));  // 4..7
                        for (std::size_t s = 0; s < G; ++s) {
                            std::int64_t qq;
                            std::memcpy(&qq, q16 + (s0 + s) * dk + std::size_t{u} * 32 + 4 * g, sizeof qq);
                            const __m256i qv = _mm256_set1_epi64x(qq);
                            ia[s][0] = _mm256_add_epi32(ia[s][0], _mm256_madd_epi16(lo, qv));
                            ia[s][1] = _mm256_add_epi32(ia[s][1], _mm256_madd_epi16(hi, qv));
                        }
                    }
                    for (std::size_t s = 0; s < G; ++s) {
                        // the block sum per cell, exact: (a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, ...): cells 0,1,4,5 | 2,3,6,7
                        const __m256i t = _mm256_hadd_epi32(ia[s][0], ia[s][1]);
                        float* fs = f[s0 + s];
                        _mm256_store_ps(fs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                                            _mm256_mul_ps(dkp, _mm256_set1_ps(dq[(s0 + s) * nu + u])),
                                                            _mm256_load_ps(fs)));
                    }
                }
            }
            for (std::size_t s = 0; s < M; ++s)
                _mm256_storeu_ps(out + s * k_tile + c0,
                                 _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_load_ps(f[s])), 0xD8)));
        }
    }

#endif  // KVCACHE_QDEC_256


#if defined(KVCACHE_QDEC_512) || defined(KVCACHE_QDEC_256)
    /// acc[s] = acc[s] * alpha[s] (when rescale) + sum over the cells of mask[s] of
    /// p[s][cell] * V[cell], for V tile `tile` of head h (row-major or transposed). The
    /// block scale is folded into w = p * d_v, set to exactly 0 outside mask[s] (a NaN
    /// scale of a cell a slot does not see never reaches it; the codes are always finite),
    /// so each slot's result is the same whatever the other slots see. The cells of `any`
    /// are visited in address order. p_buf: M x 32; acc: M x dv.
    template <std::size_t M>
    void accumulate(const kv_layer_view<const T>& kv, std::uint32_t h, std::uint32_t tile, tile_mask any,
                    const tile_mask* mask, const float* p_buf, float* acc, const float* alpha, bool rescale,
                    [[maybe_unused]] const char* pfv) const noexcept {
        const std::uint32_t dv = kv.dim_v, nv = kv.v_units();
        const bool vt = kv.vl == v_layout::transposed;
        const T* vtile = vt ? kv.v + h * kv.v_head_stride + std::size_t{tile} * k_tile : kv.v_tile_ptr(h, tile);
        static_assert(M <= 31, "accumulate: the folded weights of M slots must fit v_buf");
        // Unit (cell j, u) = unit_at(u, cstep) + j * cstep bytes.
        auto unit_at = [&](std::uint32_t u, std::size_t& cstep) -> const char* {
            if (vt) {
                cstep = unit_bytes;
                return reinterpret_cast<const char*>(vtile + std::size_t{u} * kv.n_cells_pad);
            }
            const std::uint32_t d0 = u * 32 / v_block * v_block;
            const std::uint32_t bw = dv - d0 < v_block ? dv - d0 : v_block;
            cstep = bw / 32 * unit_bytes;
            return reinterpret_cast<const char*>(vtile + (std::size_t{d0} * k_tile + (u * 32 - d0)) / 32);
        };
#if defined(KVCACHE_QDEC_256)
        if constexpr (four_bit)
            if (accumulate_bytes<M>(unit_at, nv, dv, any, mask, p_buf, acc, alpha, rescale, pfv,
                                    reinterpret_cast<const char*>(vtile)))
                return;
#endif
        // Pass 1: the folded weights of every unit, w[(u M + s) 32 + cell] (and, AVX2 q4_0,
        // their sums wsum[u M + s]) in v_buf (32 dv floats: room for M <= 31). The units'
        // scale gathers are independent and overlap here; computed in front of each unit's
        // FMAs they serialized with them.
        float* const w = this->v_buf;
        [[maybe_unused]] float* const wsum = w + std::size_t{nv} * M * k_tile;
#if defined(KVCACHE_QDEC_512)
        __m512 pair_next[2] = {};  // (scales16_pairs: the second unit of a two-unit block)
        for (std::uint32_t u = 0; u < nv; ++u) {
            std::size_t cstep;
            const char* ubc = unit_at(u, cstep);
            float* wu = w + std::size_t{u} * M * k_tile;
            // A cell's units are unit_bytes apart (transposed V, or a row-major block of one
            // unit) or come two to a cell (a row-major block of v_block = 64 dimensions).
            static_assert(v_block == 64, "accumulate: row-major V blocks hold one or two units per cell");
            __m512 d0v, d1v;
            if (cstep == unit_bytes) {  // a run of units
                d0v = scales16_run(ubc);
                d1v = scales16_run(ubc + 16 * cstep);
            } else if (u * 32 % v_block == 0) {  // both units' scales at once, the second's kept for u + 1
                scales16_pairs(ubc, d0v, pair_next[0]);
                scales16_pairs(ubc + 16 * cstep, d1v, pair_next[1]);
            } else {
                d0v = pair_next[0];
                d1v = pair_next[1];
            }
            for (std::size_t s = 0; s < M; ++s) {
                const __m512 w0 = _mm512_maskz_mul_ps(static_cast<__mmask16>(mask[s]), _mm512_loadu_ps(p_buf + s * k_tile), d0v);
                const __m512 w1 = _mm512_maskz_mul_ps(static_cast<__mmask16>(mask[s] >> 16),
                                                      _mm512_loadu_ps(p_buf + s * k_tile + 16), d1v);
                _mm512_storeu_ps(wu + s * k_tile, w0);
                _mm512_storeu_ps(wu + s * k_tile + 16, w1);
            }
        }
#else
        static_cast<void>(fold_weights8<M>(unit_at, nv, mask, p_buf, w, four_bit ? wsum : nullptr));
#endif
        // Pass 2: the FMAs, unit by unit.
        for (std::uint32_t u = 0; u < nv; ++u) {
            std::size_t cstep;
            const char* ubc = unit_at(u, cstep);
            const float* wu = w + std::size_t{u} * M * k_tile;
            float* ap = acc + std::size_t{u} * 32;
            // The V lines of tile pf (pfv) at the units read here, spread over the loop.
            const char* pfu = pfv != nullptr ? pfv + (ubc - reinterpret_cast<const char*>(vtile)) : nullptr;
#if defined(KVCACHE_QDEC_512)
            constexpr std::size_t G = M < 8 ? M : 8;  // slots per pass: 2 G accumulators
            for (std::size_t s0 = 0; s0 < M; s0 += G) {
                __m512 a[G][2];
                for (std::size_t s = 0; s < G; ++s)
                    for (int v = 0; v < 2; ++v) {
                        a[s][v] = _mm512_loadu_ps(ap + (s0 + s) * dv + v * 16);
                        if (rescale) a[s][v] = _mm512_mul_ps(a[s][v], _mm512_set1_ps(alpha[s0 + s]));
                    }
                auto cell = [&](std::uint32_t j) {
                    if (pfu != nullptr && s0 == 0) __builtin_prefetch(pfu + j * cstep, 0, 2);
                    __m512 x0, x1;
                    v_values(ubc + j * cstep, x0, x1);
                    for (std::size_t s = 0; s < G; ++s) {
                        const __m512 wj = _mm512_set1_ps(wu[(s0 + s) * k_tile + j]);
                        a[s][0] = _mm512_fmadd_ps(wj, x0, a[s][0]);
                        a[s][1] = _mm512_fmadd_ps(wj, x1, a[s][1]);
                    }
                };
                if (any == k_tile_full)
                    for (std::uint32_t j = 0; j < k_tile; ++j) cell(j);
                else
                    for (tile_mask bits = any; bits != 0; bits &= bits - 1)
                        cell(static_cast<std::uint32_t>(std::countr_zero(bits)));
                for (std::size_t s = 0; s < G; ++s)
                    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(ap + (s0 + s) * dv + v * 16, a[s][v]);
            }
#else
            // Passes of 16 dimensions and up to 4 slots: 8 accumulators (16 registers).
            constexpr std::size_t G = M < 4 ? M : 4;
            for (int half = 0; half < 2; ++half)
                for (std::size_t s0 = 0; s0 < M; s0 += G) {
                    __m256 a[G][2];
                    for (std::size_t s = 0; s < G; ++s)
                        for (int v = 0; v < 2; ++v) {
                            a[s][v] = _mm256_loadu_ps(ap + (s0 + s) * dv + half * 16 + v * 8);
                            if (rescale) a[s][v] = _mm256_mul_ps(a[s][v], _mm256_set1_ps(alpha[s0 + s]));
                        }
                    auto cell = [&](std::uint32_t j) {
                        if (pfu != nullptr && half == 0 && s0 == 0) __builtin_prefetch(pfu + j * cstep, 0, 2);
                        const char* un = ubc + j * cstep + codes_at;
                        __m256 x0, x1;
                        if constexpr (!four_bit) {
                            const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(un + half * 16));
                            x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
                            x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
                        } else {
                            __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(un));
                            if (half) c = _mm_srli_epi16(c, 4);
                            c = _mm_and_si128(c, _mm_set1_epi8(0x0F));
                            x0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
                            x1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)));
                        }
                        for (std::size_t s = 0; s < G; ++s) {
                            const __m256 wj = _mm256_broadcast_ss(wu + (s0 + s) * k_tile + j);
                            a[s][0] = _mm256_fmadd_ps(wj, x0, a[s][0]);
                            a[s][1] = _mm256_fmadd_ps(wj, x1, a[s][1]);
                        }
                    };
                    if (any == k_tile_full)
                        for (std::uint32_t j = 0; j < k_tile; ++j) cell(j);
                    else
                        for (tile_mask bits = any; bits != 0; bits &= bits - 1)
                            cell(static_cast<std::uint32_t>(std::countr_zero(bits)));
                    for (std::size_t s = 0; s < G; ++s)
                        for (int v = 0; v < 2; ++v) {
                            if constexpr (four_bit)
                                a[s][v] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), _mm256_set1_ps(wsum[u * M + s0 + s]), a[s][v]);
                            _mm256_storeu_ps(ap + (s0 + s) * dv + half * 16 + v * 8, a[s][v]);
                        }
                }
#endif
        }
    }

#if defined(KVCACHE_QDEC_256)
    /// AVX2: the folded weights w = p * d_v (exactly 0 outside mask[s]) of every unit u and
    /// slot s into w (row u M + s, 32 cells), the slots' masks built once per tile; wsum (the
    /// float p.V of q4_0) their sums per row, where not null. Returns whether every weight
    /// is finite (the sum of all of them is NaN or inf otherwise; finite ones stay below 2^31).
    template <std::size_t M, class UnitAt>
    static bool fold_weights8(UnitAt& unit_at, std::uint32_t nv, const tile_mask* mask, const float* p_buf, float* w,
                              float* wsum) noexcept {
        alignas(32) float mk[M][k_tile];
        const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (std::size_t s = 0; s < M; ++s)
            for (int k = 0; k < 4; ++k) {
                const auto bits = static_cast<int>((mask[s] >> (8 * k)) & 0xFFu);
                _mm256_store_ps(mk[s] + 8 * k, _mm256_castsi256_ps(_mm256_cmpeq_epi32(
                                                   _mm256_and_si256(_mm256_set1_epi32(bits), lane), lane)));
            }
        __m256 chk = _mm256_setzero_ps();
        for (std::uint32_t u = 0; u < nv; ++u) {
            std::size_t cstep;
            const char* ubc = unit_at(u, cstep);
            __m256 dv8[4];
            for (int k = 0; k < 4; ++k) dv8[k] = scales8(ubc + k * 8 * cstep, static_cast<std::int32_t>(cstep));
            for (std::size_t s = 0; s < M; ++s) {
                __m256 sum = _mm256_setzero_ps();
                for (int k = 0; k < 4; ++k) {
                    const __m256 wk = _mm256_and_ps(_mm256_load_ps(mk[s] + 8 * k),
                                                    _mm256_mul_ps(_mm256_loadu_ps(p_buf + s * k_tile + 8 * k), dv8[k]));
                    _mm256_storeu_ps(w + (u * M + s) * k_tile + 8 * k, wk);
                    sum = _mm256_add_ps(sum, wk);
                }
                chk = _mm256_add_ps(chk, sum);
                if (wsum != nullptr) {
                    alignas(32) float t[8];
                    _mm256_store_ps(t, sum);
                    wsum[u * M + s] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
                }
            }
        }
        const __m256 bad = _mm256_cmp_ps(_mm256_and_ps(chk, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))),
                                         _mm256_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NLT_UQ);
        return _mm256_testz_ps(bad, bad) != 0;
    }

    /// accumulate_bytes' inner loop: a16[s][0 / 1] = the int16 sums over the tile's cell
    /// pairs (those with a cell in `any`; Full: all 16) of dimensions 0..15 / 16..31 of V
    /// unit `ubc` (cell j at j * cstep) times slot s's int8 weights (wr[s]: pair p's two
    /// bytes in dword p). Straight loops (template sizes, no branch when Full): with a
    /// branch or runtime slot counts GCC 12 copied the accumulators around every pair.
    template <std::size_t GG, bool Full>
    static void pv_pairs(const char* ubc, std::size_t cstep, const char* const (&wr)[GG], tile_mask any,
                         const char* pf, __m256i (&a16)[GG][2]) noexcept {
        const __m256i nib = _mm256_set1_epi8(0x0F);
        for (std::size_t s = 0; s < GG; ++s) a16[s][0] = a16[s][1] = _mm256_setzero_si256();
        for (std::uint32_t p = 0; p < k_tile / 2; ++p) {
            if constexpr (!Full)
                if (((any >> (2 * p)) & 3u) == 0) continue;
            const std::size_t o = std::size_t{2 * p} * cstep;
            __builtin_prefetch(pf + o, 0, 2);
            __builtin_prefetch(pf + o + cstep, 0, 2);
            const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ubc + o + codes_at));
            const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ubc + o + cstep + codes_at));
            // bytes 2k, 2k + 1: the two cells' byte k (k < 8 in the low lane)
            const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi8(x0, x1), _mm_unpacklo_epi8(x0, x1));
            const __m256i lo = _mm256_and_si256(v, nib);                         // dimensions 0..15
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);  // 16..31
            for (std::size_t s = 0; s < GG; ++s) {
                std::int32_t wp;
                std::memcpy(&wp, wr[s] + 4 * p, sizeof wp);
                const __m256i wv = _mm256_set1_epi32(wp);
                a16[s][0] = _mm256_add_epi16(a16[s][0], _mm256_maddubs_epi16(lo, wv));
                a16[s][1] = _mm256_add_epi16(a16[s][1], _mm256_maddubs_epi16(hi, wv));
            }
        }
    }

    /// AVX2, q4_0: p.V on int8 weights (see the top of this file). Returns false, with
    /// nothing written to acc, when a folded weight is not finite (a NaN / inf scale a slot
    /// sees): the float path then makes those rows NaN as documented.
    /// 1. w = p * d_v per unit u, slot s and cell (0 outside mask[s]) into v_buf as floats,
    ///    row i = u M + s.
    /// 2. Per 8 rows: their max |w| and sum |w| (transposed reductions), the weight step
    ///    sw = max(max / 127, sum / 2168) (the sum bound keeps 15 sum |wq| <= 32,767: the
    ///    tile's 16 cell pairs add up in int16 without overflow; it exceeds the max bound only
    ///    for weights spread over more than 17 cells, where each is many steps), the rows
    ///    rounded to int8 and stored in place (row i's 64 bytes at 576 (i / 8) + 64 (i % 8),
    ///    below the floats of every row not yet read) as 16 dwords, pair p's two weights
    ///    twice in dword p; then the 8 rows' sw and 8 sw sum(wq) (576 (i / 8) + 512 / 544).
    /// 3. Per unit, pairs of cells: their nibbles interleaved (dimension d of cells 2p and
    ///    2p + 1 side by side), vpmaddubsw with the pair's weights (at most 2 x 15 x 127 per
    ///    lane), int16 sums over the tile, widened, converted and added to acc times sw, less
    ///    8 sw sum(wq) (the codes are 0..15).
    template <std::size_t M, class UnitAt>
    bool accumulate_bytes(UnitAt& unit_at, std::uint32_t nv, std::uint32_t dv, tile_mask any, const tile_mask* mask,
                          const float* p_buf, float* acc, const float* alpha, bool rescale, const char* pfv,
                          const char* vtile) const noexcept {
        float* const w = this->v_buf;
        const std::size_t rows = std::size_t{nv} * M;
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        if (!fold_weights8<M>(unit_at, nv, mask, p_buf, w, nullptr)) return false;
        char* const wb = reinterpret_cast<char*>(w);
        const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (std::size_t g0 = 0; g0 < rows; g0 += 8) {
            const std::size_t n = rows - g0 < 8 ? rows - g0 : 8;
            __m256 m[8], a[8];
            for (std::size_t r = 0; r < 8; ++r) {
                m[r] = a[r] = _mm256_setzero_ps();
                if (r < n)
                    for (int k = 0; k < 4; ++k) {
                        const __m256 x = _mm256_and_ps(_mm256_loadu_ps(w + (g0 + r) * k_tile + 8 * k), abs_mask);
                        m[r] = _mm256_max_ps(m[r], x);
                        a[r] = _mm256_add_ps(a[r], x);
                    }
            }
            // the 8 rows' maxima and sums, lane r = row g0 + r
            __m256 t[4];
            for (int r = 0; r < 4; ++r)
                t[r] = _mm256_max_ps(_mm256_unpacklo_ps(m[2 * r], m[2 * r + 1]), _mm256_unpackhi_ps(m[2 * r], m[2 * r + 1]));
            const __m256 h0 = _mm256_max_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
            const __m256 h1 = _mm256_max_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
            const __m256 mx = _mm256_max_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
            const __m256 a01 = _mm256_hadd_ps(a[0], a[1]), a23 = _mm256_hadd_ps(a[2], a[3]);
            const __m256 a45 = _mm256_hadd_ps(a[4], a[5]), a67 = _mm256_hadd_ps(a[6], a[7]);
            const __m256 a03 = _mm256_hadd_ps(a01, a23), a47 = _mm256_hadd_ps(a45, a67);
            const __m256 sx = _mm256_add_ps(_mm256_permute2f128_ps(a03, a47, 0x20), _mm256_permute2f128_ps(a03, a47, 0x31));
            const __m256 sw = _mm256_max_ps(_mm256_mul_ps(mx, _mm256_set1_ps(1.0f / 127.0f)),
                                            _mm256_mul_ps(sx, _mm256_set1_ps(1.0f / 2168.0f)));
            // 1 / sw only where it is finite (its zero weights would meet an infinite 1 / sw):
            // a row whose step is below FLT_MIN (every weight under ~1.5e-36, a tile ~1e-29
            // below the running maximum, the V scales being binary16) is dropped, an
            // absolute error under 1.5e-36 x 15 x 32 per value
            const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(sw, _mm256_set1_ps(std::numeric_limits<float>::min()), _CMP_GE_OQ),
                                             _mm256_div_ps(_mm256_set1_ps(1.0f), sw));
            __m256i sums[8];
            char* const gb = wb + g0 / 8 * 576;
            for (std::size_t r = 0; r < 8; ++r) {
                sums[r] = _mm256_setzero_si256();
                if (r >= n) continue;
                const __m256 ir = _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(static_cast<int>(r)));
                __m256i q[4];
                for (int k = 0; k < 4; ++k)
                    q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w + (g0 + r) * k_tile + 8 * k), ir));
                sums[r] = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                // int32 -> int8 in cell order (packs works per 128-bit lane; the dword
                // permutation puts the lanes' 4-cell groups back in order)
                const __m256i b = _mm256_permutevar8x32_epi32(
                    _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), byte_order);
                const __m256i lo = _mm256_unpacklo_epi16(b, b), hi = _mm256_unpackhi_epi16(b, b);
                char* out = gb + r * 64;  // over floats already read (rows <= g0 + r)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(lo, hi, 0x20));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
            }
            const __m256i s01 = _mm256_hadd_epi32(sums[0], sums[1]), s23 = _mm256_hadd_epi32(sums[2], sums[3]);
            const __m256i s45 = _mm256_hadd_epi32(sums[4], sums[5]), s67 = _mm256_hadd_epi32(sums[6], sums[7]);
            const __m256i s03 = _mm256_hadd_epi32(s01, s23), s47 = _mm256_hadd_epi32(s45, s67);
            const __m256i tot = _mm256_add_epi32(_mm256_permute2x128_si256(s03, s47, 0x20), _mm256_permute2x128_si256(s03, s47, 0x31));
            _mm256_storeu_ps(reinterpret_cast<float*>(gb + 512), sw);
            _mm256_storeu_ps(reinterpret_cast<float*>(gb + 544),
                             _mm256_mul_ps(_mm256_mul_ps(sw, _mm256_set1_ps(8.0f)), _mm256_cvtepi32_ps(tot)));
        }
        auto row_at = [wb](std::size_t i) -> const char* { return wb + i / 8 * 576 + i % 8 * 64; };
        auto meta = [wb](std::size_t i, std::size_t at) {
            float f;
            std::memcpy(&f, wb + i / 8 * 576 + at + i % 8 * 4, sizeof f);
            return f;
        };
        for (std::uint32_t u = 0; u < nv; ++u) {
            std::size_t cstep;
            const char* ubc = unit_at(u, cstep);
            float* ap = acc + std::size_t{u} * 32;
            // (prefetching lines just read where there is no next tile keeps the loop straight)
            const char* pf = pfv != nullptr ? pfv + (ubc - vtile) : ubc;
            auto pass = [&](std::size_t s0, auto gg) {
                constexpr std::size_t GG = decltype(gg)::value;
                const char* wr[GG];
                for (std::size_t s = 0; s < GG; ++s) wr[s] = row_at(u * M + s0 + s);
                __m256i a16[GG][2];
                if (any == k_tile_full)
                    pv_pairs<GG, true>(ubc, cstep, wr, any, pf, a16);
                else
                    pv_pairs<GG, false>(ubc, cstep, wr, any, pf, a16);
                for (std::size_t s = 0; s < GG; ++s) {
                    const std::size_t i = u * M + s0 + s;
                    const __m256 swv = _mm256_set1_ps(meta(i, 512)), corr = _mm256_set1_ps(meta(i, 544));
                    const __m256 al = _mm256_set1_ps(rescale ? alpha[s0 + s] : 1.0f);
                    for (int v = 0; v < 2; ++v) {
                        float* a = ap + (s0 + s) * dv + v * 16;
                        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a16[s][v])));
                        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(a16[s][v], 1)));
                        _mm256_storeu_ps(a, _mm256_fmadd_ps(f0, swv, _mm256_fmsub_ps(_mm256_loadu_ps(a), al, corr)));
                        _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(f1, swv, _mm256_fmsub_ps(_mm256_loadu_ps(a + 8), al, corr)));
                    }
                }
            };
            constexpr std::size_t G = M < 4 ? M : 4;  // slots per pass: 2 G int16 accumulators
            for (std::size_t s0 = 0; s0 + G <= M; s0 += G) pass(s0, std::integral_constant<std::size_t, G>{});
            if constexpr (M % G != 0) pass(M / G * G, std::integral_constant<std::size_t, M % G>{});
        }
        return true;
    }
#endif
#else
    template <std::size_t M>
    void score(const kv_layer_view<const T>&, std::uint32_t, std::uint32_t, float*, const char*) const noexcept {}
    template <std::size_t M>
    void accumulate(const kv_layer_view<const T>&, std::uint32_t, std::uint32_t, tile_mask, const tile_mask*,
                    const float*, float*, const float*, bool, const char*) const noexcept {}
#endif
};

/// The tile source of the generic (non-SIMD-storage) path for Element: quant_tiles for
/// q8_0 / q4_0, converted_tiles otherwise.
template <class Element>
struct tile_source_of {
    using type = converted_tiles<Element>;
};
template <>
struct tile_source_of<q8_0> {
    using type = quant_tiles<q8_0>;
};
template <>
struct tile_source_of<q4_0> {
    using type = quant_tiles<q4_0>;
};

/// Element's tile source over the scratch k_buf (k_tile x dim_k floats) and v_buf
/// (k_tile x dim_v floats).
template <class Element>
typename tile_source_of<Element>::type make_tile_source(float* k_buf, float* v_buf) noexcept {
    typename tile_source_of<Element>::type src;
    src.k_buf = k_buf;
    src.v_buf = v_buf;
    return src;
}

}  // namespace kernels
KVCACHE_END_NAMESPACE
