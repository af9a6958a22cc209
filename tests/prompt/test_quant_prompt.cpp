// The prompt cache, slots and chunk reuse on a q8_0 cache: a hit (copy_store,
// shared_store, state_store, a slot's own prefix, a global entry) restores the same block
// bytes as a cold computation of the same prompt, so attention equals the cold one (up to
// the summation order of other cells), and the float64 attention over the unquantized values within test_quant's q8_0
// tolerance (NMSE 2e-4); chunk reuse's K-shift leaves moved K within the K-shift tolerance
// (relative L1 0.015) of a cold computation at the new positions, V and unmoved K bit-exact.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/prompt/state_store.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/kernel_test_util.hpp"
#include "prompt/toy_model.hpp"
#include "reference/attention_ref.hpp"
#include "support/result_check.hpp"

namespace {

using kvcache::pos_t;
using kvcache::prompt_tokens;
using kvcache::seq_id_t;
namespace reuse = kvcache::reuse;

using qp_cache = kvcache::kv_cache<kvcache::q8_0, reuse::global<>>;
using qp_twin = kvcache::kv_cache<kvcache::f32, reuse::global<>>;
using qp_chunk = kvcache::kv_cache<kvcache::q8_0, reuse::chunk_shift<32>>;

/// toy::shape with head dimensions of 64 (two q8_0 blocks per head row).
kvcache::model_shape qp_shape(std::uint32_t n_cells, std::uint32_t n_seq = 8) {
    auto s = toy::shape(n_cells, n_seq);
    s.head_dim_k = 64;
    s.head_dim_v = 64;
    return s;
}

/// Block bytes of every position [0, n) of sequence a in cache x equal those of sequence b
/// in cache y (K and V, every layer).
template <class X, class Y>
bool qp_same_bytes(const X& x, seq_id_t a, const Y& y, seq_id_t b, std::size_t n, std::size_t from = 0,
                   bool k_side = true) {
    for (std::size_t i = from; i < n; ++i) {
        const long ca = toy::cell_of(x, a, static_cast<pos_t>(i)), cb = toy::cell_of(y, b, static_cast<pos_t>(i));
        if (ca < 0 || cb < 0) return false;
        for (std::uint32_t l = 0; l < x.shape().n_layer; ++l)
            for (bool v_side : {false, true}) {
                if (!v_side && !k_side) continue;
                std::vector<kvcache::block_q8_0> u, w;
                x.storage().cell_bytes(l, static_cast<std::uint32_t>(ca), v_side, u);
                y.storage().cell_bytes(l, static_cast<std::uint32_t>(cb), v_side, w);
                if (u.size() != w.size() || std::memcmp(u.data(), w.data(), u.size() * sizeof(u[0])) != 0) return false;
            }
    }
    return true;
}

/// Decode attention of sequence `seq` (next position) in cache c over every layer, both
/// heads per KV head.
template <class C>
std::vector<float> qp_decode(const C& c, seq_id_t seq, std::uint32_t layer, const std::vector<float>& q) {
    kvcache::ops::attention_params p;
    p.n_head = c.shape().n_head_kv * 2;
    const pos_t qp = c.seq_pos_max(seq) + 1;
    std::vector<float> out(std::size_t{p.n_head} * c.shape().dim_v());
    kvcache::ops::attention_workspace ws;
    kvcache::ops::attention(c, layer, q.data(), &qp, &seq, 1, p, out.data(), ws);
    return out;
}

std::vector<float> qp_query(const kvcache::model_shape& s) {
    std::vector<float> q(std::size_t{s.n_head_kv} * 2 * s.dim_k());
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(toy::unit(toy::mix(i + 77)));
    return q;
}

/// A hit in sequence `hit` of c equals a cold computation (sequence `cold`) byte for byte
/// and in attention, and the float64 attention over the unquantized prompt within 2e-4.
void qp_check_hit(qp_cache& c, seq_id_t hit, seq_id_t cold, const prompt_tokens& p) {
    toy::fill(c, cold, p, 0, p.size());
    CHECK(qp_same_bytes(c, hit, c, cold, p.size()));
    qp_twin f(c.shape());
    toy::fill(f, 0, p, 0, p.size());
    const auto q = qp_query(c.shape());
    for (std::uint32_t l = 0; l < c.shape().n_layer; ++l) {
        const auto a = qp_decode(c, hit, l, q), b = qp_decode(c, cold, l, q);
        // Same blocks in other cells: only the kernel's summation order may differ.
        CHECK(kvtest::nmse(a, std::vector<double>(b.begin(), b.end())) <= 1e-12);
        kvcache::ops::attention_params rp;
        rp.n_head = c.shape().n_head_kv * 2;
        const std::vector<pos_t> qpos = {static_cast<pos_t>(p.size())};
        const std::vector<seq_id_t> qseq = {0};
        CHECK(kvtest::nmse(a, ref::attention(f, l, q, qpos, qseq, rp)) <= 2e-4);
    }
    REQUIRE(c.seq_rm(cold, -1, -1));
}

template <class Store>
void qp_store_suite(Store st) {
    qp_cache c(qp_shape(1024));
    kvcache::prompt_cache<qp_cache, Store> pc(kvcache::prompt_cache_limits{0, 0}, std::move(st));
    prompt_tokens p = toy::text(70);
    p.push_media(42, 3);
    p.push_back(5);
    toy::fill(c, 0, p, 0, p.size());
    REQUIRE(pc.save(c, 0, p));
    REQUIRE(c.seq_rm(0, -1, -1));
    const auto s = pc.select(p);
    REQUIRE(s);
    auto got = pc.load(c, 3, s->id);
    REQUIRE(got.ok());
    CHECK(got.value().tokens == p);
    qp_check_hit(c, 3, 6, p);
    // A load into a sequence that is not empty is refused and changes nothing.
    REQUIRE(pc.save(c, 3, p));
    const auto before = kvcache::io::save_state(c);
    CHECK(pc.load(c, 3, pc.ids().front()).code() == kvcache::errc::invalid_argument);
    CHECK(kvcache::io::save_state(c) == before);
}

}  // namespace

