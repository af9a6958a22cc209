// Quantized K/V (q8_0, q4_0) on the layouts and memories test_quant (tests/element) does
// not cover: the ring (sliding window, wrap and pruning), iswa_cache (SWA ring part + full
// part) and hybrid_memory with a quantized attention part. For each: writes + attention
// against the float64 oracle over the stored values (1e-10) and over the unquantized
// values of an f32 twin (q8_0 <= 2e-4, q4_0 <= 5e-2, test_quant's tolerances), the
// K-shift against the twin's shifted K (relative L1: q8_0 <= 0.015, q4_0 <= 0.2),
// state save / load round trips bit for bit, and refusals that leave every byte.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "iswa_test_util.hpp"
#include "kernels/kernel_test_util.hpp"
#include "reference/attention_ref.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using kvcache::pos_t;
using kvcache::seq_id_t;

constexpr std::uint32_t qmem_w = 16;
using qmem_ring8 = kvcache::kv_cache<kvcache::q8_0, kvcache::ring<qmem_w>>;
using qmem_ring4 = kvcache::kv_cache<kvcache::q4_0, kvcache::ring<qmem_w, kvcache::v_layout::transposed>>;
using qmem_ringf = kvcache::kv_cache<kvcache::f32, kvcache::ring<qmem_w>>;
using qmem_iswa8 = kvcache::iswa_cache<qmem_w, kvcache::q8_0>;
using qmem_iswaf = kvcache::iswa_cache<qmem_w, kvcache::f32>;
using qmem_hyb8 = kvcache::hybrid_memory<kvcache::kv_cache<kvcache::q8_0>>;
using qmem_hybf = kvcache::hybrid_memory<kvcache::kv_cache<kvcache::f32>>;

template <class E>
constexpr double qmem_attn_tol = std::is_same_v<E, kvcache::q4_0> ? 5e-2 : 2e-4;
template <class E>
constexpr double qmem_kshift_tol = std::is_same_v<E, kvcache::q4_0> ? 0.2 : 0.015;

kvcache::model_shape qmem_shape(std::uint32_t n_cells, std::uint32_t n_seq, std::uint32_t n_layer = 2) {
    kvcache::model_shape s;
    s.n_layer = n_layer;
    s.n_head_kv = 2;
    s.head_dim_k = 64;
    s.head_dim_v = 32;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    s.rope.type = kvcache::rope_type::neox;
    return s;
}

kvcache::iswa_shape qmem_iswa_shape() {
    kvcache::iswa_shape s;
    s.shape = qmem_shape(160, 2, 4);
    s.swa_layers = kvcache::iswa_shape::every_nth_full(4, 2);
    s.swa_n_cells = kvcache::ring<qmem_w>::cells_for(2, 8);
    return s;
}

kvcache::recurrent_shape qmem_rec_shape() {
    kvcache::recurrent_shape s;
    s.n_layer = 1;
    s.n_seq_max = 2;
    s.d_conv = 3;
    s.d_inner = 4;
    s.ssm_size = 6;
    return s;
}
const std::vector<bool> qmem_hyb_layers = {false, true, false};  // layer 1 recurrent

/// Writes rows into layer l of memory m (kv_cache: the placement's cells; iswa / hybrid:
/// the placement; hybrid recurrent layers are skipped).
template <class M, class P>
void qmem_write(M& m, std::uint32_t l, const P& p, const float* k, const float* v) {
    if constexpr (requires { m.is_recurrent(l); }) {
        if (m.is_recurrent(l)) return;
    }
    if constexpr (requires { m.write_k(l, p.cells, k); }) {
        m.write_k(l, p.cells, k);
        m.write_v(l, p.cells, v);
    } else {
        m.write_k(l, p, k);
        m.write_v(l, p, v);
    }
}

