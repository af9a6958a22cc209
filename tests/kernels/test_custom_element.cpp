// A user-written element policy (the README's fixed16) with every kernel: attention
// (prefill and decode, GQA, masks, a window, soft-cap, split-K; SIMD and scalar paths)
// against the float64 oracle, the K-shift against the float64 RoPE oracle, and state
// files, in the contiguous (row-major and transposed V), paged and ring layouts. The
// kernels reach fixed16 through its to_float / from_float only (the generic path).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "reference/attention_ref.hpp"
#include "reference/rope_ref.hpp"
#include "support/rope_fill.hpp"
#include "support/result_check.hpp"
#include "kernels/kernel_test_util.hpp"

namespace {

using kvtest::all_bytes;
using kvtest::nmse;

using kvcache::pos_t;
using kvcache::seq_id_t;

/// The README's custom element (examples/custom_policy.cpp): 16-bit fixed point,
/// values in [-2^(15-FracBits), 2^(15-FracBits)) with 2^-FracBits resolution.
template <int FracBits>
struct fixed16 {
    using policy_kind = kvcache::element_tag;
    static constexpr std::string_view name = "fixed16";
    static constexpr std::uint32_t type_id = 0x1000 + FracBits;
    using storage_type = std::int16_t;

    static void to_float(const std::int16_t* src, float* dst, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * (1.0f / (1 << FracBits));
    }
    static void from_float(const float* src, std::int16_t* dst, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i) {
            const float scaled = std::nearbyint(src[i] * (1 << FracBits));
            dst[i] = static_cast<std::int16_t>(std::clamp(scaled, -32768.0f, 32767.0f));
        }
    }
};
using fx = fixed16<8>;

static_assert(kvcache::element_policy<fx>);
static_assert(kvcache::element_block_size_v<fx> == 1);
static_assert(!kvcache::detail::has_simd_storage<fx>);
static_assert(kvcache::detail::has_simd_storage<kvcache::f16>);

// Relative mean squared error against a float64 result.

struct fill_cfg {
    std::uint32_t n_seq = 3;      // sequences 0 .. n_seq - 1 get tokens
    std::uint32_t rounds = 30;    // chunks of 1..8 tokens
    bool holes = true;            // seq_rm a few positions, then place more
    bool shared = true;           // seq_cp sequence 0's first 12 positions into sequence n_seq (empty until then)
};

// Fills the cache the same way for the same seed whatever its element: sequences
// interleaved, holes, shared cells; every free cell's K/V set to the element's largest
// value, so that a kernel reading one changes the output far beyond the tolerances.
template <class Cache>
void build(Cache& cache, const fill_cfg& c, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const auto& s = cache.shape();
    std::vector<pos_t> next(c.n_seq, 0);
    auto place_some = [&](std::uint32_t rounds) {
        for (std::uint32_t r = 0; r < rounds; ++r) {
            const auto sq = static_cast<seq_id_t>(rng() % c.n_seq);
            const std::uint32_t n = 1 + rng() % 8;
            std::vector<pos_t> pos(n);
            std::vector<seq_id_t> seq(n, sq);
            for (auto& p : pos) p = next[static_cast<std::size_t>(sq)]++;
            auto placed = cache.place(pos, seq);
            if (!placed.ok()) break;
            const auto& pl = placed.value();
            for (std::uint32_t l = 0; l < s.n_layer; ++l) {
                std::vector<float> k(n * s.k_row_size()), v(n * s.v_row_size());
                for (auto& x : k) x = nd(rng);
                for (auto& x : v) x = nd(rng);
                cache.write_k(l, pl.cells, k.data());
                cache.write_v(l, pl.cells, v.data());
            }
            static_cast<void>(cache.commit());
        }
    };
    place_some(c.rounds);
    if (c.holes) {
        for (seq_id_t sq = 0; sq < static_cast<seq_id_t>(c.n_seq); ++sq) {
            const auto p0 = static_cast<pos_t>(rng() % 10);
            REQUIRE(cache.seq_rm(sq, p0, p0 + 3));
        }
        place_some(c.rounds / 3);
    }
    if (c.shared) REQUIRE(cache.seq_cp(0, static_cast<seq_id_t>(c.n_seq), 0, 12));
    kvtest::fill_free_cells(cache, 1e4f);
}

kvcache::model_shape make_shape(std::uint32_t n_head_kv, std::uint32_t dk, std::uint32_t dv, std::uint32_t n_cells,
                                std::uint32_t n_seq_max, kvcache::rope_type rope = kvcache::rope_type::normal) {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = n_head_kv;
    s.head_dim_k = dk;
    s.head_dim_v = dv;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq_max;
    s.rope.type = rope;
    return s;
}

