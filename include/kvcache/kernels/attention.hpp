// kvcache kernels: flash-style attention over tiled K / row-major or transposed V.
//
// The kernel is an object (attention_kernel) holding one work item's state; its member
// functions are the stages: load the queries, find the next visible tile, score a tile,
// the online-softmax update, accumulate V, the fused K/V loop of decode, finalize.
// attend_item() builds one and runs it.
//
// Assumptions (checked by the caller, ops/attention.hpp):
// - K is tiled (format/kv_view.hpp): tile t of head h holds cells [32t, 32t+32)
//   one dimension per row (rows in RoPE pair order: q is permuted to match), so the
//   scores of 32 cells for one query head are FMAs of a broadcast q[d] with one K row
//   (two 16-lane vectors: each broadcast feeds two FMAs): no horizontal reduction per cell.
// - A work item is one KV head, up to M "slots" (query row x query head of the GQA
//   group) and a list of tile ranges (cells [32*t0, 32*t1)); the contiguous layout
//   passes one range, a paged layout its blocks, split-K a part of them.
// - Visibility comes from attn_meta (built by ops, once per call or once per decode
//   step): plain per-tile summaries, the cells' positions and the op's view of their
//   sequence membership (kernels/ knows no cell type). A tile no slot can see is
//   skipped without touching its K/V; inside a tile, V of a cell no slot sees is never
//   read, and masked K lanes are replaced by -inf before any use (free cells may hold
//   garbage or NaN).
//
// - Elements without SIMD loads (custom element policies) pass a converted_tiles
//   (tile_source.hpp): each visited tile is converted to f32 scratch through
//   Element::to_float first, then the same code runs on the floats.
//
// Why it is fast: every K row and V row of a tile is loaded (and converted from f16 /
// bf16) once for all M slots, so the M query heads of a GQA group (and, in prefill,
// several query rows) share one read of the KV head; with M = 4 (decode, GQA 4) the
// kernel does 4 FMAs per loaded vector, with M = 16 (prefill) 16, and the accumulators
// stay in registers. Online softmax keeps (max, sum) per slot; rescaling of the output
// accumulator happens only when a slot's max grows.
// With up to 4 slots (decode) and 16-lane vectors, the loop is software-pipelined: the
// V update of one tile and the scores of the next visible tile run in one loop, K rows
// and one cell's piece of a 64-dimension V block per step, so K and V stream from memory
// together instead of one after the other (1.16-1.23x on cold decode, Zen 5;
// bench/README.md).
#pragma once

#include <xsimd/xsimd.hpp>

#include <bit>      // std::countr_zero
#include <cmath>    // std::exp, std::tanh
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <limits>   // infinity
#include <type_traits>  // std::conditional_t, std::integral_constant

#include "../config.hpp"
#include "../format/kv_view.hpp"
#include "../model_shape.hpp"
#include "../simd/tile_io.hpp"
#include "tile_source.hpp"  // converted_tiles

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// Tiles [t0, t1) to visit (cells [32*t0, 32*t1)).
struct tile_range {
    std::uint32_t t0 = 0, t1 = 0;
};

/// Summary of one K tile's cells for fast masking.
struct tile_meta {
    pos_t pmin = 0, pmax = -1;  ///< smallest / largest position among occupied cells
    std::int32_t sid = -1;      ///< -1 no occupied cell, s: every occupied cell is used by s only, -2 otherwise
    tile_mask occ = 0;          ///< bit j: cell 32t+j is occupied (and below n)
    /// >= 0: every occupied cell has the sequence set of cell `uniform` (a prefix forked to
    /// several sequences), so one membership test answers for the whole tile; -1 otherwise.
    std::int32_t uniform = -1;
};

/// Per-call cell metadata the kernel masks with (cells [0, n)), built by the op.
/// Seqs is the op's view of the cells' sequence membership (kernels/ knows no cell
/// type): `seqs.test(c, s)` is true when cell c is used by sequence s; the kernel asks
/// only for cells of tiles that mix sequences (tile_meta::sid == -2), and for a tile whose
/// cells all share one set (tile_meta::uniform) only once.
template <class Seqs>
struct attn_meta {
    const pos_t* pos = nullptr;        ///< cell positions (-1 free)
    Seqs seqs{};                       ///< per cell sequence membership (read for tiles that mix sequences)
    const tile_meta* tiles = nullptr;  ///< per tile summary
};

/// One query slot: a query row for one query head.
struct attn_slot {
    const float* q = nullptr;  ///< head_dim_k floats
    pos_t qp = 0;              ///< position of the row
    seq_id_t qs = 0;           ///< sequence of the row
    bool active = false;       ///< false: padding slot (never visible)
};

/// Visibility of tile t's cells for one slot (bit j: cell 32t+j).
/// (Forced inline: GCC inlined it into the kernel's tile search when it was no template.)
template <class Seqs>
[[gnu::always_inline]] inline tile_mask visible_mask(const attn_meta<Seqs>& m, std::uint32_t t, const attn_slot& s,
                              std::int32_t window) noexcept {
    if (!s.active) return 0;
    const tile_meta& tm = m.tiles[t];
    if (tm.occ == 0 || (tm.sid >= 0 && tm.sid != s.qs) || tm.pmin > s.qp) return 0;
    const std::int64_t lo = window > 0 ? std::int64_t{s.qp} - window : std::int64_t{-1};  // visible: pos > lo
    if (tm.pmax <= lo) return 0;
    const bool all_in_range = tm.pmax <= s.qp && tm.pmin > lo;
    if (tm.sid == s.qs && all_in_range) return tm.occ;
    // One sequence set for every cell (the slot's own tile, or a shared prefix's): the
    // membership is one test, and only the positions can still differ cell by cell.
    const bool uniform = tm.sid == s.qs || tm.uniform >= 0;
    if (uniform && tm.sid < 0 && !m.seqs.test(static_cast<std::uint32_t>(tm.uniform), s.qs)) return 0;
    if (uniform && all_in_range) return tm.occ;
    tile_mask mask = 0;
    for (tile_mask bits = tm.occ; bits != 0; bits &= bits - 1) {
        const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
        const std::uint32_t c = t * k_tile + j;
        const pos_t p = m.pos[c];
        if (p > s.qp || p <= lo) continue;
        if (uniform || m.seqs.test(c, s.qs)) mask |= 1u << j;
    }
    return mask;
}

