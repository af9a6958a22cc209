// Model-based random test: the real cache and the reference model (tests/reference/
// cache_model.hpp) receive the same random operations (placements committed or
// restored, every sequence op, K-shift resets, clears, invalid calls) and are compared
// after every step: every cell's metadata, per-sequence ranges, and K/V of live cells.
//
// Replay a failure: KVCACHE_TEST_SEED=<seed printed below> ./test_core -tc="model-based*"
// Longer run: KVCACHE_MODEL_OPS=1000000 (operations per element type).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "reference/cache_model.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"
#include "support/sanitized.hpp"

namespace {

using kvcache::pos_t;
using kvcache::seq_id_t;

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

/// The number of random operations a test runs: KVCACHE_MODEL_OPS, else `n`; half of `n`
/// under AddressSanitizer (each operation ~5x slower there; the normal build, which CI
/// also runs, does all of them).
std::uint64_t model_ops(std::uint64_t n) {
    if (kvtest::sanitized) n /= 2;
    return env_or("KVCACHE_MODEL_OPS", n);
}

/// The value the cache stores for x, computed with the scalar conversions.
template <class E>
float stored(float x) {
    if constexpr (std::is_same_v<E, kvcache::f16>)
        return kvcache::scalar::f16_to_f32(kvcache::scalar::f32_to_f16(x));
    else if constexpr (std::is_same_v<E, kvcache::bf16>)
        return kvcache::scalar::bf16_to_f32(kvcache::scalar::f32_to_bf16(x));
    else
        return x;
}

/// The values the cache stores for a row of n values (n a multiple of E's block size):
/// block elements quantize and dequantize whole blocks (q8_0 / q4_0: 32 values, one scale).
template <class E>
std::vector<float> stored_row(const float* x, std::size_t n) {
    std::vector<float> out(n);
    if constexpr (kvcache::is_block_element<E>) {
        std::vector<typename E::storage_type> blocks(n / kvcache::element_block_size_v<E>);
        E::from_float(x, blocks.data(), n);
        E::to_float(blocks.data(), out.data(), n);
    } else {
        for (std::size_t j = 0; j < n; ++j) out[j] = stored<E>(x[j]);
    }
    return out;
}

template <class Cache>
void compare(const Cache& c, const kvtest::cache_model& m, std::uint64_t step, const std::string& what) {
    INFO("step " << step << ": " << what);
    REQUIRE(c.used() == m.used());
    REQUIRE(c.in_transaction() == !m.staged.empty());
    const auto& cells = c.cells();
    std::vector<float> k(c.shape().k_row_size()), v(c.shape().v_row_size());
    for (std::uint32_t i = 0; i < cells.size(); ++i) {
        INFO("cell " << i);
        const auto& mc = m.cells[i];
        REQUIRE(cells.pos(i) == mc.pos);
        REQUIRE(cells.shift(i) == mc.shift);
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(c.shape().n_seq_max); ++s)
            REQUIRE(cells.seqs(i).test(s) == (mc.seqs.count(s) == 1));
        if (mc.pos < 0 || mc.k.empty()) continue;
        for (std::uint32_t l = 0; l < c.shape().n_layer; ++l) {
            c.read_k(l, i, k.data());
            c.read_v(l, i, v.data());
            REQUIRE(k == mc.k[l]);
            REQUIRE(v == mc.v[l]);
        }
    }
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(c.shape().n_seq_max); ++s) {
        REQUIRE(c.seq_pos_min(s) == m.seq_pos_min(s));
        REQUIRE(c.seq_pos_max(s) == m.seq_pos_max(s));
    }
    const std::uint32_t last = [&] {
        std::uint32_t l = 0;
        for (std::uint32_t i = 0; i < m.cells.size(); ++i)
            if (m.cells[i].pos >= 0) l = i + 1;
        return l;
    }();
    REQUIRE(c.n_window(1) == last);
}