struct attn_case {
    std::uint32_t group = 1, n_q = 1;
    bool decode = false;  // every row in sequence 0 one past its end, else random rows
    kvcache::ops::attention_params p;
};

// Attention of the fixed16 cache against the float64 oracle on its stored values (only the
// kernel's f32 arithmetic differs: 1e-10) and on an f32 cache filled alike (fixed16's
// rounding, 2^-9 absolute per value: 1e-4), with the SIMD and the scalar path.
template <class Layout>
void check_attention(const kvcache::model_shape& shape, const fill_cfg& fc, std::uint32_t seed, attn_case ac) {
    using cache_t = kvcache::kv_cache<fx, Layout>;
    using exact_t = kvcache::kv_cache<kvcache::f32, Layout>;
    CAPTURE(seed);
    CAPTURE(ac.group);
    CAPTURE(ac.n_q);
    CAPTURE(ac.p.window);
    CAPTURE(ac.p.softcap);
    CAPTURE(ac.p.n_threads);
    cache_t cache(shape);
    exact_t exact(shape);
    build(cache, fc, seed);
    build(exact, fc, seed);
    auto p = ac.p;
    p.n_head = shape.n_head_kv * ac.group;
    std::mt19937 rng(seed ^ 0x5bd1e995u);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(std::size_t{ac.n_q} * p.n_head * shape.dim_k());
    for (auto& x : q) x = nd(rng);
    std::vector<pos_t> qp(ac.n_q);
    std::vector<seq_id_t> qs(ac.n_q);
    pos_t max_pos = 0;
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(shape.n_seq_max); ++s) max_pos = std::max(max_pos, cache.seq_pos_max(s));
    for (std::uint32_t i = 0; i < ac.n_q; ++i) {
        qs[i] = ac.decode ? 0 : static_cast<seq_id_t>(rng() % shape.n_seq_max);
        qp[i] = ac.decode ? cache.seq_pos_max(0) + 1 : static_cast<pos_t>(rng() % static_cast<std::uint32_t>(max_pos + 3));
    }
    kvcache::ops::attention_workspace ws;
    for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
        const auto want = ref::attention(cache, layer, q, qp, qs, p);
        const auto want32 = ref::attention(exact, layer, q, qp, qs, p);
        for (auto path : {kvcache::ops::kernel_path::simd, kvcache::ops::kernel_path::scalar}) {
            CAPTURE(static_cast<int>(path));
            auto pp = p;
            pp.path = path;
            std::vector<float> out(std::size_t{ac.n_q} * p.n_head * shape.dim_v(), -1.0f);
            kvcache::ops::attention(cache, layer, q.data(), qp.data(), qs.data(), ac.n_q, pp, out.data(), ws);
            for (float x : out) REQUIRE(std::isfinite(x));
            CHECK(nmse(out, want) <= 1e-10);
            CHECK(nmse(out, want32) <= 1e-4);
        }
    }
}

// n_seq sequences get tokens; the shape has n_seq + 1 (the last one for seq_cp). The
// ring layout keeps its window: no holes below it, no copies.
template <class Layout>
void attention_suite(std::uint32_t n_cells, std::uint32_t n_seq, bool ring = false) {
    const std::uint32_t dims[][2] = {{64, 0}, {40, 24}, {128, 0}, {8, 5}};
    std::uint32_t seed = 31000;
    for (const auto& dd : dims) {
        const auto shape = make_shape(2, dd[0], dd[1], n_cells, n_seq + 1, dd[0] == 40 ? kvcache::rope_type::neox
                                                                                   : kvcache::rope_type::normal);
        fill_cfg fc;
        fc.n_seq = n_seq;
        fc.holes = fc.shared = !ring;
        for (std::uint32_t group : {1u, 4u}) {
            attn_case prefill;  // many rows of random sequences and positions: causal + sequence masks
            prefill.group = group;
            prefill.n_q = 24;
            prefill.p.n_threads = 2;
            check_attention<Layout>(shape, fc, ++seed, prefill);
            prefill.p.window = 7;
            prefill.p.softcap = 5.0f;
            check_attention<Layout>(shape, fc, ++seed, prefill);
            attn_case decode;  // one row: split-K on 2 and 3 threads
            decode.group = group;
            decode.decode = true;
            for (int threads : {1, 2, 3}) {
                decode.p.n_threads = threads;
                check_attention<Layout>(shape, fc, ++seed, decode);
            }
            decode.p.window = 20;
            decode.p.scale = 0.3f;
            check_attention<Layout>(shape, fc, ++seed, decode);
        }
    }
}

}  // namespace

// kvcache/ops/instances.hpp takes custom elements too: fx's kernels declared extern (as the
// other units of a program would), then compiled here.
KVCACHE_EXTERN_ATTENTION(fx)
KVCACHE_INSTANTIATE_ATTENTION(fx)