/// Tiles ahead whose K and V the kernel asks for (into L2) while it works on the current
/// one: the next tile (32 cells, 16 KiB of f16 K and V per head for D = 128). Measured on
/// Zen 5 (cold 16K decode, same-process A/Bs, 2026-11-24): one tile ahead beat four (the
/// distance before) in 8 of 8 one-thread runs (1.02-1.10x) and in 5 of 7 on two threads
/// (0.97-1.10x). Lines further ahead are the hardware prefetchers' job; our guess (no
/// counters in that VM) is that requests far ahead of them hold the core's miss buffers
/// for a whole DRAM round trip.
inline constexpr std::uint32_t prefetch_tiles = 1;

/// The tile `ahead` steps after tile t of ranges[r] in visiting order, crossing into the
/// following ranges (a paged layout's scattered blocks are ranges of one block each);
/// t itself when the ranges end sooner.
[[gnu::always_inline]] inline std::uint32_t tile_ahead(const tile_range* ranges, std::size_t n_ranges, std::size_t r, std::uint32_t t,
                                std::uint32_t ahead = prefetch_tiles) noexcept {
    std::uint32_t left = ahead;
    if (left == 0) return t;
    for (std::size_t i = r; i < n_ranges; ++i) {
        const std::uint32_t from = i == r ? t + 1 : ranges[i].t0;  // first tile after t in range i
        const std::uint32_t avail = ranges[i].t1 > from ? ranges[i].t1 - from : 0;
        if (left <= avail) return from + left - 1;
        left -= avail;
    }
    return t;
}

/// How far (in logits) the running max may lag behind the true max before the kernel
/// rescales: exp(8) ~ 3e3, far from f32 overflow even summed over 2^30 cells.
inline constexpr float rescale_margin = 8.0f;

/// Softmax state and output accumulator of the M slots of a work item.
template <std::size_t M>
struct attn_state {
    float m[M];     ///< reference max: >= every logit seen minus rescale_margin (-inf: nothing seen)
    float l[M];     ///< running sum of exp(logit - m)
    float* acc;     ///< M x dv running outputs (not yet divided by l)
};

/// Scalars of one call shared by every work item.
struct attn_shape {
    std::uint32_t dk = 0, dv = 0;
    float scale = 1.0f;
    float softcap = 0.0f;
    std::int32_t window = 0;
    bool burst_prefetch = false;        ///< see ops::prefetch_mode
    bool interleaved_prefetch = false;  ///< see ops::prefetch_mode
    /// Items of more query slots than this issue neither prefetch: in a call that mixes
    /// decode rows with a prefill chunk, the prefill items may run without (8 or 16).
    std::uint32_t prefetch_max_slots = 16;
};

/// Where the kernel reads tiles when they need no conversion (storage with SIMD loads).
struct in_place_tiles {};

/// Whether tile source Conv has the quantized decode stages (quant_decode.hpp,
/// quant_tiles: prepare / score / accumulate) and this build compiled them.
template <class Conv>
inline constexpr bool has_quant_stages = false;
template <class Conv>
    requires requires { Conv::fast; }
inline constexpr bool has_quant_stages<Conv> = Conv::fast;

/// One work item of the attention kernel: kv head h of view `kv`, M slots, the tiles of
/// `ranges`, accumulating into st. The member functions are the stages; run() is the
/// whole item (a software pipeline over the visible tiles, then finalize()).
/// Scratch: p_buf M x k_tile floats, vt_buf k_tile x dv floats (transposed V only), q_buf dk x M floats.
/// Conv: in_place_tiles (K / V read in place: f32 / f16 / bf16), or a converted_tiles
/// (tile_source.hpp) that converts each tile into its own f32 scratch.
/// The stages were lambdas of one function (attend_item) before 2026-11-25. Their hot
/// loops compile to the same machine code as then (GCC 12, -O3 -march=native, compared
/// loop by loop with registers renamed): run() is forced inline into attend_item so the
/// stages' out-of-line calls share its frame as before, visible_mask / tile_ahead are
/// forced inline (as templates GCC stopped inlining them), and fused_tile reads dk_ /
/// dv_ through the object as the lambda read them through its captures (local copies
/// cost a register in the fused loop, which then reloaded its bound from the stack).
/// Keep that in mind when editing: check the loops, not only the tests.
template <std::size_t M, class T, class Seqs, class Conv = in_place_tiles, bool FixedOrder = false>
class attention_kernel {
    static constexpr bool in_place = std::is_same_v<Conv, in_place_tiles>;
    // Quantized K/V (q8_0 / q4_0) read in place by the tile source's stages
    // (quant_decode.hpp) for every item: each slot's scores and V sums there do not
    // depend on M or on the other slots' masks, so the fixed-order mode holds too.
    static constexpr bool quant = !in_place && has_quant_stages<Conv>;
    using S = std::conditional_t<in_place, T, float>;  // what the loads read
    using fbatch = simd::fbatch;
    static constexpr std::size_t L = simd::lanes;
    static constexpr std::size_t B = k_tile / L;  // sub-batches per tile
    // Independent FMA chains in the score loop: at least 8 (latency x pipes) when M is small.
    // 16-register targets (AVX2, 8-lane vectors, B = 4) keep 8 score accumulators
    // (latency 4 x 2 FMA pipes) and at most 11 live registers per step: slot groups of
    // SG <= 4 over CB = 8 / SG sub-batches of the tile per pass (M >= 4: half a tile, two
    // K rows converted, four broadcasts, eight FMAs). The 32-register shapes below (all
    // B sub-batches per pass, 16 accumulators) spilled 8-16 accumulators per step there.
    static constexpr bool narrow = L < 16;
    static constexpr std::size_t SG = narrow ? (M > 4 ? 4 : M) : (M > 8 ? 8 : M);
    static constexpr std::size_t CB = narrow ? (SG * B <= 8 ? B : 8 / SG) : B;
    static_assert(B % CB == 0, "score passes must cover the tile");
    static constexpr std::size_t KC = narrow ? (SG * CB >= 8 ? 1 : 8 / (SG * CB)) : (M >= 8 ? 1 : 8 / M);
    // FixedOrder (attend_item_fixed_order): one chain whatever M (see there).
    static constexpr std::size_t KC_used = FixedOrder ? 1 : KC;
    // V accumulation in groups of MG slots and VB d-blocks: MG x VB accumulators (16 for
    // M >= 4), each converted V vector feeds MG FMAs and each broadcast p feeds VB.
    // An FMA fed by its own broadcast ran at 0.71-0.78 cycles on Zen 5 against 0.53 when
    // one broadcast feeds 4 FMAs (bench/README.md, decode cycles), so VB >= 2
    // even for M = 16 (two groups of 8: each V vector is converted twice, but half as
    // many broadcasts are issued as with one group and VB = 1).
    // 16 registers (AVX2): MG <= 4 slots x VB = 8 / MG vectors, 8 accumulators.
    static constexpr std::size_t MG = narrow ? (M > 4 ? 4 : M) : (M > 8 ? 8 : M);
    static constexpr std::size_t VB = narrow ? 8 / MG : (MG == 8 ? 2 : 4);
    static_assert(M % MG == 0, "slot count must be a multiple of the V group");
    // The fused K/V loop (see fused_tile): up to 4 slots, 16-lane vectors.
    static constexpr bool can_fuse = M <= 4 && L == 16;
    static_assert(!can_fuse || v_block == 4 * L, "the fused loop's last-block switch assumes V blocks of 4 vectors");

public:
    attention_kernel(const kv_layer_view<const T>& kv, std::uint32_t h, const attn_meta<Seqs>& meta,
                     const attn_shape& sh, const attn_slot* slots, const tile_range* ranges, std::size_t n_ranges,
                     attn_state<M>& st, float* p_buf, float* vt_buf, float* q_buf, const Conv* conv) noexcept
        : kv_(kv), h_(h), meta_(meta), sh_(sh), slots_(slots), ranges_(ranges), n_ranges_(n_ranges), st_(st),
          p_buf_(p_buf), vt_buf_(vt_buf), q_buf_(q_buf), conv_(conv), dk_(sh.dk), dv_(sh.dv),
          vt_(kv.vl == v_layout::transposed) {}