/// Places positions [p0, p0 + n) of sequence s in both memories in batches of at most
/// 8 and writes the same N(0, 1) K/V into every layer of both.
template <class A, class B>
void qmem_fill(A& a, B& b, std::uint32_t n_layer, const kvcache::model_shape& sh, seq_id_t s, pos_t p0,
               std::uint32_t n, std::mt19937& rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::uint32_t done = 0; done < n;) {
        const std::uint32_t m = std::min<std::uint32_t>(8, n - done);
        std::vector<pos_t> pos(m);
        std::vector<seq_id_t> seq(m, s);
        for (std::uint32_t i = 0; i < m; ++i) pos[i] = p0 + static_cast<pos_t>(done + i);
        auto ra = a.place(pos, seq);
        auto rb = b.place(pos, seq);
        REQUIRE(ra.ok());
        REQUIRE(rb.ok());
        for (std::uint32_t l = 0; l < n_layer; ++l) {
            std::vector<float> k(m * sh.k_row_size()), v(m * sh.v_row_size());
            for (auto& x : k) x = nd(rng);
            for (auto& x : v) x = nd(rng);
            qmem_write(a, l, ra.value(), k.data(), v.data());
            qmem_write(b, l, rb.value(), k.data(), v.data());
        }
        REQUIRE(a.commit() == kvcache::tx_result::committed);
        REQUIRE(b.commit() == kvcache::tx_result::committed);
        done += m;
    }
}

/// Attention of cache q (quantized) against the float64 oracle on its stored values and on
/// the unquantized values of its f32 twin f: decode of every sequence and a prefill of
/// the last 6 positions of sequence 0, GQA 2, both kernel paths.
template <class Q, class F>
void qmem_check_attention(const Q& q, const F& f, std::int32_t window, std::uint32_t seed) {
    using E = typename Q::element;
    const auto& sh = q.shape();
    kvcache::ops::attention_params p;
    p.n_head = sh.n_head_kv * 2;
    p.window = window;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<pos_t> qp;
    std::vector<seq_id_t> qs;
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(sh.n_seq_max); ++s) {
        if (q.seq_pos_max(s) < 0) continue;
        qp.push_back(q.seq_pos_max(s) + 1);
        qs.push_back(s);
    }
    for (pos_t i = 0; i < 6; ++i) {
        qp.push_back(q.seq_pos_max(0) - 5 + i);
        qs.push_back(0);
    }
    const auto n_q = static_cast<std::uint32_t>(qp.size());
    std::vector<float> qv(std::size_t{n_q} * p.n_head * sh.dim_k());
    for (auto& x : qv) x = nd(rng);
    kvcache::ops::attention_workspace ws;
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        CAPTURE(l);
        const auto stored = ref::attention(q, l, qv, qp, qs, p);
        const auto exact = ref::attention(f, l, qv, qp, qs, p);
        for (auto path : {kvcache::ops::kernel_path::simd, kvcache::ops::kernel_path::scalar}) {
            auto pp = p;
            pp.path = path;
            pp.n_threads = path == kvcache::ops::kernel_path::simd ? 2 : 1;
            std::vector<float> out(std::size_t{n_q} * p.n_head * sh.dim_v(), -1.0f);
            kvcache::ops::attention(q, l, qv.data(), qp.data(), qs.data(), n_q, pp, out.data(), ws);
            for (float x : out) REQUIRE(std::isfinite(x));
            CHECK(kvtest::nmse(out, stored) <= 1e-10);
            CHECK(kvtest::nmse(out, exact) <= qmem_attn_tol<E>);
        }
    }
}