TEST_CASE("custom element: attention, contiguous layout (row-major V)") {
    attention_suite<kvcache::contiguous<>>(200, 3);
}

TEST_CASE("custom element: attention, contiguous layout (transposed V)") {
    attention_suite<kvcache::contiguous<kvcache::v_layout::transposed>>(200, 3);
}

TEST_CASE("custom element: attention, paged layout") {
    attention_suite<kvcache::paged<32>>(256, 3);
}

TEST_CASE("custom element: attention, ring layout") {
    using ring = kvcache::ring<24>;
    attention_suite<ring>(ring::cells_for(4, 8), 3, true);
}

TEST_CASE("custom element: decode over a long context (fused loop, fine split-K)") {
    const auto shape = make_shape(1, 128, 0, 1500, 2);
    fill_cfg fc;
    fc.n_seq = 1;
    fc.rounds = 300;
    fc.holes = false;
    for (std::uint32_t group : {1u, 2u, 4u}) {
        attn_case ac;
        ac.group = group;
        ac.decode = true;
        ac.p.n_threads = 2;
        check_attention<kvcache::contiguous<>>(shape, fc, 500 + group, ac);
    }
}

// ---------------------------------------------------------------------------- K-shift

namespace {


// Relative L1 error of every token's K (found by position) against rope(x, new position).
template <class Cache>
double kshift_error(const Cache& cache, const std::vector<std::vector<double>>& x, const std::vector<pos_t>& now) {
    const auto& s = cache.shape();
    std::vector<float> row(s.k_row_size());
    double num = 0.0, den = 0.0;
    std::size_t found = 0;
    for (std::uint32_t c = 0; c < cache.n_window(); ++c) {
        const pos_t pc = cache.cells().pos(c);
        if (pc < 0) continue;
        const auto it = std::find(now.begin(), now.end(), pc);
        REQUIRE(it != now.end());
        const auto i = static_cast<std::size_t>(it - now.begin());
        ++found;
        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
            cache.read_k(l, c, row.data());
            for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
                const auto r = ref::rope_head(x[i * s.n_head_kv + h], now[i], s.rope);
                for (std::uint32_t d = 0; d < s.dim_k(); ++d) {
                    num += std::abs(row[h * s.dim_k() + d] - r[d] * (1.0 + 0.1 * l));
                    den += std::abs(r[d] * (1.0 + 0.1 * l));
                }
            }
        }
    }
    CHECK(found == now.size());
    return num / den;
}


template <class Layout>
void kshift_suite(std::uint32_t n_cells) {
    std::mt19937 rng(777);
    for (auto type : {kvcache::rope_type::normal, kvcache::rope_type::neox}) {
        for (std::uint32_t dk : {64u, 72u, 6u}) {
            for (auto path : {kvcache::ops::kernel_path::simd, kvcache::ops::kernel_path::scalar}) {
                for (int threads : {1, 2}) {
                    CAPTURE(static_cast<int>(type));
                    CAPTURE(dk);
                    CAPTURE(static_cast<int>(path));
                    auto s = make_shape(dk == 6 ? 1 : 2, dk, 0, n_cells, 1, type);
                    if (dk == 72) s.rope.n_rot = 32;  // partial rotary
                    kvcache::kv_cache<fx, Layout> cache(s);
                    std::vector<pos_t> pos;
                    for (pos_t i = 0; i < 40; ++i) pos.push_back(100 + i);
                    const auto x = kvtest::fill_rope(cache, pos, rng);
                    const auto v_before = all_bytes(cache, true);
                    const auto k_before = all_bytes(cache, false);
                    // Positions [100, 110) stay, [125, 140) move by -60 (to [65, 80)), [110, 125)
                    // by +37: tiles with unmoved, and with mixed, deltas.
                    REQUIRE(cache.seq_add(0, 125, -1, -60));
                    REQUIRE(cache.seq_add(0, 110, 125, 37));
                    std::vector<pos_t> now = pos;
                    for (auto& p : now) p = p < 110 ? p : p < 125 ? p + 37 : p - 60;
                    kvcache::ops::apply_k_shift(cache, threads, path);
                    CHECK_FALSE(cache.has_shift());
                    // fixed16<8>: 2^-9 absolute rounding per stored value, twice (write, shift).
                    CHECK(kshift_error(cache, x, now) <= 5e-3);
                    CHECK(all_bytes(cache, true) == v_before);  // V untouched
                    // Unmoved cells keep their exact bytes.
                    const auto k_after = all_bytes(cache, false);
                    std::vector<float> row(s.k_row_size());
                    for (std::uint32_t c = 0; c < cache.capacity(); ++c) {
                        const pos_t pc = cache.cells().pos(c);
                        if (pc < 100 || pc >= 110) continue;
                        const std::size_t per_cell = s.k_row_size();
                        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
                            const std::size_t base = (std::size_t{l} * cache.capacity() + c) * per_cell;
                            for (std::size_t e = 0; e < per_cell; ++e) REQUIRE(k_after[base + e] == k_before[base + e]);
                        }
                    }
                }
            }
        }
    }
}

}  // namespace