    /// The whole work item: queries, the pipeline over the visible tiles, finalize().
    /// (Inlined into attend_item, which the ops call: the frame the stages' out-of-line
    /// calls share is attend_item's, as when the stages were its lambdas.)
    [[gnu::always_inline]] inline void run() noexcept {
        load_queries();
        if constexpr (quant) conv_->prepare(q_buf_, M, dk_);
        start();
        const bool fuse = can_fuse && !quant && !vt_ && dv_ % L == 0;
        // Software pipeline: the scores of the next visible tile are computed together with
        // the V update of the current one.
        tile_mask mask[M], any = 0;
        if (next_tile(mask, any)) {
            std::uint32_t cur = t_++;
            fbatch sc[M][B];
            score_tile(cur, sc);
            float alpha[M];
            bool rescale = softmax_tile(mask, sc, alpha);
            for (;;) {
                tile_mask mask2[M] = {}, any2 = 0;  // (= {}: GCC 12 -O3 AVX2 warned maybe-uninitialized)
                const bool more = next_tile(mask2, any2);
                const std::uint32_t nxt = more ? t_++ : 0;
                // Cells some slots see and others do not: their V must not reach the others
                // (p = 0 times a NaN V is NaN). Checked only for those cells, rarely any.
                const tile_mask mixed = any & ~seen_by_all(mask);
                if (more && fuse && any == k_tile_full && (mixed == 0 || !v_nonfinite(cur, mixed))) {
                    fused_tile(cur, alpha, rescale, nxt, sc);
                } else {
                    accumulate_tile(cur, any, mixed, mask, alpha, rescale);
                    if (more) score_tile(nxt, sc);
                }
                if (!more) break;
                rescale = softmax_tile(mask2, sc, alpha);
                cur = nxt;
                any = any2;
                for (std::size_t s = 0; s < M; ++s) mask[s] = mask2[s];
            }
        }
        finalize();
    }

private:
    // ---- where tiles are read: in place, or converted by conv_ (tile_source.hpp)

    /// K tile `tile` of head h as the kernel reads it.
    const S* k_rows(std::uint32_t tile) const noexcept {
        if constexpr (in_place)
            return kv_.k_tile_ptr(h_, tile);
        else
            return conv_->k_rows(kv_, h_, tile);
    }
    /// Row-major V tile `tile` of head h as the kernel reads it.
    const S* v_rows(std::uint32_t tile) const noexcept {
        if constexpr (in_place)
            return kv_.v_tile_ptr(h_, tile);
        else
            return conv_->v_rows(kv_, h_, tile);
    }
    /// One cell's transposed V row (n values stride apart) as floats.
    void v_column(const T* src, std::size_t stride, float* dst, std::size_t n) const noexcept {
        if constexpr (in_place)
            simd::to_floats(src, stride, dst, n);
        else
            conv_->v_column(src, stride, dst, n);
    }

    // ---- the queries
    /// The M queries, pre-scaled, interleaved [K row][slot] into q_buf: one base pointer
    /// for every broadcast; dimension d goes to the row that holds it in K (kv.k_row: RoPE
    /// pair order, a permutation only for NeoX). Slot-major: each query row is read in
    /// address order (d-major reads touched 16 rows' lines at once and stalled on them:
    /// ~10% of a 512-row prefill on Zen 5).
    void load_queries() noexcept {
        const attn_slot* const slots = slots_;
        float* const q_buf = q_buf_;
        const std::uint32_t dk = dk_;
        std::uint32_t d_done = 0;  // dimensions [0, d_done) already in q_buf
#if defined(__AVX512F__)
        // 16 slots with 16 lanes: 16 x 16 blocks transposed in registers. One scalar store per
        // element cost ~7% of a 512 x 512 prefill on Zen 5 (2048 stores per work item).
        if constexpr (M == 16 && L == 16) {
            for (; d_done + 16 <= dk; d_done += 16) {
                __m512 r[16];
                for (std::size_t s = 0; s < M; ++s)
                    r[s] = slots[s].active ? _mm512_mul_ps(_mm512_loadu_ps(slots[s].q + d_done), _mm512_set1_ps(sh_.scale))
                                           : _mm512_setzero_ps();
                simd::transpose16(r);
                for (std::uint32_t k = 0; k < 16; ++k) _mm512_storeu_ps(q_buf + std::size_t{kv_.k_row(d_done + k)} * M, r[k]);
            }
        }
#endif
        for (std::size_t s = 0; s < M && d_done < dk; ++s) {
            float* col = q_buf + s;
            const float* q = slots[s].q;
            if (slots[s].active)
                for (std::uint32_t d = d_done; d < dk; ++d) col[std::size_t{kv_.k_row(d)} * M] = q[d] * sh_.scale;
            else
                for (std::uint32_t d = d_done; d < dk; ++d) col[std::size_t{kv_.k_row(d)} * M] = 0.0f;
        }
    }