/// Relative L1 of q's K rows against f's (the same positions in the same sequences), over
/// every occupied cell and layer.
template <class Q, class F>
double qmem_k_rel_l1(const Q& q, const F& f) {
    const auto& sh = q.shape();
    std::vector<float> rq(sh.k_row_size()), rf(sh.k_row_size());
    double num = 0.0, den = 0.0;
    std::size_t found = 0;
    for (std::uint32_t c = 0; c < q.n_window(); ++c) {
        const pos_t p = q.cells().pos(c);
        if (p < 0) continue;
        for (std::uint32_t cf = 0; cf < f.n_window(); ++cf) {
            if (f.cells().pos(cf) != p || !(f.cells().seqs(cf) == q.cells().seqs(c))) continue;
            ++found;
            for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
                q.read_k(l, c, rq.data());
                f.read_k(l, cf, rf.data());
                for (std::size_t d = 0; d < rq.size(); ++d) {
                    num += std::abs(static_cast<double>(rq[d]) - rf[d]);
                    den += std::abs(static_cast<double>(rf[d]));
                }
            }
            break;
        }
    }
    CHECK(found == q.used());
    return den > 0.0 ? num / den : 1.0;
}

/// Every token of a is in b (same position and sequences) with the same K/V bytes.
template <class A, class B>
void qmem_same_tokens(const A& a, const B& b) {
    const auto& sh = a.shape();
    std::size_t tokens = 0;
    for (std::uint32_t ca = 0; ca < a.n_window(); ++ca) {
        if (a.cells().pos(ca) < 0) continue;
        ++tokens;
        bool found = false;
        for (std::uint32_t cb = 0; cb < b.n_window() && !found; ++cb) {
            if (b.cells().pos(cb) != a.cells().pos(ca) || !(b.cells().seqs(cb) == a.cells().seqs(ca))) continue;
            found = true;
            for (std::uint32_t l = 0; l < sh.n_layer; ++l)
                for (bool v_side : {false, true}) {
                    std::vector<typename A::storage_type> x;
                    std::vector<typename B::storage_type> y;
                    a.storage().cell_bytes(l, ca, v_side, x);
                    b.storage().cell_bytes(l, cb, v_side, y);
                    REQUIRE(x.size() == y.size());
                    CHECK(std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
                }
        }
        CHECK(found);
    }
    CHECK(tokens > 0);
    CHECK(b.used() == a.used());
}

template <class Ring>
void qmem_ring_suite(std::uint32_t seed) {
    using E = typename Ring::element;
    CAPTURE(std::string(E::name));
    const auto sh = qmem_shape(kvcache::ring<qmem_w>::cells_for(3, 8), 3);
    Ring q(sh);
    qmem_ringf f(sh);
    std::mt19937 rng(seed);
    // Sequence 0 runs 4 windows past its start (the region wraps, cells are pruned);
    // sequence 1 stays inside its window; sequence 2 is empty.
    qmem_fill(q, f, sh.n_layer, sh, 0, 0, 4 * qmem_w + 5, rng);
    qmem_fill(q, f, sh.n_layer, sh, 1, 0, 11, rng);
    CHECK(q.storage().pruned_below(0) > 0);
    CHECK(kvtest::snapshot(q).pos == kvtest::snapshot(f).pos);
    qmem_check_attention(q, f, static_cast<std::int32_t>(qmem_w), seed + 1);

    // K-shift of the sequence that pruned nothing (ring: moving pruned history is refused).
    REQUIRE(q.seq_add(1, 4, -1, 9));
    REQUIRE(f.seq_add(1, 4, -1, 9));
    kvcache::ops::apply_k_shift(q, 2);
    kvcache::ops::apply_k_shift(f, 2);
    CHECK(qmem_k_rel_l1(q, f) <= qmem_kshift_tol<E>);
    qmem_check_attention(q, f, static_cast<std::int32_t>(qmem_w), seed + 2);

    // Refusals leave every byte: a move of the sequence that pruned, a removal of a
    // middle range of it, a state of another element.
    const auto snap = kvtest::snapshot(q);
    CHECK(kvtest::refused_result(q.seq_add(0, 0, -1, 3), "unsupported"));
    CHECK(kvtest::snapshot(q) == snap);
    CHECK(kvtest::refused_result(q.seq_rm(0, 20, 60), "unsupported"));
    CHECK(kvtest::snapshot(q) == snap);
    {
        const auto fbytes = kvcache::io::save_state(f);
        auto r = kvcache::io::load_state(q, fbytes);
        REQUIRE_FALSE(r.ok());
        CHECK(r.code() == kvcache::errc::dtype_mismatch);
        CHECK(kvtest::snapshot(q) == snap);
    }

    // State round trip (whole and one sequence), pruning points included, bit for bit.
    const auto bytes = kvcache::io::save_state(q);
    Ring b(sh);
    REQUIRE(kvcache::io::load_state(b, bytes).ok());
    qmem_same_tokens(q, b);
    CHECK(b.storage().pruned_below(0) == q.storage().pruned_below(0));
    CHECK(kvcache::io::save_state(b) == bytes);
    Ring c(sh);
    REQUIRE(kvcache::io::load_seq(c, 2, kvcache::io::save_seq(q, 0)).ok());
    CHECK(kvtest::positions_of(c, 2) == kvtest::positions_of(q, 0));
    // A truncated state is refused and leaves the cache as it was.
    auto cut = bytes;
    cut.resize(cut.size() - 17);
    const auto snap_b = kvtest::snapshot(b);
    CHECK_FALSE(kvcache::io::load_state(b, cut).ok());
    CHECK(kvtest::snapshot(b) == snap_b);

    // Generation goes on after the load: the reloaded ring keeps attending like the twin.
    qmem_fill(b, f, sh.n_layer, sh, 0, q.seq_pos_max(0) + 1, 2 * qmem_w, rng);
    qmem_check_attention(b, f, static_cast<std::int32_t>(qmem_w), seed + 3);
}

}  // namespace