TEST_CASE("custom element: K-shift against the float64 RoPE oracle, contiguous layout") {
    kshift_suite<kvcache::contiguous<>>(100);
}

TEST_CASE("custom element: K-shift against the float64 RoPE oracle, paged layout") {
    kshift_suite<kvcache::paged<32>>(128);
}

TEST_CASE("custom element: K-shift against the float64 RoPE oracle, ring layout") {
    using ring = kvcache::ring<64>;
    kshift_suite<ring>(ring::cells_for(1, 16));
}

TEST_CASE("custom element: the SIMD and scalar K-shift paths agree to one fixed16 step") {
    auto s = make_shape(2, 64, 0, 100, 1);
    kvcache::kv_cache<fx> a(s), b(s);
    std::mt19937 ra(5), rb(5);
    std::vector<pos_t> pos;
    for (pos_t i = 0; i < 70; ++i) pos.push_back(i);
    kvtest::fill_rope(a, pos, ra);
    kvtest::fill_rope(b, pos, rb);
    for (auto* c : {&a, &b}) {
        REQUIRE(c->seq_add(0, 0, 30, 1000));
        REQUIRE(c->seq_add(0, 30, -1, 7));
    }
    kvcache::ops::apply_k_shift(a, 1, kvcache::ops::kernel_path::simd);
    kvcache::ops::apply_k_shift(b, 1, kvcache::ops::kernel_path::scalar);
    const auto ka = all_bytes(a, false), kb = all_bytes(b, false);
    REQUIRE(ka.size() == kb.size());
    for (std::size_t i = 0; i < ka.size(); ++i) REQUIRE(std::abs(int{ka[i]} - int{kb[i]}) <= 1);
}

// ---------------------------------------------------------------------------- state files

namespace {

template <class Layout>
void state_roundtrip(std::uint32_t n_cells, std::uint32_t n_seq, bool ring = false) {
    using cache_t = kvcache::kv_cache<fx, Layout>;
    const auto s = make_shape(2, 40, 24, n_cells, n_seq + 1);
    cache_t a(s);
    fill_cfg fc;
    fc.n_seq = n_seq;
    fc.holes = fc.shared = !ring;
    build(a, fc, 99);
    const auto bytes = kvcache::io::save_state(a);
    cache_t b(s);
    REQUIRE(kvcache::io::load_state(b, bytes).ok());
    // Same tokens, bit-exact K/V per (sequence, position).
    std::vector<float> ka(s.k_row_size()), kb(s.k_row_size()), va(s.v_row_size()), vb(s.v_row_size());
    std::size_t tokens = 0;
    for (std::uint32_t ca = 0; ca < a.n_window(); ++ca) {
        const pos_t p = a.cells().pos(ca);
        if (p < 0) continue;
        ++tokens;
        bool found = false;
        for (std::uint32_t cb = 0; cb < b.n_window() && !found; ++cb) {
            if (b.cells().pos(cb) != p || !(b.cells().seqs(cb) == a.cells().seqs(ca))) continue;
            found = true;
            for (std::uint32_t l = 0; l < s.n_layer; ++l) {
                std::vector<std::int16_t> x, y;
                a.storage().cell_bytes(l, ca, false, x);
                b.storage().cell_bytes(l, cb, false, y);
                CHECK(x == y);
                a.storage().cell_bytes(l, ca, true, x);
                b.storage().cell_bytes(l, cb, true, y);
                CHECK(x == y);
            }
        }
        CHECK(found);
    }
    CHECK(tokens > 0);
    CHECK(b.used() == a.used());
    // Saving the loaded cache gives a state of the same size (the cells may be placed
    // in another order, so the bytes may differ).
    CHECK(kvcache::io::save_state(b).size() == bytes.size());
    // A cache of another element refuses the state and stays as it was.
    kvcache::kv_cache<fixed16<4>, Layout> other(s);
    CHECK_FALSE(kvcache::io::load_state(other, bytes).ok());
    CHECK(other.used() == 0);
}

}  // namespace

TEST_CASE("custom element: state save / load round trip is bit-exact") {
    state_roundtrip<kvcache::contiguous<>>(200, 3);
    state_roundtrip<kvcache::contiguous<kvcache::v_layout::transposed>>(200, 3);
    state_roundtrip<kvcache::paged<32>>(256, 3);
    using ring = kvcache::ring<24>;
    state_roundtrip<ring>(ring::cells_for(4, 8), 3, true);
}