    /// Softmax sums into lanes, the masks' shortcut and the first tile.
    void start() noexcept {
        // Per-lane partial sums of exp(logit - m): one horizontal add per item, not per tile.
        // (L is a power of two, so st.l / L spread over the lanes of block 0 sums back exactly.)
        for (std::size_t s = 0; s < M; ++s)
            for (std::size_t b = 0; b < B; ++b) lsum_[s][b] = fbatch(b == 0 ? st_.l[s] / static_cast<float>(L) : 0.0f);
        // Slots that see exactly what the previous slot sees (the query heads of one row):
        // their masks are copied instead of recomputed.
        for (std::size_t s = 0; s < M; ++s)
            same_as_prev_[s] = s > 0 && slots_[s].active == slots_[s - 1].active && slots_[s].qp == slots_[s - 1].qp &&
                               slots_[s].qs == slots_[s - 1].qs;
        r_ = 0;
        t_ = n_ranges_ > 0 ? ranges_[0].t0 : 0;
        pf_t_ = 0;
    }

    // ---- visible tiles
    /// Advances (r, t) to the next tile in visiting order that some slot sees and fills
    /// its masks; false when the ranges are done.
    bool next_tile(tile_mask* mask, tile_mask& any) noexcept {
        for (; r_ < n_ranges_; ++r_, t_ = r_ < n_ranges_ ? ranges_[r_].t0 : 0) {
            for (; t_ < ranges_[r_].t1; ++t_) {
                mask[0] = visible_mask(meta_, t_, slots_[0], sh_.window);
                any = mask[0];
                for (std::size_t s = 1; s < M; ++s) {
                    mask[s] = same_as_prev_[s] ? mask[s - 1] : visible_mask(meta_, t_, slots_[s], sh_.window);
                    any |= mask[s];
                }
                if (any != 0) {
                    pf_t_ = tile_ahead(ranges_, n_ranges_, r_, t_);
                    if (sh_.burst_prefetch && M <= sh_.prefetch_max_slots && pf_t_ != t_) {
                        // Burst: all of the K tile and V rows prefetch_tiles ahead, now. Written
                        // out here on purpose: in a helper function of their own, GCC deems the
                        // prefetches side-effect free and deletes the call.
                        const char* pk = reinterpret_cast<const char*>(kv_.k_tile_ptr(h_, pf_t_));
                        const std::size_t k_bytes = std::size_t{k_tile} * kv_.k_units() * sizeof(T);
                        for (std::size_t off = 0; off < k_bytes; off += 64) __builtin_prefetch(pk + off, 0, 2);
                        if (!vt_) {
                            const char* pv = reinterpret_cast<const char*>(kv_.v_tile_ptr(h_, pf_t_));
                            const std::size_t v_bytes = std::size_t{k_tile} * kv_.v_units() * sizeof(T);
                            for (std::size_t off = 0; off < v_bytes; off += 64) __builtin_prefetch(pv + off, 0, 2);
                        }
                    }
                    return true;
                }
            }
        }
        return false;
    }

    // ---- scores: sc[s] = q_s . K[:, cells of the tile]
    // In slot groups of at most SG = 8: 16 accumulators. With all 16 prefill slots at once
    // (32 accumulators + 2 K rows + a broadcast) GCC kept three accumulators on the stack,
    // an extra load and store per step on each; the second group re-reads the tile's K
    // rows from L1 and converts them again (512 x 512 prefill: 0.99-1.02x, mean 1.007x).
    void score_tile(std::uint32_t tile, fbatch (&sc)[M][B]) noexcept {
        if constexpr (quant) {
            // The next visible tile's K lines, asked for while this one is read (quant_tiles
            // spreads them over its loop; a burst of all of them at once measured slower).
            const char* pfk = pf_t_ != tile ? reinterpret_cast<const char*>(kv_.k_tile_ptr(h_, pf_t_)) : nullptr;
            alignas(64) float out[M * k_tile];
            conv_->template score<M>(kv_, h_, tile, out, pfk);
            for (std::size_t s = 0; s < M; ++s)
                for (std::size_t b = 0; b < B; ++b) sc[s][b] = fbatch::load_aligned(out + s * k_tile + b * L);
            return;
        }
        const S* kt = k_rows(tile);
        const std::uint32_t dk = dk_;
        // Interleaved prefetch: the K tile and the V rows prefetch_tiles ahead, one 64-byte
        // line of each per step of the loop below (same byte offset in both).
        const char* pfk = reinterpret_cast<const char*>(kv_.k_tile_ptr(h_, pf_t_));
        const char* pfv = reinterpret_cast<const char*>(kv_.v_tile_ptr(h_, pf_t_));
        const bool pf_v = !vt_;
        for (std::size_t g = 0; g < M; g += SG)
            for (std::size_t b0 = 0; b0 < B; b0 += CB) {  // (one pass when CB == B)
            const bool pf_k = sh_.interleaved_prefetch && M <= sh_.prefetch_max_slots && g == 0 && b0 == 0;
            fbatch part[KC_used][SG][CB];
            for (std::size_t c = 0; c < KC_used; ++c)
                for (std::size_t s = 0; s < SG; ++s)
                    for (std::size_t b = 0; b < CB; ++b) part[c][s][b] = fbatch(0.0f);
            const float* const qb = q_buf_ + g;
            const S* const kb = kt + b0 * L;
            std::uint32_t d = 0;
            for (; d + KC_used <= dk; d += KC_used) {
                if (pf_k) {
                    constexpr std::size_t step = KC_used * k_tile * sizeof(T);  // bytes of K rows per step
                    const std::size_t off = std::size_t{d} * k_tile * sizeof(T);
                    for (std::size_t o = 0; o < (step > 64 ? step : 64); o += 64) {
                        __builtin_prefetch(pfk + off + o, 0, 2);
                        if (pf_v) __builtin_prefetch(pfv + off + o, 0, 2);  // (a prefetch never faults)
                    }
                }
                for (std::size_t c = 0; c < KC_used; ++c) {
                    fbatch krow[CB];
                    for (std::size_t b = 0; b < CB; ++b) krow[b] = simd::load(kb + std::size_t{d + c} * k_tile + b * L);
                    for (std::size_t s = 0; s < SG; ++s) {
                        const fbatch qd = simd::broadcast(qb + std::size_t{d + c} * M + s);
                        for (std::size_t b = 0; b < CB; ++b) part[c][s][b] = xsimd::fma(qd, krow[b], part[c][s][b]);
                    }
                }
            }
            for (; d < dk; ++d) {
                fbatch krow[CB];
                for (std::size_t b = 0; b < CB; ++b) krow[b] = simd::load(kb + std::size_t{d} * k_tile + b * L);
                for (std::size_t s = 0; s < SG; ++s) {
                    const fbatch qd = simd::broadcast(qb + std::size_t{d} * M + s);
                    for (std::size_t b = 0; b < CB; ++b) part[0][s][b] = xsimd::fma(qd, krow[b], part[0][s][b]);
                }
            }
            for (std::size_t s = 0; s < SG; ++s)
                for (std::size_t b = 0; b < CB; ++b) {
                    fbatch v = part[0][s][b];
                    for (std::size_t c = 1; c < KC_used; ++c) v += part[c][s][b];
                    sc[g + s][b0 + b] = v;
                }
            }
    }

