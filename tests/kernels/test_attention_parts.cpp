// The attention kernel's parts on their own, with no cache and no cell type: the SIMD
// kernel (kernels::attend_item) and the scalar oracle read a hand-built layer view and a
// plain per-cell sequence bitmask (the Seqs view the op otherwise builds from its cell
// table) and are compared with a float64 reference; the split-K planning and merge of
// ops/detail/ against their definitions.
#include <doctest/doctest.h>

#include <kvcache/kernels/attention.hpp>
#include <kvcache/kernels/attention_scalar.hpp>
#include <kvcache/ops/detail/attention_merge.hpp>
#include <kvcache/ops/detail/attention_schedule.hpp>
#include <kvcache/element/f32.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace {

using kvcache::pos_t;
using kvcache::seq_id_t;
namespace kernels = kvcache::kernels;

/// Sequence membership as one 64-bit mask per cell: what a kernel needs, nothing more.
struct seq_bits {
    const std::uint64_t* bits = nullptr;
    [[nodiscard]] bool test(std::uint32_t c, seq_id_t s) const noexcept { return (bits[c] >> s) & 1u; }
};

struct query {
    std::vector<float> q;
    pos_t pos;
    seq_id_t seq;
};

/// One KV head of n cells (n a multiple of k_tile), f32, in a layer view.
struct layer {
    std::uint32_t n, dk, dv;
    kvcache::v_layout vl;
    std::vector<float> k, v;  // storage
    std::vector<float> kc, vc;  // cell-major copies: kc[c * dk + d], vc[c * dv + d]
    std::vector<pos_t> pos;
    std::vector<std::uint64_t> seqs;

    [[nodiscard]] kvcache::kv_layer_view<const float> view() const {
        kvcache::kv_layer_view<const float> w;
        w.k = k.data();
        w.v = v.data();
        w.n_head_kv = 1;
        w.dim_k = dk;
        w.dim_v = dv;
        w.n_cells_pad = n;
        w.k_head_stride = std::size_t{n} * dk;
        w.v_head_stride = std::size_t{n} * dv;
        w.vl = vl;
        return w;
    }
};

layer make_layer(std::uint32_t n, std::uint32_t dk, std::uint32_t dv, kvcache::v_layout vl, std::mt19937& rng) {
    layer L{n, dk, dv, vl, {}, {}, {}, {}, {}, {}};
    std::uniform_real_distribution<float> val(-1.0f, 1.0f);
    L.k.assign(std::size_t{n} * dk, 0.0f);
    L.v.assign(std::size_t{n} * dv, 0.0f);
    L.kc.resize(L.k.size());
    L.vc.resize(L.v.size());
    const auto w = L.view();
    for (std::uint32_t c = 0; c < n; ++c) {
        for (std::uint32_t d = 0; d < dk; ++d) L.k[w.k_offset(0, c, d)] = L.kc[std::size_t{c} * dk + d] = val(rng);
        for (std::uint32_t d = 0; d < dv; ++d) L.v[w.v_offset(0, c, d)] = L.vc[std::size_t{c} * dv + d] = val(rng);
    }
    // Cells: positions 0.. in order; in tiles 1 and 3 every 7th cell free (NaN in its K/V:
    // must never reach a result), so tiles 0, 2 and 4 are full (the fused loop's case);
    // sequences 0 / 1 alternating in runs of 40, every 5th cell shared by both.
    L.pos.assign(n, -1);
    L.seqs.assign(n, 0);
    for (std::uint32_t c = 0; c < n; ++c) {
        if (c % 7 == 3 && (c / kvcache::k_tile) % 2 == 1) {
            for (std::uint32_t d = 0; d < dk; ++d) L.k[w.k_offset(0, c, d)] = std::numeric_limits<float>::quiet_NaN();
            for (std::uint32_t d = 0; d < dv; ++d) L.v[w.v_offset(0, c, d)] = std::numeric_limits<float>::quiet_NaN();
            continue;
        }
        L.pos[c] = static_cast<pos_t>(c);
        L.seqs[c] = c % 5 == 0 ? 3u : (c / 40) % 2 == 0 ? 1u : 2u;
    }
    return L;
}

