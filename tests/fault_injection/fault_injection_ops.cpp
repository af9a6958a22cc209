// Fault injection: every mutating operation of every memory, with an operator new that
// throws std::bad_alloc at the N-th allocation after arming, for N = 1, 2, ... until the
// operation completes. After each throw the memory must be bit-identical to a snapshot
// taken before (cell metadata, indexes, K/V bytes of occupied cells, block tables,
// refcounts, free blocks, ring pruning points, transaction state) and must place the
// next batch exactly like an untouched twin (slot-search head, paged open-block hints);
// after the completing run it must equal the same operation on an untouched twin.
#include <doctest/doctest.h>

#include <kvcache/io/state.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/memory/iswa_cache.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/ops/context_shift.hpp>
#include <kvcache/ops/defrag.hpp>
#include <kvcache/ops/kshift.hpp>
#include <kvcache/reuse/plan.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/fault_alloc.hpp"  // the counting operator new (this file is its only user here)
#include "support/memory_snapshot.hpp"

namespace fi = kvtest::fi;

using namespace kvcache;

namespace {

constexpr std::uint32_t W = 16;
using contig_t = kv_cache<f32>;
using paged_t = kv_cache<f32, paged<32>>;
using ring_t = kv_cache<f32, ring<W>>;
using iswa_t = iswa_cache<W, f32>;

model_shape small_shape(std::uint32_t n_cells, std::uint32_t n_seq) {
    model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 8;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

using kvtest::snap;
using kvtest::first_diff;
using kvtest::snapshot;

// ------------------------------------------------------------ fixtures
/// Writes deterministic K/V rows for placed cells.
/// Plain check usable while allocations are armed (doctest's macros allocate).
void must(bool ok) {
    if (!ok) throw std::logic_error("fault injection fixture: unexpected refusal");
}

template <class M, class P>
void write_rows(M& m, const P& placed, std::size_t n, float seed) {
    const model_shape& sh = [&]() -> const model_shape& {
        if constexpr (requires { m.full(); }) return m.full().shape();
        else return m.shape();
    }();
    const std::uint32_t n_layer = [&] {
        if constexpr (requires { m.n_layer(); }) return m.n_layer();
        else return sh.n_layer;
    }();
    std::vector<float> k(n * sh.k_row_size()), v(n * sh.v_row_size());
    for (std::uint32_t l = 0; l < n_layer; ++l) {
        for (std::size_t i = 0; i < k.size(); ++i) k[i] = seed + 0.001f * static_cast<float>(i) + static_cast<float>(l);
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = -seed - 0.002f * static_cast<float>(i) - static_cast<float>(l);
        if constexpr (requires { m.full(); }) {
            m.write_k(l, placed, k.data());
            m.write_v(l, placed, v.data());
        } else {
            m.write_k(l, placed.cells, k.data());
            m.write_v(l, placed.cells, v.data());
        }
    }
}
template <class M>
void put(M& m, seq_id_t s, pos_t p0, std::uint32_t n, float seed) {
    std::vector<pos_t> pos(n);
    std::vector<seq_id_t> seq(n, s);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = p0 + static_cast<pos_t>(i);
    auto r = m.place(pos, seq);
    must(r.ok());
    write_rows(m, r.value(), n, seed);
    must(m.commit() == tx_result::committed);
}

/// Sequence 0: 0..11; seq 1 shares 0..6 of it (seq_cp) and has 7..9 of its own;
/// seq 2: 0..5. `tight`: fill the cache so that no block / almost no cell is free.
template <class M>
M make_cache(bool tight) {
    M m = [] {
        if constexpr (std::is_same_v<M, contig_t> || std::is_same_v<M, paged_t>) return M(small_shape(128, 4));
        else if constexpr (std::is_same_v<M, ring_t>) return M(small_shape(ring<W>::cells_for(4, 8), 4));
        else {
            iswa_shape s;
            s.shape = small_shape(128, 4);
            s.shape.n_layer = 3;
            s.swa_layers = iswa_shape::every_nth_full(3, 3);
            s.swa_n_cells = ring<W>::cells_for(4, 8);
            return M(s);
        }
    }();
    put(m, 0, 0, 12, 1.0f);
    must(m.seq_cp(0, 1, 0, 7).ok());
    put(m, 1, 7, 3, 2.0f);
    put(m, 2, 0, 6, 3.0f);
    if (tight) {
        if constexpr (std::is_same_v<M, paged_t>) put(m, 3, 0, 32, 4.0f);  // the last free block
        else if constexpr (std::is_same_v<M, contig_t>) put(m, 3, 0, 105, 4.0f);  // 2 cells left
    }
    return m;
}

/// The next placement after an operation: the same cells on the cache and its twin.
template <class M>
std::string next_place(M& m) {
    std::vector<pos_t> pos{m.seq_pos_max(2) + 1, m.seq_pos_max(2) + 2};
    std::vector<seq_id_t> seq{2, 2};
    auto r = m.place(pos, seq);
    std::ostringstream os;
    if (!r) {
        os << "refused " << r.message();
        return os.str();
    }
    if constexpr (requires { r.value().full; }) {
        for (std::uint32_t c : r.value().full.cells) os << c << ' ';
        os << "| ";
        for (std::uint32_t c : r.value().swa.cells) os << c << ' ';
    } else {
        for (std::uint32_t c : r.value().cells) os << c << ' ';
    }
    m.restore();
    return os.str();
}

template <class R>
std::string describe(const R& r) {
    std::ostringstream os;
    if (r.ok())
        os << "ok";
    else
        os << "error " << static_cast<int>(r.code());
    return os.str();
}

/// Sweeps N = 1, 2, ... for operation `op` on a cache built by make_cache(tight).
long total_throws = 0;

/// `prep` runs on both caches, unarmed, before the snapshot.
template <class M>
void sweep(const std::string& name, bool tight, const std::function<std::string(M&)>& op,
           const std::function<void(M&)>& prep) {
    CAPTURE(name);
    int throws = 0;
    for (long n = 1;; ++n) {
        CAPTURE(n);
        M m = make_cache<M>(tight);
        M twin = make_cache<M>(tight);
        if (prep) {
            prep(m);
            prep(twin);
        }
        const snap before = snapshot(m);
        std::string got;
        bool threw = false;
        fi::arm(n);
        try {
            got = op(m);
        } catch (const std::bad_alloc&) {
            threw = true;
        } catch (...) {
            fi::disarm();  // doctest reports it, and allocates to do so
            throw;
        }
        fi::disarm();
        if (threw) {
            ++throws;
            const snap after = snapshot(m);
            INFO(first_diff(before, after));
            REQUIRE(after == before);
            REQUIRE(next_place(m) == next_place(twin));
            REQUIRE(snapshot(m) == snapshot(twin));
            continue;
        }
        const std::string want = op(twin);
        CHECK(got == want);
        const snap a = snapshot(m), b = snapshot(twin);
        INFO(first_diff(a, b));
        REQUIRE(a == b);
        REQUIRE(next_place(m) == next_place(twin));
        total_throws += throws;
        break;
    }
}

template <class M>
void sweep_all() {
    using ops_t = std::vector<std::pair<const char*, std::function<std::string(M&)>>>;
    ops_t ops = {
        {"place 3 tokens", [](M& m) {
             std::vector<pos_t> pos{12, 13, 14};
             std::vector<seq_id_t> seq{0, 0, 0};
             return describe(m.place(pos, seq));
         }},
        {"place (copy-on-write of a shared last block on paged)", [](M& m) {
             std::vector<pos_t> pos{10};
             std::vector<seq_id_t> seq{1};
             return describe(m.place(pos, seq));
         }},
        {"place two sequences", [](M& m) {
             std::vector<pos_t> pos{6, 10, 7};
             std::vector<seq_id_t> seq{2, 1, 2};
             return describe(m.place(pos, seq));
         }},
        {"place + restore", [](M& m) {
             std::vector<pos_t> pos{10, 11};
             std::vector<seq_id_t> seq{1, 1};
             auto r = m.place(pos, seq);
             if (r) return std::to_string(static_cast<int>(m.restore()));
             return describe(r);
         }},
        {"place + commit", [](M& m) {
             std::vector<pos_t> pos{12, 13, 14, 15, 16, 17, 18, 19};
             std::vector<seq_id_t> seq(8, 0);
             auto r = m.place(pos, seq);
             if (r) return std::to_string(static_cast<int>(m.commit()));
             return describe(r);
         }},
        {"seq_rm part", [](M& m) { return describe(m.seq_rm(0, 5, 12)); }},
        {"seq_rm all sequences", [](M& m) { return describe(m.seq_rm(-1, 3, -1)); }},
        {"seq_cp", [](M& m) { return describe(m.seq_cp(0, 2, 6, -1)); }},
        {"seq_keep", [](M& m) {
             m.seq_keep(1);
             return std::string("ok");
         }},
        {"clear", [](M& m) {
             m.clear();
             return std::string("ok");
         }},
    };
    if constexpr (M::can_shift) {
        ops.push_back({"seq_add with splits", [](M& m) { return describe(m.seq_add(0, 2, -1, 3)); }});
        ops.push_back({"seq_add all", [](M& m) { return describe(m.seq_add(-1, 4, -1, -2)); }});
        ops.push_back({"seq_div", [](M& m) { return describe(m.seq_div(0, 0, -1, 2)); }});
        ops.push_back({"context_shift", [](M& m) { return describe(ops::context_shift(m, 0, 4, 4)); }});
        ops.push_back({"self_extend", [](M& m) {
                           ops::self_extend_state st{2, 8, 0};
                           return describe(ops::self_extend(m, 0, st, 12));
                       }});
        ops.push_back({"apply_plan", [](M& m) {
                           reuse::plan p;
                           p.n_lcp = 4;
                           p.moves = {{8, 4, 4}};
                           p.n_past = 8;
                           p.n_request = 9;
                           return describe(reuse::apply_plan(m, 0, p));
                       }});
        ops.push_back({"apply_k_shift", [](M& m) {
                           ops::apply_k_shift(m, 1);
                           return std::string("ok");
                       }});
    }
    ops.push_back({"load_state (whole)", [](M& m) {
                       M other = make_cache<M>(false);
                       must(other.seq_rm(0, 10, -1).ok());
                       const auto bytes = io::save_state(other);
                       return describe(io::load_state(m, bytes));
                   }});
    ops.push_back({"load_seq", [](M& m) {
                       M other = make_cache<M>(false);
                       const auto bytes = io::save_seq(other, 0);
                       must(m.seq_rm(3, -1, -1).ok());
                       return describe(io::load_seq(m, 3, bytes));
                   }});
    if constexpr (std::is_same_v<M, contig_t>)
        ops.push_back({"defrag", [](M& m) {
                           ops::defrag_params p;
                           p.threshold = 0.0f;
                           p.min_cells = 0;
                           return std::to_string(ops::defrag(m, p).moves);
                       }});
    total_throws = 0;
    for (bool tight : {false, true})
        for (auto& [name, op] : ops) {
            CAPTURE(tight);
            std::function<void(M&)> prep;
            if (std::string(name) == "apply_k_shift") prep = [](M& m) { must(m.seq_add(2, 0, -1, 5).ok()); };
            if (std::string(name) == "defrag") prep = [](M& m) { must(m.seq_rm(0, 2, 8).ok()); };
            sweep<M>(name, tight, op, prep);
        }
    CHECK(total_throws > static_cast<long>(ops.size()));  // every operation allocates, so most sweeps throw
    std::printf("  %ld injected allocation failures survived\n", total_throws);
}

}  // namespace

TEST_CASE("fault injection: contiguous kv_cache") { sweep_all<contig_t>(); }
TEST_CASE("fault injection: paged kv_cache") { sweep_all<paged_t>(); }
TEST_CASE("fault injection: ring kv_cache") { sweep_all<ring_t>(); }
TEST_CASE("fault injection: iswa_cache") { sweep_all<iswa_t>(); }