    // ---- online softmax of one tile's scores; p_buf[s][j] = exp(logit - m) (0 where masked)
    /// Returns whether some slot's reference max moved (alpha[s]: its rescale factor).
    bool softmax_tile(const tile_mask* mask, fbatch (&sc)[M][B], float* alpha) noexcept {
        const float ninf = -std::numeric_limits<float>::infinity();
        bool rescale = false;
        for (std::size_t s = 0; s < M; ++s) {
            alpha[s] = 1.0f;
            if (mask[s] == 0) {
                for (std::size_t b = 0; b < B; ++b) fbatch(0.0f).store_unaligned(p_buf_ + s * k_tile + b * L);
                continue;
            }
            const bool partial = mask[s] != k_tile_full;
            // Lazy max: keep the reference m until a logit exceeds it by more than
            // rescale_margin, so most tiles skip the rescale; p <= e^8 cannot overflow.
            // The test is one vector compare per batch; the horizontal max is only
            // computed when the reference has to move.
            // NaN: a NaN logit (NaN in q or K) is "above" (the compare is unordered), and
            // the new max is then NaN, so every later p, l and acc of the slot are NaN
            // (exp_bounded keeps NaN): the row's output is NaN, as in the scalar path. A
            // +inf logit makes m = +inf and its p = exp(inf - inf) = NaN; a -inf logit
            // gets p ~ 0. A NaN m stays NaN (thr is NaN: every tile is "above").
            const fbatch thr(st_.m[s] + rescale_margin);  // -inf while nothing was seen
            bool above = st_.m[s] == ninf;
            for (std::size_t b = 0; b < B; ++b) {
                fbatch x = sc[s][b];
                if (sh_.softcap > 0.0f) x = fbatch(sh_.softcap) * xsimd::tanh(x / fbatch(sh_.softcap));
                if (partial) x = xsimd::select(simd::lane_mask((mask[s] >> (b * L)) & ((1u << L) - 1u)), x, fbatch(ninf));
                sc[s][b] = x;
                above = above || simd::any_above_or_nan(x, thr);
            }
            float m_new = st_.m[s];
            if (above) {
                float tmax = ninf;
                bool nan = st_.m[s] != st_.m[s];
                for (std::size_t b = 0; b < B; ++b) {
                    const float mb = simd::hmax(sc[s][b]);
                    tmax = mb > tmax ? mb : tmax;
                    nan = nan || simd::any_nan(sc[s][b]);
                }
                m_new = nan ? std::numeric_limits<float>::quiet_NaN() : tmax;
            }
            if (!(m_new == st_.m[s])) {  // (true when m_new is NaN)
                alpha[s] = st_.m[s] == ninf ? 0.0f : std::exp(st_.m[s] - m_new);
                rescale = true;
                st_.m[s] = m_new;
            }
            for (std::size_t b = 0; b < B; ++b) {
                fbatch pb = simd::exp_bounded(sc[s][b] - fbatch(m_new));
                if (partial)
                    pb = xsimd::select(simd::lane_mask((mask[s] >> (b * L)) & ((1u << L) - 1u)), pb, fbatch(0.0f));
                pb.store_unaligned(p_buf_ + s * k_tile + b * L);
                lsum_[s][b] = xsimd::fma(lsum_[s][b], fbatch(alpha[s]), pb);
            }
        }
        return rescale;
    }