/// Tile summaries from the plain arrays (what the op builds from its cell table).
std::vector<kernels::tile_meta> summarise(const layer& L) {
    std::vector<kernels::tile_meta> tiles(L.n / kvcache::k_tile);
    for (std::uint32_t t = 0; t < tiles.size(); ++t) {
        kernels::tile_meta& tm = tiles[t];
        std::uint64_t first = 0;
        bool same = true;
        for (std::uint32_t j = 0; j < kvcache::k_tile; ++j) {
            const std::uint32_t c = t * kvcache::k_tile + j;
            if (L.pos[c] < 0) continue;
            if (tm.occ == 0) {
                tm.pmin = tm.pmax = L.pos[c];
                first = L.seqs[c];
            } else {
                tm.pmin = std::min(tm.pmin, L.pos[c]);
                tm.pmax = std::max(tm.pmax, L.pos[c]);
                same = same && L.seqs[c] == first;
            }
            tm.occ |= kvcache::tile_mask{1} << j;
        }
        if (tm.occ != 0) tm.sid = same && (first == 1 || first == 2) ? (first == 1 ? 0 : 1) : -2;
    }
    return tiles;
}

/// float64 attention of one query over the layer.
std::vector<double> reference(const layer& L, const query& q, float scale, std::int32_t window) {
    std::vector<double> out(L.dv, 0.0);
    double mx = -std::numeric_limits<double>::infinity(), sum = 0.0;
    std::vector<double> logit(L.n, 0.0);
    std::vector<bool> vis(L.n, false);
    for (std::uint32_t c = 0; c < L.n; ++c) {
        const pos_t p = L.pos[c];
        if (p < 0 || ((L.seqs[c] >> q.seq) & 1u) == 0 || p > q.pos) continue;
        if (window > 0 && std::int64_t{p} <= std::int64_t{q.pos} - window) continue;
        vis[c] = true;
        double s = 0.0;
        for (std::uint32_t d = 0; d < L.dk; ++d) s += double{q.q[d]} * L.kc[std::size_t{c} * L.dk + d];
        logit[c] = s * scale;
        mx = std::max(mx, logit[c]);
    }
    for (std::uint32_t c = 0; c < L.n; ++c)
        if (vis[c]) {
            const double w = std::exp(logit[c] - mx);
            sum += w;
            for (std::uint32_t d = 0; d < L.dv; ++d) out[d] += w * L.vc[std::size_t{c} * L.dv + d];
        }
    for (auto& o : out) o = sum > 0.0 ? o / sum : 0.0;
    return out;
}

/// Runs attend_item<M> over all tiles of L for the M slots made of qs (padded with
/// inactive slots) and returns the M x dv outputs (acc / l).
template <std::size_t M>
std::vector<float> run_kernel(const layer& L, const std::vector<query>& qs, float scale, std::int32_t window) {
    const auto tiles = summarise(L);
    kernels::attn_meta<seq_bits> meta;
    meta.pos = L.pos.data();
    meta.seqs = seq_bits{L.seqs.data()};
    meta.tiles = tiles.data();
    kernels::attn_shape sh;
    sh.dk = L.dk;
    sh.dv = L.dv;
    sh.scale = scale;
    sh.window = window;
    kernels::attn_slot slots[M];
    for (std::size_t s = 0; s < M; ++s) {
        slots[s].q = qs[std::min(s, qs.size() - 1)].q.data();
        if (s < qs.size()) {
            slots[s].qp = qs[s].pos;
            slots[s].qs = qs[s].seq;
            slots[s].active = true;
        }
    }
    const kernels::tile_range range{0, static_cast<std::uint32_t>(tiles.size())};
    std::vector<float> acc(M * L.dv, 0.0f), p_buf(M * kvcache::k_tile), vt_buf(std::size_t{kvcache::k_tile} * L.dv),
        q_buf(std::size_t{L.dk} * M);
    kernels::attn_state<M> st;
    st.acc = acc.data();
    for (std::size_t s = 0; s < M; ++s) {
        st.m[s] = -std::numeric_limits<float>::infinity();
        st.l[s] = 0.0f;
    }
    kernels::attend_item<M, float>(L.view(), 0, meta, sh, slots, &range, 1, st, p_buf.data(), vt_buf.data(),
                                   q_buf.data());
    for (std::size_t s = 0; s < M; ++s)
        for (std::uint32_t d = 0; d < L.dv; ++d) acc[s * L.dv + d] = st.l[s] > 0.0f ? acc[s * L.dv + d] / st.l[s] : 0.0f;
    return acc;
}