TEST_CASE("q8_0 prompt cache: copy_store hit restores the cold computation's blocks, attention equal") {
    qp_store_suite(kvcache::copy_store<qp_cache>{});
}

TEST_CASE("q8_0 prompt cache: shared_store hit") {
    qp_store_suite(kvcache::shared_store<qp_cache>(4, 4));
}

TEST_CASE("q8_0 prompt cache: state_store hit (io::save_seq bytes of q8_0 blocks)") {
    qp_store_suite(kvcache::state_store<qp_cache>{});
}

TEST_CASE("q8_0 slots: a slot's own prefix and a global cache hit equal the cold computation") {
    qp_cache c(qp_shape(2048));
    kvcache::slot_manager<qp_cache> slots(c, {.n_slots = 2});
    const prompt_tokens a = toy::text(130, 0), b = toy::text(90, 5000);
    auto run = [&](const prompt_tokens& req, std::uint32_t slot) {
        auto p = slots.prepare(req, {.slot_id = static_cast<std::int32_t>(slot)}).value();
        toy::fill(c, p.seq, req, p.n_past, p.n_request);
        slots.commit_prompt(p.slot);
        return p;
    };
    auto r = run(a, 0);
    slots.release(r.slot);
    // The same slot continues a longer prompt from its own prefix.
    const prompt_tokens a2 = toy::cat(a, toy::text(6, 800));
    r = run(a2, 0);
    CHECK(r.metrics.from_slot == 130);
    qp_check_hit(c, r.seq, 7, a2);
    slots.release(r.slot);
    auto rb = run(b, 1);
    slots.release(rb.slot);
    // Slot 1 holds b; the request extends a: slot 0's entry is loaded from the global cache.
    const prompt_tokens a3 = toy::cat(a2, toy::text(4, 77));
    r = run(a3, 1);
    CHECK(r.metrics.from_global == a2.size());
    CHECK(r.metrics.computed == 4);
    qp_check_hit(c, r.seq, 7, a3);
    slots.release(r.slot);
}