TEST_CASE("quantized ring: writes across wraps, windowed attention, K-shift, state files, refusals (q8_0)") {
    qmem_ring_suite<qmem_ring8>(8100);
}

TEST_CASE("quantized ring: the same with q4_0 and transposed V") {
    qmem_ring_suite<qmem_ring4>(8200);
}

TEST_CASE("quantized iswa_cache (q8_0): both parts attend like f32 within tolerance, K-shift, state files") {
    const auto is = qmem_iswa_shape();
    qmem_iswa8 q(is);
    qmem_iswaf f(is);
    static_assert(std::is_same_v<qmem_iswa8::swa_cache::element, kvcache::q8_0>);
    std::mt19937 rng(8300);
    qmem_fill(q, f, 4, is.shape, 0, 0, 12, rng);
    qmem_fill(q, f, 4, is.shape, 1, 0, 3 * qmem_w, rng);
    qmem_check_attention(q.swa(), f.swa(), static_cast<std::int32_t>(qmem_w), 8301);
    qmem_check_attention(q.full(), f.full(), 0, 8302);

    // K-shift of both parts (sequence 0 is still inside the window).
    REQUIRE(q.seq_add(0, 0, -1, 5));
    REQUIRE(f.seq_add(0, 0, -1, 5));
    kvcache::ops::apply_k_shift(q, 2);
    kvcache::ops::apply_k_shift(f, 2);
    CHECK_FALSE(q.has_shift());
    CHECK(qmem_k_rel_l1(q.full(), f.full()) <= qmem_kshift_tol<kvcache::q8_0>);
    CHECK(qmem_k_rel_l1(q.swa(), f.swa()) <= qmem_kshift_tol<kvcache::q8_0>);
    qmem_check_attention(q.swa(), f.swa(), static_cast<std::int32_t>(qmem_w), 8303);
    qmem_check_attention(q.full(), f.full(), 0, 8304);

    // A move the ring refuses (sequence 1 pruned): both parts unchanged.
    const auto snap = kvtest::iswa_snap(q);
    CHECK(kvtest::refused_result(q.seq_add(1, 0, -1, 2), "unsupported"));
    CHECK(kvtest::iswa_snap(q) == snap);
    // An f32 ISWA state is refused by element type: both parts unchanged.
    CHECK_FALSE(kvcache::io::load_state(q, kvcache::io::save_state(f)).ok());
    CHECK(kvtest::iswa_snap(q) == snap);

    // State files: whole state and one sequence, both parts bit for bit.
    const auto bytes = kvcache::io::save_state(q);
    qmem_iswa8 b(is);
    REQUIRE(kvcache::io::load_state(b, bytes).ok());
    qmem_same_tokens(q.full(), b.full());
    qmem_same_tokens(q.swa(), b.swa());
    CHECK(b.swa().storage().pruned_below(1) == q.swa().storage().pruned_below(1));
    CHECK(kvcache::io::save_state(b) == bytes);
    qmem_iswa8 c(is);
    REQUIRE(kvcache::io::load_seq(c, 0, kvcache::io::save_seq(q, 1)).ok());
    CHECK(kvtest::positions_of(c.full(), 0) == kvtest::positions_of(q.full(), 1));
    CHECK(kvtest::positions_of(c.swa(), 0) == kvtest::positions_of(q.swa(), 1));
    auto cut = bytes;
    cut.resize(cut.size() - 9);
    const auto snap_b = kvtest::iswa_snap(b);
    CHECK_FALSE(kvcache::io::load_state(b, cut).ok());
    CHECK(kvtest::iswa_snap(b) == snap_b);
}