    // ---- V: acc[s] = acc[s] * alpha[s] + sum_j p[s][j] * V[cell j] over the cells in `any`
    /// mixed: the cells of `any` that some active slot does not see; when one of them has
    /// a NaN / inf in V, each slot sums its own cells only (accumulate_masked).
    void accumulate_tile(std::uint32_t tile, tile_mask any, tile_mask mixed, const tile_mask* mask, const float* alpha,
                         bool rescale) noexcept {
        if constexpr (quant) {
            // V lines of the tile after the next one (pf_t_), spread over the loop as for K.
            const char* pfv =
                !vt_ && pf_t_ != tile ? reinterpret_cast<const char*>(kv_.v_tile_ptr(h_, pf_t_)) : nullptr;
            conv_->template accumulate<M>(kv_, h_, tile, any, mask, p_buf_, st_.acc, alpha, rescale, pfv);
            return;
        }
        const std::uint32_t dv = dv_;
        if (vt_) {
            // Transposed V: gather the visible cells' rows into row-major scratch.
#if defined(__AVX512F__) || defined(__AVX2__)
            // L dimensions x L cells at a time: L vector loads (converted) and a transpose
            // in registers. One strided scalar conversion per value took ~1,000 cycles per
            // cell and KV head for f16 (Zen 5, 4 query heads, head dim 128), 12-25x the
            // row-major layout.
            if constexpr (in_place && (L == 16 || L == 8)) {
                const T* vt = kv_.v + h_ * kv_.v_head_stride + std::size_t{tile} * k_tile;
                constexpr auto l = static_cast<std::uint32_t>(L);
                std::uint32_t d0 = 0;
                for (; d0 + l <= dv; d0 += l)
                    for (std::uint32_t c0 = 0; c0 < k_tile; c0 += l) {
                        if (((any >> c0) & ((1u << l) - 1u)) == 0) continue;
                        typename fbatch::register_type r[L];
                        for (std::uint32_t i = 0; i < l; ++i) r[i] = simd::load(vt + std::size_t{d0 + i} * kv_.n_cells_pad + c0);
#if defined(__AVX512F__)
                        simd::transpose16(r);  // (L = 16)
#else
                        simd::transpose8(r);  // (L = 8)
#endif
                        for (std::uint32_t j = 0; j < l; ++j)
                            fbatch(r[j]).store_unaligned(vt_buf_ + std::size_t{c0 + j} * dv + d0);
                    }
                for (tile_mask bits = d0 < dv ? any : 0; bits != 0; bits &= bits - 1) {  // dimensions past the last block of L
                    const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
                    v_column(vt + std::size_t{d0} * kv_.n_cells_pad + j, kv_.n_cells_pad, vt_buf_ + std::size_t{j} * dv + d0, dv - d0);
                }
            } else
#endif
            for (tile_mask bits = any; bits != 0; bits &= bits - 1) {
                const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
                v_column(kv_.v + h_ * kv_.v_head_stride + std::size_t{tile} * k_tile + j, kv_.n_cells_pad,
                         vt_buf_ + std::size_t{j} * dv, dv);
            }
        }
        const S* vtile = vt_ ? nullptr : v_rows(tile);
        auto at_tile = [&kv = kv_](std::uint32_t j, std::uint32_t d) { return kv.v_in_tile(j, d); };
        auto at_rows = [dv](std::uint32_t j, std::uint32_t d) { return std::size_t{j} * dv + d; };
        if (mixed != 0) [[unlikely]] {
            const bool bad = vt_ ? nonfinite(static_cast<const float*>(vt_buf_), at_rows, mixed)
                                 : nonfinite(vtile, at_tile, mixed);
            if (bad) {
                if (vt_)
                    accumulate_masked(static_cast<const float*>(vt_buf_), at_rows, mask, alpha, rescale);
                else
                    accumulate_masked(vtile, at_tile, mask, alpha, rescale);
                return;
            }
        }
        if (!vt_)
            accumulate(vtile, at_tile, any, alpha, rescale);
        else
            accumulate(static_cast<const float*>(vt_buf_), at_rows, any, alpha, rescale);
    }

    /// The cells every active slot sees (all cells when no slot is active).
    tile_mask seen_by_all(const tile_mask* mask) const noexcept {
        tile_mask all = k_tile_full;
        for (std::size_t s = 0; s < M; ++s)
            if (slots_[s].active) all &= mask[s];
        return all;
    }

    /// Whether V of some cell in `cells` of row-major tile `tile` holds a NaN or an inf.
    bool v_nonfinite(std::uint32_t tile, tile_mask cells) const noexcept {
        return nonfinite(v_rows(tile), [&kv = kv_](std::uint32_t j, std::uint32_t d) { return kv.v_in_tile(j, d); },
                         cells);
    }
    template <class Src, class At>
    bool nonfinite(const Src* src, At&& at, tile_mask cells) const noexcept {
        fbatch z(0.0f);  // x * 0 is NaN exactly when x is NaN or inf
        float zs = 0.0f;
        for (tile_mask bits = cells; bits != 0; bits &= bits - 1) {
            const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
            std::uint32_t d = 0;
            for (; d + L <= dv_ && (d % v_block) + L <= v_block; d += L) z += simd::load(src + at(j, d)) * fbatch(0.0f);
            for (; d < dv_; ++d) zs += simd::to_float(src[at(j, d)]) * 0.0f;
        }
        return simd::any_nan(z) || zs != zs;
    }

    /// The V update, each slot over its own visible cells only (a cell a slot does not see
    /// never reaches it, whatever its V holds). Scalar: taken only when such a cell's V
    /// holds a NaN or an inf.
    template <class Src, class At>
    void accumulate_masked(const Src* src, At&& at, const tile_mask* mask, const float* alpha, bool rescale) noexcept {
        for (std::size_t s = 0; s < M; ++s)
            for (std::uint32_t d = 0; d < dv_; ++d) {
                float a = st_.acc[s * dv_ + d];
                if (rescale) a *= alpha[s];
                for (tile_mask bits = mask[s]; bits != 0; bits &= bits - 1) {
                    const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
                    a += p_buf_[s * k_tile + j] * simd::to_float(src[at(j, d)]);
                }
                st_.acc[s * dv_ + d] = a;
            }
    }