template <std::size_t M>
void check_kernel(std::uint32_t dk, std::uint32_t dv, kvcache::v_layout vl, std::int32_t window) {
    std::mt19937 rng(1234 + static_cast<unsigned>(M * 7 + dk + dv + window));
    const layer L = make_layer(160, dk, dv, vl, rng);
    std::uniform_real_distribution<float> val(-1.0f, 1.0f);
    std::vector<query> qs;
    const pos_t positions[] = {159, 150, 95, 41, 0, 120, 2, 159};
    for (std::size_t s = 0; s < M && s < 8; ++s) {
        query q{std::vector<float>(dk), positions[s], static_cast<seq_id_t>(s % 2)};
        for (auto& x : q.q) x = val(rng);
        qs.push_back(q);
    }
    if (M > 1) qs.pop_back();  // one padding slot
    const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
    const auto got = run_kernel<M>(L, qs, scale, window);
    for (std::size_t s = 0; s < M; ++s) {
        const std::vector<double> want =
            s < qs.size() ? reference(L, qs[s], scale, window) : std::vector<double>(dv, 0.0);
        for (std::uint32_t d = 0; d < dv; ++d) {
            INFO("M = " << M << ", dk = " << dk << ", dv = " << dv << ", slot " << s << ", d = " << d);
            CHECK(std::abs(got[s * dv + d] - want[d]) <= 2e-5 + 2e-5 * std::abs(want[d]));
        }
    }
    // The scalar oracle through the same view and membership.
    std::vector<float> q_all, out(qs.size() * dv), acc(dv);
    std::vector<pos_t> qp;
    std::vector<seq_id_t> qsq;
    for (const auto& q : qs) {
        q_all.insert(q_all.end(), q.q.begin(), q.q.end());
        qp.push_back(q.pos);
        qsq.push_back(q.seq);
    }
    kernels::scalar_attn_args<seq_bits> a;
    a.cell_pos = L.pos.data();
    a.cell_seqs = seq_bits{L.seqs.data()};
    a.n = L.n;
    a.q = q_all.data();
    a.q_pos = qp.data();
    a.q_seq = qsq.data();
    a.n_q = static_cast<std::uint32_t>(qs.size());
    a.n_head = 1;
    a.scale = scale;
    a.window = window;
    a.out = out.data();
    kernels::attention_scalar<kvcache::f32>(L.view(), a, acc.data());
    for (std::size_t s = 0; s < qs.size(); ++s) {
        const auto want = reference(L, qs[s], scale, window);
        for (std::uint32_t d = 0; d < dv; ++d) CHECK(std::abs(out[s * dv + d] - want[d]) <= 2e-5 + 2e-5 * std::abs(want[d]));
    }
}

}  // namespace

TEST_CASE("attend_item and the scalar oracle with a plain sequence bitmask (no cell type)") {
    for (const auto vl : {kvcache::v_layout::row_major, kvcache::v_layout::transposed})
        for (const std::int32_t window : {0, 50}) {
            check_kernel<1>(64, 64, vl, window);
            check_kernel<2>(128, 128, vl, window);   // fused loop: 2 K rows per V piece
            check_kernel<4>(64, 128, vl, window);    // fused loop: 1 K row per V piece
            check_kernel<4>(80, 48, vl, window);     // fused loop: Bresenham, narrow last block
            check_kernel<8>(64, 64, vl, window);
            check_kernel<16>(40, 24, vl, window);    // scalar tails of the score and V loops
        }
}