TEST_CASE("hybrid_memory with a q8_0 attention part: attention, K-shift, state files, refusals") {
    const auto ash = qmem_shape(96, 2);
    qmem_hyb8 q(ash, qmem_rec_shape(), qmem_hyb_layers);
    qmem_hybf f(ash, qmem_rec_shape(), qmem_hyb_layers);
    std::mt19937 rng(8400);
    qmem_fill(q, f, 3, ash, 0, 0, 20, rng);
    qmem_fill(q, f, 3, ash, 1, 0, 9, rng);
    qmem_check_attention(q.attention(), f.attention(), 0, 8401);
    REQUIRE(q.seq_add(0, -1, -1, 7));
    REQUIRE(f.seq_add(0, -1, -1, 7));
    kvcache::ops::apply_k_shift(q, 2);
    kvcache::ops::apply_k_shift(f, 2);
    CHECK(qmem_k_rel_l1(q.attention(), f.attention()) <= qmem_kshift_tol<kvcache::q8_0>);
    qmem_check_attention(q.attention(), f.attention(), 0, 8402);

    // State files: both parts, bit for bit; an f32 hybrid state is refused, nothing changed.
    const auto bytes = kvcache::io::save_state(q);
    qmem_hyb8 b(ash, qmem_rec_shape(), qmem_hyb_layers);
    REQUIRE(kvcache::io::load_state(b, bytes).ok());
    qmem_same_tokens(q.attention(), b.attention());
    CHECK(kvcache::io::save_state(b) == bytes);
    const auto snap = kvtest::snapshot(b.attention());
    CHECK_FALSE(kvcache::io::load_state(b, kvcache::io::save_state(f)).ok());
    CHECK(kvtest::snapshot(b.attention()) == snap);
    CHECK(kvcache::io::save_state(b) == bytes);
    // A partial removal the recurrent part refuses: the quantized part keeps its bytes.
    const auto snap_q = kvtest::snapshot(q.attention());
    CHECK_FALSE(q.seq_rm(0, 10, 12).ok());
    CHECK(kvtest::snapshot(q.attention()) == snap_q);
}