    /// The V update of accumulate_tile on one tile's rows: element (cell j, dimension d)
    /// of the tile is src[at(j, d)], into V blocks (format/kv_view.hpp) or the scratch rows.
    template <class Src, class At>
    void accumulate(const Src* src, At&& at, tile_mask any, const float* alpha, bool rescale) noexcept {
        const std::uint32_t dv = dv_;
        std::uint32_t d = 0;
        for (; d + VB * L <= dv; d += VB * L) {
            for (std::size_t g = 0; g < M; g += MG) {  // slot groups: MG x VB accumulators
                fbatch a[MG][VB];
                for (std::size_t s = 0; s < MG; ++s)
                    for (std::size_t v = 0; v < VB; ++v) {
                        a[s][v] = fbatch::load_unaligned(st_.acc + (g + s) * dv + d + v * L);
                        if (rescale) a[s][v] *= fbatch(alpha[g + s]);
                    }
                auto cell = [&](std::uint32_t j) {
                    fbatch vr[VB];
                    for (std::size_t v = 0; v < VB; ++v) vr[v] = simd::load(src + at(j, d + v * L));
                    for (std::size_t s = 0; s < MG; ++s) {
                        const fbatch pj = simd::broadcast(p_buf_ + (g + s) * k_tile + j);
                        for (std::size_t v = 0; v < VB; ++v) a[s][v] = xsimd::fma(pj, vr[v], a[s][v]);
                    }
                };
                if (any == k_tile_full) {
                    for (std::uint32_t j = 0; j < k_tile; ++j) cell(j);
                } else {
                    for (tile_mask bits = any; bits != 0; bits &= bits - 1)
                        cell(static_cast<std::uint32_t>(std::countr_zero(bits)));
                }
                for (std::size_t s = 0; s < MG; ++s)
                    for (std::size_t v = 0; v < VB; ++v) a[s][v].store_unaligned(st_.acc + (g + s) * dv + d + v * L);
            }
        }
        for (; d + L <= dv; d += L) {
            fbatch a[M];
            for (std::size_t s = 0; s < M; ++s) {
                a[s] = fbatch::load_unaligned(st_.acc + s * dv + d);
                if (rescale) a[s] *= fbatch(alpha[s]);
            }
            for (tile_mask bits = any; bits != 0; bits &= bits - 1) {
                const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
                const fbatch vr = simd::load(src + at(j, d));
                for (std::size_t s = 0; s < M; ++s) a[s] = xsimd::fma(simd::broadcast(p_buf_ + s * k_tile + j), vr, a[s]);
            }
            for (std::size_t s = 0; s < M; ++s) a[s].store_unaligned(st_.acc + s * dv + d);
        }
        for (; d < dv; ++d) {
            for (std::size_t s = 0; s < M; ++s) {
                float a = st_.acc[s * dv + d];
                if (rescale) a *= alpha[s];
                for (tile_mask bits = any; bits != 0; bits &= bits - 1) {
                    const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
                    a += p_buf_[s * k_tile + j] * simd::to_float(src[at(j, d)]);
                }
                st_.acc[s * dv + d] = a;
            }
        }
    }

    // ---- fused: V of tile `vtile` (every cell visible to some slot) and the scores of
    // tile `stile`, K rows and one V piece (up to 4 vectors of 16 dims of one cell, 128
    // bytes of f16) per step, so both streams are read at once. Alone, each loop reads one
    // stream while the other waits; on Zen 5 that left one core at 0.7-0.85 of its read
    // bandwidth, and the two streams read together at 1.0 (bench/README.md, "Reading K
    // and V together"). Per step with D = 128 and 4 query heads: 2 K rows (4 conversions,
    // 8 broadcasts, 16 FMAs) and a 64-dimension V piece (4 conversions, 4 broadcasts, 16
    // FMAs). The broadcasts are simd::broadcast (integer form): with the compiler's float
    // form one Zen 4 core ran this loop at 0.82 of its FMA rate in L1 and decoded 1.15x
    // slower cold (bench/README.md, "Broadcasts on Zen 4").
    // Scoring two tiles per step (each broadcast q feeding four FMAs) read four streams
    // and lost about a fifth cold ("V blocks of 64 dimensions").
    void fused_tile(std::uint32_t vtile, const float* alpha, bool rescale, std::uint32_t stile,
                    fbatch (&sc)[M][B]) noexcept {
        const S* kt = k_rows(stile);
        const S* vb = v_rows(vtile);
        // No software prefetch here: with both streams read at once the hardware prefetchers
        // keep up, and `interleaved` requests in this loop cost 2-12% (Zen 5, A/B).
        fbatch part[M][B];
        for (std::size_t s = 0; s < M; ++s)
            for (std::size_t b = 0; b < B; ++b) part[s][b] = fbatch(0.0f);
        // Locals, not the members: through captured references (and so through `this`)
        // GCC reloaded q_buf and st.acc from the stack on every step.
        const float* const qb = q_buf_;
        const float* const pb = p_buf_;
        float* const acc = st_.acc;
        std::uint32_t d = 0;  // next K row
        auto score_row = [&]() {
            fbatch krow[B];
            for (std::size_t b = 0; b < B; ++b) krow[b] = simd::load(kt + std::size_t{d} * k_tile + b * L);
            for (std::size_t s = 0; s < M; ++s) {
                const fbatch qd = simd::broadcast(qb + std::size_t{d} * M + s);
                for (std::size_t b = 0; b < B; ++b) part[s][b] = xsimd::fma(qd, krow[b], part[s][b]);
            }
            ++d;
        };
        // K rows paired with V pieces (one cell's dimensions of one V block): a fixed number
        // per piece when the K head size is 1 or 2 pieces' worth per cell (a loop with no
        // branch per step; D = 128: 2 K rows per 64-dimension piece), else spread evenly
        // (Bresenham). The last block is narrower when v_block does not divide dv.
        const std::uint32_t n_blocks = (dv_ + v_block - 1) / v_block;
        const std::uint32_t nv = n_blocks * k_tile;  // V pieces per tile
        std::uint32_t err = 0;
        auto block = [&](std::uint32_t blk, auto vw_tag, auto rows_tag) {
            constexpr std::size_t VW = decltype(vw_tag)::value;  // vectors per piece
            constexpr std::size_t R = decltype(rows_tag)::value;  // K rows per piece, 0: Bresenham
            const std::uint32_t d0 = blk * v_block;
            const S* vp = vb + std::size_t{d0} * k_tile;  // (earlier blocks are full)
            const std::size_t w = VW * L;                 // this block's width
            float* ab = acc + d0;
            fbatch a[M][VW];
            for (std::size_t s = 0; s < M; ++s)
                for (std::size_t v = 0; v < VW; ++v) {
                    a[s][v] = fbatch::load_unaligned(ab + s * dv_ + v * L);
                    if (rescale) a[s][v] *= fbatch(alpha[s]);
                }
            for (std::uint32_t j = 0; j < k_tile; ++j) {
                if constexpr (R > 0)
                    for (std::size_t r = 0; r < R; ++r) score_row();
                else
                    for (err += dk_; err >= nv; err -= nv) score_row();
                fbatch vr[VW];
                for (std::size_t v = 0; v < VW; ++v) vr[v] = simd::load(vp + j * w + v * L);
                for (std::size_t s = 0; s < M; ++s) {
                    const fbatch pj = simd::broadcast(pb + s * k_tile + j);
                    for (std::size_t v = 0; v < VW; ++v) a[s][v] = xsimd::fma(pj, vr[v], a[s][v]);
                }
            }
            for (std::size_t s = 0; s < M; ++s)
                for (std::size_t v = 0; v < VW; ++v) a[s][v].store_unaligned(ab + s * dv_ + v * L);
        };
        using full = std::integral_constant<std::size_t, v_block / L>;
        using bresenham = std::integral_constant<std::size_t, 0>;
        if constexpr (!can_fuse) {
            // (Never called: `fuse` is false. Not instantiating the blocks keeps builds with
            // narrower vectors from compiling dead loops of v_block / L accumulators each.)
        } else if (dv_ % v_block == 0 && nv == dk_) {
            for (std::uint32_t blk = 0; blk < n_blocks; ++blk) block(blk, full{}, std::integral_constant<std::size_t, 1>{});
        } else if (dv_ % v_block == 0 && 2 * nv == dk_) {
            for (std::uint32_t blk = 0; blk < n_blocks; ++blk) block(blk, full{}, std::integral_constant<std::size_t, 2>{});
        } else {
            for (std::uint32_t blk = 0; blk + 1 < n_blocks; ++blk) block(blk, full{}, bresenham{});
            // The last block: full, or 1 to v_block / L - 1 vectors wide (dv is a multiple of L).
            const std::uint32_t last = n_blocks - 1;
            switch ((dv_ - last * v_block) / L) {
                case 1: block(last, std::integral_constant<std::size_t, 1>{}, bresenham{}); break;
                case 2: block(last, std::integral_constant<std::size_t, 2>{}, bresenham{}); break;
                case 3: block(last, std::integral_constant<std::size_t, 3>{}, bresenham{}); break;
                default: block(last, full{}, bresenham{}); break;
            }
        }
        while (d < dk_) score_row();
        for (std::size_t s = 0; s < M; ++s)
            for (std::size_t b = 0; b < B; ++b) sc[s][b] = part[s][b];
    }