TEST_CASE("plan_split: parts cover the tiles to visit once, in order, evenly") {
    using kernels::tile_range;
    std::vector<tile_range> split;
    std::vector<std::size_t> first;
    for (const auto& ranges : {std::vector<tile_range>{{0, 1000}}, std::vector<tile_range>{{5, 300}, {400, 401}, {500, 900}}}) {
        for (const int threads : {1, 2, 4, 16}) {
            const std::size_t n = kvcache::ops::detail_attn::plan_split(ranges, 2, threads, split, first);
            REQUIRE(first.size() == n + 1);
            CHECK(first.front() == 0);
            CHECK(first.back() == split.size());
            if (threads == 1) CHECK(n == 1);
            if (threads == 16) CHECK(n > 1);
            // Concatenated parts == ranges, tile for tile.
            std::vector<std::uint32_t> want, got;
            std::size_t total = 0;
            for (const auto& r : ranges)
                for (std::uint32_t t = r.t0; t < r.t1; ++t) want.push_back(t);
            std::size_t lo = want.size(), hi = 0;
            for (std::size_t k = 0; k < n; ++k) {
                std::size_t len = 0;
                for (std::size_t i = first[k]; i < first[k + 1]; ++i) {
                    CHECK(split[i].t0 < split[i].t1);
                    for (std::uint32_t t = split[i].t0; t < split[i].t1; ++t) got.push_back(t);
                    len += split[i].t1 - split[i].t0;
                }
                total += len;
                lo = std::min(lo, len);
                hi = std::max(hi, len);
            }
            CHECK(got == want);
            CHECK(total == want.size());
            CHECK(hi - lo <= 1);
        }
    }
}

TEST_CASE("merge_slot: the split-K merge equals one softmax over all parts") {
    constexpr std::uint32_t dv = 3;
    const float ninf = -std::numeric_limits<float>::infinity();
    // Two parts of one slot (M = 1): logits {1, 2} and {4}, V rows {1,0,0} {0,1,0} and {0,0,1}.
    std::vector<float> partial = {
        2.0f, std::exp(1.0f - 2.0f) + 1.0f, std::exp(-1.0f), 1.0f, 0.0f,  // part 0: m = 2
        4.0f, 1.0f, 0.0f, 0.0f, 1.0f,                                     // part 1: m = 4
    };
    float o[dv] = {-1, -1, -1};
    kvcache::ops::detail_attn::merge_slot<1>(partial.data(), 2, dv, 0, o);
    const double e1 = std::exp(1.0), e2 = std::exp(2.0), e4 = std::exp(4.0), z = e1 + e2 + e4;
    CHECK(o[0] == doctest::Approx(e1 / z).epsilon(1e-6));
    CHECK(o[1] == doctest::Approx(e2 / z).epsilon(1e-6));
    CHECK(o[2] == doctest::Approx(e4 / z).epsilon(1e-6));
    // A part that saw nothing (m = -inf, l = 0) does not count; all empty: zeros.
    partial[5] = ninf;
    partial[6] = 0.0f;
    kvcache::ops::detail_attn::merge_slot<1>(partial.data(), 2, dv, 0, o);
    CHECK(o[0] == doctest::Approx(e1 / (e1 + e2)).epsilon(1e-6));
    CHECK(o[2] == 0.0f);
    partial[0] = ninf;
    partial[1] = 0.0f;
    kvcache::ops::detail_attn::merge_slot<1>(partial.data(), 2, dv, 0, o);
    CHECK(o[0] == 0.0f);
    CHECK(o[1] == 0.0f);
    CHECK(o[2] == 0.0f);
    // A padding slot (no output row) is skipped.
    kvcache::ops::detail_attn::merge_slot<1>(partial.data(), 2, dv, 0, nullptr);
}