template <class Cache>
void run_model_test(const char* label, std::uint64_t n_ops) {
    const std::uint64_t seed = env_or("KVCACHE_TEST_SEED", 20261122);
    MESSAGE(std::string(label) << ": seed " << seed << ", " << n_ops << " operations");
    std::mt19937_64 rng(seed);
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };
    std::uniform_real_distribution<float> val(-4.0f, 4.0f);

    kvcache::model_shape shape;
    shape.n_layer = 2;
    shape.n_head_kv = 2;
    using E = typename Cache::element;
    shape.head_dim_k = kvcache::is_block_element<E> ? 64 : 4;  // block elements: whole blocks of 32
    shape.head_dim_v = kvcache::is_block_element<E> ? 32 : 2;
    shape.n_cells = 40;  // 2.5 K tiles
    shape.n_seq_max = 4;
    Cache c(shape);
    kvtest::cache_model m(shape);
    const int n_seq = static_cast<int>(shape.n_seq_max);

    auto rand_range = [&](pos_t& p0, pos_t& p1) {
        p0 = chance(0.2) ? -1 : uni(0, 60);
        p1 = chance(0.3) ? -1 : p0 < 0 ? uni(0, 60) : p0 + uni(0, 30);
    };
    std::uint64_t n_placed = 0, n_full = 0, n_refused = 0, n_split_fail = 0;

    for (std::uint64_t step = 0; step < n_ops; ++step) {
        const int op = uni(0, 99);
        std::string last_op = "op " + std::to_string(op);
        if (op < 38) {  // placement: 1-3 ubatches, committed or restored
            const int n_ub = uni(1, 3);
            const bool do_commit = chance(0.75);
            bool failed = false;
            for (int u = 0; u < n_ub && !failed; ++u) {
                const int n = uni(1, 6);
                std::vector<pos_t> pos;
                std::vector<kvcache::seq_set> sets;
                std::vector<std::set<seq_id_t>> msets;
                std::map<seq_id_t, pos_t> last;  // batch position rule: each sequence continues its last position
                auto last_of = [&](seq_id_t s) {
                    auto it = last.find(s);
                    return it != last.end() ? it->second : m.seq_pos_max(s);
                };
                for (int i = 0; i < n; ++i) {
                    kvcache::seq_set ss;
                    std::set<seq_id_t> ms;
                    const seq_id_t s0 = uni(0, n_seq - 1);
                    ss.set(s0);
                    ms.insert(s0);
                    if (chance(0.15)) {
                        const seq_id_t s1 = uni(0, n_seq - 1);
                        ss.set(s1);
                        ms.insert(s1);
                    }
                    // The next position of every sequence of the token (a sequence that holds none
                    // may start anywhere); sequences that disagree: the token keeps s0 only.
                    pos_t p = last_of(s0) + 1;
                    for (seq_id_t s : ms) p = std::max(p, last_of(s) + 1);
                    for (seq_id_t s : std::set<seq_id_t>(ms))
                        if (last_of(s) >= 0 && last_of(s) + 1 != p) {
                            ms = {s0};
                            ss = kvcache::seq_set::of(s0);
                            p = last_of(s0) + 1;
                            break;
                        }
                    bool all_empty = true;
                    for (seq_id_t s : ms) all_empty &= last_of(s) < 0;
                    if (all_empty) p = chance(0.7) ? uni(0, 2) : uni(0, 80);
                    for (seq_id_t s : ms) last[s] = p;
                    pos.push_back(p);
                    sets.push_back(ss);
                    msets.push_back(ms);
                }
                auto r = c.place(pos, std::span<const kvcache::seq_set>(sets));
                auto mr = m.place(pos, msets);
                REQUIRE(r.ok() == mr.has_value());
                if (!r.ok()) {
                    REQUIRE((r.code() == kvcache::errc::no_space || r.code() == kvcache::errc::batch_too_large));
                    ++n_full;
                    failed = true;
                    break;
                }
                REQUIRE(r.value().cells == *mr);
                ++n_placed;
                for (std::uint32_t l = 0; l < shape.n_layer; ++l) {
                    std::vector<float> k(pos.size() * shape.k_row_size()), v(pos.size() * shape.v_row_size());
                    for (auto& x : k) x = val(rng);
                    for (auto& x : v) x = val(rng);
                    c.write_k(l, r.value().cells, k.data());
                    c.write_v(l, r.value().cells, v.data());
                    for (std::size_t i = 0; i < pos.size(); ++i) {
                        const std::size_t nk = shape.k_row_size(), nv = shape.v_row_size();
                        m.write(l, (*mr)[i], stored_row<E>(k.data() + i * nk, nk), stored_row<E>(v.data() + i * nv, nv));
                    }
                }
            }
            if (do_commit && !failed) {
                const bool any = m.commit();
                REQUIRE((c.commit() == kvcache::tx_result::committed) == any);
            } else {
                const bool any = m.restore();
                REQUIRE((c.restore() == kvcache::tx_result::restored) == any);
            }
        } else if (op < 50) {
            pos_t p0, p1;
            rand_range(p0, p1);
            const seq_id_t s = chance(0.1) ? -1 : uni(0, n_seq - 1);
            last_op = "seq_rm(" + std::to_string(s) + ", " + std::to_string(p0) + ", " + std::to_string(p1) + ")";
            REQUIRE(c.seq_rm(s, p0, p1));
            m.seq_rm(s, p0, p1);
        } else if (op < 58) {
            pos_t p0, p1;
            rand_range(p0, p1);
            const seq_id_t src = uni(0, n_seq - 1), dst = uni(0, n_seq - 1);
            bool clash = false;
            for (const auto& mc : m.cells)
                if (src != dst && mc.pos >= 0 && kvtest::cache_model::in(mc.pos, p0, p1) && mc.seqs.count(src) &&
                    !mc.seqs.count(dst) && m.seq_has_pos(dst, mc.pos))
                    clash = true;
            if (clash) {
                const auto before = kvtest::snapshot(c);
                REQUIRE_THROWS_AS(static_cast<void>(c.seq_cp(src, dst, p0, p1)), kvcache::error);  // invalid argument
                REQUIRE(kvtest::snapshot(c) == before);
                ++n_refused;
            } else {
                last_op = "seq_cp(" + std::to_string(src) + ", " + std::to_string(dst) + ", " + std::to_string(p0) +
                          ", " + std::to_string(p1) + ")";
                REQUIRE(c.seq_cp(src, dst, p0, p1));
                m.seq_cp(src, dst, p0, p1);
            }
        } else if (op < 60) {
            const seq_id_t s = uni(0, n_seq - 1);
            c.seq_keep(s);
            m.seq_keep(s);
        } else if (op < 78) {  // seq_add / seq_div (may need free cells to split)
            pos_t p0, p1;
            rand_range(p0, p1);
            const seq_id_t s = chance(0.1) ? -1 : uni(0, n_seq - 1);
            const bool is_div = chance(0.3);
            const int d = is_div ? uni(1, 4) : uni(-30, 30);
            last_op = std::string(is_div ? "seq_div(" : "seq_add(") + std::to_string(s) + ", " + std::to_string(p0) +
                      ", " + std::to_string(p1) + ", " + std::to_string(d) + ")";
            auto trial = m;
            bool fits = true;
            try {
                if (is_div)
                    trial.seq_div(s, p0, p1, d);
                else
                    trial.seq_add(s, p0, p1, d);
            } catch (const std::out_of_range&) {
                fits = false;
            }
            if (fits) {
                REQUIRE((is_div ? c.seq_div(s, p0, p1, d) : c.seq_add(s, p0, p1, d)));
                m = trial;
            } else {  // no room to split: an error result (not an exception), nothing changed
                const auto before = kvtest::snapshot(c);
                const kvcache::result<void> r = is_div ? c.seq_div(s, p0, p1, d) : c.seq_add(s, p0, p1, d);
                REQUIRE_MESSAGE(!r.ok(), "split without enough free cells was accepted");
                REQUIRE(r.code() == kvcache::errc::no_space);
                REQUIRE(kvtest::snapshot(c) == before);
                ++n_split_fail;
            }
        } else if (op < 81) {  // the K-shift kernel applied the pending deltas
            c.clear_shifts();
            for (auto& mc : m.cells) mc.shift = 0;
        } else if (op < 82) {
            c.clear();
            m.clear();
        } else {  // invalid calls: refused, nothing changes
            const auto before = kvtest::snapshot(c);
            const int kind = uni(0, 8);
            try {
                switch (kind) {
                    case 0: (void)c.seq_rm(n_seq + uni(0, 3), 0, -1); break;
                    case 1: (void)c.seq_rm(0, 10, uni(0, 9)); break;
                    case 2: (void)c.seq_cp(uni(0, n_seq - 1), -1 - uni(0, 3), 0, -1); break;
                    case 3: c.seq_keep(n_seq); break;
                    case 4:  // overflow past 2^31-1 for the largest position of sequence 0
                        if (m.seq_pos_max(0) >= 1)
                            (void)c.seq_add(0, 0, -1, std::numeric_limits<pos_t>::max() - uni(0, m.seq_pos_max(0) - 1));
                        else
                            (void)c.seq_div(0, 0, -1, 0);
                        break;
                    case 5: (void)c.seq_div(uni(0, n_seq - 1), 0, -1, -uni(0, 3)); break;
                    case 6: (void)c.place(std::vector<pos_t>{uni(0, 5), -1}, std::vector<seq_id_t>{0, 0}); break;
                    case 7: (void)c.place(std::vector<pos_t>{1}, std::vector<seq_id_t>{n_seq}); break;
                    default: {
                        std::vector<float> row(shape.k_row_size());
                        const std::vector<std::uint32_t> bad{shape.n_cells + static_cast<std::uint32_t>(uni(0, 9))};
                        c.write_k(0, bad, row.data());
                    }
                }
                FAIL("invalid call " << kind << " was accepted");
            } catch (const kvcache::error& e) {
                REQUIRE(e.code() == kvcache::errc::invalid_argument);
                ++n_refused;
            }
            REQUIRE(kvtest::snapshot(c) == before);
        }
        compare(c, m, step, last_op);
    }
    MESSAGE(std::string(label) << ": " << n_placed << " ubatches placed, " << n_full << " full, " << n_refused << " refused, "
                  << n_split_fail << " splits without room");
    CHECK(n_placed > n_ops / 10);
    CHECK(n_full > 0);
    CHECK(n_split_fail > 0);
}

}  // namespace

TEST_CASE("model-based random operations: f32") {
    run_model_test<kvcache::kv_cache<kvcache::f32>>("f32", model_ops(60000));
}
TEST_CASE("model-based random operations: f16") {
    run_model_test<kvcache::kv_cache<kvcache::f16>>("f16", model_ops(60000));
}
TEST_CASE("model-based random operations: bf16, transposed V") {
    run_model_test<kvcache::kv_cache<kvcache::bf16, kvcache::contiguous<kvcache::v_layout::transposed>>>(
        "bf16/vt", model_ops(60000));
}
TEST_CASE("model-based random operations: q8_0 (blocks of 32 values, one scale)") {
    run_model_test<kvcache::kv_cache<kvcache::q8_0>>("q8_0", model_ops(8000));
}
TEST_CASE("model-based random operations: q4_0, transposed V") {
    run_model_test<kvcache::kv_cache<kvcache::q4_0, kvcache::contiguous<kvcache::v_layout::transposed>>>(
        "q4_0", model_ops(8000));
}
TEST_CASE("model-based random operations: f16, transposed V") {
    run_model_test<kvcache::kv_cache<kvcache::contiguous<kvcache::v_layout::transposed>, kvcache::f16>>(
        "f16/vt", model_ops(30000));
}