    // ---- finalize: the lanes' partial sums into st.l
    void finalize() noexcept {
        for (std::size_t s = 0; s < M; ++s) {
            fbatch v = lsum_[s][0];
            for (std::size_t b = 1; b < B; ++b) v += lsum_[s][b];
            st_.l[s] = xsimd::hadd(v);
        }
    }

    const kv_layer_view<const T>& kv_;
    std::uint32_t h_;                 // KV head
    const attn_meta<Seqs>& meta_;
    const attn_shape& sh_;
    const attn_slot* slots_;          // M slots
    const tile_range* ranges_;        // tiles to visit
    std::size_t n_ranges_;
    attn_state<M>& st_;
    float* p_buf_;                    // M x k_tile: exp(logit - m) of the current tile
    float* vt_buf_;                   // k_tile x dv: transposed V gathered into rows
    float* q_buf_;                    // dk x M: the scaled queries, [K row][slot]
    const Conv* conv_;                // the tile converter (unused when in place)
    std::uint32_t dk_, dv_;
    bool vt_;                         // V transposed
    fbatch lsum_[M][B];               // per-lane partial sums of exp(logit - m)
    bool same_as_prev_[M];            // slot s sees what slot s - 1 sees
    std::size_t r_ = 0;               // next_tile: current range
    std::uint32_t t_ = 0;             // ... and tile
    std::uint32_t pf_t_ = 0;          // tile whose K/V the interleaved prefetch asks for
};

/// Runs one work item over `ranges`: kv head h of view `kv`, M slots, accumulating into st
/// (attention_kernel::run). Scratch: p_buf M x k_tile floats, vt_buf k_tile x dv floats
/// (transposed V only), q_buf dk x M floats. conv: none (K / V read in place: storage with
/// SIMD loads, f32 / f16 / bf16), or one converted_tiles (tile_source.hpp) that converts
/// each tile into its own f32 scratch.
template <std::size_t M, class T, class Seqs, class... Conv>
void attend_item(const kv_layer_view<const T>& kv, std::uint32_t h, const attn_meta<Seqs>& meta, const attn_shape& sh,
                 const attn_slot* slots, const tile_range* ranges, std::size_t n_ranges, attn_state<M>& st,
                 float* p_buf, float* vt_buf, float* q_buf, const Conv&... conv) noexcept {
    static_assert(sizeof...(Conv) <= 1, "attend_item: at most one tile converter");
    if constexpr (sizeof...(Conv) == 0) {
        attention_kernel<M, T, Seqs> k(kv, h, meta, sh, slots, ranges, n_ranges, st, p_buf, vt_buf, q_buf, nullptr);
        k.run();
    } else {
        attention_kernel<M, T, Seqs, Conv...> k(kv, h, meta, sh, slots, ranges, n_ranges, st, p_buf, vt_buf, q_buf,
                                                &conv...);
        k.run();
    }
}

// ---- (ops' deterministic mode, issue 26) -------------------------------------------
/// attend_item with every score summed in one fixed order whatever M: one FMA chain per
/// lane over the K rows in order (as M >= 8 and the fused loop always do), so a slot's
/// output bits do not depend on how many other slots share its item, nor on whether a
/// tile went through the fused loop. (Only M < 8 differs from attend_item: its score
/// loop splits the sum over 8 / M chains for latency.)
template <std::size_t M, class T, class Seqs, class... Conv>
void attend_item_fixed_order(const kv_layer_view<const T>& kv, std::uint32_t h, const attn_meta<Seqs>& meta,
                             const attn_shape& sh, const attn_slot* slots, const tile_range* ranges,
                             std::size_t n_ranges, attn_state<M>& st, float* p_buf, float* vt_buf, float* q_buf,
                             const Conv&... conv) noexcept {
    static_assert(sizeof...(Conv) <= 1, "attend_item_fixed_order: at most one tile converter");
    if constexpr (sizeof...(Conv) == 0) {
        attention_kernel<M, T, Seqs, in_place_tiles, true> k(kv, h, meta, sh, slots, ranges, n_ranges, st, p_buf,
                                                             vt_buf, q_buf, nullptr);
        k.run();
    } else {
        attention_kernel<M, T, Seqs, Conv..., true> k(kv, h, meta, sh, slots, ranges, n_ranges, st, p_buf, vt_buf,
                                                      q_buf, &conv...);
        k.run();
    }
}

}  // namespace kernels
KVCACHE_END_NAMESPACE