TEST_CASE("q8_0 chunk reuse: moved K within the K-shift tolerance of a cold computation, the rest bit-exact") {
    const prompt_tokens A = toy::text(100, 0), X = toy::text(10, 500), B = toy::text(40, 1000), C = toy::text(5, 2000);
    const prompt_tokens cached = toy::cat(toy::cat(A, X), B);
    const prompt_tokens request = toy::cat(toy::cat(A, B), C);
    qp_chunk c(qp_shape(512, 4));
    toy::fill(c, 0, cached, 0, cached.size(), /*context_free=*/true);
    reuse::plan_options o;
    o.min_chunk = 32;
    o.can_shift = true;
    const auto p = reuse::make_plan(cached, request, o);
    REQUIRE(p.moves.size() == 1);
    REQUIRE(p.n_past == 140);
    REQUIRE(reuse::apply_plan(c, 0, p));
    CHECK(c.has_shift());
    kvcache::ops::apply_k_shift(c, 2);
    toy::fill(c, 0, request, p.n_past, request.size(), true);
    // The cold computation of the request in sequence 1.
    toy::fill(c, 1, request, 0, request.size(), true);
    CHECK(qp_same_bytes(c, 0, c, 1, 100));                            // unmoved prefix
    CHECK(qp_same_bytes(c, 0, c, 1, request.size(), 140));            // computed after the chunk
    CHECK(qp_same_bytes(c, 0, c, 1, 140, 100, /*k_side=*/false));     // moved V: the same bytes
    CHECK_FALSE(qp_same_bytes(c, 0, c, 1, 140, 100));                 // moved K was requantized
    // Moved K against the exact rotation (toy::compute in double at the new positions).
    const auto& s = c.shape();
    std::vector<float> row(s.k_row_size());
    double num = 0.0, den = 0.0, num_cold = 0.0;
    for (std::size_t i = 100; i < 140; ++i) {
        const auto want = toy::compute(s, toy::symbol(request, i), static_cast<pos_t>(i));
        for (seq_id_t sq : {0, 1}) {
            const long cell = toy::cell_of(c, sq, static_cast<pos_t>(i));
            REQUIRE(cell >= 0);
            for (std::uint32_t l = 0; l < s.n_layer; ++l) {
                c.read_k(l, static_cast<std::uint32_t>(cell), row.data());
                for (std::size_t d = 0; d < row.size(); ++d) {
                    const double e = std::abs(row[d] - want.k[l][d]);
                    (sq == 0 ? num : num_cold) += e;
                    if (sq == 0) den += std::abs(want.k[l][d]);
                }
            }
        }
    }
    MESSAGE("q8_0 chunk reuse: moved K relative L1 " << num / den << " (cold computation " << num_cold / den << ")");
    CHECK(num / den <= 0.015);
    CHECK(num / den >= num_cold / den);  // two quantizations cannot beat one on this data
    // A plan that needs more free cells than there are (the moved chunk shared with
    // sequence 2 must be split) is refused and changes nothing.
    REQUIRE(c.seq_rm(1, -1, -1));
    REQUIRE(c.seq_rm(0, -1, -1));
    toy::fill(c, 0, cached, 0, cached.size(), true);
    REQUIRE(c.seq_cp(0, 2, -1, -1));
    toy::fill(c, 3, toy::text(512 - 150 - 20, 9000), 0, 512 - 150 - 20, true);
    const auto before = kvcache::io::save_state(c);
    CHECK(kvtest::refused_result(reuse::apply_plan(c, 0, p), "free cells"));
    CHECK(kvcache::io::save_state(c) == before);
}