TEST_CASE("quantized state files: NaN and inf scales load and read back NaN / inf, a cut block is refused") {
    // The quantized-block inputs of tests/fuzz/regressions (quant_*, made by make_corpus)
    // built here the same way, with the documented behaviour (io/format.hpp, "Block elements").
    auto sh = qmem_shape(64, 2);
    sh.rope.type = kvcache::rope_type::normal;
    kvcache::kv_cache<kvcache::q8_0> src(sh);
    kvcache::kv_cache<kvcache::f32> twin(sh);
    std::mt19937 rng(8500);
    qmem_fill(src, twin, 2, sh, 0, 0, 10, rng);
    const std::uint32_t cell = *src.cells().used_cells().begin();
    auto with_scale = [&](bool v_side, std::uint16_t bits) {
        auto v = src.storage().view(0);
        auto& blk = v_side ? v.v[v.v_unit(1, cell, 0)] : v.k[v.k_unit(1, cell, 0)];
        const auto old = blk.d;
        blk.d = static_cast<kvcache::half>(bits);
        auto bytes = kvcache::io::save_state(src);
        blk.d = old;
        return bytes;
    };
    const std::size_t dk = sh.dim_k(), dv = sh.dim_v();
    for (bool v_side : {false, true})
        for (std::uint16_t bits : {std::uint16_t{0x7e00}, std::uint16_t{0xfe01}, std::uint16_t{0x7c00}}) {
            CAPTURE(v_side);
            CAPTURE(bits);
            kvcache::kv_cache<kvcache::q8_0> dst(sh);
            REQUIRE(kvcache::io::load_state(dst, with_scale(v_side, bits)).ok());
            // The cell at position 0 of sequence 0: head 1's first 32 values are NaN (NaN
            // scale) or +-inf / NaN (inf scale, NaN where the code is 0); the rest as saved.
            std::uint32_t c0 = 0;
            while (dst.cells().pos(c0) != src.cells().pos(cell)) ++c0;
            std::vector<float> row(v_side ? sh.v_row_size() : sh.k_row_size()), want(row.size());
            (v_side ? dst.read_v(0, c0, row.data()) : dst.read_k(0, c0, row.data()));
            (v_side ? src.read_v(0, cell, want.data()) : src.read_k(0, cell, want.data()));
            const std::size_t d = v_side ? dv : dk;
            for (std::size_t i = 0; i < row.size(); ++i) {
                if (i < d || i >= d + 32) {
                    CHECK(row[i] == want[i]);
                } else if (bits == 0x7c00) {
                    CHECK((std::isinf(row[i]) || (std::isnan(row[i]) && want[i] == 0.0f)));
                } else {
                    CHECK(std::isnan(row[i]));
                }
            }
            // Attention rows of sequence 0 see the cell: head group 1 is not finite.
            std::vector<float> q(4 * dk, 0.25f), out(4 * dv);
            const pos_t qp = 10;
            const seq_id_t qs = 0;
            kvcache::ops::attention_params p;
            p.n_head = 4;
            kvcache::ops::attention_workspace ws;
            kvcache::ops::attention(dst, 0, q.data(), &qp, &qs, 1, p, out.data(), ws);
            for (std::size_t i = 0; i < out.size(); ++i) CHECK(std::isfinite(out[i]) == (i < 2 * dv));
        }
    // A state cut inside its last block (total_size and checksum made to match) is refused.
    auto cut = kvcache::io::save_state(src);
    cut.resize(cut.size() - 8 - 20);
    const std::uint64_t total = cut.size() + 8;
    std::memcpy(cut.data() + kvcache::io::detail::off::total_size, &total, 8);
    const std::uint64_t h = kvcache::io::checksum(std::span<const std::byte>(cut.data(), cut.size()));
    cut.resize(cut.size() + 8);
    std::memcpy(cut.data() + cut.size() - 8, &h, 8);
    kvcache::kv_cache<kvcache::q8_0> dst(sh);
    qmem_fill(dst, twin, 2, sh, 1, 0, 3, rng);
    const auto before = kvtest::snapshot(dst);
    auto r = kvcache::io::load_state(dst, cut);
    REQUIRE_FALSE(r.ok());
    CHECK(kvtest::snapshot(dst) == before);
}
